/**
 * The API's types, taken from the daemon's OpenAPI document (docs/openapi.json, turned into
 * src/generated/openapi.ts by openapi-typescript at build time): request bodies and answers are looked up by
 * path and method, so the client does not compile against a document whose routes or bodies it misuses.
 *
 * Where the document declares no schema for an answer (snapshot details, BRANCH, workspaces) the types below are
 * written by hand from docs/api.md and say so.
 */

import type { paths } from "./generated/openapi.js";

type Operation<P extends keyof paths, M extends keyof paths[P]> = paths[P][M];

/** The JSON request body of `M P`. */
export type JsonBody<P extends keyof paths, M extends keyof paths[P]> =
  Operation<P, M> extends { requestBody?: { content: { "application/json": infer B } } } ? B : never;

/** The JSON answer of `M P` (its 200 or 201). */
export type JsonAnswer<P extends keyof paths, M extends keyof paths[P]> =
  Operation<P, M> extends { responses: { 200: { content: { "application/json": infer A } } } } ? A
    : Operation<P, M> extends { responses: { 201: { content: { "application/json": infer A } } } } ? A
      : never;

type ListOf<T, K extends keyof T> = T[K];

export type SandboxRecord = ListOf<JsonAnswer<"/v1/sandboxes", "get">, "sandboxes">[number];
export type SnapshotListing = ListOf<JsonAnswer<"/v1/snapshots", "get">, "snapshots">[number];
export type Pool = JsonAnswer<"/v1/pools/{tag}", "get">;
export type CommandOutcome = JsonAnswer<"/v1/sandboxes/{sandbox_id}/exec", "post">;
export type CodeOutcome = JsonAnswer<"/v1/sandboxes/{sandbox_id}/run_code", "post">;
export type EvalOutcome = JsonAnswer<"/v1/sandboxes/{sandbox_id}/eval", "post">;
export type FileEntry = ListOf<JsonAnswer<"/v1/sandboxes/{sandbox_id}/files/list", "get">, "entries">[number];

export type ForkRequest = JsonBody<"/v1/sandboxes", "post">;
export type ExecRequest = JsonBody<"/v1/sandboxes/{sandbox_id}/exec", "post">;
export type BranchRequest = JsonBody<"/v1/sandboxes/{sandbox_id}/branch", "post">;
export type RunCodeRequest = JsonBody<"/v1/sandboxes/{sandbox_id}/run_code", "post">;
export type SnapshotCreateRequest = JsonBody<"/v1/snapshots", "post">;

export type BranchMode = NonNullable<BranchRequest["mode"]>;

/** Fork options: the fork body but its snapshot, count and stream flag, which the SDK sets. */
export type ForkOptions = Omit<ForkRequest, "snapshot_tag" | "n" | "stream">;
/** Snapshot options: the create body but its tag. */
export type SnapshotOptions = Omit<SnapshotCreateRequest, "tag">;

/** One failed child of a fork: a code of the error table and what happened. */
export interface ChildError {
  code: string;
  message: string;
}

/** A fork's answer, with every child's error as `{code, message}` (an older daemon's bare strings are `internal`). */
export interface ForkResult {
  sandboxes: SandboxRecord[];
  errors: ChildError[];
}

/** One child of a streamed fork, in the order children answer or fail; `index` is its place in the request. */
export interface ChildOutcome {
  index: number;
  sandbox?: SandboxRecord;
  error?: ChildError;
  /** Milliseconds per spawn stage. */
  timings: Record<string, number>;
}

/** A snapshot's details (written by hand: the document declares no schema for it; see docs/api.md). */
export interface SnapshotInfo {
  tag: string;
  /** `writing`, `ready` or `failed` (then `error` says why). */
  status: string;
  error?: string;
  parent_tag?: string | null;
  depth?: number;
  ancestors?: string[];
  dependents?: string[];
  /** BRANCH: `full`, `diff` or `live`. */
  mode?: string;
  [key: string]: unknown;
}

/** A workspace (written by hand: the document declares no schema for it; see docs/api.md). */
export interface Workspace {
  name: string;
  /** `running`, `suspended` or `lost`. */
  state: string;
  sandbox_id: string | null;
  snapshot_tag: string;
  base_tag: string;
  suspends: number;
  [key: string]: unknown;
}

/** An output or lifecycle event of a streamed `exec` or `run_code` (`started`, `stdout`, `stderr`, `result`). */
export interface OutputEvent {
  event: string;
  data?: string;
  pid?: number;
  [key: string]: unknown;
}

/** Normalizes a child's error as either daemon sends it: `{code, message}`, or a bare string (older daemons). */
export function childError(error: unknown): ChildError {
  if (typeof error === "object" && error !== null) {
    const { code, message } = error as { code?: unknown; message?: unknown };
    return { code: typeof code === "string" && code ? code : "internal",
      message: typeof message === "string" && message ? message : "failed" };
  }
  return { code: "internal", message: typeof error === "string" && error ? error : "failed" };
}
