import numpy as np
from sklearn.cluster import KMeans
from sklearn.datasets import make_blobs, make_classification
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def test_kmeans_finds_blobs():
    points, labels = make_blobs(n_samples=300, centers=[(-10, -10), (0, 10), (10, -10)], cluster_std=1.0,
                                random_state=0)
    found = KMeans(n_clusters=3, n_init=5, random_state=0).fit_predict(points)
    # Each true blob maps onto one found cluster.
    assert all(len(set(found[labels == blob])) == 1 for blob in range(3))


def test_logistic_regression_accuracy():
    x, y = make_classification(n_samples=400, n_features=8, random_state=0)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    assert cross_val_score(model, x, y, cv=4).mean() > 0.8


def test_linear_regression_recovers_slope(rng):
    x = rng.uniform(0, 10, size=(200, 1))
    y = 3.0 * x[:, 0] + 1.0 + rng.normal(0, 0.1, 200)
    fit = LinearRegression().fit(x, y)
    assert abs(fit.coef_[0] - 3.0) < 0.05 and abs(fit.intercept_ - 1.0) < 0.1


def test_scaler_standardises(rng):
    scaled = StandardScaler().fit_transform(rng.normal(7, 3, size=(500, 2)))
    assert np.allclose(scaled.mean(axis=0), 0, atol=1e-9)


def test_pipeline_predicts_shape():
    x, y = make_classification(n_samples=100, n_features=4, random_state=1)
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)
    assert model.predict(x).shape == (100,)
