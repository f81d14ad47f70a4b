"""Tests that fail on purpose: a harness must report these, not crash on them."""

import numpy as np


def test_wrong_on_purpose():
    assert np.array([1, 2, 3]).sum() == 7


def test_passes_beside_it():
    assert np.array([1, 2, 3]).sum() == 6
