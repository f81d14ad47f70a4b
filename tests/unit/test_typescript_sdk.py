"""The TypeScript SDK (sdk/typescript) without a daemon: its node unit tests, and its error table against the
Python one it mirrors."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import node_tests

from forkd.errors import KINDS


def test_node_unit_tests_pass(typescript_sdk: Path) -> None:
    """Argument checks, NDJSON torn lines, error mapping, the transport against a stand-in server."""
    node_tests(typescript_sdk, "unit", dict(os.environ), timeout_s=300)


def test_error_table_matches_forkd_errors(typescript_sdk: Path) -> None:
    """Every code means the same status, family and next step in TypeScript as in src/forkd/errors.py (the
    build generates the table from docs/openapi.json's x-error-kinds: this checks that whole path)."""
    script = ("import('./dist/src/errors.js').then(m => console.log(JSON.stringify("
              "[...m.KINDS.values()].map(k => [k.code, k.status, k.family, k.nextStep]))))")
    done = subprocess.run(["node", "-e", script], cwd=typescript_sdk, capture_output=True, text=True, timeout=60,
                          check=True)
    typescript = {code: (status, family, step) for code, status, family, step in json.loads(done.stdout)}
    python = {code: (kind.status, kind.family, kind.next_step) for code, kind in KINDS.items()}
    assert typescript == python, "the TypeScript SDK's error table differs from src/forkd/errors.py " \
        "(regenerate docs/openapi.json, rebuild): " \
        f"only in Python {sorted(set(python) - set(typescript))}, only in TypeScript " \
        f"{sorted(set(typescript) - set(python))}, different " \
        f"{sorted(c for c in set(python) & set(typescript) if python[c] != typescript[c])}"


def test_a_failing_node_test_fails_the_gate(tmp_path: Path) -> None:
    """The suite cannot pass while a node test fails or skips, or when none ran."""
    tests = tmp_path / "dist" / "test" / "case"
    tests.mkdir(parents=True)
    (tests / "a.test.mjs").write_text("import { test } from 'node:test';\n"
                                      "test('passes', () => {});\ntest('fails', () => { throw new Error('no'); });\n")
    with pytest.raises(AssertionError, match="fail"):
        node_tests(tmp_path, "case", dict(os.environ), timeout_s=120)
    (tests / "a.test.mjs").write_text("import { test } from 'node:test';\n"
                                      "test('passes', () => {});\ntest('skipped', (t) => t.skip('later'));\n")
    with pytest.raises(AssertionError, match="none skipped"):
        node_tests(tmp_path, "case", dict(os.environ), timeout_s=120)
    (tests / "a.test.mjs").unlink()
    with pytest.raises(AssertionError):
        node_tests(tmp_path, "case", dict(os.environ), timeout_s=120)


def test_the_docs_tour_is_the_compiled_example() -> None:
    """docs/typescript.md's example is examples/tour.ts, which the build type-checks (only the import differs)."""
    repo = Path(__file__).resolve().parents[2]
    documented = re.search(r"```ts\n(.*?)```", (repo / "docs" / "typescript.md").read_text(), re.DOTALL)
    assert documented is not None
    example = (repo / "sdk" / "typescript" / "examples" / "tour.ts").read_text()
    body = example[example.index("*/\n") + 3:].lstrip("\n")
    assert body == documented.group(1).replace('from "@forkd/sdk";', 'from "../src/index.js";')


USER_SCRIPT = """
import { Controller, NotFoundError, Sandbox, type ChildOutcome, type ForkResult } from "@forkd/sdk";

export async function use(controller: Controller): Promise<string> {
  const forked: ForkResult = await controller.fork("py", 2, { timeout_s: 60 });
  const first: ChildOutcome[] = [];
  for await (const child of controller.forkEach("py", 1)) first.push(child);
  const sbx = await Sandbox.create({ template: "py", via: controller });
  const run = await sbx.run("uname -r", { onStdout: (data: string) => data.length });
  const code: number = run.exit_code;
  const text: string = await sbx.files.read("/etc/hostname");
  const bytes: Buffer = await sbx.files.read("/etc/hostname", { format: "bytes" });
  await sbx.branch({ mode: "live", wait: false });
  try {
    await controller.snapshot("nope");
  } catch (err) {
    if (err instanceof NotFoundError) return err.nextStep;
  }
  return `${forked.errors.map((e) => e.code)} ${code} ${text} ${bytes.length} ${first.length} ${run.stdout}`;
}
"""
MISTAKES = """
import { Controller } from "@forkd/sdk";
export async function use(controller: Controller): Promise<void> {
  await controller.fork("py", 2, { timeout: 60 });
  await controller.branch("sb-x", { mode: "half" });
}
"""


def test_packed_package_installs_and_type_checks(typescript_sdk: Path, tmp_path: Path) -> None:
    """`npm pack`, installed into an empty project (no registry: the SDK has no runtime dependency), imports, and
    its types check a user's script strictly and catch a misspelt option and a wrong BRANCH mode."""
    subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(tmp_path)], cwd=typescript_sdk,
                   check=True, capture_output=True, timeout=300)
    (tarball,) = tmp_path.glob("forkd-sdk-*.tgz")
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text('{"name": "app", "private": true, "type": "module"}')
    subprocess.run(["npm", "install", "--offline", "--no-audit", "--no-fund", "--loglevel=error", str(tarball)],
                   cwd=app, check=True, capture_output=True, timeout=300)
    imported = subprocess.run(["node", "-e", "import('@forkd/sdk').then(m => console.log(typeof m.Controller, "
                               "typeof m.Sandbox, typeof m.NotFoundError))"], cwd=app, capture_output=True,
                              text=True, timeout=60)
    assert imported.stdout.split() == ["function"] * 3, imported.stderr
    tsc = ["node", str(typescript_sdk / "node_modules" / "typescript" / "bin" / "tsc"), "--noEmit", "--strict",
           "--target", "es2022", "--module", "nodenext", "--moduleResolution", "nodenext", "--types", "node",
           "--typeRoots", str(typescript_sdk / "node_modules" / "@types")]
    (app / "use.ts").write_text(USER_SCRIPT)
    good = subprocess.run([*tsc, "use.ts"], cwd=app, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stdout + good.stderr
    (app / "mistakes.ts").write_text(MISTAKES)
    bad = subprocess.run([*tsc, "mistakes.ts"], cwd=app, capture_output=True, text=True, timeout=300)
    assert "'timeout' does not exist in type 'ForkOptions'" in bad.stdout and '"half"' in bad.stdout, bad.stdout
