"""What the fuzz tests (tests/unit/test_openapi.py, tests/vm/test_fuzz_live.py) check beyond schemathesis's own."""

from __future__ import annotations

from typing import Any

#: Codes of a request refused before any work for failing the API's own checks: one the schema admitted
#: means the document lacks a pattern or bound. (A refusal of what the request names, such as a pack
#: file that is not there or a guest path that is a directory, is the operation's answer, not this.)
BOUNDARY_CODES = {"invalid_request", "malformed_body", "body_too_large", "method_not_allowed"}
#: What JSON Schema cannot say: a CIDR with host bits set (10.0.0.1/24), a port range from high to low, a
#: warm command line whose quotes do not close.
BEYOND_A_SCHEMA = ("has host bits set", "low to high", "must split into words")


def assert_not_refused_at_the_boundary(case: Any, response: Any) -> None:
    """Schemathesis's "schema-valid request rejected" (ST202), narrowed to the daemon's boundary checks."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code not in (400, 405, 413):
        return
    error = response.json().get("error", {})
    if any(reason in error.get("message", "") for reason in BEYOND_A_SCHEMA):
        return
    assert error.get("code") not in BOUNDARY_CODES, \
        f"schema-valid request rejected: {case.method} {case.formatted_path} {case.query} {case.body!r:.300} → " \
        f"{response.status_code} {response.text[:300]}"
