/**
 * The errors forkd reports, as typed exceptions.
 *
 * The daemon answers `{"error": {"code", "message"}}` with an HTTP status; the code's kind picks the class, so
 * callers catch `NotFoundError` without parsing messages. `KINDS` mirrors the Python table in
 * src/forkd/errors.py (code, status, family, next step); a unit test of the repository compares the two.
 */

/** Which exception class a kind belongs to (named after the Python SDK's, which are E2B's). */
export type Family =
  | "invalid_argument"
  | "authentication"
  | "not_found"
  | "conflict"
  | "timeout"
  | "rate_limit"
  | "other";

export interface ErrorKind {
  readonly code: string;
  readonly status: number;
  readonly family: Family;
  /** What to do about any error of this kind. */
  readonly nextStep: string;
}

const kind = (code: string, status: number, family: Family, nextStep: string): ErrorKind =>
  ({ code, status, family, nextStep });

const TABLE: readonly ErrorKind[] = [
  kind("invalid_request", 400, "invalid_argument",
    "fix the named field or value (the schema is in docs/api.md and /openapi.json) and send it again"),
  kind("malformed_body", 400, "invalid_argument", "send the body as one JSON object"),
  kind("bad_request", 400, "invalid_argument", "fix the argument the guest agent named"),
  kind("os_error", 400, "invalid_argument", "check the path or command inside the sandbox (it failed there)"),
  kind("unauthorized", 401, "authentication", "set FORKD_TOKEN to the daemon's bearer token"),
  kind("not_found", 404, "not_found",
    "list what exists (`forkd ls`, `forkd snapshots`, `forkd workspace ls`) and use one of those"),
  kind("snapshot_not_found", 404, "not_found",
    "GET /v1/node of each node lists the digests it holds: fork where it is held, or pull it from " +
    "such a node first (POST /v1/node/pull)"),
  kind("no_route", 404, "not_found", "this daemon does not offer that route: upgrade forkd and restart it"),
  kind("method_not_allowed", 405, "invalid_argument", "use a method the route accepts (see docs/api.md)"),
  kind("conflict", 409, "conflict", "pick another tag or name, or wait for the operation holding it to finish"),
  kind("sandbox_ended", 409, "conflict",
    "the sandbox ended (timeout or kill) while this ran: start a new one and try again"),
  kind("snapshot_mismatch", 409, "conflict",
    "recreate the snapshot on this host (it was saved by another VMM setup)"),
  kind("incompatible_snapshot", 409, "conflict",
    "move snapshots only between nodes with the same compat key (GET /v1/node), or create it on this node"),
  kind("idempotency_conflict", 409, "conflict",
    "send the same request again to get its answer, or use a new idempotency key for a new fork"),
  kind("snapshot_corrupt", 409, "conflict", "remove the snapshot with `forkd rmi TAG` and recreate it"),
  kind("body_too_large", 413, "invalid_argument",
    "send less: upload big files with PUT /files, which streams them in chunks"),
  kind("snapshot_error", 400, "invalid_argument", "fix what the message names and retry the snapshot operation"),
  kind("pack_refused", 400, "invalid_argument", "use a pack made by forkd for this host's VMM setup"),
  kind("image_error", 400, "invalid_argument", "fix the image spec the message names, then build again"),
  kind("unknown_op", 400, "invalid_argument",
    "the guest agent is older than this daemon: recreate the snapshot from a rebuilt image"),
  kind("internal", 500, "other", "report it with the daemon log; retrying may work"),
  kind("vmm_error", 500, "other", "check `forkd doctor` and the daemon log, then retry"),
  kind("agent_unavailable", 502, "other",
    "the sandbox's guest agent is gone: kill the sandbox and spawn a new one"),
  kind("peer_error", 502, "other",
    "check the peer's URL, its token (source_token) and its daemon's log, or pull from another node"),
  kind("busy", 503, "rate_limit", "retry in a moment: the daemon is over a concurrency cap"),
  kind("timeout", 504, "timeout", "raise timeout_s, or split the work into shorter calls"),
  kind("disk_full", 507, "other", "free disk space under FORKD_HOME (remove snapshots with `forkd rmi`)"),
  // Client side only: no daemon answered, or its stream ended early.
  kind("unreachable", 0, "other",
    "start the daemon with `forkd daemon` (as root), or point FORKD_URL at a running one"),
  kind("truncated", 0, "other", "the daemon stopped mid-answer: check its log and retry"),
];

export const KINDS: ReadonlyMap<string, ErrorKind> = new Map(TABLE.map((k) => [k.code, k]));
const INTERNAL = KINDS.get("internal")!;

/** The kind of an error code; unknown codes (a newer daemon's) count as internal. */
export function kindOf(code: string): ErrorKind {
  return KINDS.get(code) ?? INTERNAL;
}

/** The kind a bare HTTP status stands for (an answer without a forkd error body). */
export function kindForStatus(status: number): ErrorKind {
  if (status === 404) return KINDS.get("no_route")!;
  return TABLE.find((k) => k.status === status) ?? INTERNAL;
}

/**
 * The daemon refused or failed a request: `status` and `code` say how, `reason` is what went wrong this time,
 * `nextStep` what to do about it; `message` holds both.
 */
export class ForkdError extends Error {
  override name = "ForkdError";
  readonly nextStep: string;
  /** Seconds the daemon asked to wait before retrying (its `Retry-After`), when it said. */
  retryAfterS?: number;

  constructor(readonly status: number, readonly code: string, readonly reason: string) {
    const nextStep = (KINDS.get(code) ?? kindForStatus(status)).nextStep;
    super(`${reason} (${code}: ${nextStep})`);
    this.nextStep = nextStep;
  }
}

/** 400/405/413: the request itself is wrong; its message names the field. */
export class InvalidArgumentError extends ForkdError { override name = "InvalidArgumentError"; }
/** 401: no bearer token, or the wrong one (set FORKD_TOKEN). */
export class AuthenticationError extends ForkdError { override name = "AuthenticationError"; }
/** 404: no such sandbox, snapshot, workspace, file or process. */
export class NotFoundError extends ForkdError { override name = "NotFoundError"; }
/** 409: the target is busy or in the wrong state (e.g. a snapshot still being written). */
export class ConflictError extends ForkdError { override name = "ConflictError"; }
/** 504, or a call that ran past its timeout. */
export class TimeoutError extends ForkdError { override name = "TimeoutError"; }
/** 503: over a concurrency cap; retry later. */
export class RateLimitError extends ForkdError { override name = "RateLimitError"; }

/** Nothing answered at the daemon's address. */
export class DaemonUnreachableError extends ForkdError {
  override name = "DaemonUnreachableError";

  constructor(where: string, reason: string) {
    super(0, "unreachable", `cannot reach the forkd daemon at ${where}: ${reason}`);
  }
}

const BY_FAMILY: Record<Family, new (status: number, code: string, message: string) => ForkdError> = {
  invalid_argument: InvalidArgumentError,
  authentication: AuthenticationError,
  not_found: NotFoundError,
  conflict: ConflictError,
  timeout: TimeoutError,
  rate_limit: RateLimitError,
  other: ForkdError,
};

/** The exception for an error answer: by its code's kind, or by its status when the code is not forkd's. */
export function errorFor(status: number, code: string, message: string): ForkdError {
  const found = KINDS.get(code) ?? kindForStatus(status);
  return new BY_FAMILY[found.family](status, code, message);
}

/** The exception for an `{"error": ...}` body (or whatever else an error answer held). */
export function errorFromBody(status: number, body: unknown, text: string): ForkdError {
  const err = typeof body === "object" && body !== null ? (body as { error?: unknown }).error : undefined;
  if (typeof err === "object" && err !== null) {
    const { code, message } = err as { code?: unknown; message?: unknown };
    return errorFor(status, typeof code === "string" ? code : "error",
      typeof message === "string" ? message : text);
  }
  return errorFor(status, "error", text || `HTTP ${status}`);
}
