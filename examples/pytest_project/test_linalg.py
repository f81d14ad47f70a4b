import numpy as np
import scipy.linalg
import scipy.stats


def test_cholesky(rng):
    a = rng.normal(size=(30, 30))
    spd = a @ a.T + 30 * np.eye(30)
    c = scipy.linalg.cholesky(spd, lower=True)
    assert np.allclose(c @ c.T, spd)


def test_lu_solve(rng):
    a = rng.normal(size=(20, 20)) + 20 * np.eye(20)
    b = rng.normal(size=20)
    assert np.allclose(scipy.linalg.lu_solve(scipy.linalg.lu_factor(a), b), np.linalg.solve(a, b))


def test_expm_of_zero_is_identity():
    assert np.allclose(scipy.linalg.expm(np.zeros((4, 4))), np.eye(4))


def test_normal_test_accepts_normal(rng):
    assert scipy.stats.normaltest(rng.normal(size=2000)).pvalue > 0.001


def test_ttest_detects_shift(rng):
    assert scipy.stats.ttest_ind(rng.normal(0, 1, 300), rng.normal(1, 1, 300)).pvalue < 1e-6
