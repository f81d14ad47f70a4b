/** Error answers become the exception class of their code's family, with the next step in the message. */

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  AuthenticationError, ConflictError, ForkdError, InvalidArgumentError, KINDS, NotFoundError, RateLimitError,
  TimeoutError, errorFor, errorFromBody,
} from "../../src/errors.js";

test("each family has its class", () => {
  const cases: [string, number, new (...args: never[]) => ForkdError][] = [
    ["invalid_request", 400, InvalidArgumentError], ["unauthorized", 401, AuthenticationError],
    ["not_found", 404, NotFoundError], ["sandbox_ended", 409, ConflictError], ["busy", 503, RateLimitError],
    ["timeout", 504, TimeoutError], ["body_too_large", 413, InvalidArgumentError],
  ];
  for (const [code, status, cls] of cases) {
    const err = errorFor(status, code, "why");
    assert.ok(err instanceof cls, `${code} → ${err.name}`);
    assert.ok(err instanceof ForkdError && err instanceof Error);
    assert.equal(err.code, code);
    assert.equal(err.reason, "why");
    assert.equal(err.nextStep, KINDS.get(code)!.nextStep);
    assert.ok(err.message.startsWith("why (") && err.message.includes(err.nextStep));
  }
});

test("an error kind of the other family is the base class", () => {
  const err = errorFor(500, "vmm_error", "qemu died");
  assert.equal(err.constructor, ForkdError);
  assert.match(err.message, /forkd doctor/);
});

test("a code this SDK does not know is read by its status", () => {
  assert.ok(errorFor(409, "newer_conflict", "x") instanceof ConflictError);
  assert.ok(errorFor(404, "gone_elsewhere", "x") instanceof NotFoundError);
  assert.equal(errorFor(418, "teapot", "x").constructor, ForkdError);
});

test("an error body that is not forkd's still becomes an error", () => {
  const err = errorFromBody(502, undefined, "Bad Gateway");
  assert.equal(err.status, 502);
  assert.equal(err.reason, "Bad Gateway");
  const typed = errorFromBody(404, { error: { code: "not_found", message: "no snapshot nope" } }, "");
  assert.ok(typed instanceof NotFoundError);
  assert.equal(typed.reason, "no snapshot nope");
});
