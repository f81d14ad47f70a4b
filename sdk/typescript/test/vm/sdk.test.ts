/**
 * The SDK against a real daemon with real guests. tests/vm/test_typescript_sdk_vm.py runs this with the daemon's
 * socket in FORKD_URL, its TCP listener in FORKD_TEST_TCP_URL (token in FORKD_TOKEN) and a warm snapshot in
 * FORKD_TEST_SNAPSHOT; without them every test fails (it never skips).
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import {
  AuthenticationError, ConflictError, Controller, ForkdError, NotFoundError, Sandbox, type OutputEvent,
} from "../../src/index.js";

const SNAPSHOT = process.env.FORKD_TEST_SNAPSHOT ?? "";
const TCP_URL = process.env.FORKD_TEST_TCP_URL ?? "";
const TIMEOUT = { timeout: 900_000 };
const controller = new Controller(); // FORKD_URL: the daemon's Unix socket
const sandboxes: string[] = [];
const tags: string[] = [];
let sbx: Sandbox;

before(async () => {
  assert.ok(SNAPSHOT && TCP_URL && process.env.FORKD_URL?.startsWith("unix://"),
    "FORKD_URL (unix://), FORKD_TEST_TCP_URL and FORKD_TEST_SNAPSHOT must be set (tests/vm/test_typescript_sdk_vm.py does)");
  sbx = await Sandbox.create({ template: SNAPSHOT, via: controller, timeout_s: 1800 });
  sandboxes.push(sbx.id);
});

after(async () => {
  for (const id of sandboxes) await controller.kill(id).catch(() => undefined);
  for (const tag of tags.reverse()) await controller.removeSnapshot(tag, { cascade: true }).catch(() => undefined);
  controller.close();
});

test("fork: n children with per-child outcomes", TIMEOUT, async () => {
  const result = await controller.fork(SNAPSHOT, 2, { timeout_s: 600, metadata: { by: "ts" } });
  sandboxes.push(...result.sandboxes.map((s) => s.id));
  assert.deepEqual(result.errors, []);
  assert.equal(result.sandboxes.length, 2);
  assert.ok(result.sandboxes.every((s) => s.id.startsWith("sb-") && s.snapshot_tag === SNAPSHOT));
  assert.deepEqual(result.sandboxes[0]!.metadata, { by: "ts" });
  const outcomes = [];
  for await (const child of controller.forkEach(SNAPSHOT, 2, { timeout_s: 600 })) {
    outcomes.push(child);
    if (child.sandbox) sandboxes.push(child.sandbox.id);
  }
  assert.deepEqual(outcomes.map((c) => c.index).sort(), [0, 1]);
  assert.ok(outcomes.every((c) => c.sandbox && !c.error && typeof c.timings === "object"));
  const key = { idempotency_key: `ts-${process.pid}`, owner: "ts-sdk", timeout_s: 600 };
  const once = await controller.fork(SNAPSHOT, 1, key);
  sandboxes.push(...once.sandboxes.map((s) => s.id));
  const again = await controller.fork(SNAPSHOT, 1, key); // a retried fork forks nothing more
  assert.deepEqual(again.sandboxes.map((s) => s.id), once.sandboxes.map((s) => s.id));
});

test("exec streams output as events and keeps the exit code", TIMEOUT, async () => {
  const events: OutputEvent[] = [];
  const outcome = await controller.exec(sbx.id, "for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 3",
    { onEvent: (event) => { events.push(event); } });
  assert.equal(outcome.exit_code, 3);
  assert.equal(events[0]?.event, "started");
  assert.ok(typeof events[0]?.pid === "number");
  const stdout = events.filter((e) => e.event === "stdout").map((e) => e.data).join("");
  assert.equal(stdout, "line1\nline2\nline3\n");
  assert.equal(events.filter((e) => e.event === "stderr").map((e) => e.data).join(""), "oops\n");

  const pieces: string[] = [];
  const run = await sbx.run(["sh", "-c", "echo $GREETING; cat"], {
    env: { GREETING: "hello" }, stdin: "piped\n", onStdout: (data) => { pieces.push(data); },
  });
  assert.equal(run.exit_code, 0);
  assert.equal(run.stdout, "hello\npiped\n");
  assert.equal(pieces.join(""), run.stdout);
  assert.equal((await sbx.run("cat /tmp/warm-marker")).stdout, "warmed\n"); // the snapshot's warm state
});

test("a started command gets stdin while its events are read", TIMEOUT, async () => {
  const events = await controller.startExec(sbx.id, "tr a-z A-Z"); // no stdin: it stays open
  const stdout: string[] = [];
  for await (const event of events) {
    if (event.event === "started") await controller.sendStdin(sbx.id, event.pid as number, "piped in\n", true);
    if (event.event === "stdout") stdout.push(event.data as string);
  }
  assert.equal(stdout.join(""), "PIPED IN\n");
  assert.equal(events.result?.exit_code, 0);
});

test("runCode and eval keep state in a context; output streams", TIMEOUT, async () => {
  const plain = await sbx.runCode("import numpy as np\nx = int(np.arange(10).sum())\nx");
  assert.equal(plain.value_json, 45);
  const lines: string[] = [];
  const streamed = await sbx.runCode("print('from', x)\nx * 2", { onStdout: (data) => { lines.push(data); } });
  assert.equal(lines.join(""), "from 45\n");
  assert.equal(streamed.stdout, "from 45\n");
  assert.equal(streamed.value_json, 90);
  assert.equal(await sbx.eval("x + 1"), 46);
  const failed = await sbx.runCode("1 / 0");
  assert.equal(failed.error?.name, "ZeroDivisionError");
  const context = await controller.createContext(sbx.id, { id: "other" });
  assert.equal(context.id, "other");
  await sbx.runCode("x = 'own'", { context: "other" });
  assert.equal(await sbx.eval("x", "other"), "own");
  assert.equal(await sbx.eval("x"), 45); // the default context keeps its own
  assert.ok((await controller.contexts(sbx.id)).some((c) => c.id === "other"));
  await controller.removeContext(sbx.id, "other");
  assert.ok(!(await controller.contexts(sbx.id)).some((c) => c.id === "other"));
});

test("files: write, read (text and bytes), list, stat, remove", TIMEOUT, async () => {
  const bytes = Buffer.from(Array.from({ length: 70_000 }, (_, i) => i % 256));
  await sbx.files.makeDir("/root/ts");
  assert.deepEqual(await sbx.files.write("/root/ts/data.bin", bytes), { path: "/root/ts/data.bin", size: bytes.length });
  async function* pieces() { yield "streamed "; yield Buffer.from("text\n"); }
  await sbx.files.write("/root/ts/note.txt", pieces());
  assert.equal(await sbx.files.read("/root/ts/note.txt"), "streamed text\n");
  assert.ok((await sbx.files.read("/root/ts/data.bin", { format: "bytes" })).equals(bytes));
  await assert.rejects(sbx.files.read("/root/ts/data.bin", { maxBytes: 1000 }), (err: unknown) =>
    err instanceof ForkdError && err.status === 413);
  const names = (await sbx.files.list("/root/ts")).map((e) => e.name).sort();
  assert.deepEqual(names, ["data.bin", "note.txt"]);
  assert.equal((await sbx.files.stat("/root/ts/data.bin")).size, bytes.length);
  await controller.rename(sbx.id, "/root/ts/note.txt", "/root/ts/moved.txt");
  assert.equal(await sbx.files.read("/root/ts/moved.txt"), "streamed text\n");
  await sbx.files.remove("/root/ts/moved.txt");
  await assert.rejects(sbx.files.read("/root/ts/moved.txt"), NotFoundError);
});

test("BRANCH diff and live with wait false, then fork from each", TIMEOUT, async () => {
  await sbx.run("echo branched > /root/state.txt");
  for (const mode of ["diff", "live"] as const) {
    const tag = `ts-${mode}-${Date.now()}`;
    tags.push(tag);
    const answer = await sbx.branch({ tag, mode, wait: false });
    assert.equal(answer.tag, tag);
    assert.ok(["writing", "ready"].includes(answer.status), answer.status);
    const info = await controller.waitSnapshot(tag);
    assert.equal(info.status, "ready", JSON.stringify(info));
    assert.equal(info.mode, mode);
    const child = await Sandbox.create({ template: tag, via: controller, timeout_s: 600 });
    sandboxes.push(child.id);
    assert.equal((await child.run("cat /root/state.txt")).stdout, "branched\n");
  }
  assert.equal((await sbx.run("echo still running")).stdout, "still running\n");
});

test("Sandbox.fork: children in the parent's exact state", TIMEOUT, async () => {
  await sbx.runCode("marker = 'parent state'");
  const children = await sbx.fork(2, { timeout_s: 600 });
  sandboxes.push(...children.map((c) => c.id));
  assert.equal(children.length, 2);
  for (const child of children) assert.equal(await child.eval("marker"), "parent state");
});

test("snapshots list and info; unknown snapshot is NotFoundError", TIMEOUT, async () => {
  const listed = await controller.snapshots();
  const mine = listed.find((s) => s.tag === SNAPSHOT);
  assert.ok(mine && mine.status === "ready" && mine.disk.logical_bytes > 0);
  assert.equal((await controller.snapshot(SNAPSHOT)).tag, SNAPSHOT);
  await assert.rejects(controller.snapshot("no-such-snapshot"), (err: unknown) =>
    err instanceof NotFoundError && err.code === "not_found" && err.message.includes("forkd snapshots"));
  await assert.rejects(Sandbox.create({ template: "no-such-snapshot", via: controller }), (err: unknown) =>
    err instanceof ForkdError && err.status >= 400 && err.message.includes("no-such-snapshot"));
});

test("pool set and list", TIMEOUT, async () => {
  try {
    const pool = await controller.setPoolSize(SNAPSHOT, 1);
    assert.equal(pool.tag, SNAPSHOT);
    assert.equal(pool.size, 1);
    const listed = await controller.pools();
    assert.equal(listed.find((p) => p.tag === SNAPSHOT)?.size, 1);
  } finally {
    assert.equal((await controller.setPoolSize(SNAPSHOT, 0)).size, 0);
  }
});

test("workspace create, suspend, resume, remove", TIMEOUT, async () => {
  const name = `ts-ws-${process.pid}`;
  const created = await controller.createWorkspace(name, SNAPSHOT);
  try {
    assert.equal(created.state, "running");
    const first = created.sandbox_id!;
    await controller.writeFile(first, "/root/ws.txt", "kept\n");
    const suspended = await controller.suspendWorkspace(name);
    assert.equal(suspended.state, "suspended");
    assert.equal(suspended.sandbox_id, null);
    await assert.rejects(controller.suspendWorkspace(name), ConflictError);
    const resumed = await controller.resumeWorkspace(name);
    assert.equal(resumed.state, "running");
    assert.notEqual(resumed.sandbox_id, first);
    assert.equal((await controller.readFile(resumed.sandbox_id!, "/root/ws.txt")).toString(), "kept\n");
    assert.ok((await controller.workspaces()).some((w) => w.name === name));
  } finally {
    const removed = await controller.removeWorkspace(name);
    assert.ok(removed.every((tag) => tag.startsWith(`ws-${name}-`)));
  }
  await assert.rejects(controller.workspace(name), NotFoundError);
});

test("over TCP with the bearer token; a wrong token is AuthenticationError", TIMEOUT, async () => {
  const tcp = new Controller({ url: TCP_URL });
  const wrong = new Controller({ url: TCP_URL, token: "0".repeat(64) });
  try {
    assert.ok((await tcp.snapshots()).some((s) => s.tag === SNAPSHOT));
    assert.equal((await tcp.exec(sbx.id, "echo over tcp")).stdout, "over tcp\n");
    await assert.rejects(wrong.snapshots(), AuthenticationError);
  } finally {
    tcp.close();
    wrong.close();
  }
});

test("kill: the sandbox is gone for later calls", TIMEOUT, async () => {
  const doomed = await Sandbox.create({ template: SNAPSHOT, via: controller, timeout_s: 600 });
  sandboxes.push(doomed.id);
  await doomed.kill();
  assert.ok(!(await Sandbox.list(controller)).some((s) => s.id === doomed.id));
  await assert.rejects(doomed.run("true"), (err: unknown) => err instanceof NotFoundError || err instanceof ConflictError);
});
