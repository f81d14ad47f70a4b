"""A small data-science module under test: the kind of code an evaluation harness checks."""

from __future__ import annotations

import numpy as np
import pandas as pd


def zscore(values: np.ndarray) -> np.ndarray:
    """Standardise ``values`` to mean 0 and standard deviation 1."""
    values = np.asarray(values, dtype=float)
    return (values - values.mean()) / values.std()


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each run of ``window`` consecutive values."""
    if window < 1:
        raise ValueError("window must be at least 1")
    return np.convolve(values, np.ones(window) / window, mode="valid")


def summarise(frame: pd.DataFrame, by: str, column: str) -> pd.DataFrame:
    """Count, mean and max of ``column`` per value of ``by``, sorted by ``by``."""
    return frame.groupby(by)[column].agg(["count", "mean", "max"]).sort_index()


def fill_gaps(series: pd.Series) -> pd.Series:
    """Interpolate missing values linearly; leading gaps take the first known value."""
    return series.interpolate().bfill()
