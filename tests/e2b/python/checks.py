"""What every E2B SDK check script here shares: run one named check, print ``ok NAME`` or ``FAIL NAME``
(the VM tests read those lines), and remember the failures so the script's exit code reports them."""

from __future__ import annotations

import traceback
from collections.abc import Callable

failures: list[str] = []


def check(name: str, body: Callable[[], object]) -> None:
    try:
        body()
    except Exception as exc:  # reported, and the remaining checks still run
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
    else:
        print(f"ok {name}", flush=True)
