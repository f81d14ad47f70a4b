/** forkd's TypeScript SDK: `Controller` (every REST operation) and `Sandbox` (one sandbox as an object). */

export { Connection, type ConnectionOptions, defaultSocket } from "./connection.js";
export { Client } from "./client.js";
export {
  BRANCH_MODES, Controller, type BranchOptions, type CodeContext, type EventHandler, type ExecOptions,
  type RunCodeOptions,
} from "./controller.js";
export {
  AuthenticationError, ConflictError, DaemonUnreachableError, ForkdError, InvalidArgumentError, KINDS,
  NotFoundError, RateLimitError, TimeoutError, errorFor, kindForStatus, kindOf, type ErrorKind, type Family,
} from "./errors.js";
export { EventStream, LineSplitter, decodeLine } from "./ndjson.js";
export {
  CodeError, DEFAULT_TEMPLATE, Files, ForkFailedError, Sandbox, type CodeOptions, type CommandResult,
  type CreateOptions, type OutputCallbacks, type RunOptions, type Via,
} from "./sandbox.js";
export { StoreClient, type ImageSpec, type PullRequest } from "./store.js";
export type { Body, Request } from "./transport.js";
export type * from "./types.js";
export { childError } from "./types.js";
