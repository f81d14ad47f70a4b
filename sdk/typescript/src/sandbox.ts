/**
 * `Sandbox`: one running forkd sandbox as an object, the TypeScript counterpart of the Python SDK's
 * `forkd.Sandbox` (forkd's own operations; for E2B's interface use E2B's SDK against forkd's E2B front).
 * Everything goes through a `Controller`.
 */

import { checkInt } from "./check.js";
import { Connection, type ConnectionOptions } from "./connection.js";
import { Controller, type BranchOptions, type EventHandler } from "./controller.js";
import { ForkdError, errorFor, kindOf } from "./errors.js";
import type { Body } from "./transport.js";
import type {
  ChildOutcome, CodeOutcome, CommandOutcome, ExecRequest, FileEntry, ForkOptions, OutputEvent, SandboxRecord,
  SnapshotInfo,
} from "./types.js";

export const DEFAULT_TEMPLATE = "quickstart"; // the snapshot `forkd quickstart` bakes
export const DEFAULT_SANDBOX_TIMEOUT_S = 300; // a forgotten sandbox does not live forever

/** Which daemon: a `Controller` to share, a `Connection`, or connection options (default: the environment's). */
export type Via = Controller | Connection | ConnectionOptions;

export interface CreateOptions extends ForkOptions {
  /** The snapshot to fork (default `$FORKD_TEMPLATE`, else `quickstart`). */
  template?: string;
  via?: Via;
}

export interface OutputCallbacks {
  onStdout?: (data: string) => unknown;
  onStderr?: (data: string) => unknown;
}

export type RunOptions = Omit<ExecRequest, "cmd" | "argv" | "stream"> & OutputCallbacks;

/** A command's outcome with its whole output, also when it was streamed to callbacks. */
export type CommandResult = CommandOutcome & { stdout: string; stderr: string };

export interface CodeOptions extends OutputCallbacks {
  context?: string;
  timeout_s?: number;
  /** Each rich result (`display()`, a figure) as it is shown. */
  onResult?: (result: Record<string, unknown>) => unknown;
}

/** The Python expression of `eval` raised; `error` is its `{name, value, traceback}`. */
export class CodeError extends ForkdError {
  override name = "CodeError";

  constructor(readonly error: { name?: string; value?: string; traceback?: string }) {
    super(400, "bad_request", `${error.name ?? "Error"}: ${error.value ?? ""}`);
  }
}

/** Some children of `Sandbox.fork` did not start (the ones that did were killed); `children` says which and why. */
export class ForkFailedError extends ForkdError {
  override name = "ForkFailedError";

  constructor(readonly children: ChildOutcome[]) {
    const failed = children.filter((child) => child.error);
    const detail = failed.map((child) => `child ${child.index}: ${child.error!.code}: ${child.error!.message}`);
    super(500, "fork_failed", `${failed.length} of ${children.length} children failed: ${detail.join("; ") || "no child started"}`);
  }
}

function controllerFor(via: Via | undefined): Controller {
  return via instanceof Controller ? via : new Controller(via ?? {});
}

export class Sandbox {
  readonly files: Files;

  constructor(readonly id: string, readonly controller: Controller) {
    this.files = new Files(this);
  }

  /** Fork one child of `template`; the daemon kills it `timeout_s` later (default 300 s; `null`: never). */
  static async create(options: CreateOptions = {}): Promise<Sandbox> {
    const { template, via, ...fork } = options;
    const controller = controllerFor(via);
    const tag = template ?? (process.env.FORKD_TEMPLATE || DEFAULT_TEMPLATE);
    const timeout_s = fork.timeout_s === undefined ? DEFAULT_SANDBOX_TIMEOUT_S : fork.timeout_s;
    const result = await controller.fork(tag, 1, { ...fork, timeout_s });
    const first = result.sandboxes[0];
    if (!first) {
      const error = result.errors[0] ?? { code: "internal", message: "the daemon started no sandbox" };
      throw errorFor(kindOf(error.code).status, error.code, `forking ${tag} failed: ${error.message}`);
    }
    return new Sandbox(first.id, controller);
  }

  /** The running sandbox `id` (checked with the daemon). */
  static async connect(id: string, via?: Via): Promise<Sandbox> {
    const controller = controllerFor(via);
    await controller.sandbox(id);
    return new Sandbox(id, controller);
  }

  static async list(via?: Via): Promise<SandboxRecord[]> {
    return controllerFor(via).sandboxes();
  }

  async info(): Promise<SandboxRecord> {
    return this.controller.sandbox(this.id);
  }

  async kill(): Promise<void> {
    return this.controller.kill(this.id);
  }

  /** The daemon kills this sandbox `timeoutS` from now; answers that moment (Unix time, seconds). */
  async setTimeout(timeoutS: number): Promise<number> {
    return this.controller.setTimeout(this.id, timeoutS);
  }

  /** Run a shell command line (or an argv array); callbacks get output as it arrives. Default timeout 60 s. */
  async run(cmd: string | string[], options: RunOptions = {}): Promise<CommandResult> {
    const { onStdout, onStderr, ...fields } = options;
    if (!onStdout && !onStderr) {
      const outcome = await this.controller.exec(this.id, cmd, fields);
      return { ...outcome, stdout: outcome.stdout ?? "", stderr: outcome.stderr ?? "" };
    }
    const out = { stdout: [] as string[], stderr: [] as string[] };
    const outcome = await this.controller.exec(this.id, cmd, {
      ...fields, onEvent: collect(out, { onStdout, onStderr }),
    });
    return { ...outcome, stdout: out.stdout.join(""), stderr: out.stderr.join("") };
  }

  /** Run a Python cell in a persistent context (default `default`); callbacks get output as it arrives. */
  async runCode(code: string, options: CodeOptions = {}): Promise<CodeOutcome> {
    const { onStdout, onStderr, onResult, ...rest } = options;
    if (!onStdout && !onStderr && !onResult) return this.controller.runCode(this.id, code, rest);
    const out = { stdout: [] as string[], stderr: [] as string[] };
    const onEvent = collect(out, { onStdout, onStderr }, onResult);
    const outcome = await this.controller.runCode(this.id, code, { ...rest, onEvent });
    return { ...outcome, stdout: out.stdout.join(""), stderr: out.stderr.join("") };
  }

  /** The value of one Python expression (JSON-able values as themselves, others as their repr). */
  async eval(expr: string, context = "default"): Promise<unknown> {
    const outcome = await this.controller.eval(this.id, expr, context);
    const error = (outcome as { error?: unknown }).error;
    if (error) throw new CodeError(error as { name?: string; value?: string; traceback?: string });
    return outcome.value_json ?? outcome.value;
  }

  /** Snapshot this running sandbox (it keeps running); children fork from the tag. */
  async branch(options: BranchOptions = {}): Promise<SnapshotInfo> {
    return this.controller.branch(this.id, options);
  }

  /**
   * `count` new sandboxes in this one's exact current state: a diff BRANCH, then a streamed fork of it. If any child
   * fails, the started ones are killed and `ForkFailedError` lists every child's outcome.
   */
  async fork(count = 1, options: ForkOptions = {}): Promise<Sandbox[]> {
    checkInt("count", count, 1, 1000);
    const { tag } = await this.branch({ mode: "diff" });
    const timeout_s = options.timeout_s === undefined ? DEFAULT_SANDBOX_TIMEOUT_S : options.timeout_s;
    const children: ChildOutcome[] = [];
    for await (const child of this.controller.forkEach(tag, count, { ...options, timeout_s })) children.push(child);
    children.sort((a, b) => a.index - b.index);
    if (children.length && children.every((child) => child.sandbox)) {
      return children.map((child) => new Sandbox(child.sandbox!.id, this.controller));
    }
    await Promise.allSettled(children.filter((c) => c.sandbox).map((c) => this.controller.kill(c.sandbox!.id)));
    throw new ForkFailedError(children);
  }
}

function collect(out: { stdout: string[]; stderr: string[] }, callbacks: OutputCallbacks,
  onResult?: (result: Record<string, unknown>) => unknown): EventHandler {
  return async (event: OutputEvent) => {
    const data = event.data ?? "";
    if (event.event === "stdout") {
      out.stdout.push(data);
      await callbacks.onStdout?.(data);
    } else if (event.event === "stderr") {
      out.stderr.push(data);
      await callbacks.onStderr?.(data);
    } else if (event.event === "result") {
      await onResult?.(event);
    }
  };
}

/** A sandbox's files (paths are absolute paths in the guest). */
export class Files {
  constructor(private readonly sandbox: Sandbox) {}

  /** The file as text (UTF-8), or its bytes with `{format: "bytes"}`; `maxBytes` bounds what is read. */
  async read(path: string, options?: { format?: "text"; maxBytes?: number }): Promise<string>;
  async read(path: string, options: { format: "bytes"; maxBytes?: number }): Promise<Buffer>;
  async read(path: string, options: { format?: "text" | "bytes"; maxBytes?: number } = {}): Promise<string | Buffer> {
    const data = await this.sandbox.controller.readFile(this.sandbox.id, path, { maxBytes: options.maxBytes });
    return options.format === "bytes" ? data : data.toString("utf8");
  }

  /** The file's bytes as they arrive. */
  stream(path: string): AsyncGenerator<Buffer> {
    return this.sandbox.controller.readFileStream(this.sandbox.id, path);
  }

  /** Write bytes, text or an async iterable of pieces (e.g. `fs.createReadStream`), streamed; parents are created. */
  write(path: string, data: Body, mode?: number): Promise<{ path: string; size: number }> {
    return this.sandbox.controller.writeFile(this.sandbox.id, path, data, mode);
  }

  list(path: string): Promise<FileEntry[]> {
    return this.sandbox.controller.listFiles(this.sandbox.id, path);
  }

  stat(path: string): Promise<FileEntry> {
    return this.sandbox.controller.stat(this.sandbox.id, path);
  }

  remove(path: string, recursive = false): Promise<void> {
    return this.sandbox.controller.removeFile(this.sandbox.id, path, recursive);
  }

  makeDir(path: string): Promise<void> {
    return this.sandbox.controller.makeDir(this.sandbox.id, path);
  }
}
