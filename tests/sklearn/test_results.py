"""Results that predict, save and load (OptimizeResult, TrainResult), and estimators from models/jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client
from numpy.typing import ArrayLike
from sklearn.datasets import load_iris
from sklearn.preprocessing import StandardScaler

from distbelief import downpour, models, sandblaster
from distbelief.downpour import TrainResult
from distbelief.errors import InvalidOptionError, StoreError
from distbelief.sandblaster import OptimizeResult
from distbelief.sklearn import LogisticRegression, MLPClassifier, SoftmaxRegression, from_model


@pytest.fixture(scope="module")
def iris() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_iris(return_X_y=True)
    return StandardScaler().fit_transform(X), y.astype(float)


def test_optimize_result_predicts_saves_and_loads(
    tmp_path: Path, iris: tuple[np.ndarray, np.ndarray], client: Client
) -> None:
    X, y = iris
    model = models.Softmax(4, 3)
    res = sandblaster.minimize(model, (X, y), l2=1e-3, client=client)
    np.testing.assert_array_equal(res.predict(X), model.predict(res.x, X))
    assert (res.predict(X) == y).mean() > 0.9
    np.testing.assert_allclose(res.predict_proba(X).sum(axis=1), 1.0)
    res.to_zarr(str(tmp_path / "run"))
    back = OptimizeResult.from_zarr(str(tmp_path / "run"))
    assert back.model == model
    np.testing.assert_array_equal(back.x, res.x)
    assert (back.fun, back.nit, back.message, back.success) == (res.fun, res.nit, res.message, res.success)
    np.testing.assert_array_equal(back.history.objective.values, res.history.objective.values)
    np.testing.assert_array_equal(back.predict(X), res.predict(X))
    with pytest.raises(StoreError, match="does not hold a saved TrainResult"):
        TrainResult.from_zarr(str(tmp_path / "run"))
    with pytest.raises(StoreError, match="no saved result"):
        OptimizeResult.from_zarr(str(tmp_path / "nothing"))


def test_train_result_predicts_saves_and_loads(
    tmp_path: Path, iris: tuple[np.ndarray, np.ndarray], client: Client
) -> None:
    X, y = iris
    model = models.Softmax(4, 3)
    res = downpour.train(model, (X, y), epochs=3, batch_size=10, trace=True, client=client)
    # The result predicts with the model at its x. (How well 3 asynchronous epochs do depends on the
    # interleaving of the replicas' pushes, i.e. on the box's load: the training itself is tested elsewhere.)
    np.testing.assert_array_equal(res.predict(X), model.predict(res.x, X))
    assert not np.array_equal(res.x, model.init_params(seed=0))
    res.to_zarr(str(tmp_path / "run"))
    back = TrainResult.from_zarr(str(tmp_path / "run"))
    np.testing.assert_array_equal(back.x, res.x)
    assert (back.stop_reason, back.steps) == (res.stop_reason, res.steps)
    np.testing.assert_array_equal(back.predict(X), res.predict(X))
    assert set(back.losses) == set(res.losses)


def test_result_of_a_model_without_spec(tmp_path: Path, client: Client) -> None:
    class Quadratic:
        n_params = 2
        n_features = 1

        def init_params(self, seed: int | None = None) -> np.ndarray:
            return np.ones(2)

        def loss_and_grad(self, w: ArrayLike, X: Any, y: ArrayLike) -> tuple[float, np.ndarray]:
            x = np.asarray(w)
            return 0.5 * len(X) * float(x @ x), len(X) * x

    res = sandblaster.minimize(Quadratic(), (np.ones((4, 1)), np.zeros(4)), client=client)
    with pytest.raises(InvalidOptionError, match="has no predict"):
        res.predict(np.ones((2, 1)))
    res.to_zarr(str(tmp_path / "q"))
    back = OptimizeResult.from_zarr(str(tmp_path / "q"))
    assert back.model is None
    np.testing.assert_array_equal(back.x, res.x)
    assert OptimizeResult.from_zarr(str(tmp_path / "q"), model=Quadratic()).model is not None


def test_estimator_result_saves_with_the_inner_spec(
    tmp_path: Path, iris: tuple[np.ndarray, np.ndarray]
) -> None:
    X, y = iris
    clf = LogisticRegression(C=10.0).fit(X, y)
    clf.result_.to_zarr(str(tmp_path / "fit"))
    back = OptimizeResult.from_zarr(str(tmp_path / "fit"))
    assert back.model == models.Softmax(4, 3)
    np.testing.assert_array_equal(back.predict(X), clf.predict(X).astype(np.int64))


def test_from_model_rebuilds_fitted_estimators(iris: tuple[np.ndarray, np.ndarray]) -> None:
    X, y = iris
    clf = LogisticRegression(C=10.0).fit(X, y)
    est = from_model(clf.model_.spec, clf.w_, n_iter=7)
    assert isinstance(est, SoftmaxRegression)  # three classes: the softmax model
    np.testing.assert_array_equal(est.predict(X), clf.predict(X))
    assert est.n_iter_[0] == 7 and est.score(X, y) == clf.score(X, y)
    mlp = MLPClassifier((5,), activation="logistic", random_state=0).fit(X, y)
    again = from_model(mlp.model_, mlp.w_, classes=mlp.classes_)
    assert again.activation == "logistic" and again.hidden_layer_sizes == (5,)
    np.testing.assert_array_equal(again.predict_proba(X), mlp.predict_proba(X))
    reg = from_model({"kind": "least_squares", "n_features": 2}, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(reg.predict(np.array([[1.0, 1.0]])), [6.0])
    with pytest.raises(InvalidOptionError, match="w has 2 values"):
        from_model({"kind": "logistic", "n_features": 2}, [1.0, 2.0])
    with pytest.raises(InvalidOptionError, match="needs a built-in model"):
        from_model(object(), [1.0])
    with pytest.raises(InvalidOptionError, match="classes must list"):
        from_model({"kind": "logistic", "n_features": 1}, [1.0, 2.0], classes=[0, 1, 2])


def test_saving_over_an_earlier_result_leaves_nothing_of_it(tmp_path: Path) -> None:
    import xarray as xr

    def result(losses: dict[int, np.ndarray], history: xr.Dataset) -> TrainResult:
        return TrainResult(
            x=np.zeros(5), history=history, stop_reason="epochs", success=True, message="", steps=1,
            wall_time=1.0, losses=losses, model=models.Logistic(4),
        )  # fmt: skip

    url = str(tmp_path / "run")
    result({0: np.ones(3), 1: np.ones(3), 2: np.ones(2)}, xr.Dataset({"a": ("t", [1.0, 2.0])})).to_zarr(url)
    result({0: np.zeros(3)}, xr.Dataset()).to_zarr(url)
    back = TrainResult.from_zarr(url)
    assert set(back.losses) == {0}
    np.testing.assert_array_equal(back.losses[0], np.zeros(3))
    assert "a" not in back.history


def test_a_diverged_result_saves_and_loads_its_nan_objective(tmp_path: Path) -> None:
    import math

    import xarray as xr

    res = OptimizeResult(
        x=np.zeros(5), fun=math.nan, grad_norm=math.inf, nit=1, nfev=1, success=False, status=2,
        message="the objective became NaN", history=xr.Dataset(), model=models.Logistic(4),
    )  # fmt: skip
    res.to_zarr(str(tmp_path / "nan"))
    back = OptimizeResult.from_zarr(str(tmp_path / "nan"))
    assert math.isnan(back.fun) and back.grad_norm == math.inf
    assert "fun=nan" in repr(back)
