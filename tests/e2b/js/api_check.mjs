// The rest of E2B's API with E2B's unmodified JavaScript SDKs: snapshots, lifecycle (pause at the
// timeout, resume on the next request), metrics, and a route this server does not serve (501).
//
// Pointed at forkd only through E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_TEST_TEMPLATE.
// Prints `ok NAME` / `FAIL NAME: why` per check; exits non-zero if any failed.
import assert from 'node:assert/strict'
import { NotFoundError, Sandbox } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'
import { check, failures } from './checks.mjs'

const TEMPLATE = process.env.E2B_TEST_TEMPLATE
const API = process.env.E2B_API_URL
const KEY = { 'X-API-KEY': process.env.E2B_API_KEY }
const CYCLES = 3 // the Python check runs 10; these show the same through the other SDK

async function waitFor(what, test, withinMs) {
  const end = Date.now() + withinMs
  while (!(await test())) {
    if (Date.now() > end) assert.fail(`${what}: not within ${withinMs / 1000} s`)
    await new Promise((resolve) => setTimeout(resolve, 1000))
  }
}

await check('unsupported', async () => {
  const answer = await fetch(`${API}/volumes`, { headers: KEY })
  assert.equal(answer.status, 501)
  assert.match((await answer.json()).message, /not supported by this server/)
})

await check('snapshots', async () => {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  let made
  try {
    await sbx.files.write('/tmp/snap-js', 'in memory')
    const snap = await sbx.createSnapshot()
    assert.ok((await sbx.listSnapshots().nextItems()).some((s) => s.snapshotId === snap.snapshotId))
    await sbx.files.write('/tmp/snap-js', 'changed')
    made = await Sandbox.create(snap.snapshotId, { timeoutMs: 300_000 })
    assert.equal(await made.files.read('/tmp/snap-js'), 'in memory')
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.ok(!(await Sandbox.listSnapshots().nextItems()).some((s) => s.snapshotId === snap.snapshotId))
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  } finally {
    if (made) await made.kill()
    await sbx.kill()
  }
})

await check('lifecycle', async () => {
  const code = await CodeSandbox.create(TEMPLATE, {
    timeoutMs: 600_000, lifecycle: { onTimeout: 'pause', autoResume: true },
  })
  try {
    assert.deepEqual((await code.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true })
    const first = await code.runCode('counter = 0\nimport subprocess\nsleeper = subprocess.Popen(["sleep", "86400"])')
    assert.equal(first.error, undefined)
    await code.files.write('/tmp/cycle-js', 'kept')
    await code.setTimeout(5_000)
    await waitFor('paused at its timeout', async () => (await Sandbox.getInfo(code.sandboxId)).state === 'paused', 180_000)
    for (let cycle = 1; cycle <= CYCLES; cycle++) {
      if (cycle > 1) assert.equal(await code.pause(), true)
      const ran = await code.runCode('counter += 1\n(counter, sleeper.poll())', { timeoutMs: 300_000 })
      assert.equal(ran.error, undefined)
      assert.equal(ran.text, `(${cycle}, None)`)
      const info = await Sandbox.getInfo(code.sandboxId)
      assert.equal(info.state, 'running')
      assert.equal(await code.files.read('/tmp/cycle-js'), 'kept')
    }
  } finally {
    await code.kill()
  }
})

await check('metrics', async () => {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  try {
    const samples = await sbx.getMetrics()
    assert.ok(samples.length >= 1, 'no sample')
    const last = samples.at(-1)
    assert.ok(last.cpuCount >= 1 && last.cpuUsedPct >= 0 && last.cpuUsedPct <= 100, JSON.stringify(last))
    assert.ok(last.memUsed > 0 && last.memUsed < last.memTotal && last.diskUsed > 0 && last.diskUsed < last.diskTotal,
      JSON.stringify(last))
    assert.ok(last.timestamp instanceof Date)
  } finally {
    await sbx.kill()
  }
})

await check('not_found_is_not_unsupported', async () => {
  // a sandbox that does not exist is still "not found", which the SDK keys on
  try {
    await Sandbox.getMetrics('sb-aaaaaaaaaaaa')
    assert.fail('metrics of a sandbox that does not exist')
  } catch (error) {
    assert.ok(error instanceof NotFoundError || /not found/i.test(error?.message), `${error?.name}: ${error?.message}`)
  }
})

process.exit(failures.length ? 1 : 0)
