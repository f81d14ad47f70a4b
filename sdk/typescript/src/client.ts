/**
 * The base every client class stands on: one `Connection`, its `Transport`, and how a JSON or an NDJSON answer
 * is read. `StoreClient` (store.ts) and `Controller` (controller.ts) add the operations.
 */

import { Connection, type ConnectionOptions } from "./connection.js";
import { LONG_TIMEOUT_MS, type Request, Transport } from "./transport.js";

/** A path segment (tag, name, id) as it goes into a URL, after its check. */
export const seg = encodeURIComponent;

/** A streamed operation's progress lines as text, for an `onProgress(line)` callback. */
export function progress(onProgress?: (line: string) => unknown): ((line: Record<string, unknown>) => unknown) | undefined {
  return onProgress && ((line) => onProgress(String(line.progress ?? JSON.stringify(line))));
}

export class Client {
  readonly connection: Connection;
  protected readonly transport: Transport;

  /** Talk to the daemon `options` name (default: the environment's, see `Connection`). */
  constructor(options: ConnectionOptions | Connection = {}) {
    this.connection = options instanceof Connection ? options : new Connection(options);
    this.transport = new Transport(this.connection);
  }

  /** Closes idle connections (open streams end on their own). */
  close(): void {
    this.transport.close();
  }

  /** Send one request and answer its JSON (for calls the methods do not name). */
  async request<T = unknown>(req: Request): Promise<T> {
    return this.transport.json<T>(req);
  }

  /** Send a request answered with NDJSON; pass each event line to `onEvent`; answer the result line. */
  protected async streamed<R>(req: Request, onEvent?: (event: Record<string, unknown>) => unknown): Promise<R> {
    const events = await this.transport.events<R>({ timeoutMs: LONG_TIMEOUT_MS, ...req });
    return events.drain(onEvent);
  }
}
