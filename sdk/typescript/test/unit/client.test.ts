/**
 * The client without a daemon: arguments refused before anything is sent, where the environment points it,
 * and its transport against a small node:http server on a Unix socket and on TCP (torn NDJSON, error bodies,
 * the bearer token).
 */

import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Connection, defaultSocket } from "../../src/connection.js";
import { Controller } from "../../src/controller.js";
import { ForkFailedError, Sandbox } from "../../src/sandbox.js";
import {
  DaemonUnreachableError, ForkdError, InvalidArgumentError, NotFoundError, RateLimitError,
} from "../../src/errors.js";
import { childError } from "../../src/types.js";

const nowhere = new Controller({ url: "unix:///nonexistent/forkd.sock" });

test("arguments are refused before anything is sent", async () => {
  const refused = (err: unknown) => err instanceof InvalidArgumentError && err.code === "invalid_request";
  await assert.rejects(nowhere.fork("bad tag!", 1), refused);
  await assert.rejects(nowhere.fork("py", 0), refused);
  await assert.rejects(nowhere.fork("py", 1.5), refused);
  await assert.rejects(nowhere.fork("py", 1, { timeout: 5 } as never), TypeError);
  await assert.rejects(nowhere.fork(null, 1), refused); // neither a tag nor a digest
  await assert.rejects(nowhere.branch("sb-aaaaaaaaaaaa", { mode: "half" as never }), refused);
  await assert.rejects(nowhere.branch("sb-aaaaaaaaaaaa", { tags: "x" } as never), TypeError);
  await assert.rejects(nowhere.branch("../etc", {}), refused);
  await assert.rejects(nowhere.exec("sb-aaaaaaaaaaaa", [] as string[]), TypeError);
  await assert.rejects(nowhere.exec("sb-aaaaaaaaaaaa", "ls", { timeout: 1 } as never), TypeError);
  await assert.rejects(nowhere.setPoolSize("py", 33), refused);
  await assert.rejects(nowhere.readFile("sb-aaaaaaaaaaaa", "relative/path"), refused);
  await assert.rejects(nowhere.createWorkspace("a/b", "py"), refused);
});

test("no daemon at the address is DaemonUnreachableError naming it and what to do", async () => {
  await assert.rejects(nowhere.health(), (err: unknown) => err instanceof DaemonUnreachableError &&
    err.message.includes("/nonexistent/forkd.sock") && err.message.includes("forkd daemon"));
});

test("the connection comes from the environment as the Python SDK's does", () => {
  assert.equal(defaultSocket({}), "/var/lib/forkd/forkd.sock");
  assert.equal(defaultSocket({ FORKD_HOME: "/srv/f" }), "/srv/f/forkd.sock");
  assert.equal(defaultSocket({ FORKD_HOME: "/srv/f", FORKD_SOCKET: "/run/f.sock" }), "/run/f.sock");
  assert.equal(new Connection({}, { FORKD_SOCKET: "/run/f.sock" }).socket, "/run/f.sock");
  const tcp = new Connection({}, { FORKD_URL: "http://127.0.0.1:7070", FORKD_TOKEN: "t" });
  assert.equal(tcp.socket, undefined);
  assert.equal(tcp.token, "t");
  assert.equal(new Connection({ url: "http://h:1", token: "mine" }, { FORKD_TOKEN: "env" }).token, "mine");
  assert.throws(() => new Connection({ url: "ftp://h" }, {}), InvalidArgumentError);
  assert.throws(() => new Connection({}, { FORKD_URL: "https://h:1", FORKD_CA_CERT: "/nonexistent/ca.pem" }),
    (err: unknown) => err instanceof InvalidArgumentError && err.message.includes("FORKD_CA_CERT"));
});

test("a child's error is {code, message} whichever way the daemon sends it", () => {
  assert.deepEqual(childError({ code: "busy", message: "max_sandboxes reached" }), { code: "busy", message: "max_sandboxes reached" });
  assert.deepEqual(childError("vmm died"), { code: "internal", message: "vmm died" });
  assert.deepEqual(childError(null), { code: "internal", message: "failed" });
});

// A stand-in daemon: answers a few routes as the real one does, torn into small writes.
const seen: { method?: string; url?: string; auth?: string; body?: string }[] = [];
let busyAnswers = 0;
const server = http.createServer((req, res) => {
  let body = "";
  req.on("data", (chunk: Buffer) => { body += chunk.toString(); });
  req.on("end", () => {
    seen.push({ method: req.method, url: req.url, auth: req.headers.authorization, body });
    if (req.url === "/v1/sandboxes/sb-aaaaaaaaaaaa/exec") {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      const answer = '{"event": "started", "pid": 9}\n{"event": "stdout", "data": "hé"}\n{"result": {"exit_code": 0, "timed_out": false, "duration_s": 0.1}}\n';
      const bytes = Buffer.from(answer);
      let at = 0;
      const next = () => {
        if (at >= bytes.length) return res.end();
        res.write(bytes.subarray(at, at + 7));
        at += 7;
        setImmediate(next);
      };
      next();
    } else if (req.url === "/v1/pools" && busyAnswers > 0) {
      busyAnswers -= 1;
      res.writeHead(503, { "content-type": "application/json", "retry-after": "0" });
      res.end(JSON.stringify({ error: { code: "busy", message: "over the cap" } }));
    } else if (req.url === "/v1/pools") {
      res.writeHead(200, { "content-type": "application/json" });
      res.end('{"pools": []}');
    } else if (req.url === "/v1/snapshots/nope") {
      res.writeHead(404, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { code: "not_found", message: "no snapshot 'nope'" } }));
    } else if (req.url === "/v1/sandboxes/sb-aaaaaaaaaaaa/branch") {
      res.writeHead(201, { "content-type": "application/json" });
      res.end(JSON.stringify({ tag: JSON.parse(body).tag, status: "ready" }));
    } else if (req.url === "/v1/sandboxes" && req.method === "POST" && JSON.parse(body).stream) {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write(`${JSON.stringify({ child: { index: 1, error: { code: "busy", message: "cap" }, timings: {} } })}\n`);
      res.write(`${JSON.stringify({ child: { index: 0, sandbox: { id: "sb-bbbbbbbbbbbb" }, timings: { spawn: 1 } } })}\n`);
      res.end('{"result": {"sandboxes": [], "errors": []}}\n');
    } else if (req.url === "/v1/sandboxes" && req.method === "POST") {
      res.writeHead(201, { "content-type": "application/json" });
      res.end(JSON.stringify({ sandboxes: [], errors: ["old daemon string", { code: "busy", message: "cap" }] }));
    } else {
      res.writeHead(200, { "content-type": "application/json" });
      res.end('{"ok": true}');
    }
  });
});
const dir = mkdtempSync(join(tmpdir(), "forkd-ts-"));
const socket = join(dir, "forkd.sock");
const tcp = http.createServer(server.listeners("request")[0] as http.RequestListener);
let tcpUrl = "";

before(async () => {
  await new Promise<void>((resolve) => server.listen(socket, resolve));
  await new Promise<void>((resolve) => tcp.listen(0, "127.0.0.1", resolve));
  tcpUrl = `http://127.0.0.1:${(tcp.address() as AddressInfo).port}`;
});
after(() => {
  server.close();
  tcp.close();
  rmSync(dir, { recursive: true, force: true });
});

test("over the Unix socket: streamed exec output torn into pieces arrives whole, errors are typed", async () => {
  const controller = new Controller({ url: `unix://${socket}` });
  try {
    const events: unknown[] = [];
    const outcome = await controller.exec("sb-aaaaaaaaaaaa", "echo hé", { onEvent: (event) => events.push(event) });
    assert.equal(outcome.exit_code, 0);
    assert.deepEqual(events, [{ event: "started", pid: 9 }, { event: "stdout", data: "hé" }]);
    assert.deepEqual(JSON.parse(seen.at(-1)!.body!), { cmd: "echo hé", env: {}, timeout_s: 60, stream: true });
    await assert.rejects(controller.snapshot("nope"), (err: unknown) => err instanceof NotFoundError &&
      err.reason === "no snapshot 'nope'" && err.message.includes("forkd snapshots"));
    const forked = await controller.fork("py", 2);
    assert.deepEqual(forked.errors, [{ code: "internal", message: "old daemon string" }, { code: "busy", message: "cap" }]);
  } finally {
    controller.close();
  }
});

test("over TCP the bearer token is sent", async () => {
  const controller = new Controller({ url: tcpUrl, token: "s3cr3t-for-the-test" });
  try {
    assert.deepEqual(await controller.health(), { ok: true });
    assert.equal(seen.at(-1)!.auth, "Bearer s3cr3t-for-the-test");
  } finally {
    controller.close();
  }
});

test("an upload whose own source fails rejects with that error, not as unreachable", async () => {
  const controller = new Controller({ url: `unix://${socket}` });
  async function* failing(): AsyncGenerator<string> {
    yield "first piece";
    throw new RangeError("the caller's file went away");
  }
  try {
    await assert.rejects(controller.writeFile("sb-aaaaaaaaaaaa", "/root/x", failing()), RangeError);
  } finally {
    controller.close();
  }
});

test("the store and context operations check their arguments too", async () => {
  const refused = (err: unknown) => err instanceof InvalidArgumentError;
  await assert.rejects(nowhere.compact("a", "b c"), refused);
  await assert.rejects(nowhere.snapshotDiff("../a", "b", "true"), refused);
  await assert.rejects(nowhere.pull({ url: "http://h/p", sha: "x" } as never), TypeError);
  await assert.rejects(nowhere.unpack("/p.tar.zst", { tag: "a/b" }), refused);
  await assert.rejects(nowhere.rename("sb-aaaaaaaaaaaa", "/a", "b"), refused);
  await assert.rejects(nowhere.createContext("sb-aaaaaaaaaaaa", { id: "a b" }), refused);
  await assert.rejects(nowhere.createContext("sb-aaaaaaaaaaaa", { name: "x" } as never), TypeError);
  await assert.rejects(nowhere.removeImage("../default"), refused);
});

test("a busy refusal is sent again after the daemon's Retry-After, as often as busyRetries allows", async () => {
  const patient = new Controller({ url: `unix://${socket}` });
  const impatient = new Controller({ url: `unix://${socket}`, busyRetries: 1 });
  try {
    busyAnswers = 2;
    assert.deepEqual(await patient.pools(), []);
    assert.equal(busyAnswers, 0);
    busyAnswers = 2;
    await assert.rejects(impatient.pools(), (err: unknown) => err instanceof RateLimitError && err.retryAfterS === 0);
    assert.equal(busyAnswers, 0);
  } finally {
    busyAnswers = 0;
    patient.close();
    impatient.close();
  }
  assert.throws(() => new Connection({ busyRetries: -1 }, {}), InvalidArgumentError);
});

test("Sandbox.fork with a failed child kills the started one and says which failed", async () => {
  const controller = new Controller({ url: `unix://${socket}` });
  try {
    const parent = new Sandbox("sb-aaaaaaaaaaaa", controller);
    await assert.rejects(parent.fork(2), (err: unknown) => err instanceof ForkFailedError &&
      err.children.map((c) => c.index).join() === "0,1" && err.children[1]!.error!.code === "busy" &&
      err.message.includes("child 1: busy: cap"));
    assert.ok(seen.some((r) => r.method === "DELETE" && r.url === "/v1/sandboxes/sb-bbbbbbbbbbbb"));
    await assert.rejects(Sandbox.create({ template: "py", via: controller }), (err: unknown) =>
      err instanceof ForkdError && err.code === "internal" && err.message.includes("old daemon string"));
  } finally {
    controller.close();
  }
});
