"""ModelClassifier: a JaxModel (or any model) as a scikit-learn classifier."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_iris
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from distbelief import models
from distbelief.errors import InvalidOptionError
from distbelief.sklearn import ModelClassifier

jax = pytest.importorskip("jax", reason='JaxModel needs JAX: pip install "distbelief[jax]"')
jnp = pytest.importorskip("jax.numpy")


def softmax_loss(params: Any, X: Any, y: Any) -> Any:
    Z = X @ params["W"] + params["b"]
    picked = jnp.take_along_axis(Z, y.astype(jnp.int32)[:, None], axis=1)[:, 0]
    return jnp.sum(jax.nn.logsumexp(Z, axis=1) - picked)


def softmax_predict(params: Any, X: Any) -> Any:
    return jnp.argmax(X @ params["W"] + params["b"], axis=1)


def test_a_jax_model_in_a_pipeline_matches_the_built_in() -> None:
    X, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    jm = models.JaxModel(
        softmax_loss, example_params={"W": np.zeros((4, 3)), "b": np.zeros(3)}, predict_fn=softmax_predict
    )
    pipe = make_pipeline(StandardScaler(), ModelClassifier(jm, alpha=1.0, tol=1e-9)).fit(X, names)
    ref = make_pipeline(StandardScaler(), ModelClassifier(models.Softmax(4, 3), alpha=1.0, tol=1e-9)).fit(
        X, names
    )
    # Same objective, same start (zeros), same layout (W then b): the same solution.
    np.testing.assert_allclose(pipe[-1].w_, ref[-1].w_, atol=1e-6)
    assert pipe.score(X, names) > 0.9
    assert set(pipe.predict(X)) <= set(names)
    np.testing.assert_allclose(ref.predict_proba(X).sum(axis=1), 1.0)
    with pytest.raises(AttributeError, match="no predict_proba"):
        pipe.predict_proba(X)


def test_bad_model() -> None:
    with pytest.raises(InvalidOptionError, match="model must be a distbelief model"):
        ModelClassifier().fit(np.eye(2), [0, 1])
    with pytest.raises(InvalidOptionError, match="random_state must be None, an int >= 0"):
        ModelClassifier(models.Logistic(2), random_state="x").fit(np.eye(2), [0, 1])  # type: ignore[arg-type]
