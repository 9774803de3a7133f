"""The estimators against scikit-learn on the same data, in Pipeline / GridSearchCV, and their bad inputs."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import sklearn.linear_model as sk
from distributed import Client
from sklearn.base import clone
from sklearn.datasets import load_breast_cancer, load_iris
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from distbelief import models
from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.sklearn import LinearRegression, LogisticRegression, MLPClassifier, SoftmaxRegression
from distbelief.sklearn._base import FreeParams, check_common
from distbelief.storage import Dataset
from distbelief.storage.internal import resolve_client


@pytest.fixture(scope="module")
def cancer() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.fixture(scope="module")
def iris() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_iris(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.mark.parametrize("C", [0.05, 1.0])
def test_logistic_matches_sklearn_lbfgs(cancer: tuple[np.ndarray, np.ndarray], C: float) -> None:
    X, y = cancer
    ours = LogisticRegression(C=C, tol=1e-10, max_iter=1000).fit(X, y)
    ref = sk.LogisticRegression(C=C, solver="lbfgs", tol=1e-10, max_iter=1000).fit(X, y)
    assert ours.coef_.shape == ref.coef_.shape == (1, 30)
    assert np.abs(ours.coef_ - ref.coef_).max() < 1e-4
    assert np.abs(ours.intercept_ - ref.intercept_).max() < 1e-4
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-6)
    assert ours.n_iter_.shape == (1,) and ours.n_iter_[0] >= 1


def test_intercept_is_not_penalized(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    # A strong penalty shrinks the coefficients to ~0, but the unpenalized intercept still fits the base rate.
    ours = LogisticRegression(C=1e-6, tol=1e-12).fit(X, y)
    assert np.abs(ours.coef_).max() < 1e-3
    assert ours.intercept_[0] == pytest.approx(np.log(y.mean() / (1 - y.mean())), abs=1e-3)


def test_multiclass_matches_sklearn(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    ref = sk.LogisticRegression(C=10.0, tol=1e-10, max_iter=1000).fit(X, y)
    for est in (LogisticRegression, SoftmaxRegression):
        ours = est(C=10.0, tol=1e-10, max_iter=1000).fit(X, y)
        assert ours.coef_.shape == (3, 4)
        # The intercepts are unpenalized, so they are only determined up to a common shift: compare
        # probabilities, and coefficients (which the penalty pins down).
        np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-4)
        assert np.abs(ours.coef_ - ref.coef_).max() < 1e-3


def test_softmax_on_two_classes_has_two_rows(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    ours = SoftmaxRegression(C=1.0, tol=1e-10, max_iter=1000).fit(X, y)
    # Two softmax rows W0, W1 with w = W1 - W0 pay (||W0||^2 + ||W1||^2) / 2 = ||w||^2 / 4 at the optimum
    # (W0 = -W1): the binary logistic model with twice the C.
    ref = sk.LogisticRegression(C=2.0, tol=1e-10, max_iter=1000).fit(X, y)
    assert ours.coef_.shape == (2, 30)
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-4)
    assert ours.decision_function(X).shape == (X.shape[0],)


def test_ridge_and_ols_match_sklearn(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, _ = cancer
    rng = np.random.default_rng(0)
    target = X @ rng.normal(size=30) + 2.0 + rng.normal(size=X.shape[0])
    ours = LinearRegression(alpha=10.0, tol=1e-10).fit(X, target)
    ref = sk.Ridge(alpha=10.0).fit(X, target)
    assert np.abs(ours.coef_ - ref.coef_).max() < 1e-4
    assert ours.intercept_ == pytest.approx(ref.intercept_, abs=1e-4)
    ours0 = LinearRegression(tol=1e-10, max_iter=5000).fit(X[:, :5], target)
    ref0 = sk.LinearRegression().fit(X[:, :5], target)
    assert np.abs(ours0.coef_ - ref0.coef_).max() < 1e-4
    assert ours0.score(X[:, :5], target) == pytest.approx(ref0.score(X[:, :5], target), abs=1e-8)


def test_mlp_learns_and_leaves_biases_unpenalized(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    clf = MLPClassifier((6,), activation="tanh", alpha=1e-3, random_state=0, max_iter=500).fit(X, y)
    assert clf.score(X, y) > 0.95
    assert [c.shape for c in clf.coefs_] == [(4, 6), (6, 3)]
    assert [b.shape for b in clf.intercepts_] == [(6,), (3,)]
    # What it minimized penalizes the weights only: F = mean loss + (alpha / (2N)) sum ||W||^2.
    weights = sum(float((W**2).sum()) for W in clf.coefs_)
    expected = models.objective(clf.model_, clf.w_, X, y.astype(float))[0] + 0.5 * 1e-3 / len(y) * weights
    assert clf.result_.fun == pytest.approx(expected, rel=1e-10)
    # Same seed, same fit; the seed changes the start.
    again = MLPClassifier((6,), activation="tanh", alpha=1e-3, random_state=0, max_iter=500).fit(X, y)
    np.testing.assert_array_equal(clf.coefs_[0], again.coefs_[0])


def test_free_params_cancels_the_penalty_exactly() -> None:
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(50, 3)), rng.integers(0, 3, 50).astype(float)
    m = models.Softmax(3, 3)
    w = rng.normal(size=m.n_params)
    l2 = 0.7
    free = [(9, 12)]
    value, grad = models.objective(FreeParams(m, l2, free), w, X, y, l2=l2)
    data, data_grad = models.objective(m, w, X, y)
    assert value == pytest.approx(data + 0.5 * l2 * float(w[:9] @ w[:9]), rel=1e-12)
    expected = data_grad.copy()
    expected[:9] += l2 * w[:9]
    np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-14)
    # Split over portions (any split of the rows) the data terms add up to the same thing.
    parts = [FreeParams(m, l2, free).loss_and_grad(w, X[a:b], y[a:b]) for a, b in ((0, 17), (17, 50))]
    assert sum(p[0] for p in parts) / 50 + 0.5 * l2 * float(w @ w) == pytest.approx(value, rel=1e-12)


def test_free_params_takes_the_csr_rows_of_a_sparse_dataset() -> None:
    # fit(dataset) hands the rows of a sparse Dataset (csr_array) to the model: len() of one raises.
    import scipy.sparse as sp

    rng = np.random.default_rng(2)
    X = rng.normal(size=(6, 3)) * (rng.random((6, 3)) < 0.5)
    y = rng.integers(0, 2, 6).astype(float)
    m, w = models.Logistic(3), rng.normal(size=4)
    dense = FreeParams(m, 0.5, [(3, 4)]).loss_and_grad(w, X, y)
    loss, grad = FreeParams(m, 0.5, [(3, 4)]).loss_and_grad(w, sp.csr_array(X), y)
    assert loss == pytest.approx(dense[0], rel=1e-12)
    np.testing.assert_allclose(grad, dense[1], rtol=1e-12)


@pytest.mark.parametrize("solver", ["cg", "gd"])
def test_other_sandblaster_methods(cancer: tuple[np.ndarray, np.ndarray], solver: str) -> None:
    X, y = cancer
    ref = sk.LogisticRegression(C=1.0, tol=1e-10, max_iter=1000).fit(X, y)
    ours = LogisticRegression(C=1.0, solver=solver, tol=1e-6, max_iter=3000).fit(X, y)
    assert np.abs(ours.coef_ - ref.coef_).max() < 1e-3


def test_downpour_solver(cancer: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = cancer
    clf = LogisticRegression(solver="downpour", max_iter=5, downpour_options={"batch_size": 16}).fit(X, y)
    assert clf.score(X, y) > 0.9
    assert clf.n_iter_[0] == 5


def test_pipeline_and_grid_search(cancer: tuple[np.ndarray, np.ndarray], client: Client) -> None:
    X, y = load_breast_cancer(return_X_y=True)
    pipe = make_pipeline(StandardScaler(), LogisticRegression(client=client))
    search = GridSearchCV(pipe, {"logisticregression__C": [0.01, 1.0]}, cv=2).fit(X, y)
    assert search.best_score_ > 0.9
    best = search.best_estimator_[-1]
    # Clones share the live client (a connection, which copy.deepcopy cannot copy).
    assert best.client is client
    assert best.get_params()["C"] in (0.01, 1.0)


def test_clone_keeps_the_client_and_pickle_drops_it(
    cancer: tuple[np.ndarray, np.ndarray], client: Client
) -> None:
    X, y = cancer
    est = LogisticRegression(client=client).fit(X, y)
    assert clone(est).client is client
    # A pickle keeps no connection: the cluster may be gone when it is loaded (a refit waited 30 s for it).
    back = pickle.loads(pickle.dumps(est))
    assert back.client is None
    np.testing.assert_array_equal(back.predict(X), est.predict(X))
    np.testing.assert_allclose(back.fit(X, y).coef_, est.coef_, atol=1e-6)  # refits where None runs
    # An address the user gave is their setting, and is kept.
    by_address = LogisticRegression(client=client.scheduler.address)
    assert pickle.loads(pickle.dumps(by_address)).client == client.scheduler.address
    assert resolve_client(by_address.client).scheduler_info()["address"] == client.scheduler.address


def test_fit_a_dataset(tmp_path: Path, iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    ds = Dataset.from_arrays(X, y, path=tmp_path / "iris")
    ours = SoftmaxRegression(C=10.0, tol=1e-10, max_iter=1000).fit(ds)
    ref = SoftmaxRegression(C=10.0, tol=1e-10, max_iter=1000).fit(X, y)
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-6)
    np.testing.assert_array_equal(ours.classes_, [0, 1, 2])


def test_fit_dask_arrays(iris: tuple[np.ndarray, np.ndarray]) -> None:
    da = pytest.importorskip("dask.array")
    X, y = iris
    labels = np.array(["setosa", "versicolor", "virginica"])[y]
    ours = LogisticRegression(C=10.0, tol=1e-10, max_iter=1000).fit(
        da.from_array(X, chunks=(40, 4)), da.from_array(labels, chunks=40)
    )
    ref = LogisticRegression(C=10.0, tol=1e-10, max_iter=1000).fit(X, labels)
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-6)
    lazy = ours.predict(da.from_array(X, chunks=(50, 4)))
    assert isinstance(lazy, da.Array)
    np.testing.assert_array_equal(lazy.compute(), ref.predict(X))


def test_dask_arrays_are_read_by_the_estimators_own_cluster(
    iris: tuple[np.ndarray, np.ndarray], client: Client, tmp_path: Path
) -> None:
    # client= names the cluster: the classes and the dataset must be computed there, not by whatever
    # scheduler is the default in this process (here the local synchronous one).
    import dask
    import dask.array as da
    from distributed import get_worker

    def on_a_worker(block: np.ndarray) -> np.ndarray:
        get_worker()  # ValueError outside a worker
        return block

    X, y = iris
    Xd = da.from_array(X, chunks=(50, 4)).map_blocks(on_a_worker, dtype=float)
    yd = da.from_array(y, chunks=50).map_blocks(on_a_worker, dtype=y.dtype)
    with dask.config.set(scheduler="sync"):
        ds, n = LogisticRegression(client=client)._dask_data(Xd, yd, str(tmp_path))
    assert (n, ds.n_classes) == (150, 3)
    np.testing.assert_array_equal(ds.read_all()[1], y)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("est", "match"),
    [
        (LogisticRegression(penalty="elasticnet"), "needs l1_ratio"),
        (SoftmaxRegression(penalty="l3"), "penalty must be one of"),
        (LogisticRegression(solver="newton"), "solver must be one of"),
        (LogisticRegression(C=0.0), "C must be a number > 0"),
        (LogisticRegression(max_iter=0), "max_iter must be an int >= 1"),
        (LogisticRegression(tol=-1.0), "tol must be a number >= 0"),
        (LinearRegression(alpha=-1.0), "alpha must be a number >= 0"),
        (MLPClassifier(activation="identity"), "activation must be one of"),
        (MLPClassifier(hidden_layer_sizes=(0,)), "hidden_layer_sizes must be a tuple of ints"),
        (MLPClassifier(random_state="seed"), "random_state must be None, an int"),
        (MLPClassifier(alpha=-1.0), "alpha must be a number >= 0"),
        (LogisticRegression(client=42), "client must be None"),
    ],
)
def test_bad_options_raise_clear_errors(est: object, match: str) -> None:
    X, y = np.eye(4), np.array([0, 1, 0, 1])
    with pytest.raises(InvalidOptionError, match=match):
        est.fit(X, y)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("max_iter", "tol"),
    [(np.int32(5), np.float32(1e-4)), (np.int64(1), np.float16(0.5)), (np.uint8(3), np.int64(0)), (7, 1)],
)
def test_numpy_scalars_are_accepted_where_python_numbers_are(max_iter: object, tol: object) -> None:
    # As scikit-learn: a tol read from a float32 array or a grid of np.arange values is a number.
    check_common("lbfgs", "l2", max_iter, tol, "LogisticRegression")


@pytest.mark.parametrize(
    ("max_iter", "tol", "match"),
    [
        (True, 1e-4, "max_iter must be an int >= 1"),
        (np.bool_(True), 1e-4, "max_iter must be an int >= 1"),
        (5.0, 1e-4, "max_iter must be an int >= 1"),
        (np.float64(5), 1e-4, "max_iter must be an int >= 1"),
        ("5", 1e-4, "max_iter must be an int >= 1"),
        (np.int64(0), 1e-4, "max_iter must be an int >= 1"),
        (5, True, "tol must be a number >= 0"),
        (5, np.bool_(False), "tol must be a number >= 0"),
        (5, np.float32("nan"), "tol must be a number >= 0"),
        (5, float("nan"), "tol must be a number >= 0"),
        (5, np.float32(-1e-3), "tol must be a number >= 0"),
        (5, np.int8(-1), "tol must be a number >= 0"),
        (5, "1e-4", "tol must be a number >= 0"),
        (5, None, "tol must be a number >= 0"),
        (5, np.array([1e-4]), "tol must be a number >= 0"),
    ],
)
def test_bad_max_iter_and_tol_are_refused_numpy_or_not(max_iter: object, tol: object, match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        check_common("lbfgs", "l2", max_iter, tol, "LogisticRegression")


def test_bad_data_raise_clear_errors(tmp_path: Path) -> None:
    ds = Dataset.from_arrays(np.eye(4), [0.5, 1.5, 2.0, 3.0], path=tmp_path / "real")
    with pytest.raises(DatasetError, match="needs class labels"):
        LogisticRegression().fit(ds)
    with pytest.raises(DatasetError, match="without y"):
        LinearRegression().fit(ds, np.zeros(4))
    with pytest.raises(DatasetError, match="at least 2 classes"):
        LogisticRegression().fit(np.eye(4), np.zeros(4))
    with pytest.raises(ValueError, match="requires y"):
        LogisticRegression().fit(np.eye(4))
    da = pytest.importorskip("dask.array")
    with pytest.raises(DatasetError, match="both as Dask arrays"):
        LogisticRegression().fit(da.from_array(np.eye(4)), np.array([0, 1, 0, 1]))
    with pytest.raises(DatasetError, match="X must be 2-D"):
        LinearRegression().fit(da.zeros(4), da.zeros(4))
