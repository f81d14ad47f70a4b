/**
 * The tour of docs/typescript.md, compiled by `npm run build` so the documented calls keep type-checking
 * (there it imports from "@forkd/sdk"). Run: node dist/examples/tour.js with a daemon that has a "py" snapshot.
 */

import { Controller, NotFoundError, Sandbox } from "../src/index.js";

const controller = new Controller();                      // FORKD_URL, or the local socket

// Fork: a failed child does not fail the others; each error is {code, message}.
const { sandboxes, errors } = await controller.fork("py", 3, { timeout_s: 600, metadata: { job: "42" } });
console.log(sandboxes.map((s) => s.id), errors);
for await (const child of controller.forkEach("py", 3)) {  // each child as it answers or fails
  console.log(child.index, child.sandbox?.id ?? `${child.error!.code}: ${child.error!.message}`);
}

const sbx = await Sandbox.create({ template: "py", via: controller });
// Streamed output: callbacks get it as it arrives; the result still holds all of it.
const run = await sbx.run("for i in 1 2 3; do echo $i; sleep 1; done", { onStdout: (d) => process.stdout.write(d) });
console.log(run.exit_code, run.stdout);
await controller.exec(sbx.id, ["python3", "-V"], { onEvent: (e) => console.log(e) }); // started/stdout/stderr events

// Code in a persistent Python context.
const cell = await sbx.runCode("import numpy as np\nx = np.arange(5)\nint(x.sum())");
console.log(cell.value_json, await sbx.eval("int(x.max())"));        // 10 4

// Files.
await sbx.files.write("/root/data.txt", "hello\n");                   // also bytes or an async iterable (a file stream)
console.log(await sbx.files.read("/root/data.txt"), await sbx.files.list("/root"));

// BRANCH: the sandbox keeps running; wait: false answers right after the pause, the snapshot "writing".
const snap = await sbx.branch({ tag: "py-step1", mode: "live", wait: false });
await controller.waitSnapshot(snap.tag);                              // ready (or failed)
const children = await sbx.fork(2);                                   // a diff BRANCH, then 2 children of it
await Promise.all(children.map((child) => child.kill()));

// Snapshots, pools, workspaces.
console.log(await controller.snapshots(), await controller.snapshot("py"));
await controller.setPoolSize("py", 4);                                // keep 4 ready VMMs of "py"
await controller.createWorkspace("notebook", "py");
await controller.suspendWorkspace("notebook");                         // a diff layer; the VMM is freed
await controller.resumeWorkspace("notebook");

try {
  await controller.snapshot("nope");
} catch (err) {
  if (err instanceof NotFoundError) console.log(err.code, err.reason, err.nextStep);
}
await sbx.kill();
controller.close();
