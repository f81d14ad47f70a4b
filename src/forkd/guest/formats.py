"""A value's rich representations, by E2B result key: what a cell's result or ``display()`` shows.

IPython's ``_repr_*_`` methods and ``_repr_mimebundle_``, a matplotlib figure as PNG plus its data
as E2B's chart (:mod:`charts`), plain text always; each format bounded. Runs in a context's
process (:mod:`kernel`); stdlib only.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from typing import Any

from . import charts

#: value_json is dropped (null) above this encoded size; ``value`` still carries the repr.
VALUE_JSON_MAX_BYTES = 1024 * 1024

#: One rich format larger than this is left out of its result (and named in ``extra``).
FORMAT_MAX_BYTES = 4 * 1024 * 1024

#: IPython's display-method names and the E2B result keys they fill.
_REPR_METHODS = (
    ("_repr_html_", "html"),
    ("_repr_markdown_", "markdown"),
    ("_repr_svg_", "svg"),
    ("_repr_png_", "png"),
    ("_repr_jpeg_", "jpeg"),
    ("_repr_pdf_", "pdf"),
    ("_repr_latex_", "latex"),
    ("_repr_json_", "json"),
    ("_repr_javascript_", "javascript"),
)
_MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
_BINARY_KEYS = frozenset({"png", "jpeg", "pdf"})

#: Made once: json.dumps with an argument builds a new encoder per call (costly under TCG).
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def json_or_none(value: Any) -> Any:
    try:
        encoded = _STRICT_JSON.encode(value)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if len(encoded) <= VALUE_JSON_MAX_BYTES else None


def _format_value(key: str, value: Any) -> Any:
    if key in _BINARY_KEYS and isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if key == "json":
        return value if json_or_none(value) is not None or value is None else None
    return value if isinstance(value, str) else None


def _figure_png(figure: Any) -> str:
    buf = io.BytesIO()
    figure.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def is_figure(obj: Any) -> bool:
    figure_module = sys.modules.get("matplotlib.figure")
    return figure_module is not None and isinstance(obj, figure_module.Figure)


def formats_of(obj: Any) -> dict[str, Any]:
    """Every representation ``obj`` offers, by E2B result key; a failing ``_repr_*_`` is skipped."""
    found: dict[str, Any] = {}
    dropped: list[str] = []
    if is_figure(obj):
        found["png"] = _figure_png(obj)  # first: drawing lays out the tick labels the chart reads
        chart = None
        try:
            chart = charts.chart_of(obj)
        except charts.TooLarge:
            dropped.append("chart")
        except Exception:  # a figure this code cannot read is still shown as an image
            pass
        if chart is not None:
            found["chart"] = chart
    bundle = getattr(obj, "_repr_mimebundle_", None)
    if callable(bundle) and not isinstance(obj, type):
        try:
            data = bundle()
            data = data[0] if isinstance(data, tuple) else data
            for mime, value in (data or {}).items():
                key = _MIME_KEYS.get(mime)
                if key is not None and (formatted := _format_value(key, value)) is not None:
                    found.setdefault(key, formatted)
        except Exception:
            pass
    for method, key in _REPR_METHODS:
        repr_method = getattr(obj, method, None)
        if key in found or not callable(repr_method) or isinstance(obj, type):
            continue
        try:
            value = repr_method()
        except Exception:
            continue
        value = value[0] if isinstance(value, tuple) else value  # (data, metadata) is allowed
        if (formatted := _format_value(key, value)) is not None:
            found[key] = formatted
    found.setdefault("text", safe_repr(obj))
    oversized = [key for key, value in found.items() if len(json.dumps(value)) > FORMAT_MAX_BYTES]
    for key in oversized:
        del found[key]
    if oversized or dropped:
        found["extra"] = {"dropped_formats": dropped + oversized, "format_max_bytes": FORMAT_MAX_BYTES}
    return found


def safe_repr(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception as exc:
        return f"<repr failed: {type(exc).__name__}: {exc}>"
