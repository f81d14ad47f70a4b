"""Ready-made templates built through the REST API: the image, then the snapshot only when absent
(or again with ``force``), with the template's packages, warm modules and the caller's CA certificates."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from forkd.cli import templates as cli_templates
from forkd.sdk.templates import CODE_INTERPRETER, build_template


class _Daemon:
    """Records the REST calls a template build makes (the seam is the Controller)."""

    def __init__(self, tags: set[str]) -> None:
        self.tags = tags
        self.calls: list[tuple[str, Any]] = []

    def build_image(self, on_progress: Any = None, **spec: Any) -> dict[str, Any]:
        self.calls.append(("build_image", spec))
        return {"name": spec["name"]}

    def snapshots(self) -> list[dict[str, Any]]:
        return [{"tag": t} for t in sorted(self.tags)]

    def snapshot(self, tag: str) -> dict[str, Any]:
        return {"tag": tag, "status": "ready"}

    def remove_snapshot(self, tag: str) -> list[str]:
        self.calls.append(("remove_snapshot", tag))
        self.tags.discard(tag)
        return [tag]

    def create_snapshot(self, tag: str, on_progress: Any = None, **options: Any) -> dict[str, Any]:
        self.calls.append(("create_snapshot", (tag, options)))
        self.tags.add(tag)
        return {"tag": tag}


def test_the_code_interpreter_ships_e2bs_libraries_warm() -> None:
    assert CODE_INTERPRETER.tag == "code-interpreter-v1"  # what the code-interpreter SDK asks for by default
    for module in ("numpy", "pandas", "matplotlib", "scipy", "sklearn", "seaborn", "requests"):
        assert module in CODE_INTERPRETER.warm_modules
    assert {"python3-sklearn", "python3-seaborn", "python3-matplotlib"} <= set(CODE_INTERPRETER.packages)


def test_a_build_bakes_the_snapshot_once_and_again_only_when_forced() -> None:
    daemon = _Daemon(set())
    build_template(daemon, CODE_INTERPRETER, ca_certs=["PEM"])  # type: ignore[arg-type]
    (_, spec), (_, (tag, options)) = daemon.calls
    assert spec["name"] == "code-interpreter" and spec["ca_certs"] == ["PEM"] and spec["force"] is False
    assert tag == "code-interpreter-v1" and options["warm_modules"] == list(CODE_INTERPRETER.warm_modules)
    daemon.calls.clear()
    build_template(daemon, CODE_INTERPRETER)  # type: ignore[arg-type]
    assert [name for name, _ in daemon.calls] == ["build_image"]  # the image is checked; the snapshot reused
    daemon.calls.clear()
    build_template(daemon, CODE_INTERPRETER, force=True)  # type: ignore[arg-type]
    assert [name for name, _ in daemon.calls] == ["build_image", "remove_snapshot", "create_snapshot"]


def test_the_cli_passes_ca_certificates_and_refuses_unknown_templates(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Any) -> None:
    daemon = _Daemon(set())
    monkeypatch.setattr(cli_templates, "daemon", lambda: daemon)
    ca = tmp_path / "ca.pem"
    ca.write_text("PEM TEXT")
    done = CliRunner().invoke(cli_templates.template, ["code-interpreter", "--ca-cert", str(ca)])
    assert done.exit_code == 0, done.output
    assert daemon.calls[0][1]["ca_certs"] == ["PEM TEXT"] and "code-interpreter-v1" in done.output
    refused = CliRunner().invoke(cli_templates.template, ["base"])
    assert refused.exit_code == 2 and "code-interpreter" in refused.output
