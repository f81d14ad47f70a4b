// A guest program's ports and a sandbox's network through forkd's E2B front, with E2B's unmodified
// JavaScript SDK: what ../python/ports_check.py and network_check.py check, through the other SDK.
//
// Pointed at forkd only through E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_TEST_TEMPLATE.
// `getHost(port)` names `{port}-{sandboxID}.{domain}`; no resolver here knows that wildcard name, so the
// checks connect to the front's address and send that name as the Host header, as a wildcard DNS entry
// would. There is no internet here, so what a guest may reach is checked where it is decided: a refused
// destination fails at once inside the guest (a TCP reset from the child's namespace), and the rules
// loaded in that namespace are read back (`ip netns exec`, as root). Prints `ok NAME` / `FAIL NAME: why`
// per check and exits non-zero if any failed.
import { execFileSync } from 'node:child_process'
import { readFileSync } from 'node:fs'
import http from 'node:http'
import assert from 'node:assert/strict'
import { CommandExitError, Sandbox } from 'e2b'
import WebSocket from 'ws'
import { check, failures } from './checks.mjs'

const TEMPLATE = process.env.E2B_TEST_TEMPLATE
const FRONT = new URL(process.env.E2B_SANDBOX_URL)
const WS_ECHO = readFileSync(new URL('../ws_echo.py', import.meta.url), 'utf8')
const PROBE = (ip) => `python3 -c "import socket, sys\ntry:\n socket.create_connection(('${ip}', 80), 20)\nexcept ` +
  'ConnectionRefusedError:\n sys.exit(3)\nexcept OSError as e:\n print(e); sys.exit(4)"'

function get(host, path, headers = {}) {
  return new Promise((resolve, reject) => {
    const request = http.get({ hostname: FRONT.hostname, port: FRONT.port, path, headers: { Host: host, ...headers },
      timeout: 120_000 }, (answer) => {
      const chunks = []
      answer.on('data', (chunk) => chunks.push(chunk))
      answer.on('end', () => resolve({ status: answer.statusCode, text: Buffer.concat(chunks).toString() }))
      answer.on('error', reject)
    })
    request.on('timeout', () => request.destroy(new Error(`no answer from ${host}${path} in 120 s`)))
    request.on('error', reject)
  })
}

async function exitCode(sbx, command) {
  try {
    return (await sbx.commands.run(command, { timeoutMs: 120_000 })).exitCode
  } catch (error) {
    if (error instanceof CommandExitError) return error.exitCode
    throw error
  }
}

async function waitFor(port, sbx) {
  // until the guest program listens (it starts in the background)
  const connect = `python3 -c "import socket; socket.create_connection(('127.0.0.1', ${port}), 1)"`
  for (let i = 0; i < 240; i++) {
    if ((await exitCode(sbx, connect)) === 0) return
    await new Promise((resolve) => setTimeout(resolve, 500))
  }
  assert.fail(`nothing listened on ${port} in the guest`)
}

function websocketEcho(host, token, messages) {
  // connects to the front, names the guest port's host: the `ws` package sends that Host header as given
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(`ws://${FRONT.hostname}:${FRONT.port}/echo`,
      { headers: { Host: host, 'E2B-Traffic-Access-Token': token }, handshakeTimeout: 120_000 })
    const answers = []
    const timer = setTimeout(() => { socket.terminate(); reject(new Error(`echoed ${answers.length} in 120 s`)) }, 120_000)
    socket.on('open', () => { for (const message of messages) socket.send(message) })
    socket.on('message', (data, isBinary) => {
      answers.push(isBinary ? Buffer.from(data) : data.toString())
      if (answers.length === messages.length) socket.close(1000)
    })
    socket.on('close', () => { clearTimeout(timer); resolve(answers) })
    socket.on('unexpected-response', (_, answer) => { clearTimeout(timer); reject(new Error(`refused: ${answer.statusCode}`)) })
    socket.on('error', (error) => { clearTimeout(timer); reject(error) })
  })
}

function rules(sbx) {
  return execFileSync('ip', ['netns', 'exec', `forkd-${sbx.sandboxId}`, 'nft', 'list', 'table', 'ip', 'forkd'],
    { encoding: 'utf8', timeout: 60_000 })
}

const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 900_000 })
const token = sbx.trafficAccessToken ?? ''
try {
  await sbx.files.write('/tmp/site/hello.txt', 'served from the guest\n')
  await sbx.files.write('/tmp/ws_echo.py', WS_ECHO)
  await sbx.commands.run('cd /tmp/site && python3 -m http.server 8000', { background: true })
  await sbx.commands.run('python3 /tmp/ws_echo.py 8765', { background: true })
  await waitFor(8000, sbx)
  await waitFor(8765, sbx)
  const host = sbx.getHost(8000)

  await check('http_server', async () => {
    assert.ok(host.startsWith(`8000-${sbx.sandboxId}.`), host)
    const answer = await get(host, '/hello.txt', { 'E2B-Traffic-Access-Token': token })
    assert.deepEqual([answer.status, answer.text], [200, 'served from the guest\n'])
    const listing = await get(FRONT.host, '/', {
      'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000', 'E2B-Traffic-Access-Token': token })
    assert.ok(listing.status === 200 && listing.text.includes('hello.txt'), listing.text)
  })

  await check('needs_token', async () => {
    for (const headers of [{}, { 'E2B-Traffic-Access-Token': '0'.repeat(64) }]) {
      const answer = await get(host, '/hello.txt', headers)
      assert.equal(answer.status, 401, answer.text)
    }
  })

  await check('closed_port', async () => {
    const answer = await get(sbx.getHost(8001), '/', { 'E2B-Traffic-Access-Token': token })
    assert.ok(answer.status === 502 && JSON.parse(answer.text).message.includes('8001'), answer.text)
  })

  await check('websocket', async () => {
    const sent = ['hello', Buffer.from('\x00\x01binary', 'latin1'), 'x'.repeat(40_000)]
    assert.deepEqual(await websocketEcho(sbx.getHost(8765), token, sent), sent)
  })
} finally {
  await sbx.kill()
}

await check('no_option_no_link', async () => {
  const plain = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  try {
    assert.equal(await exitCode(plain, PROBE('203.0.113.5')), 4) // no link: unreachable, not refused by a rule
    assert.throws(() => execFileSync('ip', ['netns', 'pids', `forkd-${plain.sandboxId}`], { stdio: 'ignore' }))
  } finally {
    await plain.kill()
  }
})

await check('deny_list_then_update', async () => {
  const listed = await Sandbox.create(TEMPLATE, {
    timeoutMs: 600_000, network: { denyOut: ['203.0.113.0/24'], allowOut: ['203.0.113.9'] },
  })
  try {
    let table = rules(listed)
    assert.ok(table.includes('ip daddr 203.0.113.9 accept') && table.includes('ip daddr 203.0.113.0/24'), table)
    assert.equal(await exitCode(listed, PROBE('203.0.113.5')), 3) // denied: reset inside the namespace
    await listed.updateNetwork({ denyOut: ['0.0.0.0/0'], allowOut: ['198.51.100.0/24'] })
    table = rules(listed)
    assert.ok(!table.includes('oifname "veth0" accept') && table.includes('ip daddr 198.51.100.0/24 accept'), table)
    assert.equal(await exitCode(listed, PROBE('192.0.2.10')), 3)
    await listed.updateNetwork({}) // omitted fields clear: everything beyond the host again
    assert.ok(rules(listed).includes('oifname "veth0" accept'))
  } finally {
    await listed.kill()
  }
})

await check('internet_off', async () => {
  const closed = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000, allowInternetAccess: false })
  try {
    assert.equal(await exitCode(closed, PROBE('192.0.2.10')), 3)
    assert.ok(!rules(closed).includes('oifname "veth0" accept'))
    await closed.updateNetwork({ allowInternetAccess: true }) // and on again, live
    assert.ok(rules(closed).includes('oifname "veth0" accept'))
  } finally {
    await closed.kill()
  }
})

process.exit(failures.length ? 1 : 0)
