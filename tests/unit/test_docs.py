"""The docs that are derived from the code stay derived: the CLI reference is current, the troubleshooting page
has a section for every error kind (and none for a kind that is gone), and the README links every doc."""

from __future__ import annotations

import re
from pathlib import Path

from forkd.cli.reference import render
from forkd.errors import KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_cli_reference_is_current() -> None:
    assert (DOCS / "cli-reference.md").read_text() == render(), \
        "docs/cli-reference.md is stale: run `.venv/bin/python -m forkd.cli.reference > docs/cli-reference.md`"


def test_the_cli_reference_covers_every_visible_command_and_its_options() -> None:
    reference = render()
    for heading in ("## `forkd exec`", "## `forkd snapshot ls`", "## `forkd sandbox rm`", "## `forkd daemon`"):
        assert heading in reference
    assert "`--check-config`" in reference and "`-h`, `--help`" in reference
    assert "## `forkd snapshots`" not in reference and "`forkd snapshots`" in reference  # an older, hidden name


def test_troubleshooting_has_one_section_per_error_kind() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    sections = re.findall(r"^### `([a-z_]+)`", text, flags=re.MULTILINE)
    assert len(sections) == len(set(sections))
    assert sorted(sections) == sorted(KINDS), "docs/troubleshooting.md: add (or remove) the kinds of forkd/errors.py"
    for code, kind in KINDS.items():  # each section states the kind's status as the daemon answers it
        section = text.split(f"### `{code}`", 1)[1].split("\n### ", 1)[0]
        assert (f"HTTP {kind.status}" if kind.status else "no HTTP status") in section, code


def test_the_readme_links_every_doc() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    missing = [doc.name for doc in sorted(DOCS.glob("*.md")) if f"docs/{doc.name}" not in readme]
    assert missing == []
