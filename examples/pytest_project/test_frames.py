import numpy as np
import pandas as pd

from stats import fill_gaps, summarise


def test_summary_counts(sales):
    assert summarise(sales, "region", "amount")["count"].to_dict() == {"east": 1, "north": 3, "south": 2}


def test_summary_means(sales):
    assert summarise(sales, "region", "amount").loc["north", "mean"] == 20.0


def test_summary_sorted(sales):
    assert list(summarise(sales, "region", "amount").index) == ["east", "north", "south"]


def test_fill_gaps_interpolates():
    assert fill_gaps(pd.Series([1.0, np.nan, 3.0])).tolist() == [1.0, 2.0, 3.0]


def test_fill_gaps_leading():
    assert fill_gaps(pd.Series([np.nan, 2.0, 4.0])).tolist() == [2.0, 2.0, 4.0]


def test_pivot_roundtrip(sales):
    pivot = sales.assign(n=1).pivot_table(index="region", values="n", aggfunc="sum")
    assert pivot["n"].sum() == len(sales)


def test_merge_on_key(sales):
    targets = pd.DataFrame({"region": ["north", "south", "east"], "target": [50, 50, 10]})
    merged = sales.groupby("region", as_index=False)["amount"].sum().merge(targets, on="region")
    assert merged.set_index("region").eval("amount >= target").to_dict() == {
        "east": False, "north": True, "south": True}


def test_rolling_window():
    assert pd.Series(range(6)).rolling(3).mean().dropna().tolist() == [1.0, 2.0, 3.0, 4.0]
