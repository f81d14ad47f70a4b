/** https with the CA of FORKD_CA_CERT / `ca`: a server certificate that CA signed is trusted, others are not. */

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import https from "node:https";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Connection } from "../../src/connection.js";
import { Controller } from "../../src/controller.js";
import { DaemonUnreachableError } from "../../src/errors.js";

const dir = mkdtempSync(join(tmpdir(), "forkd-ts-tls-"));
const file = (name: string) => join(dir, name);
const openssl = (...args: string[]) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
let server: https.Server;
let url = "";

before(async () => {
  openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=forkd ts test CA",
    "-keyout", "ca.key", "-out", "ca.pem");
  openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key", "-out", "server.csr");
  writeFileSync(file("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
  openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
    "-extfile", "san.ext", "-out", "server.pem");
  server = https.createServer({ key: readFileSync(file("server.key")), cert: readFileSync(file("server.pem")) },
    (_req, res) => res.writeHead(200, { "content-type": "application/json" }).end('{"ok": true}'));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  url = `https://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

after(() => {
  server?.close();
  rmSync(dir, { recursive: true, force: true });
});

test("the CA named by FORKD_CA_CERT makes the daemon's certificate trusted", async () => {
  const previous = process.env.FORKD_CA_CERT;
  process.env.FORKD_CA_CERT = file("ca.pem");
  const controller = new Controller({ url, token: "t" });
  try {
    assert.deepEqual(await controller.health(), { ok: true });
  } finally {
    controller.close();
    if (previous === undefined) delete process.env.FORKD_CA_CERT;
    else process.env.FORKD_CA_CERT = previous;
  }
});

test("without that CA the certificate is refused", async () => {
  const controller = new Controller(new Connection({ url }, {})); // an environment without FORKD_CA_CERT
  try {
    await assert.rejects(controller.health(), (err: unknown) => err instanceof DaemonUnreachableError &&
      err.message.includes("set FORKD_CA_CERT"));
  } finally {
    controller.close();
  }
});
