/** NDJSON reading without a daemon: torn lines and characters, error lines, streams that end early. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { ForkdError, NotFoundError, TimeoutError } from "../../src/errors.js";
import { EventStream, LineSplitter, decodeLine } from "../../src/ndjson.js";

async function* chunks(...parts: (string | Buffer)[]): AsyncGenerator<Buffer> {
  for (const part of parts) yield Buffer.isBuffer(part) ? part : Buffer.from(part);
}

test("a line torn across chunks is whole once its newline comes", () => {
  const splitter = new LineSplitter();
  assert.deepEqual(splitter.push(Buffer.from('{"event": "stdout", "da')), []);
  assert.deepEqual(splitter.push(Buffer.from('ta": "hi"}\n{"res')), ['{"event": "stdout", "data": "hi"}']);
  assert.deepEqual(splitter.push(Buffer.from('ult": 1}\n')), ['{"result": 1}']);
  assert.deepEqual(splitter.end(), []);
});

test("a UTF-8 character split between chunks is decoded whole", () => {
  const bytes = Buffer.from('{"data": "é€"}\n');
  const splitter = new LineSplitter();
  const lines = [...splitter.push(bytes.subarray(0, 11)), ...splitter.push(bytes.subarray(11, 13)),
    ...splitter.push(bytes.subarray(13))];
  assert.deepEqual(lines.map((line) => JSON.parse(line)), [{ data: "é€" }]);
});

test("a last line without its newline is kept at the end", () => {
  const splitter = new LineSplitter();
  assert.deepEqual(splitter.push('{"result": 2}'), []);
  assert.deepEqual(splitter.end(), ['{"result": 2}']);
});

test("a line over the bound is refused instead of growing", () => {
  const splitter = new LineSplitter(16);
  assert.throws(() => splitter.push("x".repeat(17)), (err: unknown) => err instanceof ForkdError && err.code === "truncated");
});

test("decodeLine tells events, results and blank lines apart and throws error lines typed", () => {
  assert.deepEqual(decodeLine("  "), { kind: "skip" });
  assert.deepEqual(decodeLine('{"event": "started", "pid": 7}'), { kind: "event", line: { event: "started", pid: 7 } });
  assert.deepEqual(decodeLine('{"result": {"exit_code": 0}}'), { kind: "result", value: { exit_code: 0 } });
  assert.throws(() => decodeLine('{"error": {"code": "not_found", "message": "no sandbox sb-x"}}'),
    (err: unknown) => err instanceof NotFoundError && err.status === 404 && /no sandbox sb-x/.test(err.message));
  assert.throws(() => decodeLine('{"error": {"code": "timeout", "message": "slow"}}'), TimeoutError);
  assert.throws(() => decodeLine("not json"), (err: unknown) => err instanceof ForkdError && err.code === "internal");
  assert.throws(() => decodeLine("[1]"), ForkdError);
});

test("an EventStream yields its events and keeps the result", async () => {
  let closed = false;
  const stream = new EventStream<{ exit_code: number }>(
    chunks('{"event": "started", "pid": 3}\n{"event": "std', 'out", "data": "a"}\n\n{"result": {"exit_code": 0}}\n'),
    () => { closed = true; });
  const seen: unknown[] = [];
  assert.deepEqual(await stream.drain((event) => seen.push(event)), { exit_code: 0 });
  assert.deepEqual(seen, [{ event: "started", pid: 3 }, { event: "stdout", data: "a" }]);
  assert.ok(stream.done && closed);
});

test("an EventStream that ends without a result throws truncated", async () => {
  const stream = new EventStream(chunks('{"event": "stdout", "data": "a"}\n'), () => {});
  await assert.rejects(stream.drain(), (err: unknown) => err instanceof ForkdError && err.code === "truncated");
});

test("an error line ends an EventStream with its typed error", async () => {
  const stream = new EventStream(chunks('{"progress": "1/2"}\n{"error": {"code": "disk_full", "message": "full"}}\n'),
    () => {});
  await assert.rejects(stream.drain(), (err: unknown) => err instanceof ForkdError && err.code === "disk_full" &&
    err.status === 507 && err.message.includes("free disk space"));
});
