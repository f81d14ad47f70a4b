"""What every benchmark's figure shares: drawn without a display (Agg), titled, laid out and saved as
a PNG next to its JSON. Benchmarks import it from next to themselves (``from figures import plt, save``),
as they import ``spawn``'s helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: a benchmark runs on hosts with no display
import matplotlib.pyplot as plt

__all__ = ["load_span", "plt", "save"]


def load_span(report: dict[str, Any]) -> str:
    """The host's load average before and after the run: figures taken under load say so."""
    return f"load {report['load_start']:.1f} → {report['load_end']:.1f}"


def save(fig: Any, path: Path, title: str | None = None, dpi: int = 110) -> None:
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
