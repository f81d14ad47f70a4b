/**
 * NDJSON answers (`application/x-ndjson`): `progress`/`event`/`child` lines, then one `{"result": ...}` or
 * `{"error": ...}` line. Chunks from the socket end anywhere, inside a line or inside a UTF-8 character, so
 * `LineSplitter` keeps the torn tail until its newline comes; a line longer than `maxLineBytes` is refused
 * instead of growing without end.
 */

import { StringDecoder } from "node:string_decoder";

import { ForkdError, errorFor, kindOf } from "./errors.js";

/** Longest line accepted: an output event carries at most the agent's chunk, far below this. */
export const MAX_LINE_BYTES = 64 * 1024 * 1024;

export class LineSplitter {
  private readonly decoder = new StringDecoder("utf8");
  private tail = "";

  constructor(private readonly maxLineBytes = MAX_LINE_BYTES) {}

  /** The lines this chunk completes (without their newlines); the rest waits for the next chunk. */
  push(chunk: Buffer | string): string[] {
    const text = this.tail + (typeof chunk === "string" ? chunk : this.decoder.write(chunk));
    const lines = text.split("\n");
    this.tail = lines.pop() ?? "";
    if (Buffer.byteLength(this.tail) > this.maxLineBytes) {
      throw new ForkdError(500, "truncated", `an NDJSON line of the answer is over ${this.maxLineBytes} bytes`);
    }
    return lines;
  }

  /** What is left when the answer ended: a last line without its newline, if any. */
  end(): string[] {
    const rest = this.tail + this.decoder.end();
    this.tail = "";
    return rest.trim() ? [rest] : [];
  }
}

export type Decoded =
  | { kind: "skip" }
  | { kind: "event"; line: Record<string, unknown> }
  | { kind: "result"; value: unknown };

/** One line: an event, the result, or nothing (blank); an `{"error": ...}` line is thrown as its exception. */
export function decodeLine(text: string): Decoded {
  if (!text.trim()) return { kind: "skip" };
  let line: unknown;
  try {
    line = JSON.parse(text);
  } catch {
    throw new ForkdError(500, "internal", `the daemon sent a line that is not JSON: ${text.slice(0, 200)}`);
  }
  if (typeof line !== "object" || line === null || Array.isArray(line)) {
    throw new ForkdError(500, "internal", `the daemon sent a line that is not a JSON object: ${text.slice(0, 200)}`);
  }
  const record = line as Record<string, unknown>;
  if ("error" in record) {
    const err = (record.error ?? {}) as { code?: unknown; message?: unknown };
    const code = typeof err.code === "string" ? err.code : "internal";
    throw errorFor(kindOf(code).status, code, typeof err.message === "string" ? err.message : String(record.error));
  }
  if ("result" in record) return { kind: "result", value: record.result };
  return { kind: "event", line: record };
}

/** The error for a stream that ended before its result line. */
export function truncated(): ForkdError {
  return new ForkdError(500, "truncated", "the daemon closed the stream without a result");
}

/**
 * Reads an NDJSON body: yields its events; `result` is set once the last line came. A body that ends
 * without a result line throws `truncated`.
 */
export class EventStream<R = unknown> implements AsyncIterable<Record<string, unknown>> {
  result: R | undefined;
  done = false;

  constructor(private readonly chunks: AsyncIterable<Buffer | string>, private readonly close: () => void) {}

  async *[Symbol.asyncIterator](): AsyncIterator<Record<string, unknown>> {
    const splitter = new LineSplitter();
    try {
      for await (const chunk of this.chunks) {
        for (const text of splitter.push(chunk)) {
          const event = this.take(text);
          if (event) yield event;
          if (this.done) return;
        }
      }
      for (const text of splitter.end()) {
        const event = this.take(text);
        if (event) yield event;
        if (this.done) return;
      }
    } finally {
      this.close();
    }
    throw truncated();
  }

  private take(text: string): Record<string, unknown> | undefined {
    const decoded = decodeLine(text);
    if (decoded.kind === "result") {
      this.done = true;
      this.result = decoded.value as R;
    }
    return decoded.kind === "event" ? decoded.line : undefined;
  }

  /** Read to the end, passing each event to `onEvent`; answers the result. */
  async drain(onEvent?: (event: Record<string, unknown>) => unknown): Promise<R> {
    for await (const event of this) await onEvent?.(event);
    return this.result as R;
  }
}
