"""``JaxModel``: any JAX function of (params, X, y) as a model, gradient by ``jax.value_and_grad``.

Optional: needs ``pip install "distbelief[jax]"``. JAX is imported when a ``JaxModel`` is made (and again
on each worker when it is unpickled there), with 64-bit floats enabled, so the gradient is float64 like
the built-in models'. The compiled function is not pickled: each process compiles its own on first use
(JAX compiles once per shape of ``X``: a dataset's portions have at most two row counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse
from numpy.typing import ArrayLike, NDArray

from distbelief.errors import InvalidOptionError

__all__ = ["JaxModel"]

FloatArray = NDArray[np.float64]


def _jax() -> Any:
    try:
        import jax
    except ImportError as exc:
        raise InvalidOptionError(
            'JaxModel needs JAX: pip install "distbelief[jax]" (or pip install jax for the CPU build)'
        ) from exc
    jax.config.update("jax_enable_x64", True)
    return jax


class JaxModel:
    """A model from a JAX loss function: ``loss_fn(params, X, y)`` -> the *sum* of per-example losses.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, X, y)`` returning a scalar, written with ``jax.numpy``: the sum (not the mean) of
        the losses of the rows, as every model returns (the optimizers divide by N and add the L2 term).
        ``params`` is a flat float64 vector, or a pytree shaped like ``example_params``.
    n_params : int, optional
        Length of a flat parameter vector (give this or ``example_params``).
    example_params : pytree of arrays, optional
        Parameters in the shape ``loss_fn`` wants (dicts/lists/tuples of arrays); the model's flat vector is
        their concatenation (``jax.flatten_util.ravel_pytree``), and they are the default start.
    n_features : int, optional
        Columns of ``X`` the model expects (checked against a dataset when given).
    predict_fn : callable, optional
        ``predict_fn(params, X)`` -> predictions, for ``result.predict``.
    init_scale : float
        With ``n_params``: the start is ``init_scale`` times standard normal draws (seeded).

    Raises
    ------
    InvalidOptionError
        JAX is missing, neither or both of ``n_params`` and ``example_params`` are given, or they are bad.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> def logistic(w, X, y):
    ...     z = X @ w
    ...     return jnp.sum(jnp.logaddexp(0.0, z) - y * z)
    >>> m = JaxModel(logistic, n_params=2)
    >>> loss, grad = m.loss_and_grad(np.zeros(2), np.array([[1.0, 2.0]]), np.array([1.0]))
    >>> round(loss, 6), grad
    (0.693147, array([-0.5, -1. ]))
    """

    label_kind = "real"  # any labels: the loss function decides what they mean
    n_classes = None

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        n_params: int | None = None,
        *,
        example_params: Any = None,
        n_features: int | None = None,
        predict_fn: Callable[..., Any] | None = None,
        init_scale: float = 0.01,
    ) -> None:
        jax = _jax()
        if not callable(loss_fn):
            raise InvalidOptionError(f"loss_fn must be a function (params, X, y) -> scalar, got {loss_fn!r}")
        if (n_params is None) == (example_params is None):
            raise InvalidOptionError(
                "give exactly one of n_params= (a flat vector) and example_params= (a pytree)"
            )
        self.loss_fn = loss_fn
        self.predict_fn = predict_fn
        if (
            isinstance(init_scale, bool)
            or not isinstance(init_scale, int | float | np.integer | np.floating)
            or not (np.isfinite(init_scale) and init_scale >= 0)
        ):
            raise InvalidOptionError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
        self.init_scale = float(init_scale)
        self.example_params = example_params
        if example_params is not None:
            from jax.flatten_util import ravel_pytree

            flat, _ = ravel_pytree(
                jax.tree_util.tree_map(lambda a: np.asarray(a, dtype=np.float64), example_params)
            )
            self._n = int(flat.size)
            if self._n < 1:
                raise InvalidOptionError("example_params hold no numbers; pass arrays of parameters")
        else:
            if isinstance(n_params, bool) or not isinstance(n_params, int | np.integer) or n_params < 1:
                raise InvalidOptionError(f"n_params must be an int >= 1, got {n_params!r}")
            self._n = int(n_params)
        if n_features is not None and (
            isinstance(n_features, bool) or not isinstance(n_features, int | np.integer) or n_features < 1
        ):
            raise InvalidOptionError(f"n_features must be None or an int >= 1, got {n_features!r}")
        self.n_features = None if n_features is None else int(n_features)
        self._compiled: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled"] = None  # compiled code does not pickle: every process compiles its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _jax()

    @property
    def n_params(self) -> int:
        """Length of the flat parameter vector."""
        return self._n

    def _functions(self) -> tuple[Any, Any]:
        if self._compiled is None:
            jax = _jax()
            loss_fn = self.loss_fn
            if self.example_params is not None:
                from jax.flatten_util import ravel_pytree

                example = jax.tree_util.tree_map(
                    lambda a: np.asarray(a, dtype=np.float64), self.example_params
                )
                _, unravel = ravel_pytree(example)

                def flat_loss(w: Any, X: Any, y: Any) -> Any:
                    return loss_fn(unravel(w), X, y)

                unflatten = unravel
            else:
                flat_loss, unflatten = loss_fn, (lambda w: w)
            self._compiled = (jax.jit(jax.value_and_grad(flat_loss)), unflatten)
        compiled: tuple[Any, Any] = self._compiled
        return compiled

    def init_params(self, seed: int | None = None) -> FloatArray:
        """``example_params`` flattened, or ``init_scale`` times seeded standard normal draws."""
        if self.example_params is not None:
            from jax.flatten_util import ravel_pytree

            jax = _jax()
            flat, _ = ravel_pytree(
                jax.tree_util.tree_map(lambda a: np.asarray(a, dtype=np.float64), self.example_params)
            )
            return np.array(flat, dtype=np.float64)
        return self.init_scale * np.random.default_rng(seed).standard_normal(self._n)

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """``loss_fn`` at ``w`` and its gradient (float64), by the jit-compiled ``value_and_grad``."""
        w_arr = np.asarray(w, dtype=np.float64)
        if w_arr.shape != (self._n,):
            raise InvalidOptionError(f"w must have shape ({self._n},), got {w_arr.shape}")
        if scipy.sparse.issparse(X):
            raise InvalidOptionError(
                "JaxModel takes dense rows, but these are sparse (a sparse dataset's rows come as a "
                "csr_array); build the dataset from dense rows (X.toarray()), or write a model whose "
                "loss_and_grad takes CSR rows"
            )
        value_and_grad, _ = self._functions()
        value, grad = value_and_grad(w_arr, np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64))
        return float(value), np.array(grad, dtype=np.float64)

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[Any]:
        """``predict_fn(params, X)`` as numpy (needs ``predict_fn``)."""
        if self.predict_fn is None:
            raise InvalidOptionError(
                "this JaxModel has no predict_fn; pass predict_fn=(params, X) -> predictions"
            )
        _, unflatten = self._functions()
        return np.asarray(
            self.predict_fn(unflatten(np.asarray(w, dtype=np.float64)), np.asarray(X, dtype=np.float64))
        )
