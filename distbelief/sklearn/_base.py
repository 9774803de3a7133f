"""What the estimators share: the cluster to fit on, the data to fit, the solver call, cloning and pickling.

The objective of every solver is ``F(w) = (1/N) sum_i loss_i(w) + (l2/2) ||w||^2`` with the regularizer
applied to *every* parameter on the parameter-server shards. scikit-learn does not penalize intercepts (and
MLP biases); :class:`FreeParams` wraps a model so that, summed over all ``N`` rows, its data term gives the
penalty of those parameters back exactly: each row adds ``-(l2/2) ||w_free||^2`` to its loss (and
``-l2 * w_free`` to its gradient). Summed over the portions of a Sandblaster batch, or averaged over a
Downpour mini-batch, that cancels the shards' ``(l2/2) ||w_free||^2`` term for any split of the rows.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.storage import Dataset
from distbelief.storage.internal import run_store

__all__ = ["PENALTIES", "SOLVERS", "FreeParams", "fit_model", "resolve_client"]

SOLVERS = ("lbfgs", "cg", "gd", "downpour")
PENALTIES = ("l2", "l1", "elasticnet", None)

FloatArray = NDArray[np.float64]


class FreeParams:
    """A model whose parameters in ``free`` are left out of the shards' L2 penalty (intercepts, biases).

    Parameters
    ----------
    model : Model
        The wrapped model; every other member is passed through.
    l2 : float
        The ``l2`` the solver applies on the shards.
    free : sequence of (start, stop)
        Ranges of ``w`` that must not be penalized.

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.models import LeastSquares, objective
    >>> m = FreeParams(LeastSquares(1), 0.5, [(1, 2)])
    >>> X, y, w = np.ones((4, 1)), np.zeros(4), np.array([1.0, 2.0])
    >>> objective(m, w, X, y, l2=0.5)[0] == objective(LeastSquares(1), w, X, y)[0] + 0.25 * 1.0
    True
    """

    def __init__(self, model: Any, l2: float, free: Sequence[tuple[int, int]]) -> None:
        self.model = model
        self.l2 = float(l2)
        self.free = tuple((int(a), int(b)) for a, b in free)

    @property
    def n_params(self) -> int:
        """That of the wrapped model."""
        return int(self.model.n_params)

    @property
    def n_features(self) -> int:
        """That of the wrapped model."""
        return int(self.model.n_features)

    @property
    def n_classes(self) -> int | None:
        """That of the wrapped model."""
        k = getattr(self.model, "n_classes", None)
        return None if k is None else int(k)

    @property
    def label_kind(self) -> str:
        """That of the wrapped model."""
        return str(getattr(self.model, "label_kind", "real"))

    def init_params(self, seed: int | None = None) -> FloatArray:
        """That of the wrapped model."""
        return np.asarray(self.model.init_params(seed), dtype=np.float64)

    def check_labels(self, y: ArrayLike) -> None:
        """That of the wrapped model (if it has one)."""
        check = getattr(self.model, "check_labels", None)
        if callable(check):
            check(y)

    def loss_and_grad(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> tuple[float, FloatArray]:
        """The wrapped model's summed loss, minus ``(l2/2) ||w_free||^2`` per row, and its gradient."""
        loss, grad = self.model.loss_and_grad(w, X, y)
        grad = np.array(grad, dtype=np.float64)
        w_arr = np.asarray(w, dtype=np.float64)
        n = np.shape(X)[0]  # not len(X): the rows of a sparse dataset are a csr_array, whose len() raises
        for a, b in self.free:
            part = w_arr[a:b]
            loss -= n * 0.5 * self.l2 * float(part @ part)
            grad[a:b] -= n * self.l2 * part
        return float(loss), grad

    def compact(self, n_features: int, keys: NDArray[np.int64]) -> FreeParams:
        """This wrapper around the wrapped model narrowed to the parameters ``keys`` (the sparse path).

        A portion of sparse rows is computed by a model of the width of the columns it touches, whose
        parameters are ``w[keys]`` (``storage._keys.compact_model``); the free ranges move to where their
        keys sit in that vector. Every free parameter must be among ``keys`` (the intercepts always are),
        else the penalty of an untouched one would not be given back.

        Examples
        --------
        >>> from distbelief.models import Logistic
        >>> m = FreeParams(Logistic(1000), 0.5, [(1000, 1001)]).compact(2, np.array([3, 7, 1000]))
        >>> m.n_params, m.free
        (3, ((2, 3),))
        """
        from distbelief.storage.internal import compact_model

        inner = compact_model(self.model, n_features, keys)
        keys = np.asarray(keys, dtype=np.int64)
        # Parameters of the narrowed model before those of keys[0] have no key (a placeholder column).
        offset = int(inner.n_params) - keys.size
        free = []
        for a, b in self.free:
            lo, hi = (int(i) for i in np.searchsorted(keys, [a, b]))
            if hi - lo != b - a:
                raise InvalidOptionError(
                    f"FreeParams: the unpenalized parameters [{a}, {b}) are not all among a portion's keys"
                )
            free.append((lo + offset, hi + offset))
        return FreeParams(inner, self.l2, free)

    @property
    def spec(self) -> dict[str, Any] | None:
        """That of the wrapped model (so a result saved with ``to_zarr`` rebuilds it).

        It also makes the sparse path take this wrapper for the linear model it wraps
        (``storage._keys.sparse_layout_of``), which narrows it through :meth:`compact`.
        """
        spec = getattr(self.model, "spec", None)
        return spec if isinstance(spec, dict) else None

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[Any]:
        """That of the wrapped model."""
        return np.asarray(self.model.predict(w, X))

    def predict_proba(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """That of the wrapped model."""
        return np.asarray(self.model.predict_proba(w, X), dtype=np.float64)

    def accuracy(self, w: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        """That of the wrapped model (Downpour's held-out evaluation)."""
        return float(self.model.accuracy(w, X, y))


# ------------------------------------------------------------------------------------------- clusters


def resolve_client(client: Any) -> Any:
    """The Dask client a fit runs on (:func:`storage._cluster.resolve_client`).

    ``None``: the current default client (``distributed.default_client()``) if one runs, else the
    embedded ``LocalCluster`` shared by every call of this process. A ``str``: a client of the scheduler at
    that address (made once, then reused). A ``Client``: itself.

    Raises
    ------
    InvalidOptionError
        For anything else, or a malformed address.
    """
    from distbelief.storage.internal import resolve_client as resolve

    return resolve(client)


def clone_keeping_client(estimator: Any) -> Any:
    """``sklearn.base.clone`` for an estimator whose ``client`` may be a live ``distributed.Client``.

    A client is a connection, not state: clones share it (``copy.deepcopy`` of a client fails).
    """
    params = estimator.get_params(deep=False)
    client = params.pop("client", None)
    new_params = {name: clone(value, safe=False) for name, value in params.items()}
    return type(estimator)(client=client, **new_params)


def picklable_state(state: dict[str, Any]) -> dict[str, Any]:
    """The ``__dict__`` of an estimator without a live ``distributed.Client``: it becomes ``None``.

    A client is a connection to a cluster that may be gone when the estimator is loaded (a refit would
    wait for its scheduler, then fail): the loaded estimator predicts as before, and a refit runs on the
    default client or the embedded cluster, or where ``set_params(client=...)`` says. A scheduler address
    the user gave (a ``str``) is kept: it is their setting.
    """
    client = state.get("client")
    if client is not None and not isinstance(client, str):
        state = dict(state)
        state["client"] = None
    return state


# -------------------------------------------------------------------------------------------- fitting


@contextlib.contextmanager
def fit_store(store: str | os.PathLike[str] | None) -> Iterator[str]:
    """``store`` itself, or a temporary directory deleted after the fit."""
    with run_store(store, "distbelief-fit-") as root:
        yield root


def check_common(solver: object, penalty: object, max_iter: object, tol: object, name: str) -> None:
    """Check the options every estimator has; raise :class:`InvalidOptionError` saying what to pass."""
    if penalty not in PENALTIES:
        raise InvalidOptionError(f"{name}: penalty must be one of {PENALTIES}, got {penalty!r}")
    if solver not in SOLVERS:
        raise InvalidOptionError(f"{name}: solver must be one of {SOLVERS}, got {solver!r}")
    if penalty in ("l1", "elasticnet") and solver != "lbfgs":
        raise InvalidOptionError(
            f"{name}: penalty={penalty!r} is minimized by OWL-QN (L-BFGS for an L1 term): use "
            f"solver='lbfgs', got solver={solver!r}"
        )
    # numbers.Integral / numbers.Real take numpy's scalars too (np.int32(5), np.float32(1e-4)), as
    # scikit-learn's parameter checks do; a bool is an Integral, but never a count or a tolerance.
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1:
        raise InvalidOptionError(f"{name}: max_iter must be an int >= 1, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not float(tol) >= 0:
        raise InvalidOptionError(f"{name}: tol must be a number >= 0, got {tol!r}")


def check_alpha(alpha: object, name: str) -> None:
    """Check an L2 strength ``alpha`` (>= 0) as scikit-learn means it."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not float(alpha) >= 0:
        raise InvalidOptionError(f"{name}: alpha must be a number >= 0, got {alpha!r}")


def fit_model(
    model: Any,
    data: Dataset | tuple[FloatArray, FloatArray],
    *,
    l2: float,
    free: Sequence[tuple[int, int]],
    solver: str,
    l1: float = 0.0,
    max_iter: int,
    tol: float,
    client: Any,
    store: str,
    x0: FloatArray | None = None,
    seed: int = 0,
    downpour_options: dict[str, Any] | None = None,
    name: str = "estimator",
) -> tuple[FloatArray, int, Any]:
    """Minimize ``F`` with the chosen solver; return the parameters, the iterations and the run's result.

    ``F(w) = (1/N) sum_i loss_i(w) + l1 ||w||_1 + (l2/2) ||w||^2`` with neither term on the ``free``
    ranges: the L2 term is given back by :class:`FreeParams`, the L1 term leaves them out on the shards
    (``minimize(l1_exclude=...)``). ``l1 > 0`` runs OWL-QN (``solver`` must be ``"lbfgs"``).
    Iterations are Sandblaster's ``nit``, or Downpour's epochs run (``max_iter`` epochs per replica).
    A run that stops at ``max_iter`` warns with scikit-learn's ``ConvergenceWarning``.
    """
    run_model = FreeParams(model, l2, free) if (l2 > 0 and free) else model
    c = resolve_client(client)
    if l1 > 0 and solver != "lbfgs":
        raise InvalidOptionError(f"{name}: an L1 term needs solver='lbfgs' (OWL-QN), got {solver!r}")
    if solver == "downpour":
        from distbelief.downpour import train

        options = dict(downpour_options or {})
        trained = train(
            run_model,
            data,
            l2=l2,
            epochs=max_iter,
            client=c,
            store=os.path.join(store, "run"),
            x0=x0,
            seed=seed,
            **options,
        )
        if not trained.success:
            raise DatasetError(f"{name}: Downpour stopped early ({trained.message})")
        return np.asarray(trained.x, dtype=np.float64), int(max_iter), trained
    from distbelief.sandblaster import minimize

    res = minimize(
        run_model,
        data,
        method="owlqn" if l1 > 0 else solver,  # type: ignore[arg-type]
        x0=x0,
        l2=l2,
        l1=l1,
        l1_exclude=free if l1 > 0 else (),
        gtol=tol,
        ftol=64 * np.finfo(float).eps,  # scikit-learn's lbfgs setting
        maxiter=max_iter,
        client=c,
        store=os.path.join(store, "run"),
        seed=seed,
    )
    if res.status == 1:
        warnings.warn(
            f"{name}: {solver} did not converge in max_iter={max_iter} iterations ({res.message}); "
            "increase max_iter or scale the data",
            ConvergenceWarning,
            stacklevel=3,
        )
    return np.asarray(res.x, dtype=np.float64), int(res.nit), res


def is_dask_array(X: object) -> bool:
    """Whether ``X`` is a Dask array (without importing dask.array unless it is loaded)."""
    import sys

    da = sys.modules.get("dask.array")
    return da is not None and isinstance(X, da.Array)


def map_rows(X: Any, fn: Callable[[FloatArray], NDArray[Any]], out_cols: int | None, dtype: Any) -> Any:
    """``fn`` applied to every row block of the Dask array ``X`` on the workers (a lazy Dask array)."""
    X = X.rechunk({1: -1})
    if out_cols is None:
        return X.map_blocks(fn, drop_axis=1, dtype=dtype)
    return X.map_blocks(fn, chunks=(X.chunks[0], (out_cols,)), dtype=dtype)
