import numpy as np
import pytest

from stats import moving_average, zscore


def test_zscore_mean_zero(rng):
    assert abs(zscore(rng.normal(5, 2, 1000)).mean()) < 1e-9


def test_zscore_unit_std(rng):
    assert zscore(rng.normal(5, 2, 1000)).std() == pytest.approx(1.0)


def test_moving_average_constant():
    assert np.allclose(moving_average(np.full(10, 3.0), 4), 3.0)


def test_moving_average_length():
    assert len(moving_average(np.arange(10), 3)) == 8


def test_moving_average_rejects_zero_window():
    with pytest.raises(ValueError):
        moving_average(np.arange(5), 0)


@pytest.mark.parametrize("n", [2, 16, 64])
def test_matmul_identity(rng, n):
    a = rng.normal(size=(n, n))
    assert np.allclose(a @ np.eye(n), a)


def test_solve_linear_system(rng):
    a = rng.normal(size=(50, 50)) + 50 * np.eye(50)
    b = rng.normal(size=50)
    assert np.allclose(a @ np.linalg.solve(a, b), b)


def test_svd_reconstructs(rng):
    a = rng.normal(size=(40, 30))
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    assert np.allclose((u * s) @ vt, a)
