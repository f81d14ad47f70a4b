// Drive forkd with E2B's unmodified JavaScript SDKs (`e2b`, `@e2b/code-interpreter`) under Node.
//
// Pointed at forkd only through the environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, and
// E2B_TEST_TEMPLATE (the forkd snapshot to start sandboxes from), E2B_TEST_CHART_TEMPLATE (one whose
// image has matplotlib, for the `charts` check). Prints `ok NAME` per check that
// passed, `FAIL NAME: why` per check that did not, and exits non-zero if any failed.
import { randomBytes } from 'node:crypto'
import { readFileSync } from 'node:fs'
import assert from 'node:assert/strict'
import { AuthenticationError, CommandExitError, FilesystemEventType, NotFoundError, Sandbox, TimeoutError } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'
import { check, failures } from './checks.mjs'

const TEMPLATE = process.env.E2B_TEST_TEMPLATE
const CHART_CELL = readFileSync(new URL('../chart_cell.py', import.meta.url), 'utf8')
const MATPLOTLIB_CELL = readFileSync(new URL('../matplotlib_cell.py', import.meta.url), 'utf8')

async function expectRejects(kind, body) {
  try {
    await body()
  } catch (error) {
    assert.ok(error instanceof kind, `expected ${kind.name}, got ${error?.name}: ${error?.message}`)
    return error
  }
  assert.fail(`expected ${kind.name}`)
}

async function listedIds(query) {
  const paginator = Sandbox.list(query ? { query } : undefined)
  const ids = []
  while (paginator.hasNext) ids.push(...(await paginator.nextItems()).map((info) => info.sandboxId))
  return ids
}

const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 900_000, metadata: { suite: 'e2b-js' }, envs: { GREETING: 'hi' } })
console.log(`sandbox ${sbx.sandboxId}`)

await check('commands', async () => {
  assert.equal((await sbx.commands.run('echo $GREETING $EXTRA', { envs: { EXTRA: 'there' } })).stdout, 'hi there\n')
  assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
})

await check('stdout_streams_before_the_end', async () => {
  const seen = []
  let released
  const result = await sbx.commands.run(
    'rm -f /tmp/go; echo ready; while [ ! -f /tmp/go ]; do sleep 0.1; done; echo done',
    {
      timeoutMs: 120_000,
      onStdout: (text) => {
        seen.push(text)
        if (text.includes('ready') && !released) released = sbx.files.write('/tmp/go', '1') // the command waits for this
      },
    },
  )
  await released
  assert.ok(seen[0].startsWith('ready'), JSON.stringify(seen))
  assert.equal(result.stdout, 'ready\ndone\n')
})

await check('background_command_killed', async () => {
  const handle = await sbx.commands.run('sleep 600', { background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === handle.pid))
  assert.equal(await handle.kill(), true)
  const error = await expectRejects(CommandExitError, () => handle.wait())
  assert.notEqual(error.exitCode, 0)
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === handle.pid))
})

await check('stdin', async () => {
  const handle = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(handle.pid, 'piped\n')
  await sbx.commands.closeStdin(handle.pid)
  assert.equal((await handle.wait()).stdout, 'piped\n')
})

await check('non_zero_exit', async () => {
  const error = await expectRejects(CommandExitError, () => sbx.commands.run('echo oops >&2; exit 3'))
  assert.equal(error.exitCode, 3)
  assert.equal(error.stderr, 'oops\n')
})

await check('files', async () => {
  const data = randomBytes(20 << 20)
  const slow = { requestTimeoutMs: 900_000 } // 20 MiB through an emulated (TCG) guest on a busy host
  await sbx.files.write('/tmp/big-js.bin', data.buffer.slice(data.byteOffset, data.byteOffset + data.length), slow)
  const back = Buffer.from(await sbx.files.read('/tmp/big-js.bin', { format: 'bytes', ...slow }))
  assert.ok(back.equals(data), `read ${back.length} bytes, not the ${data.length} written`)
  await sbx.files.write('/tmp/jsdir/a.txt', 'hello')
  assert.deepEqual((await sbx.files.list('/tmp/jsdir')).map((e) => e.name), ['a.txt'])
  assert.equal(await sbx.files.exists('/tmp/jsdir/a.txt'), true)
  await sbx.files.rename('/tmp/jsdir/a.txt', '/tmp/jsdir/b.txt')
  assert.equal(await sbx.files.exists('/tmp/jsdir/a.txt'), false)
  assert.equal(await sbx.files.read('/tmp/jsdir/b.txt'), 'hello')
  await sbx.files.remove('/tmp/jsdir/b.txt')
  assert.equal(await sbx.files.exists('/tmp/jsdir/b.txt'), false)
  assert.equal(await sbx.files.makeDir('/tmp/jsdir/sub'), true)
  assert.equal(await sbx.files.makeDir('/tmp/jsdir/sub'), false)
  await expectRejects(NotFoundError, () => sbx.files.read('/tmp/missing'))
})

await check('watch', async () => {
  await sbx.files.makeDir('/tmp/watched-js')
  const seen = []
  const handle = await sbx.files.watchDir('/tmp/watched-js', (event) => seen.push(event), { recursive: true })
  try {
    await sbx.files.write('/tmp/watched-js/new.txt', 'x')
    const deadline = Date.now() + 60_000
    while (!seen.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.CREATE)) {
      assert.ok(Date.now() < deadline, JSON.stringify(seen))
      await new Promise((resolve) => setTimeout(resolve, 200))
    }
  } finally {
    await handle.stop()
  }
})

await check('pty', async () => {
  const output = []
  const handle = await sbx.pty.create({ rows: 30, cols: 100, onData: (data) => output.push(Buffer.from(data)) })
  const send = (text) => sbx.pty.sendInput(handle.pid, new TextEncoder().encode(text))
  await send('stty size > /tmp/pty-size-js; read line; stty size; exit 5\n')
  const deadline = Date.now() + 60_000
  const answered = async () => (await sbx.files.exists('/tmp/pty-size-js')) && (await sbx.files.read('/tmp/pty-size-js')).trim()
  while (!(await answered())) { // the first stty wrote its answer (the shell makes the file first) before the resize
    assert.ok(Date.now() < deadline)
    await new Promise((resolve) => setTimeout(resolve, 200))
  }
  await sbx.pty.resize(handle.pid, { rows: 12, cols: 40 })
  await send('go\n')
  const error = await expectRejects(CommandExitError, () => handle.wait())
  assert.equal(error.exitCode, 5)
  assert.equal((await sbx.files.read('/tmp/pty-size-js')).trim(), '30 100')
  assert.ok(Buffer.concat(output).toString().includes('12 40'))
})

await check('second_client', async () => {
  await sbx.files.write('/tmp/shared-js', 'from the first client')
  const other = await Sandbox.connect(sbx.sandboxId)
  assert.equal(await other.files.read('/tmp/shared-js'), 'from the first client')
})

await check('set_timeout', async () => {
  await sbx.setTimeout(1_200_000)
  const info = await sbx.getInfo()
  const left = (info.endAt.getTime() - Date.now()) / 1000
  assert.ok(left > 1100 && left <= 1201, `${left} s left`)
  assert.deepEqual(info.metadata, { suite: 'e2b-js' })
})

await check('list', async () => {
  assert.ok((await listedIds({ metadata: { suite: 'e2b-js' } })).includes(sbx.sandboxId))
  assert.ok(!(await listedIds({ metadata: { suite: 'other' } })).includes(sbx.sandboxId))
})

await check('wrong_api_key', async () => {
  await expectRejects(AuthenticationError, () => Sandbox.list({ apiKey: 'e2b_' + '0'.repeat(40) }).nextItems())
})

await check('unknown_sandbox', async () => {
  await expectRejects(NotFoundError, () => Sandbox.connect('sb-doesnotexist'))
  await expectRejects(NotFoundError, () => Sandbox.getInfo('sb-doesnotexist'))
})

await check('client_timeouts', async () => {
  // A client that gives up stops its work in the guest: the cell is interrupted (the next one answers
  // instead of waiting for the abandoned sleep), the command ends at its timeout.
  const code = await CodeSandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  try {
    await code.runCode('kept = 1')
    await expectRejects(TimeoutError, () => code.runCode('import time; time.sleep(3600)', { timeoutMs: 3_000 }))
    const after = await code.runCode('kept + 1', { timeoutMs: 300_000 }) // before: waited for the hour-long sleep
    assert.equal(after.text, '2')
    await expectRejects(Error, () => code.commands.run('sleep 3600 && echo never', { timeoutMs: 3_000 }))
    let gone = false
    for (let i = 0; i < 120 && !gone; i++) { // bounds a hang only: the command ends 3 s after it started
      gone = !(await code.commands.list()).some((p) => [p.cmd, ...p.args].join(' ').includes('sleep 3600'))
      if (!gone) await new Promise((resolve) => setTimeout(resolve, 1000))
    }
    assert.ok(gone, 'the command outlived its timeout')
  } finally {
    await code.kill()
  }
})

await check('run_code', async () => {
  const code = await CodeSandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  try {
    await code.runCode('x = 41')
    const execution = await code.runCode("print('side'); x + 1")
    assert.equal(execution.text, '42')
    assert.deepEqual(execution.logs.stdout, ['side\n'])
    const failed = await code.runCode('1 / 0')
    assert.equal(failed.error?.name, 'ZeroDivisionError')
    const context = await code.createCodeContext()
    assert.equal((await code.runCode('x = 1; x', { context })).text, '1')
    assert.equal((await code.runCode('x')).text, '41')
    assert.ok((await code.listCodeContexts()).some((c) => c.id === context.id))
    await code.removeCodeContext(context)
    await code.restartCodeContext('default')
    assert.equal((await code.runCode("'x' in globals()")).text, 'False')
    const chart = await code.runCode(CHART_CELL)
    assert.equal(chart.error, undefined)
    assert.equal(chart.results.length, 1)
    assert.ok(Buffer.from(chart.results[0].png, 'base64').subarray(0, 4).equals(Buffer.from('\x89PNG', 'latin1')))
  } finally {
    await code.kill()
  }
})

await check('charts', async () => {
  const code = await CodeSandbox.create(process.env.E2B_TEST_CHART_TEMPLATE, { timeoutMs: 600_000 })
  try {
    const execution = await code.runCode(MATPLOTLIB_CELL, { timeoutMs: 600_000 })
    assert.equal(execution.error, undefined)
    const [line, scatter, bar, pie] = execution.results.map((result) => result.chart)
    assert.deepEqual([line.type, line.title, line.x_unit], ['line', 'Line', 'd'])
    assert.deepEqual(line.elements.map((e) => [e.label, e.points]), [['growth', [[1, 2], [2, 4], [3, 8]]]])
    assert.deepEqual([scatter.type, scatter.elements[0].points], ['scatter', [[1, 3], [2, 4]]])
    assert.deepEqual(bar.elements.map((e) => [e.label, e.group, e.value]), [['apples', 'stock', 3], ['pears', 'stock', 5]])
    assert.deepEqual(pie.elements.map((e) => [e.label, Math.round(e.angle)]), [['left', 90], ['right', 270]])
  } finally {
    await code.kill()
  }
})

await check('fork', async () => {
  await sbx.commands.run('echo before-fork > /tmp/state-js')
  const children = await sbx.fork({ count: 2, timeoutMs: 300_000 })
  try {
    assert.equal(children.length, 2)
    for (const child of children) {
      assert.ok(child instanceof Sandbox, String(child))
      assert.equal(await child.files.read('/tmp/state-js'), 'before-fork\n')
      await child.files.write('/tmp/state-js', child.sandboxId)
    }
    assert.equal(await sbx.files.read('/tmp/state-js'), 'before-fork\n')
  } finally {
    for (const child of children) if (child instanceof Sandbox) await child.kill()
  }
})

await check('pause_resume', async () => {
  await sbx.commands.run('echo kept-in-memory > /tmp/paused-js')
  assert.equal(await sbx.pause(), true)
  assert.ok((await listedIds({ state: ['paused'] })).includes(sbx.sandboxId))
  const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
  assert.equal(await resumed.files.read('/tmp/paused-js'), 'kept-in-memory\n')
})

await check('kill', async () => {
  assert.equal(await sbx.kill(), true)
  assert.ok(!(await listedIds()).includes(sbx.sandboxId))
})

process.exit(failures.length ? 1 : 0)
