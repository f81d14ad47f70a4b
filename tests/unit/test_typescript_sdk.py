"""The TypeScript SDK (sdk/typescript) without a daemon: its node unit tests, and its error table against the
Python one it mirrors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

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
