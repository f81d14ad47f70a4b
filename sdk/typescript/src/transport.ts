/**
 * Moving bytes to and from the daemon with node:http/node:https.
 *
 * Why not `fetch`: Node's fetch cannot reach a Unix socket without the undici package's Agent, a runtime
 * dependency; node:http takes `socketPath` for the socket and speaks TCP (and https with a CA) the same way, so
 * the SDK has no runtime dependency at all. Answers are read as streams: NDJSON lines as they arrive, file
 * downloads chunk by chunk; a JSON answer is read whole but bounded.
 */

import http from "node:http";
import https from "node:https";
import { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";

import { Connection } from "./connection.js";
import { DaemonUnreachableError, ForkdError, RateLimitError, TimeoutError, errorFromBody } from "./errors.js";
import { EventStream } from "./ndjson.js";

/** An answer held whole (JSON) is refused past this: bigger output comes streamed or as a file. */
export const MAX_JSON_BYTES = 256 * 1024 * 1024;
export const LONG_TIMEOUT_MS = 3_600_000;
const MAX_BUSY_DELAY_S = 10;

export type Body = Buffer | Uint8Array | string | AsyncIterable<Uint8Array | string>;

export interface Request {
  method: string;
  path: string;
  query?: Record<string, string | number | boolean | undefined>;
  json?: unknown;
  content?: Body;
  /** Longest wait for the daemon's next bytes; default: the connection's request timeout. */
  timeoutMs?: number;
}

export class Transport {
  private readonly agent: http.Agent;
  private readonly send: typeof http.request;

  constructor(readonly connection: Connection) {
    const secure = connection.url.startsWith("https://");
    const options = { keepAlive: true, ...(secure && connection.ca ? { ca: connection.ca } : {}) };
    this.agent = secure ? new https.Agent(options) : new http.Agent(options);
    this.send = secure ? https.request : http.request;
  }

  close(): void {
    this.agent.destroy();
  }

  /**
   * Send `req`; answers the response once its status is a success (an error answer is thrown). A `busy` refusal
   * (503: the daemon did nothing) is sent again up to `busyRetries` times, after the daemon's `Retry-After` or
   * 0.5, 1, 2 … s (at most 10 s) - unless the body is a stream, which cannot be sent twice.
   */
  async open(req: Request): Promise<http.IncomingMessage> {
    const resendable = req.content === undefined || typeof req.content === "string" || req.content instanceof Uint8Array;
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.openOnce(req);
      } catch (err) {
        if (!(err instanceof RateLimitError) || !resendable || attempt >= this.connection.busyRetries) throw err;
        const delayS = Math.min(err.retryAfterS ?? 0.5 * 2 ** attempt, MAX_BUSY_DELAY_S);
        await new Promise((resolve) => setTimeout(resolve, delayS * 1000));
      }
    }
  }

  private async openOnce(req: Request): Promise<http.IncomingMessage> {
    const conn = this.connection;
    const query = new URLSearchParams();
    for (const [key, value] of Object.entries(req.query ?? {})) {
      if (value !== undefined) query.set(key, String(value));
    }
    const path = req.path + (query.size ? `?${query}` : "");
    const headers: Record<string, string> = { accept: "application/json, application/x-ndjson" };
    if (conn.token) headers.authorization = `Bearer ${conn.token}`;
    let payload: Body | undefined = req.content;
    if (req.json !== undefined) {
      payload = JSON.stringify(req.json);
      headers["content-type"] = "application/json";
    } else if (payload !== undefined) {
      headers["content-type"] = "application/octet-stream";
    }
    const target = conn.socket ? { socketPath: conn.socket, host: "forkd" } : urlParts(conn.url);
    const timeoutMs = req.timeoutMs ?? conn.requestTimeoutMs;
    const response = await new Promise<http.IncomingMessage>((resolve, reject) => {
      const outgoing = this.send({ ...target, agent: this.agent, method: req.method, path, headers, timeout: timeoutMs });
      const onTimeout = () => outgoing.destroy(timeoutError(req, timeoutMs));
      outgoing.on("timeout", onTimeout);
      outgoing.on("response", (response) => {
        outgoing.off("timeout", onTimeout); // from here on the response's own timeout counts
        resolve(response);
      });
      let bodyError: unknown; // the caller's own body failed: that error, not "unreachable"
      outgoing.on("error", (err) => reject(bodyError ?? this.failure(err)));
      writeBody(outgoing, payload, (err) => { bodyError = err; }).catch((err: Error) => outgoing.destroy(err));
    });
    response.setTimeout(timeoutMs, () => response.destroy(timeoutError(req, timeoutMs)));
    const status = response.statusCode ?? 0;
    if (status >= 200 && status < 300) return response;
    const text = (await this.readAll(response, 1024 * 1024)).toString("utf8");
    let body: unknown;
    try {
      body = JSON.parse(text);
    } catch {
      body = undefined;
    }
    const error = errorFromBody(status, body, text);
    const retryAfter = Number(response.headers["retry-after"]);
    if (response.headers["retry-after"] !== undefined && Number.isFinite(retryAfter) && retryAfter >= 0) {
      error.retryAfterS = retryAfter;
    }
    throw error;
  }

  /** The answer's JSON (undefined for an empty body). */
  async json<T>(req: Request): Promise<T> {
    const text = (await this.readAll(await this.open(req), MAX_JSON_BYTES)).toString("utf8");
    return (text ? JSON.parse(text) : undefined) as T;
  }

  /** The answer as NDJSON events (see `EventStream`). */
  async events<R>(req: Request): Promise<EventStream<R>> {
    const response = await this.open(req);
    return new EventStream<R>(this.chunks(response), () => response.destroy());
  }

  /** The answer's bytes as they arrive; stopping early closes the connection. */
  async *chunks(response: http.IncomingMessage): AsyncGenerator<Buffer> {
    try {
      for await (const chunk of response) yield chunk as Buffer;
    } catch (err) {
      throw this.failure(err as Error);
    } finally {
      if (!response.complete) response.destroy();
    }
  }

  async readAll(response: http.IncomingMessage, maxBytes: number): Promise<Buffer> {
    const parts: Buffer[] = [];
    let size = 0;
    for await (const chunk of this.chunks(response)) {
      size += chunk.length;
      if (size > maxBytes) {
        throw new ForkdError(413, "body_too_large", `the daemon's answer is over ${maxBytes} bytes`);
      }
      parts.push(chunk);
    }
    return Buffer.concat(parts);
  }

  private failure(err: Error): Error {
    if (err instanceof ForkdError) return err;
    const code = String((err as NodeJS.ErrnoException).code ?? "");
    const hint = /CERT|SELF_SIGNED|UNABLE_TO_VERIFY|ERR_TLS/.test(code)
      ? " (the daemon's TLS certificate is not trusted: set FORKD_CA_CERT to the PEM of the CA that signed it)" : "";
    return new DaemonUnreachableError(this.connection.url, (err.message || err.name) + hint);
  }
}

function urlParts(url: string): http.RequestOptions {
  const parsed = new URL(url);
  return { protocol: parsed.protocol, hostname: parsed.hostname.replace(/^\[|\]$/g, ""), port: parsed.port || undefined };
}

function timeoutError(req: Request, timeoutMs: number): TimeoutError {
  return new TimeoutError(504, "timeout", `${req.method} ${req.path}: the daemon sent nothing for ${timeoutMs / 1000} s`);
}

/** Sends `body`; an error of the caller's own iterable goes to `onSourceError` before the request is ended. */
async function writeBody(outgoing: http.ClientRequest, body: Body | undefined,
  onSourceError: (err: unknown) => void): Promise<void> {
  if (body === undefined) {
    outgoing.end();
  } else if (typeof body === "string" || body instanceof Uint8Array) {
    outgoing.setHeader("content-length", Buffer.byteLength(body));
    outgoing.end(body);
  } else {
    const source = body;
    await pipeline(Readable.from((async function* () {
      try {
        yield* source;
      } catch (err) {
        onSourceError(err);
        throw err;
      }
    })()), outgoing);
  }
}
