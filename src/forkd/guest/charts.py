"""The data behind a matplotlib figure, in the shape E2B's code-interpreter SDKs parse as ``Result.chart``.

A figure with one Axes is one chart; with several, a ``superchart`` whose elements are one chart per
Axes. An Axes holding only lines is a ``line`` chart, only scatter collections a ``scatter`` chart,
only bar containers a ``bar`` chart, only pie wedges a ``pie`` chart; anything else is ``unknown``
(type and title only), so a client never gets data it would misread.

Stdlib only, like the rest of the guest: matplotlib's classes are looked up in ``sys.modules`` (a
figure exists, so matplotlib is imported). Runs in the context process, after the figure was
rendered to PNG, so tick labels are laid out. Guest code made the figure: sizes are bounded.
"""

from __future__ import annotations

import datetime
import math
import re
import sys
from collections.abc import Callable
from typing import Any

#: A figure whose series hold more points (or bars, or wedges) than this in all gets no chart.
MAX_POINTS = 100_000

#: "Speed (m/s)" or "Speed [m/s]": the unit E2B's SDKs expect in ``x_unit`` / ``y_unit``.
_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")


class TooLarge(Exception):
    """The figure holds more data than :data:`MAX_POINTS`; it is shown as an image only."""


def chart_of(figure: Any) -> dict[str, Any] | None:
    """The chart of ``figure``, None if it has no Axes. Raises :class:`TooLarge`."""
    axes = list(figure.get_axes())
    budget = _Budget()
    if not axes:
        return None
    if len(axes) == 1:
        return _axes_chart(axes[0], budget)
    suptitle = getattr(figure, "_suptitle", None)  # get_suptitle() is matplotlib >= 3.8 only
    return {"type": "superchart", "title": _text(suptitle.get_text()) if suptitle is not None else None,
            "elements": [_axes_chart(ax, budget) for ax in axes]}


def _classes(module: str, *names: str) -> tuple[type, ...]:
    found = sys.modules.get(module)
    return tuple(getattr(found, name) for name in names) if found is not None else ()


def _axes_chart(ax: Any, budget: _Budget) -> dict[str, Any]:
    lines, collections, patches = list(ax.lines), list(ax.collections), list(ax.patches)
    wedges = _classes("matplotlib.patches", "Wedge")
    bars: list[Any] = [c for c in ax.containers if isinstance(c, _classes("matplotlib.container", "BarContainer"))]
    scatter = _classes("matplotlib.collections", "PathCollection")
    if lines and not collections and not patches:
        return _line_chart(ax, lines, budget)
    if collections and not lines and not patches and all(isinstance(c, scatter) for c in collections):
        return _scatter_chart(ax, collections, budget)
    if bars and not lines and not collections and len(patches) == sum(len(c) for c in bars):
        return _bar_chart(ax, bars, budget)
    if patches and wedges and not lines and not collections and all(isinstance(p, wedges) for p in patches):
        return _pie_chart(ax, patches, budget)
    return {"type": "unknown", "title": _text(ax.get_title()), "elements": []}


# -- values


def _text(value: Any) -> str | None:
    return str(value) or None


def _number(value: Any) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None  # JSON has no NaN or infinity


def _value(value: Any) -> str | float | None:
    """A data value as JSON: numbers as floats, dates as ISO 8601, categories as strings."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, str):
        return value
    if type(value).__name__ == "datetime64":  # numpy's; str() is ISO 8601
        return str(value)
    try:
        return _number(value)
    except (TypeError, ValueError):
        return str(value)


def _reader(axis: Any) -> Callable[[Any], str | float | None]:
    """:func:`_value` for data on ``axis``, where matplotlib keeps some values as plain numbers
    (scatter offsets, dates given as day numbers): those become the date or the category's name."""
    if _is_date_axis(axis):
        num2date = sys.modules["matplotlib.dates"].num2date

        def on_dates(raw: Any) -> str | float | None:
            value = _value(raw)
            return num2date(value).isoformat() if isinstance(value, float) else value

        return on_dates
    if _is_category_axis(axis):
        names = dict(zip((float(t) for t in axis.get_ticklocs()), (t.get_text() for t in axis.get_ticklabels())))

        def on_categories(raw: Any) -> str | float | None:
            value = _value(raw)
            return names.get(value, value) if isinstance(value, float) else value

        return on_categories
    return _value


class _Budget:
    """The points a figure may still hold; spent per series before any is read."""

    def __init__(self) -> None:
        self.left = MAX_POINTS

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise TooLarge(f"the figure holds more than {MAX_POINTS} points")


# -- axes


def _axis_labels(ax: Any, swap: bool = False) -> dict[str, Any]:
    x_label, y_label = _text(ax.get_xlabel()), _text(ax.get_ylabel())
    if swap:  # horizontal bars: x names the categories, as for vertical ones
        x_label, y_label = y_label, x_label
    return {"title": _text(ax.get_title()), "x_label": x_label, "y_label": y_label,
            "x_unit": _unit(x_label), "y_unit": _unit(y_label)}


def _unit(label: str | None) -> str | None:
    match = _UNIT.search(label) if label else None
    return (match.group(1) or match.group(2)) if match else None


def _is_date_axis(axis: Any) -> bool:
    locators = _classes("matplotlib.dates", "DateLocator")
    return bool(locators) and isinstance(axis.get_major_locator(), locators)


def _is_category_axis(axis: Any) -> bool:
    return isinstance(axis.get_units(), _classes("matplotlib.category", "UnitData"))


def _scale(axis: Any) -> str:
    if _is_date_axis(axis):
        return "datetime"
    if _is_category_axis(axis):
        return "categorical"
    return str(axis.get_scale())


def _ticks(axis: Any) -> list[Any]:
    ticks = list(axis.get_ticklocs())
    if _is_date_axis(axis):
        num2date = sys.modules["matplotlib.dates"].num2date
        return [num2date(tick).isoformat() for tick in ticks]
    return [_number(tick) for tick in ticks]


def _point_axes(ax: Any) -> dict[str, Any]:
    found = _axis_labels(ax)
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        found[f"{name}_ticks"] = _ticks(axis)
        found[f"{name}_tick_labels"] = [label.get_text() for label in axis.get_ticklabels()]
        found[f"{name}_scale"] = _scale(axis)
    return found


# -- chart types


def _series_label(label: Any, kind: str, index: int) -> str:
    """A legend label, or ``Line 1`` and the like for matplotlib's hidden ones (``_child0``)."""
    label = str(label)
    return f"{kind} {index + 1}" if not label or label.startswith("_") else label


def _line_chart(ax: Any, lines: list[Any], budget: _Budget) -> dict[str, Any]:
    elements, x_of, y_of = [], _reader(ax.xaxis), _reader(ax.yaxis)
    for index, line in enumerate(lines):
        xs, ys = line.get_xdata(), line.get_ydata()
        budget.spend(len(xs))
        elements.append({"label": _series_label(line.get_label(), "Line", index),
                         "points": [[x_of(x), y_of(y)] for x, y in zip(xs, ys)]})
    return {"type": "line", **_point_axes(ax), "elements": elements}


def _scatter_chart(ax: Any, collections: list[Any], budget: _Budget) -> dict[str, Any]:
    elements, x_of, y_of = [], _reader(ax.xaxis), _reader(ax.yaxis)
    for index, collection in enumerate(collections):
        offsets = collection.get_offsets()
        budget.spend(len(offsets))
        elements.append({"label": _series_label(collection.get_label(), "Series", index),
                         "points": [[x_of(x), y_of(y)] for x, y in offsets]})
    return {"type": "scatter", **_point_axes(ax), "elements": elements}


def _tick_label_at(axis: Any, position: float) -> str:
    """The tick label at a bar's centre (its category), or the position itself."""
    for tick, label in zip(axis.get_ticklocs(), axis.get_ticklabels()):
        if math.isclose(float(tick), position, rel_tol=1e-9, abs_tol=1e-9) and label.get_text():
            return str(label.get_text())
    return f"{position:g}"


def _bar_chart(ax: Any, containers: list[Any], budget: _Budget) -> dict[str, Any]:
    horizontal = getattr(containers[0], "orientation", None) == "horizontal"
    elements = []
    for index, container in enumerate(containers):
        budget.spend(len(container))
        group = _series_label(container.get_label(), "Group", index)
        values = getattr(container, "datavalues", None)  # the data, whatever the bars' bottoms
        for position, rect in enumerate(container):
            if horizontal:
                category = _tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                size = rect.get_width()
            else:
                category = _tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                size = rect.get_height()
            value = values[position] if values is not None and len(values) > position else size
            elements.append({"label": category, "group": group, "value": _value(value)})
    return {"type": "bar", **_axis_labels(ax, swap=horizontal), "elements": elements}


def _pie_chart(ax: Any, wedges: list[Any], budget: _Budget) -> dict[str, Any]:
    budget.spend(len(wedges))
    return {"type": "pie", "title": _text(ax.get_title()), "elements": [
        {"label": _series_label(wedge.get_label(), "Slice", index),
         "angle": _number(round(abs(wedge.theta2 - wedge.theta1), 9)), "radius": _number(wedge.r)}
        for index, wedge in enumerate(wedges)]}
