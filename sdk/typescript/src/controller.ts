/**
 * `Controller`: every REST operation of the daemon as an async method, the TypeScript twin of the Python SDK's
 * `forkd.Controller` (src/forkd/sdk/operations.py): same operations, same defaults, same timeouts. Those on what
 * the daemon keeps come from `StoreClient` (store.ts); here are those on sandboxes. Bodies and answers are typed
 * from the OpenAPI document (types.ts); arguments are checked first (check.ts).
 */

import { checkInt, checkKeys, checkName, checkOneOf, checkPath, checkSandboxId, defined } from "./check.js";
import { seg } from "./client.js";
import { ForkdError, InvalidArgumentError } from "./errors.js";
import type { EventStream } from "./ndjson.js";
import { StoreClient } from "./store.js";
import { type Body, LONG_TIMEOUT_MS, type Request } from "./transport.js";
import {
  type BranchMode, type ChildOutcome, type CodeOutcome, type CommandOutcome, type EvalOutcome, type ExecRequest,
  type FileEntry, type ForkOptions, type ForkResult, type OutputEvent, type SandboxRecord, type SnapshotInfo,
  childError,
} from "./types.js";

const FORK_KEYS: Record<keyof ForkOptions, true> = {
  timeout_s: true, envs: true, metadata: true, net: true, egress: true, memory_limit_mib: true, cpu_quota: true,
  cpu_weight: true, pids_max: true, deadline_s: true, snapshot_digest: true, idempotency_key: true, owner: true,
};
// `pty` (a command on a terminal) is not offered here yet: the Python SDK and the CLI (`exec -t`) have it.
type ExecFields = Omit<ExecRequest, "cmd" | "argv" | "stream" | "pty">;
const EXEC_FIELDS: Record<keyof ExecFields, true> = {
  env: true, cwd: true, stdin: true, timeout_s: true, user: true, warm: true,
};
export const BRANCH_MODES: readonly BranchMode[] = ["full", "diff", "live"];

export type EventHandler = (event: OutputEvent) => unknown;

/** `exec` options: the exec body's fields, and `onEvent` to stream output as it arrives. */
export interface ExecOptions extends ExecFields {
  onEvent?: EventHandler;
}

export interface RunCodeOptions {
  context?: string;
  timeout_s?: number;
  onEvent?: EventHandler;
}

export interface BranchOptions {
  /** The new snapshot's tag (default: made from the sandbox id). */
  tag?: string;
  /** `full`: the whole memory; `diff` (default): pages changed since the parent; `live`: full, pre-copied while running. */
  mode?: BranchMode;
  /** false: answer at once with the snapshot `writing` (see `waitSnapshot`). */
  wait?: boolean;
}

/** A 60 s exec runs under a 120 s request; no timeout waits an hour (as the Python SDK). */
function callTimeout(timeoutS: number | null | undefined): number {
  return timeoutS == null ? LONG_TIMEOUT_MS : (timeoutS + 60) * 1000;
}

/** A code context: its own interpreter process forked from the snapshot's warm one. */
export interface CodeContext {
  id: string;
  language: string;
  cwd: string | null;
  [key: string]: unknown;
}

export class Controller extends StoreClient {
  // sandboxes

  /**
   * `n` children of snapshot `tag`. A failed child does not fail the others: it is listed in `errors` as
   * `{code, message}`. Options are the fork body's fields (`timeout_s`, `envs`, `metadata`, `net`, `egress`, limits,
   * `idempotency_key`, `owner`; `snapshot_digest` with a null `tag` forks a snapshot by its digest).
   */
  async fork(tag: string | null, n = 1, options: ForkOptions = {}): Promise<ForkResult> {
    const answer = await this.request<{ sandboxes: SandboxRecord[]; errors: unknown[] }>(
      { method: "POST", path: "/v1/sandboxes", json: forkBody(tag, n, options, false), timeoutMs: LONG_TIMEOUT_MS });
    return { sandboxes: answer.sandboxes, errors: answer.errors.map(childError) };
  }

  /** Fork like `fork`, yielding each child as it answers or fails, in that order. */
  async *forkEach(tag: string | null, n = 1, options: ForkOptions = {}): AsyncGenerator<ChildOutcome> {
    const events = await this.transport.events({
      method: "POST", path: "/v1/sandboxes", json: forkBody(tag, n, options, true), timeoutMs: LONG_TIMEOUT_MS,
    });
    for await (const line of events) {
      const child = line.child as { index: number; sandbox?: SandboxRecord; error?: unknown; timings?: Record<string, number> } | undefined;
      if (!child) continue;
      yield {
        index: child.index, timings: child.timings ?? {},
        ...(child.sandbox ? { sandbox: child.sandbox } : { error: childError(child.error) }),
      };
    }
  }

  async sandboxes(): Promise<SandboxRecord[]> {
    return (await this.request<{ sandboxes: SandboxRecord[] }>({ method: "GET", path: "/v1/sandboxes" })).sandboxes;
  }

  async sandbox(sandboxId: string): Promise<SandboxRecord> {
    return this.request({ method: "GET", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}` });
  }

  async kill(sandboxId: string): Promise<void> {
    await this.request({ method: "DELETE", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}` });
  }

  /** Kill the sandbox `timeoutS` from now; answers the deadline (Unix time, seconds). */
  async setTimeout(sandboxId: string, timeoutS: number): Promise<number> {
    const answer = await this.request<{ end_at: number }>({
      method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/timeout`, json: { timeout_s: timeoutS },
    });
    return answer.end_at;
  }

  async ping(sandboxId: string): Promise<Record<string, unknown>> {
    return this.request({ method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/ping` });
  }

  // commands and code

  /**
   * Run a command (`cmd` a shell line, or an argv array); with `onEvent` its output is streamed as it arrives
   * (`started`, `stdout`, `stderr` events) and the outcome has no stdout/stderr. Default timeout 60 s.
   */
  async exec(sandboxId: string, cmd: string | string[], options: ExecOptions = {}): Promise<CommandOutcome> {
    const { onEvent, ...fields } = options;
    const req = execRequest(sandboxId, cmd, fields, onEvent !== undefined);
    return onEvent ? this.streamed(req, onEvent as (event: Record<string, unknown>) => unknown) : this.request(req);
  }

  /** Start a command and answer its open event stream (`started` with the pid first); `stdin` unset keeps it open. */
  async startExec(sandboxId: string, cmd: string | string[], options: ExecFields = {}): Promise<EventStream<CommandOutcome>> {
    return this.transport.events(execRequest(sandboxId, cmd, options, true));
  }

  async processes(sandboxId: string): Promise<Record<string, unknown>[]> {
    const path = `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/processes`;
    return (await this.request<{ processes: Record<string, unknown>[] }>({ method: "GET", path })).processes;
  }

  async signalProcess(sandboxId: string, pid: number, signal = 9): Promise<void> {
    await this.request({
      method: "POST", json: { signal },
      path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/processes/${checkInt("pid", pid, 1, 2 ** 31)}/signal`,
    });
  }

  async sendStdin(sandboxId: string, pid: number, data: string, eof = false): Promise<void> {
    await this.request({
      method: "POST", json: { data, eof },
      path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/processes/${checkInt("pid", pid, 1, 2 ** 31)}/stdin`,
    });
  }

  /** The value of one Python expression in `context`'s interpreter (`value_json` when JSON-able, else `value`). */
  async eval(sandboxId: string, expr: string, context = "default"): Promise<EvalOutcome> {
    return this.request({
      method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/eval`,
      json: { expr, context: checkName("context", context) },
    });
  }

  /** Run a Python cell; with `onEvent` its output is streamed and the outcome has no stdout/stderr. */
  async runCode(sandboxId: string, code: string, options: RunCodeOptions = {}): Promise<CodeOutcome> {
    checkKeys("runCode", options, { context: true, timeout_s: true, onEvent: true });
    const json = defined({ code, context: checkName("context", options.context ?? "default"),
      timeout_s: options.timeout_s, stream: options.onEvent ? true : undefined });
    const req: Request = { method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/run_code`, json,
      timeoutMs: callTimeout(options.timeout_s) };
    return options.onEvent ? this.streamed(req, options.onEvent as (event: Record<string, unknown>) => unknown)
      : this.request(req);
  }

  /** A new code context (`id` default: one is made); pass its id as `runCode`'s `context`. */
  async createContext(sandboxId: string, options: { id?: string; cwd?: string; language?: "python" } = {}):
  Promise<CodeContext> {
    checkKeys("createContext", options, { id: true, cwd: true, language: true });
    const json = defined({ id: options.id === undefined ? undefined : checkName("context id", options.id),
      cwd: options.cwd, language: options.language });
    return this.request({ method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/contexts`, json });
  }

  async contexts(sandboxId: string): Promise<CodeContext[]> {
    const path = `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/contexts`;
    return (await this.request<{ contexts: CodeContext[] }>({ method: "GET", path })).contexts;
  }

  /** The context as a fresh fork again (its variables are gone). */
  async restartContext(sandboxId: string, contextId: string): Promise<CodeContext> {
    return this.request({ method: "POST",
      path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/contexts/${seg(checkName("context id", contextId))}/restart` });
  }

  async removeContext(sandboxId: string, contextId: string): Promise<void> {
    await this.request({ method: "DELETE",
      path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/contexts/${seg(checkName("context id", contextId))}` });
  }

  // files

  /** The whole file; with `maxBytes`, refused (413 `too_large`) as soon as it holds more. */
  async readFile(sandboxId: string, path: string, options: { maxBytes?: number } = {}): Promise<Buffer> {
    const parts: Buffer[] = [];
    let size = 0;
    for await (const chunk of this.readFileStream(sandboxId, path)) {
      size += chunk.length;
      if (options.maxBytes !== undefined && size > options.maxBytes) {
        throw new ForkdError(413, "too_large", `${path} holds more than ${options.maxBytes} bytes; read it in parts ` +
          "(e.g. exec 'head -c N') or raise maxBytes");
      }
      parts.push(chunk);
    }
    return Buffer.concat(parts);
  }

  /** The file's bytes as they arrive (a large file is never held whole); stopping early ends the download. */
  async *readFileStream(sandboxId: string, path: string): AsyncGenerator<Buffer> {
    const response = await this.transport.open({
      method: "GET", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files`,
      query: { path: checkPath(path) }, timeoutMs: LONG_TIMEOUT_MS,
    });
    yield* this.transport.chunks(response);
  }

  /** Write `data` (bytes, text, or an async iterable of pieces such as a file stream, sent as it is read). */
  async writeFile(sandboxId: string, path: string, data: Body, mode?: number): Promise<{ path: string; size: number }> {
    return this.request({
      method: "PUT", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files`,
      query: { path: checkPath(path), mode }, content: data, timeoutMs: LONG_TIMEOUT_MS,
    });
  }

  async listFiles(sandboxId: string, path: string): Promise<FileEntry[]> {
    const answer = await this.request<{ entries: FileEntry[] }>({
      method: "GET", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files/list`, query: { path: checkPath(path) },
    });
    return answer.entries;
  }

  async stat(sandboxId: string, path: string): Promise<FileEntry> {
    return this.request({
      method: "GET", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files/stat`, query: { path: checkPath(path) },
    });
  }

  async removeFile(sandboxId: string, path: string, recursive = false): Promise<void> {
    await this.request({
      method: "DELETE", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files`,
      query: { path: checkPath(path), recursive },
    });
  }

  async makeDir(sandboxId: string, path: string): Promise<void> {
    await this.request({
      method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files/mkdir`, json: { path: checkPath(path) },
    });
  }

  async rename(sandboxId: string, src: string, dst: string): Promise<void> {
    await this.request({ method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/files/rename`,
      json: { src: checkPath(src), dst: checkPath(dst) } });
  }

  // BRANCH

  /**
   * Save a running sandbox as a snapshot (it keeps running). `wait: false` answers right after the pause with the
   * snapshot `writing` (it holds the sandbox as it was then); `waitSnapshot(tag)` waits for it.
   */
  async branch(sandboxId: string, options: BranchOptions = {}): Promise<SnapshotInfo> {
    checkKeys("branch", options, { tag: true, mode: true, wait: true });
    const id = checkSandboxId(sandboxId);
    const tag = checkName("tag", options.tag ?? `${id}-${Math.random().toString(16).slice(2, 10)}`);
    return this.request({
      method: "POST", path: `/v1/sandboxes/${seg(id)}/branch`, timeoutMs: LONG_TIMEOUT_MS,
      json: { tag, mode: checkOneOf("mode", options.mode ?? "diff", BRANCH_MODES), wait: options.wait ?? true },
    });
  }


}

function forkBody(tag: string | null, n: number, options: ForkOptions, stream: boolean): Record<string, unknown> {
  checkKeys("fork", options, FORK_KEYS);
  if (tag === null && !options.snapshot_digest) {
    throw new InvalidArgumentError(400, "invalid_request", "fork needs a snapshot tag, or null and options.snapshot_digest");
  }
  const snapshot = tag === null ? {} : { snapshot_tag: checkName("snapshot tag", tag) };
  return { ...snapshot, n: checkInt("n", n, 1, 1000), ...defined(options), stream };
}

function execRequest(sandboxId: string, cmd: string | string[], fields: ExecFields, stream: boolean): Request {
  checkKeys("exec", fields, EXEC_FIELDS);
  if (typeof cmd !== "string" && !(Array.isArray(cmd) && cmd.length > 0 && cmd.every((a) => typeof a === "string"))) {
    throw new TypeError("cmd must be a shell command line (a string) or a non-empty array of strings (an argv)");
  }
  const timeoutS = fields.timeout_s === undefined ? 60 : fields.timeout_s;
  const json = { ...(typeof cmd === "string" ? { cmd } : { argv: cmd }), env: fields.env ?? {}, timeout_s: timeoutS,
    ...defined({ cwd: fields.cwd, stdin: fields.stdin, user: fields.user, warm: fields.warm || undefined }),
    ...(stream ? { stream: true } : {}) };
  return { method: "POST", path: `/v1/sandboxes/${seg(checkSandboxId(sandboxId))}/exec`, json,
    timeoutMs: callTimeout(timeoutS) };
}
