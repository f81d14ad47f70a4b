/**
 * The errors forkd reports, as typed exceptions.
 *
 * The daemon answers `{"error": {"code", "message"}}` with an HTTP status; the code's kind picks the class, so
 * callers catch `NotFoundError` without parsing messages. `KINDS` is the Python table in src/forkd/errors.py
 * (code, status, family, next step), generated from the OpenAPI document's `x-error-kinds` at build time.
 */

import { ERROR_KINDS } from "./generated/errors.js";

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

const TABLE: readonly ErrorKind[] = ERROR_KINDS;

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
