"""models.JaxModel: gradients equal the built-in models' on the same objective; it trains everywhere."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from distributed import Client

from distbelief import models
from distbelief.errors import InvalidOptionError

jax = pytest.importorskip("jax", reason='JaxModel needs JAX: pip install "distbelief[jax]"')
jnp = pytest.importorskip("jax.numpy")


def logistic_loss(w: Any, X: Any, y: Any) -> Any:
    z = X @ w[:-1] + w[-1]
    return jnp.sum(jnp.logaddexp(0.0, z) - y * z)


def softmax_loss(params: Any, X: Any, y: Any) -> Any:
    Z = X @ params["W"] + params["b"]
    picked = jnp.take_along_axis(Z, y.astype(jnp.int32)[:, None], axis=1)[:, 0]
    return jnp.sum(jax.nn.logsumexp(Z, axis=1) - picked)


def mlp_loss(params: Any, X: Any, y: Any) -> Any:
    (W1, b1), (W2, b2) = params
    H = jnp.tanh(X @ W1 + b1)
    return softmax_loss({"W": W2, "b": b2}, H, y)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 5))
    return X, (X[:, 0] > 0).astype(float), rng.integers(0, 3, 200).astype(float)


def test_gradient_equals_the_built_in_logistic(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    X, y, _ = data
    w = np.random.default_rng(1).normal(size=6)
    ours = models.objective(models.JaxModel(logistic_loss, n_params=6), w, X, y, l2=0.3)
    ref = models.objective(models.Logistic(5), w, X, y, l2=0.3)
    assert ours[0] == pytest.approx(ref[0], rel=1e-12)
    assert np.abs(ours[1] - ref[1]).max() < 1e-10
    assert ours[1].dtype == np.float64


def test_pytree_params_softmax_and_mlp(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    X, _, y3 = data
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(5, 3)), rng.normal(size=3)
    m = models.JaxModel(softmax_loss, example_params={"W": W, "b": b}, n_features=5)
    assert m.n_params == 18
    w = m.init_params()  # the flat vector: W then b (ravel_pytree sorts dict keys; 'W' < 'b')
    value, grad = m.loss_and_grad(w, X, y3)
    ref_value, ref_grad = models.Softmax(5, 3).loss_and_grad(np.concatenate([W.ravel(), b]), X, y3)
    assert value == pytest.approx(ref_value, rel=1e-12)
    np.testing.assert_array_equal(w, np.concatenate([W.ravel(), b]))
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=1e-10)

    sizes = [5, 4, 3]
    builtin = models.MLP(sizes, activation="tanh")
    flat = builtin.init_params(seed=0)
    (W1, b1), (W2, b2) = [(W_, b_) for W_, b_ in _layers(flat, sizes)]
    jm = models.JaxModel(mlp_loss, example_params=[(W1, b1), (W2, b2)])
    # ravel_pytree of a list of tuples keeps the order: W1, b1, W2, b2, the built-in layout.
    np.testing.assert_array_equal(jm.init_params(), flat)
    v1, g1 = jm.loss_and_grad(flat, X, y3)
    v2, g2 = builtin.loss_and_grad(flat, X, y3)
    assert v1 == pytest.approx(v2, rel=1e-12)
    assert np.abs(g1 - g2).max() < 1e-10


def _layers(flat: np.ndarray, sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    out, start = [], 0
    for fan_in, fan_out in itertools.pairwise(sizes):
        W = flat[start : start + fan_in * fan_out].reshape(fan_in, fan_out)
        start += fan_in * fan_out
        out.append((W, flat[start : start + fan_out]))
        start += fan_out
    return out


def test_trains_with_sandblaster_and_downpour(
    data: tuple[np.ndarray, np.ndarray, np.ndarray], client: Client
) -> None:
    from distbelief import downpour, sandblaster

    X, y, _ = data
    jm = models.JaxModel(
        logistic_loss, n_params=6, n_features=5, predict_fn=lambda w, X: X @ w[:-1] + w[-1] > 0
    )
    ours = sandblaster.minimize(jm, (X, y), l2=1e-2, client=client)
    ref = sandblaster.minimize(models.Logistic(5), (X, y), l2=1e-2, client=client)
    assert ours.success
    np.testing.assert_allclose(ours.x, ref.x, atol=1e-5)
    assert (ours.predict(X) == y).mean() > 0.9
    sgd = downpour.train(jm, (X, y), epochs=10, batch_size=20, lr=0.5, l2=1e-2, client=client)
    assert sgd.success and np.isfinite(sgd.x).all()
    assert (sgd.predict(X) == y).mean() > 0.8


def test_estimator_with_free_intercept_wraps_a_jax_model(
    data: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    from distbelief.sklearn._base import FreeParams

    X, y, _ = data
    w = np.random.default_rng(3).normal(size=6)
    jm = FreeParams(models.JaxModel(logistic_loss, n_params=6), 0.5, [(5, 6)])
    builtin = FreeParams(models.Logistic(5), 0.5, [(5, 6)])
    g1 = models.objective(jm, w, X, y, l2=0.5)[1]
    g2 = models.objective(builtin, w, X, y, l2=0.5)[1]
    assert np.abs(g1 - g2).max() < 1e-10


def test_bad_input() -> None:
    with pytest.raises(InvalidOptionError, match="exactly one of n_params"):
        models.JaxModel(logistic_loss)
    with pytest.raises(InvalidOptionError, match="exactly one of n_params"):
        models.JaxModel(logistic_loss, 3, example_params=np.zeros(3))
    with pytest.raises(InvalidOptionError, match="n_params must be an int >= 1"):
        models.JaxModel(logistic_loss, 0)
    with pytest.raises(InvalidOptionError, match="loss_fn must be a function"):
        models.JaxModel("loss", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="n_features must be None or an int"):
        models.JaxModel(logistic_loss, 3, n_features=0)
    m = models.JaxModel(logistic_loss, 3)
    with pytest.raises(InvalidOptionError, match=r"w must have shape \(3,\)"):
        m.loss_and_grad(np.zeros(4), np.ones((2, 2)), np.zeros(2))
    with pytest.raises(InvalidOptionError, match="no predict_fn"):
        m.predict(np.zeros(3), np.ones((2, 2)))
    for scale in ("big", float("nan"), -1.0):
        with pytest.raises(InvalidOptionError, match="init_scale must be a finite number >= 0"):
            models.JaxModel(logistic_loss, 3, init_scale=scale)  # type: ignore[arg-type]
    # The rows of a sparse dataset reach the model as a csr_array, which JAX cannot take.
    import scipy.sparse as sp

    with pytest.raises(InvalidOptionError, match="dense rows"):
        m.loss_and_grad(np.zeros(3), sp.csr_array(np.ones((2, 3))), np.zeros(2))


def test_missing_jax_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_jax(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "jax" or name.startswith("jax."):
            raise ImportError("No module named 'jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax)
    with pytest.raises(InvalidOptionError, match=r"distbelief\[jax\]"):
        models.JaxModel(logistic_loss, 3)


def test_the_convnet_example_learns_the_digits(client: Client) -> None:
    import importlib.util
    from pathlib import Path

    from distbelief import sandblaster
    from distbelief.storage import load_digits

    path = Path(__file__).resolve().parents[2] / "examples" / "jax_digits_convnet.py"
    spec = importlib.util.spec_from_file_location("jax_digits_convnet", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    X, y = load_digits()
    rng = np.random.default_rng(0)
    params = {
        "conv": rng.normal(scale=0.3, size=(8, 1, 3, 3)),
        "conv_b": np.zeros(8),
        "dense": rng.normal(scale=0.1, size=(72, 10)),
        "dense_b": np.zeros(10),
    }
    model = models.JaxModel(example.loss, example_params=params, n_features=64, predict_fn=example.predict)
    w = model.init_params()
    _, grad = model.loss_and_grad(w, X[:50], y[:50].astype(float))
    for i in (0, 80, 700):  # central differences agree with the JAX gradient
        e = np.zeros_like(w)
        e[i] = 1e-6
        fd = (
            model.loss_and_grad(w + e, X[:50], y[:50])[0] - model.loss_and_grad(w - e, X[:50], y[:50])[0]
        ) / 2e-6
        assert fd == pytest.approx(grad[i], rel=1e-5, abs=1e-7)
    res = sandblaster.minimize(model, (X[:600], y[:600].astype(float)), l2=1e-4, maxiter=40, client=client)
    assert float(np.mean(res.predict(X[600:]) == y[600:])) > 0.8
