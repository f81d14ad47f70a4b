import numpy as np
import pandas as pd
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def sales() -> pd.DataFrame:
    return pd.DataFrame({"region": ["north", "south", "north", "east", "south", "north"],
                         "amount": [10.0, 20.0, 30.0, 5.0, 40.0, 20.0]})
