"""Ready-made templates: an image plus a warm snapshot under a well-known tag, built through the REST API.

``code-interpreter-v1`` is what E2B's code-interpreter SDK starts when ``Sandbox.create()`` names
no template: the libraries E2B's own code-interpreter template ships, from Debian's packages (the
image builder installs them from the machine's configured mirror), imported in the warm
interpreter before the snapshot is saved, so a child's first cell finds them loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forkd.sdk.controller import Controller
from forkd.sdk.records import SnapshotRecord


@dataclass(frozen=True)
class Template:
    tag: str  # the snapshot (E2B's template id)
    image: str  # the image it is baked from, cached by the builder by its inputs
    packages: tuple[str, ...]  # Debian packages over the base image's
    warm_modules: tuple[str, ...]  # imported before the snapshot is saved
    memory_mib: int = 1024


CODE_INTERPRETER = Template(
    tag="code-interpreter-v1",
    image="code-interpreter",
    packages=("python3-numpy", "python3-pandas", "python3-matplotlib", "python3-scipy", "python3-sklearn",
              "python3-seaborn", "python3-requests", "python3-bs4", "python3-openpyxl", "python3-pil",
              "python3-sympy", "python3-plotly", "python3-xlrd", "python3-aiohttp", "ca-certificates"),
    warm_modules=("numpy", "pandas", "matplotlib", "matplotlib.pyplot", "scipy", "sklearn", "seaborn", "requests"),
)
TEMPLATES = {"code-interpreter": CODE_INTERPRETER}


def build_template(controller: Controller, template: Template, ca_certs: Sequence[str] = (), force: bool = False,
                   on_progress: Callable[[str], Any] | None = None) -> SnapshotRecord:
    """Build (or reuse) the template's image, then bake its snapshot unless it exists already.

    ``force`` rebuilds the image and bakes the snapshot again (the old one is removed first, which
    the daemon refuses while children of it run). Returns the snapshot's record.
    """
    controller.build_image(on_progress=on_progress, name=template.image, packages=list(template.packages),
                           ca_certs=list(ca_certs), force=force)
    existing = {s["tag"] for s in controller.snapshots()}
    if template.tag in existing:
        if not force:
            return controller.snapshot(template.tag)
        controller.remove_snapshot(template.tag)
    controller.create_snapshot(template.tag, on_progress=on_progress, image=template.image,
                               memory_mib=template.memory_mib, warm_modules=list(template.warm_modules))
    return controller.snapshot(template.tag)
