"""Chart data from matplotlib figures (guest/charts.py), read back by E2B's own SDK classes."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from e2b_code_interpreter.charts import (
    BarChart,
    LineChart,
    PieChart,
    ScatterChart,
    SuperChart,
)
from e2b_code_interpreter.models import Result

from forkd.guest import charts


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    yield
    plt.close("all")


def extract(figure: Any) -> dict[str, Any]:
    figure.canvas.draw()  # as the kernel does: the PNG is rendered before the chart is read
    chart = charts.chart_of(figure)
    assert chart is not None
    json.dumps(chart, allow_nan=False)  # what the agent sends must be plain JSON
    return chart


def as_sdk(chart: dict[str, Any]) -> Any:
    """What e2b-code-interpreter makes of a result carrying this chart."""
    parsed = Result(chart=chart).chart
    assert parsed is not None
    return parsed


def test_line_chart_with_labels_units_and_ticks() -> None:
    figure, ax = plt.subplots()
    ax.plot([1, 2, 3], [1.5, 4, float("nan")], label="speed")
    ax.plot([1, 2, 3], [2, 2, 2])
    ax.set_title("Runs")
    ax.set_xlabel("Time (s)")
    ax.set_ylabel("Speed [m/s]")
    chart = extract(figure)
    parsed = as_sdk(chart)
    assert isinstance(parsed, LineChart)
    assert (parsed.title, parsed.x_label, parsed.x_unit, parsed.y_unit) == ("Runs", "Time (s)", "s", "m/s")
    assert [e.label for e in parsed.elements] == ["speed", "Line 2"]
    assert parsed.elements[0].points == [(1.0, 1.5), (2.0, 4.0), (3.0, None)]  # NaN is no JSON number
    assert parsed.x_scale.value == "linear" and parsed.x_ticks and len(parsed.x_ticks) == len(parsed.x_tick_labels)
    assert any(parsed.x_tick_labels)


def test_scatter_chart_on_a_log_axis() -> None:
    figure, ax = plt.subplots()
    ax.scatter([1, 10, 100], [3, 2, 1], label="points")
    ax.set_xscale("log")
    parsed = as_sdk(extract(figure))
    assert isinstance(parsed, ScatterChart)
    assert parsed.x_scale.value == "log" and parsed.y_scale.value == "linear"
    assert parsed.elements[0].label == "points"
    assert parsed.elements[0].points == [(1.0, 3.0), (10.0, 2.0), (100.0, 1.0)]


def test_bar_chart_groups_and_categories() -> None:
    figure, ax = plt.subplots()
    ax.bar(["apples", "pears"], [3, 5], label="2025")
    ax.bar(["apples", "pears"], [1, 2], bottom=[3, 5], label="2026")  # stacked: values, not tops
    ax.set_ylabel("Count")
    parsed = as_sdk(extract(figure))
    assert isinstance(parsed, BarChart)
    assert [(e.label, e.group, e.value) for e in parsed.elements] == [
        ("apples", "2025", 3.0), ("pears", "2025", 5.0), ("apples", "2026", 1.0), ("pears", "2026", 2.0)]
    assert parsed.y_label == "Count"


def test_horizontal_bars_name_their_categories_on_x() -> None:
    figure, ax = plt.subplots()
    ax.barh(["a", "b", "c"], [1, 2, 3])
    ax.set_xlabel("Amount")
    ax.set_ylabel("Item")
    parsed = as_sdk(extract(figure))
    assert isinstance(parsed, BarChart)
    assert [(e.label, e.value) for e in parsed.elements] == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert (parsed.x_label, parsed.y_label) == ("Item", "Amount")
    assert parsed.elements[0].group == "Group 1"


def test_pie_chart_angles() -> None:
    figure, ax = plt.subplots()
    ax.pie([1, 1, 2], labels=["a", "b", "c"])
    ax.set_title("Share")
    parsed = as_sdk(extract(figure))
    assert isinstance(parsed, PieChart)
    assert parsed.title == "Share"
    assert [(e.label, e.angle, e.radius) for e in parsed.elements] == [("a", 90.0, 1.0), ("b", 90.0, 1.0),
                                                                       ("c", 180.0, 1.0)]


def test_dates_and_categories_come_back_as_such() -> None:
    figure, ax = plt.subplots()
    days = [datetime.date(2026, 1, 1), datetime.date(2026, 1, 2)]
    ax.scatter(days, ["low", "high"])
    parsed = as_sdk(extract(figure))
    assert parsed.x_scale.value == "datetime" and parsed.y_scale.value == "categorical"
    assert parsed.elements[0].points == [("2026-01-01T00:00:00+00:00", "low"), ("2026-01-02T00:00:00+00:00", "high")]
    assert all(isinstance(tick, str) for tick in parsed.x_ticks)


def test_several_axes_are_one_superchart() -> None:
    figure, (left, right) = plt.subplots(1, 2)
    left.plot([1, 2], [3, 4])
    right.pie([1, 2])
    figure.suptitle("Both")
    parsed = as_sdk(extract(figure))
    assert isinstance(parsed, SuperChart) and parsed.title == "Both"
    assert [type(e) for e in parsed.elements] == [LineChart, PieChart]


def test_mixed_or_empty_figures() -> None:
    figure, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    ax.bar([1, 2], [1, 2])
    assert extract(figure) == {"type": "unknown", "title": None, "elements": []}  # never misread data
    assert charts.chart_of(plt.figure()) is None


def test_too_many_points_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(charts, "MAX_POINTS", 10)
    figure, ax = plt.subplots()
    ax.plot(range(11))
    with pytest.raises(charts.TooLarge):
        charts.chart_of(figure)
