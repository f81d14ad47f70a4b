/**
 * Where the daemon is and how to reach it: the one place the SDK reads `FORKD_URL`, `FORKD_SOCKET`,
 * `FORKD_HOME`, `FORKD_TOKEN` and `FORKD_CA_CERT`, with the Python SDK's defaults (src/forkd/sdk/connection.py).
 *
 * `FORKD_URL` is `unix:///path/to/forkd.sock` or `http(s)://host:port`; without it the local daemon's socket,
 * `$FORKD_SOCKET`, else `$FORKD_HOME/forkd.sock`, else `/var/lib/forkd/forkd.sock`.
 */

import { readFileSync } from "node:fs";
import { join } from "node:path";

import { InvalidArgumentError } from "./errors.js";

export const DEFAULT_REQUEST_TIMEOUT_MS = 120_000;
export const DEFAULT_BUSY_RETRIES = 3;
export const DEFAULT_HOME = "/var/lib/forkd";

export interface ConnectionOptions {
  /** `unix:///path/forkd.sock`, `http://host:port` or `https://host:port` (default: the environment's). */
  url?: string;
  /** Bearer token of a TCP daemon (default: `FORKD_TOKEN`). */
  token?: string;
  /** PEM of the CA that signed an https daemon's certificate (default: the file `FORKD_CA_CERT` names). */
  ca?: string | Buffer;
  /** How long a request may wait for the daemon's next bytes (default 120 s; long operations wait longer). */
  requestTimeoutMs?: number;
  /** How often a request the daemon refused as `busy` (503, over a concurrency cap) is sent again (default 3). */
  busyRetries?: number;
}

/** The local daemon's socket as the Python SDK computes it. */
export function defaultSocket(env: NodeJS.ProcessEnv = process.env): string {
  return env.FORKD_SOCKET || join(env.FORKD_HOME || DEFAULT_HOME, "forkd.sock");
}

export class Connection {
  readonly url: string;
  readonly token: string | undefined;
  readonly ca: string | Buffer | undefined;
  readonly requestTimeoutMs: number;
  readonly busyRetries: number;

  /** `options` over the environment's daemon (`env`: default `process.env`). */
  constructor(options: ConnectionOptions = {}, env: NodeJS.ProcessEnv = process.env) {
    this.url = options.url || env.FORKD_URL || `unix://${defaultSocket(env)}`;
    this.token = options.token || env.FORKD_TOKEN || undefined;
    this.requestTimeoutMs = options.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
    this.busyRetries = options.busyRetries ?? DEFAULT_BUSY_RETRIES;
    if (!/^(unix|http|https):\/\//.test(this.url)) {
      throw new InvalidArgumentError(400, "invalid_request",
        `FORKD_URL must start with unix://, http:// or https://, not ${JSON.stringify(this.url)}`);
    }
    if (this.url === "unix://") {
      throw new InvalidArgumentError(400, "invalid_request", "FORKD_URL unix:// names no socket path");
    }
    if (!(this.requestTimeoutMs > 0)) {
      throw new InvalidArgumentError(400, "invalid_request",
        `requestTimeoutMs must be positive, not ${this.requestTimeoutMs}`);
    }
    if (!Number.isInteger(this.busyRetries) || this.busyRetries < 0 || this.busyRetries > 100) {
      throw new InvalidArgumentError(400, "invalid_request",
        `busyRetries must be a whole number from 0 to 100, not ${this.busyRetries}`);
    }
    this.ca = options.ca ?? (env.FORKD_CA_CERT ? readCa(env.FORKD_CA_CERT) : undefined);
  }

  /** The Unix socket path, or undefined for a TCP daemon. */
  get socket(): string | undefined {
    return this.url.startsWith("unix://") ? this.url.slice("unix://".length) : undefined;
  }
}

function readCa(path: string): Buffer {
  try {
    return readFileSync(path);
  } catch (err) {
    throw new InvalidArgumentError(400, "invalid_request",
      `FORKD_CA_CERT names ${path}, which cannot be read (${(err as Error).message}): point it at the CA's PEM file`);
  }
}
