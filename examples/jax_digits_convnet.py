"""A small convolutional network on the handwritten digits, written in JAX and trained by Sandblaster.

``models.JaxModel`` turns the loss function below into a distbelief model: the replicas compute its
gradient with ``jax.value_and_grad`` (compiled once per process), and the parameter server and L-BFGS
coordinator treat it like any built-in model. Needs ``pip install "distbelief[jax]"``.

Run: ``python examples/jax_digits_convnet.py`` (starts an embedded Dask cluster; ~1 minute on 2 cores).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distbelief import models, sandblaster
from distbelief.storage import load_digits

FILTERS = 8  # 3x3 filters of the one convolutional layer


def forward(params: dict[str, Any], X: Any) -> Any:
    """Logits of the rows of X (64 pixels each): conv 3x3 -> relu -> 2x2 mean pool -> dense -> 10 classes."""
    images = X.reshape(-1, 1, 8, 8) / 16.0  # NCHW
    h = jax.lax.conv_general_dilated(images, params["conv"], window_strides=(1, 1), padding="VALID")
    h = jax.nn.relu(h + params["conv_b"][None, :, None, None])  # (n, FILTERS, 6, 6)
    h = h.reshape(-1, FILTERS, 3, 2, 3, 2).mean(axis=(3, 5))  # (n, FILTERS, 3, 3)
    return h.reshape(h.shape[0], -1) @ params["dense"] + params["dense_b"]


def loss(params: dict[str, Any], X: Any, y: Any) -> Any:
    """Summed softmax cross-entropy (a sum over the rows, as every distbelief model returns)."""
    Z = forward(params, X)
    picked = jnp.take_along_axis(Z, y.astype(jnp.int32)[:, None], axis=1)[:, 0]
    return jnp.sum(jax.nn.logsumexp(Z, axis=1) - picked)


def predict(params: dict[str, Any], X: Any) -> Any:
    return jnp.argmax(forward(params, X), axis=1)


def main() -> None:
    X, y = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(X))
    train, test = order[:1400], order[1400:]
    example = {
        "conv": rng.normal(scale=0.3, size=(FILTERS, 1, 3, 3)),
        "conv_b": np.zeros(FILTERS),
        "dense": rng.normal(scale=0.1, size=(FILTERS * 9, 10)),
        "dense_b": np.zeros(10),
    }
    model = models.JaxModel(loss, example_params=example, n_features=64, predict_fn=predict)
    res = sandblaster.minimize(model, (X[train], y[train].astype(float)), l2=1e-4, maxiter=200)
    accuracy = float(np.mean(res.predict(X[test]) == y[test]))
    print(f"{model.n_params} parameters, {res.nit} L-BFGS iterations, {res.message}")
    print(f"held-out accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
