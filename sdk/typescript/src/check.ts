/**
 * Arguments checked before they leave the process: a JavaScript caller has no compiler to stop a misspelt option,
 * and a tag or id becomes part of a URL path. Options are checked against key lists the compiler holds to the
 * OpenAPI document (`Record<keyof Body, true>`: a field added to or dropped from the document breaks the build).
 */

import { InvalidArgumentError } from "./errors.js";

const NAME = /^[A-Za-z0-9_-]{1,64}$/;
const SANDBOX_ID = /^[A-Za-z0-9_-]{1,128}$/;

function refuse(message: string): never {
  throw new InvalidArgumentError(400, "invalid_request", message);
}

/** A snapshot tag, context or workspace name: `[A-Za-z0-9_-]{1,64}`, as the daemon requires. */
export function checkName(what: string, value: unknown): string {
  if (typeof value !== "string" || !NAME.test(value)) {
    refuse(`${what} must match [A-Za-z0-9_-]{1,64}, not ${JSON.stringify(value)}`);
  }
  return value;
}

export function checkSandboxId(value: unknown): string {
  if (typeof value !== "string" || !SANDBOX_ID.test(value)) {
    refuse(`a sandbox id looks like sb-…, not ${JSON.stringify(value)} (list them with controller.sandboxes())`);
  }
  return value;
}

export function checkInt(what: string, value: unknown, min: number, max: number): number {
  if (typeof value !== "number" || !Number.isInteger(value) || value < min || value > max) {
    refuse(`${what} must be a whole number from ${min} to ${max}, not ${JSON.stringify(value)}`);
  }
  return value;
}

export function checkOneOf<T extends string>(what: string, value: unknown, allowed: readonly T[]): T {
  if (!allowed.includes(value as T)) {
    refuse(`${what} must be one of ${allowed.join(", ")}, not ${JSON.stringify(value)}`);
  }
  return value as T;
}

export function checkPath(value: unknown): string {
  if (typeof value !== "string" || !value.startsWith("/")) {
    refuse(`a path in the sandbox must be absolute (start with /), not ${JSON.stringify(value)}`);
  }
  return value;
}

/** Refuses keys of `options` that `known` does not list (a TypeError, as for a wrong argument in JavaScript). */
export function checkKeys(what: string, options: object | undefined, known: Record<string, true>): void {
  const unknown = Object.keys(options ?? {}).filter((key) => !(key in known));
  if (unknown.length) {
    throw new TypeError(`unknown ${what} options: ${unknown.sort().join(", ")} (known: ${Object.keys(known).join(", ")})`);
  }
}

/** `options` without the keys whose value is undefined (the daemon refuses explicit nulls for some fields). */
export function defined<T extends object>(options: T): Partial<T> {
  return Object.fromEntries(Object.entries(options).filter(([, value]) => value !== undefined)) as Partial<T>;
}
