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
    """Every code means the same status, family and next step in TypeScript as in src/forkd/errors.py."""
    script = ("import('./dist/src/errors.js').then(m => console.log(JSON.stringify("
              "[...m.KINDS.values()].map(k => [k.code, k.status, k.family, k.nextStep]))))")
    done = subprocess.run(["node", "-e", script], cwd=typescript_sdk, capture_output=True, text=True, timeout=60,
                          check=True)
    typescript = {code: (status, family, step) for code, status, family, step in json.loads(done.stdout)}
    python = {code: (kind.status, kind.family, kind.next_step) for code, kind in KINDS.items()}
    assert typescript == python, "sdk/typescript/src/errors.ts differs from src/forkd/errors.py: " \
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
