"""Linear models: least squares, binary logistic regression, multinomial (softmax) regression.

Each returns the *sum* of per-example losses over the rows it is given and its gradient, computed with
two matrix products (``X @ w`` and ``r @ X``) and no copy of ``X``. When ``X`` is much larger than the CPU
cache (:data:`_BLOCK_MIN_BYTES`), both products are bound by memory bandwidth, so the two are fused into one
pass over ``X`` (:func:`_block_rows`, :meth:`_Linear._fused_pass`): each row's (or block's) residual and
gradient contribution are computed while it is still in cache, which reads ``X`` once instead of twice.
That pass runs as a numba-compiled kernel when numba is available (:mod:`models._compiled`: no Python per
block, 5-27% faster on one thread and ~2.5x on two, as it holds no GIL), and otherwise as numpy/BLAS calls
over ~512 KiB row blocks.
The results equal the two-pass ones up to the order of summation. The losses are the
standard ones of generalized linear models (e.g. Hastie, Tibshirani & Friedman, *The Elements of
Statistical Learning*, 2nd ed., sections 3.2 and 4.4); the logistic and softmax losses are evaluated in
the numerically stable log-sum-exp form.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit

from . import _checks, _compiled
from ._base import ClassifierBase, ModelBase, softmax_
from ._checks import LabelKind
from ._specs import LeastSquaresSpec, LogisticSpec, SoftmaxSpec, validate_spec

__all__ = ["LeastSquares", "Logistic", "Softmax", "softmax_xent_", "softmax_xent_rows"]

FloatArray = NDArray[np.float64]

#: ``X`` of at most this many bytes takes the two-pass path: it stays (mostly) in the L2/L3 cache between the
#: two products, so fusing them saves nothing, and small calls (digits, 1797 x 64 = 0.9 MB: 0.05-0.5 ms) are
#: latency-critical and must not pay for a Python loop over blocks. Well above the 2 MiB L2 per core.
_BLOCK_MIN_BYTES: int = 8 << 20

#: Target bytes of ``X`` per row block of the fused pass: small enough that the block is still in the L2
#: cache (2 MiB per core here) when it is read the second time, large enough that the per-block Python and
#: BLAS call overhead (~10-30 us) stays small. Medians of 8 interleaved runs, 100,000 x 500 float64, 1 BLAS
#: thread, without the softmax cap below (shared 2-core machine; 512 KiB was best or tied in all 4 sweeps):
#:   block           two-pass  256 KiB  512 KiB  1 MiB  2 MiB
#:   least squares       54.9     45.5     41.9   42.2   46.7 ms
#:   logistic            56.4     47.1     43.7   46.6   50.9 ms
#:   softmax, 10 cl.    201.5    113.6    105.0  166.4  184.6 ms  (1 MiB and up: past the small-GEMM limit)
_BLOCK_BYTES: int = 512 << 10

#: Softmax blocks are also capped at ``rows * n_features * n_classes <= _SMALL_GEMM_MNK``: OpenBLAS (the BLAS
#: of the numpy/scipy wheels) runs such products with its "small matrix" kernels, which for these skinny
#: shapes are ~2x faster than its general GEMM (measured, 500 features x 10 classes: 200 rows 68 us, 224 rows
#: 131 us for ``X_b @ W``, and the same step for ``X_b.T @ R_b``). That is also why the two-pass softmax is
#: slow: one big skinny GEMM. On 40,000 x 500 with 50 classes the cap (40 rows) took 100 ms against 125 ms
#: for 131 rows (two-pass: 142 ms).
_SMALL_GEMM_MNK: int = 1_000_000

#: Below this many rows per block the per-block overhead would dominate, so the cap above is not applied.
_MIN_CAPPED_ROWS: int = 32

#: A block's residual, in place: ``residual_(Z_b, start, stop)`` gets ``Z_b = X[start:stop] @ coef + b`` and
#: returns the residual ``dloss/dZ`` of those rows (``Z_b`` itself or another buffer) and their summed loss.
BlockResidual = Callable[[FloatArray, int, int], tuple[FloatArray, float]]

#: The whole fused pass, compiled: ``compiled(w, X, rows) -> (loss, grad)`` (``rows`` per block, where the
#: kernel works in blocks), or None when numba is unavailable.
CompiledPass = Callable[[FloatArray, FloatArray, int], "tuple[float, FloatArray] | None"]


class _FusedLoss:
    """A model's loss for :meth:`_Linear._fused_pass`, in both of the forms that pass can take.

    Callable as the :data:`BlockResidual` of the numpy blocks. ``compiled`` is the compiled form of the
    whole pass (:data:`CompiledPass`), tried first; ``total``, if given, turns the numpy blocks' summed
    losses into the loss (e.g. evaluating it on all of ``Z_all`` after the pass).
    """

    __slots__ = ("compiled", "residual_", "total")

    def __init__(
        self, residual_: BlockResidual, compiled: CompiledPass, total: Callable[[float], float] | None = None
    ) -> None:
        self.residual_ = residual_
        self.compiled = compiled
        self.total = total

    def __call__(self, Z_b: FloatArray, start: int, stop: int) -> tuple[FloatArray, float]:
        return self.residual_(Z_b, start, stop)


def _block_rows(X: FloatArray, n_outputs: int) -> int:
    """Rows per block of the fused single pass over ``X``, or 0 for the two-pass path.

    Parameters
    ----------
    X : ndarray, shape (n_rows, n_features)
        The checked rows.
    n_outputs : int
        Columns of ``Z = X @ coef`` (1, or the number of classes).

    Returns
    -------
    int
        0 when ``X`` is small (:data:`_BLOCK_MIN_BYTES`) or not a C-contiguous float64 array (its row
        blocks would not be contiguous views, and copying a big ``X`` costs more than the pass saved);
        otherwise about :data:`_BLOCK_BYTES` of rows (at least 1), capped for several outputs at
        :data:`_SMALL_GEMM_MNK`.
    """
    if (
        _checks.is_sparse(X)
        or X.nbytes <= _BLOCK_MIN_BYTES
        or X.dtype != np.float64
        or not X.flags.c_contiguous
    ):
        return 0
    n_cols = int(X.shape[1])
    rows = max(1, _BLOCK_BYTES // (n_cols * X.itemsize))
    if n_outputs > 1:
        cap = _SMALL_GEMM_MNK // (n_cols * n_outputs)
        if cap >= _MIN_CAPPED_ROWS:
            rows = min(rows, cap)
    return rows


def _log1pexp_sum(t: FloatArray) -> float:
    """``sum(log(1 + exp(t)))``, evaluated stably (``t`` is left unchanged).

    Computed as ``max(t, 0) + log1p(exp(-|t|))``: the same value as ``np.logaddexp(0, t)``, never
    overflowing, and about 4x faster than logaddexp's generic ufunc.
    """
    u = np.abs(t)
    np.negative(u, out=u)
    np.exp(u, out=u)
    np.log1p(u, out=u)
    loss = float(u.sum())
    np.maximum(t, 0.0, out=u)
    loss += float(u.sum())
    return loss


def softmax_xent_(Z: FloatArray, labels: NDArray[np.intp]) -> float:
    """Summed cross-entropy of softmax(Z) against ``labels``; overwrites ``Z`` with its gradient in Z.

    Stable log-sum-exp: with ``m_i = max_k Z_ik`` (attained at ``k = a_i``),
    ``loss_i = log1p(sum_{k != a_i} exp(Z_ik - m_i)) - (Z_{i,y_i} - m_i)``; ``log1p`` keeps the tiny loss
    of a confidently right row instead of rounding ``log(1 + 1e-20)`` to 0. On return ``Z`` holds
    ``softmax(Z) - onehot(labels)``, where the label entry ``p_y - 1`` is formed as ``-sum_{k != y} p_k``
    so it does not cancel to 0 when ``p_y`` is close to 1.
    """
    n, k = Z.shape
    if n == 0:
        return 0.0
    # Flat indices into the C-contiguous Z, and row sums as Z @ ones (BLAS), are several times faster than
    # fancy 2-D indexing and Z.sum(axis=1) for the few-columns-many-rows shapes of a classifier.
    assert Z.flags.c_contiguous, "Z must be C-contiguous, so that flat is a view"
    flat = Z.reshape(-1)
    base = np.arange(0, n * k, k)
    at_top = base + Z.argmax(axis=1)
    at_label = base + labels
    ones = np.ones(k)
    Z -= flat[at_top][:, None]  # the largest entry of every row becomes exactly 0
    picked = flat[at_label]
    np.exp(Z, out=Z)
    flat[at_top] = 0.0
    totals = Z @ ones  # sum of the exponentials other than the largest (which is exactly 1)
    loss = float(np.log1p(totals).sum() - picked.sum())
    flat[at_top] = 1.0
    totals += 1.0
    np.reciprocal(totals, out=totals)
    Z *= totals[:, None]
    flat[at_label] = 0.0
    flat[at_label] = -(Z @ ones)
    return loss


def _squares_rows(y: FloatArray, z: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Least squares per row (:meth:`_Linear._weighted`): losses ``0.5 r^2`` and residuals ``r = z - y``."""
    z -= y
    return 0.5 * z * z, z


def _logistic_rows(sign: FloatArray, z: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Logistic loss per row in the margin form of :meth:`Logistic.loss_and_grad` (``sign = 1 - 2 y``)."""
    t = np.multiply(sign, z, out=z)
    losses = np.logaddexp(0.0, t)
    r = expit(t)
    r *= sign
    return losses, r


def softmax_xent_rows(labels: NDArray[np.intp], Z: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Cross-entropy per row, ``logsumexp(Z_i) - Z_{i, y_i}``, and ``softmax(Z) - onehot(y)`` (in ``Z``)."""
    Z -= Z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(Z).sum(axis=1))
    rows = np.arange(Z.shape[0])
    losses = lse - Z[rows, labels]
    Z -= lse[:, None]
    np.exp(Z, out=Z)
    Z[rows, labels] -= 1.0
    return losses, Z


class _Linear(ModelBase):
    """A linear predictor ``X @ coef + intercept``, with the intercept(s) as the last parameter(s)."""

    def __init__(self, n_features: int, fit_intercept: bool, n_outputs: int) -> None:
        self._n_features = n_features
        self._fit_intercept = fit_intercept
        self._n_outputs = n_outputs

    @property
    def n_features(self) -> int:
        """Number of input features (columns of ``X``)."""
        return self._n_features

    @property
    def fit_intercept(self) -> bool:
        """Whether the model has an intercept (stored after the coefficients)."""
        return self._fit_intercept

    @property
    def n_params(self) -> int:
        """``n_features * n_outputs`` coefficients, then ``n_outputs`` intercepts if ``fit_intercept``."""
        return (self._n_features + int(self._fit_intercept)) * self._n_outputs

    def init_params(self, seed: int | None = None) -> FloatArray:
        """All zeros: the loss is convex, so zero is as good a start as any and needs no seed.

        Parameters
        ----------
        seed : int, optional
            Ignored (accepted for the :class:`Model` protocol).

        Returns
        -------
        ndarray, shape (n_params,)

        Examples
        --------
        >>> from distbelief.models import Logistic
        >>> Logistic(2).init_params(seed=0)
        array([0., 0., 0.])
        """
        return np.zeros(self.n_params)

    def _checked(self, w: ArrayLike, X: ArrayLike) -> tuple[FloatArray, FloatArray]:
        """``w`` and ``X`` checked and as float64 arrays (no copy of float64 input); sparse ``X`` as CSR.

        Sparse rows are typed as arrays here: every use of them below (``X @ coef``, ``X.T @ R``, ``X.shape``)
        is one that scipy's CSR supports, and the compiled CSR pass is chosen by :meth:`_compiled_csr`.
        """
        w_arr = _checks.as_params(w, self.n_params, self._name)
        if _checks.is_sparse(X):
            return w_arr, _checks.as_csr(X, self._n_features, self._name)
        return w_arr, _checks.as_rows(X, self._n_features, self._name)

    def _coef(self, w: FloatArray) -> tuple[FloatArray, FloatArray | float]:
        """Views ``(coef, intercept)`` into a checked ``w``: coef (n_features,) or (n_features, k)."""
        k = self._n_outputs
        n_coef = self._n_features * k
        coef = w[:n_coef] if k == 1 else w[:n_coef].reshape(self._n_features, k)
        intercept: FloatArray | float = 0.0
        if self._fit_intercept:
            intercept = w[n_coef:] if k > 1 else float(w[n_coef])
        return coef, intercept

    def _product(self, w: FloatArray, X: FloatArray) -> FloatArray:
        """``Z = X @ coef + intercept`` (shape (n,) for one output) for a checked ``w`` and ``X``."""
        coef, intercept = self._coef(w)
        Z = X @ coef
        if self._fit_intercept:
            Z += intercept
        return Z

    def _linear(self, w: ArrayLike, X: ArrayLike) -> tuple[FloatArray, FloatArray]:
        """Checked ``X`` and ``Z = X @ coef + intercept`` (shape (n,) for one output)."""
        w_arr, X_arr = self._checked(w, X)
        return X_arr, self._product(w_arr, X_arr)

    def _fused_pass(
        self,
        w: FloatArray,
        X: FloatArray,
        rows: int,
        residual_: BlockResidual | _FusedLoss,
        Z_all: FloatArray | None = None,
    ) -> tuple[float, FloatArray]:
        """The loss and the gradient in one pass over ``X``: compiled if possible, else in numpy blocks.

        With a :class:`_FusedLoss`, its compiled pass is used when numba is available (the models always
        pass one); otherwise, or with a plain :data:`BlockResidual`, :meth:`_blocked_pass` runs with
        ``rows``, ``residual_`` and ``Z_all``, and the loss is ``residual_.total`` of the summed block
        losses (just their sum for a plain residual).

        Returns
        -------
        loss : float
        grad : ndarray, shape (n_params,)
        """
        if not isinstance(residual_, _FusedLoss):
            return self._blocked_pass(w, X, rows, residual_, Z_all)
        result = residual_.compiled(w, X, rows)
        if result is not None:
            return result
        loss, grad = self._blocked_pass(w, X, rows, residual_.residual_, Z_all)
        return (residual_.total(loss) if residual_.total is not None else loss), grad

    def _blocked_pass(
        self,
        w: FloatArray,
        X: FloatArray,
        rows: int,
        residual_: BlockResidual,
        Z_all: FloatArray | None = None,
    ) -> tuple[float, FloatArray]:
        """Summed block losses and the gradient, in one pass over ``X`` in blocks of ``rows`` rows (numpy).

        For every block ``X_b`` (a view: ``X`` is C-contiguous), ``Z_b = X_b @ coef + b`` is computed,
        turned into the residual ``R_b`` by ``residual_``, and ``X_b.T @ R_b`` (and ``sum(R_b)``) added to
        the gradient while ``X_b`` is still in cache. The products run through ``np.matmul`` into buffers
        made once per call and are added in place: the same BLAS kernels as the two-pass path, and unlike
        the f2py wrappers of ``scipy.linalg.blas`` (``dgemv``/``dgemm`` with ``beta=1``) they release the
        GIL, which the Dask worker's event loop needs (see ``storage/_shard.py``). Measured no slower
        either, on 100,000 x 500: logistic 46 vs 47 ms, softmax 120 vs 124 ms, and for softmax in two
        threads of one process 235 vs 334 ms.

        Parameters
        ----------
        w : ndarray, shape (n_params,)
            Checked parameters.
        X : ndarray, shape (n_rows, n_features)
            Checked, C-contiguous rows.
        rows : int
            Rows per block (from :func:`_block_rows`).
        residual_ : callable
            ``residual_(Z_b, start, stop) -> (R_b, loss_b)``, see :data:`BlockResidual`.
        Z_all : ndarray, shape (n_rows,), optional
            For one output: write each ``Z_b`` into ``Z_all[start:stop]`` (so the caller can evaluate the loss
            on all of ``Z`` afterwards, with fewer calls per block); otherwise ``Z_b`` lives in one block
            buffer reused by every block.

        Returns
        -------
        loss : float
            The sum of the ``loss_b`` returned by ``residual_``.
        grad : ndarray, shape (n_params,)
            ``[X.T @ R, sum(R)]`` in the layout of ``w``.
        """
        n, d = X.shape
        k = self._n_outputs
        n_coef = d * k
        coef, intercept = self._coef(w)
        grad = np.zeros(self.n_params)
        step = max(1, min(rows, n))  # no bigger buffers than X has rows
        if k == 1:
            grad_coef = grad[:n_coef]
            part = np.empty(d)
        else:
            grad_coef = grad[:n_coef].reshape(d, k)
            part = np.empty((d, k))
            grad_b = grad[n_coef:]
            part_b = np.empty(k)
            ones = np.ones(step)  # column sums as a BLAS product: several times faster than sum(axis=0)
        whole = Z_all is not None  # Z_b is Z_all[start:stop], else the first rows of one block buffer
        Z_buf = Z_all if Z_all is not None else np.empty((step,) if k == 1 else (step, k))
        loss = 0.0
        intercept_sum = 0.0
        for start in range(0, n, step):
            stop = min(start + step, n)
            X_b = X[start:stop]
            Z_b = Z_buf[start:stop] if whole else Z_buf[: stop - start]
            np.matmul(X_b, coef, out=Z_b)
            if self._fit_intercept:
                Z_b += intercept
            R_b, loss_b = residual_(Z_b, start, stop)
            loss += loss_b
            if k == 1:
                np.matmul(R_b, X_b, out=part)
            else:
                np.matmul(X_b.T, R_b, out=part)
            grad_coef += part
            if self._fit_intercept:
                if k == 1:
                    intercept_sum += float(R_b.sum())
                else:
                    np.matmul(ones[: stop - start], R_b, out=part_b)
                    grad_b += part_b
        if self._fit_intercept and k == 1:
            grad[n_coef] = intercept_sum
        return loss, grad

    def _compiled_glm(
        self,
        kind: Literal["least_squares", "logistic"],
        y: FloatArray,
        w: FloatArray,
        X: FloatArray,
        rows: int,
    ) -> tuple[float, FloatArray] | None:
        """The least squares or logistic loss and gradient by the compiled kernel, or None without numba.

        ``X`` must be C-contiguous float64 (as :func:`_block_rows` makes sure), ``y`` float64. ``rows`` is
        not used: the kernel works row by row.
        """
        kernel = _compiled.fused_kernel(kind)
        if kernel is None:
            return None
        coef, intercept = self._coef(w)
        n_coef = self._n_features
        grad = np.zeros(self.n_params)
        loss, r_sum = kernel(X, y, np.ascontiguousarray(coef), float(intercept), grad[:n_coef])
        if self._fit_intercept:
            grad[n_coef] = r_sum
        return loss, grad

    def _compiled_csr(
        self, y: FloatArray | NDArray[np.intp], w: FloatArray, X: Any
    ) -> tuple[float, FloatArray] | None:
        """The loss and gradient on CSR rows in one compiled pass over the nonzeros, or None without numba.

        ``y``: float64 targets/labels (least squares, logistic) or intp class labels (softmax). Without
        numba the caller's two-pass path runs, through scipy's sparse products.
        """
        grad = np.zeros(self.n_params)
        d, k = self._n_features, self._n_outputs
        n_coef = d * k
        if self.kind == "softmax":
            softmax = _compiled.sparse_kernel("softmax")
            if softmax is None:
                return None
            W = np.ascontiguousarray(w[:n_coef]).reshape(d, k)
            if self._fit_intercept:
                intercept, grad_b = np.ascontiguousarray(w[n_coef:]), grad[n_coef:]
            else:
                intercept, grad_b = np.zeros(k), np.zeros(k)
            # Blocks of about 64 KiB of Z: in L2 with the W rows they gather, and few kernel-level loops.
            rows = max(1, 8192 // k)
            loss = softmax(
                X, y.astype(np.intp, copy=False), W, intercept, grad[:n_coef].reshape(d, k), grad_b, rows
            )
            return loss, grad
        glm = _compiled.sparse_kernel("logistic" if self.kind == "logistic" else "least_squares")
        if glm is None:
            return None
        coef, b = self._coef(w)
        loss, r_sum = glm(
            X, y.astype(np.float64, copy=False), np.ascontiguousarray(coef), float(b), grad[:n_coef]
        )
        if self._fit_intercept:
            grad[n_coef] = r_sum
        return loss, grad

    def rows_residuals(
        self, w: FloatArray, X: Any, y: NDArray[Any], rows: NDArray[np.int64]
    ) -> tuple[float, FloatArray] | None:
        """The summed loss of rows ``rows`` of CSR ``X`` (targets ``y[rows]``) and each row's residual
        ``dloss/dz``, read straight from the full parameter vector ``w``; None where no compiled pass does it
        (a softmax, numba missing, rows that are not float64 CSR): then narrow the rows and use
        :meth:`loss_and_grad`.

        The gradient is ``X[rows].T @ residuals`` at the coefficients (their sum at the intercept): a
        Downpour step on a wide sparse model adds it into its vectors row by row, so that nothing is
        narrowed or renumbered (issue 29). The loss adds the rows' losses in the order
        :meth:`loss_and_grad` adds them on ``X[rows]``.

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from distbelief.models import LeastSquares
        >>> X = sp.csr_array(np.array([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]]))
        >>> got = LeastSquares(3).rows_residuals(np.ones(4), X, np.array([0.0, 1.0]), np.array([1]))
        >>> got is None or (got[0], got[1].tolist()) == (8.0, [4.0])
        True
        """
        kernel = _compiled.rows_kernel()
        if (
            kernel is None
            or self.kind == "softmax"
            or not _checks.is_sparse(X)
            or X.format != "csr"
            or X.dtype != np.float64
            or X.indptr.dtype != X.indices.dtype
            or X.shape[1] != self._n_features
        ):
            return None
        y_rows = np.asarray(y)[rows]
        logistic = self.kind == "logistic"
        if logistic:
            targets = _checks.binary_labels(y_rows, self._name)
        else:
            targets = np.asarray(_checks.as_targets(y_rows, rows.size, self._name), dtype=np.float64)
        intercept = float(w[self._n_features]) if self._fit_intercept else 0.0
        loss, residuals = kernel(X, rows, targets, w, intercept, logistic)
        if not np.isfinite(loss):
            loss = _checks.diagnose_nonfinite(loss, X[rows], targets, self._name)
        return loss, residuals

    def _compiled_softmax(
        self, labels: NDArray[np.intp], w: FloatArray, X: FloatArray, rows: int
    ) -> tuple[float, FloatArray] | None:
        """The softmax loss and gradient by the compiled kernel in blocks of ``rows`` rows, or None.

        The blocks of the numpy pass (:func:`_block_rows`) are about the best for the compiled pass too.
        100,000 x 500, 1 BLAS thread, medians of 5 interleaved runs, ms (rows per block; * = _block_rows):
          classes   numpy pass   compiled:
          3         75           65: 57    131*: 59
          10        103          65: 84     96: 82     131*: 86
          20        123          65: 112   100*: 106   131: 169 (past the small-GEMM limit)
          50        266          32: 246    40*: 237    65: 306
          100       491          20: 494    65: 516    131*: 470
        """
        kernel = _compiled.fused_kernel("softmax")
        if kernel is None:
            return None
        d, k = self._n_features, self._n_outputs
        n_coef = d * k
        grad = np.zeros(self.n_params)
        W = np.ascontiguousarray(w[:n_coef]).reshape(d, k)
        if self._fit_intercept:
            intercept, grad_b = np.ascontiguousarray(w[n_coef:]), grad[n_coef:]
        else:
            intercept, grad_b = np.zeros(k), np.zeros(k)
        loss = kernel(X, labels, W, intercept, grad[:n_coef].reshape(d, k), grad_b, rows)
        return loss, grad

    def _weighted_or_csr(
        self,
        w: FloatArray,
        X: Any,
        y: FloatArray | NDArray[np.intp],
        sample_weight: ArrayLike | None,
        per_row: Callable[[FloatArray], tuple[FloatArray, FloatArray]],
    ) -> tuple[float, FloatArray] | None:
        """:meth:`_weighted` with ``sample_weight``, else :meth:`_compiled_csr` on CSR rows, else None (then
        the fused or two-pass numpy path)."""
        if sample_weight is not None:
            return self._weighted(w, X, sample_weight, per_row)
        return self._compiled_csr(y, w, X) if _checks.is_sparse(X) else None

    def _weighted(
        self,
        w: FloatArray,
        X: Any,
        sample_weight: ArrayLike,
        per_row: Callable[[FloatArray], tuple[FloatArray, FloatArray]],
    ) -> tuple[float, FloatArray]:
        """``sum_i s_i loss_i`` and its gradient ``[X.T @ (s * R), sum(s * R)]`` (per-row weights ``s``).

        One two-pass evaluation for every model (dense or CSR rows): the model's ``per_row(Z)`` turns
        ``Z = X @ coef + b`` (its own buffer, which it may overwrite) into every row's loss and residual
        ``dloss_i/dZ_i``, and the residual rows are scaled by their weights. Weighted fits do not take the
        fused or compiled passes: those sum the losses inside the kernels, and a weight is one multiply
        per row here, next to a product over the row's features.
        """
        s = _checks.as_weights(sample_weight, X.shape[0], self._name)
        losses, R = per_row(self._product(w, X))
        R *= s if R.ndim == 1 else s[:, None]
        return float(s @ losses), self._grad_from_residual(X, R)

    def _grad_from_residual(self, X: FloatArray, R: FloatArray) -> FloatArray:
        """Gradient ``[X.T @ R, sum(R)]`` written straight into one flat vector (no concatenation)."""
        k = self._n_outputs
        n_coef = self._n_features * k
        grad = np.empty(self.n_params)
        if _checks.is_sparse(X):
            grad[:n_coef] = (X.T @ R).reshape(-1)  # scipy: no out=, and X.T of a CSR is a CSC view
        elif k == 1:
            np.matmul(R, X, out=grad[:n_coef])
        else:
            np.matmul(X.T, R, out=grad[:n_coef].reshape(self._n_features, k))
        if self._fit_intercept:
            if k == 1:
                grad[n_coef] = R.sum()
            else:  # column sums as a BLAS product: several times faster than R.sum(axis=0)
                np.matmul(np.ones(R.shape[0]), R, out=grad[n_coef:])
        return grad

    def _spec_fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "n_features": self._n_features, "fit_intercept": self._fit_intercept}


class _OneOutput(_Linear):
    """A linear model with one output (:class:`LeastSquares`, :class:`Logistic`): one constructor."""

    def __init__(self, n_features: int, *, fit_intercept: bool = True) -> None:
        spec = validate_spec({"kind": self.kind, "n_features": n_features, "fit_intercept": fit_intercept})
        assert isinstance(spec, LeastSquaresSpec | LogisticSpec)
        super().__init__(spec.n_features, spec.fit_intercept, 1)

    @property
    def spec(self) -> dict[str, Any]:
        """``{"kind": ..., "n_features": ..., "fit_intercept": ...}``."""
        return self._spec_fields()


class LeastSquares(_OneOutput):
    """Linear least squares: ``loss_i = 0.5 * (x_i . coef + b - y_i) ** 2``.

    Parameter layout: ``w = [coef (n_features), b]`` (``b`` only when ``fit_intercept``).

    Parameters
    ----------
    n_features : int
        Number of input features (>= 1).
    fit_intercept : bool, optional
        Learn an intercept ``b`` (the last parameter). Default True.

    Raises
    ------
    distbelief.errors.ModelSpecError
        If a size is not a positive integer or ``fit_intercept`` is not a bool.

    Examples
    --------
    >>> import numpy as np
    >>> m = LeastSquares(2)
    >>> w = np.array([1.0, -1.0, 0.5])  # coef, then intercept
    >>> m.loss_and_grad(w, np.array([[1.0, 1.0]]), np.array([0.0]))
    (0.125, array([0.5, 0.5, 0.5]))
    >>> m.predict(w, np.array([[2.0, 1.0]]))
    array([1.5])
    """

    kind: ClassVar[str] = "least_squares"
    label_kind: ClassVar[LabelKind] = "real"
    _name: ClassVar[str] = "least squares"

    @property
    def n_classes(self) -> None:
        """None: the targets are real numbers."""
        return None

    def loss_and_grad(
        self, w: ArrayLike, X: ArrayLike, y: ArrayLike, *, sample_weight: ArrayLike | None = None
    ) -> tuple[float, FloatArray]:
        """Summed squared-error loss over the rows and its gradient.

        Parameters
        ----------
        w, X, sample_weight
            As in :meth:`Model.loss_and_grad`.
        y : array_like, shape (n_rows,)
            Real targets.

        Returns
        -------
        loss : float
            ``sum_i 0.5 * r_i ** 2`` with ``r = X @ coef + b - y`` (a sum, not a mean; no regularizer).
        grad : ndarray, shape (n_params,)
            ``[X.T @ r, sum(r)]``.

        Examples
        --------
        >>> import numpy as np
        >>> LeastSquares(1, fit_intercept=False).loss_and_grad([2.0], [[1.0], [3.0]], [0.0, 0.0])
        (20.0, array([20.]))
        """
        w_arr, X_arr = self._checked(w, X)
        rows = _block_rows(X_arr, 1)
        y_arr = np.asarray(_checks.as_targets(y, X_arr.shape[0], self._name), dtype=np.float64)
        compiled = self._weighted_or_csr(w_arr, X_arr, y_arr, sample_weight, partial(_squares_rows, y_arr))
        if compiled is not None:
            loss, grad = compiled
        elif rows:
            r = np.empty(X_arr.shape[0])

            def residual_(z_b: FloatArray, start: int, stop: int) -> tuple[FloatArray, float]:
                z_b -= y_arr[start:stop]
                return z_b, 0.0  # the loss is taken on all of r after the pass, as in the two-pass path

            fused = _FusedLoss(
                residual_,
                compiled=partial(self._compiled_glm, "least_squares", y_arr),
                total=lambda _: 0.5 * float(r @ r),
            )
            loss, grad = self._fused_pass(w_arr, X_arr, rows, fused, r)
        else:
            r = self._product(w_arr, X_arr)
            r -= y_arr
            loss = 0.5 * float(r @ r)
            grad = self._grad_from_residual(X_arr, r)
        if not np.isfinite(loss):
            loss = _checks.diagnose_nonfinite(loss, X_arr, y_arr, self._name)
        return loss, grad

    def predict(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """Predicted real values ``X @ coef + b``, shape (n_rows,).

        Examples
        --------
        >>> LeastSquares(1).predict([2.0, 1.0], [[1.0], [0.0]])
        array([3., 1.])
        """
        return self._linear(w, X)[1]


class Logistic(_OneOutput, ClassifierBase):
    """Binary logistic regression on labels 0/1.

    ``z_i = x_i . coef + b``, ``P(y_i = 1) = 1 / (1 + exp(-z_i))`` and
    ``loss_i = log(1 + exp(-s_i z_i))`` with ``s_i = 2 y_i - 1``, evaluated stably with ``logaddexp``.
    Parameter layout, parameters and errors: as :class:`LeastSquares`.

    Examples
    --------
    >>> import numpy as np
    >>> m = Logistic(1)
    >>> X, y = np.array([[-1.0], [1.0]]), np.array([0, 1])
    >>> loss, grad = m.loss_and_grad(np.zeros(2), X, y)
    >>> round(loss, 6), grad
    (1.386294, array([-1.,  0.]))
    >>> m.predict([3.0, 0.0], X), m.accuracy([3.0, 0.0], X, y)
    (array([0, 1]), 1.0)
    """

    kind: ClassVar[str] = "logistic"
    label_kind: ClassVar[LabelKind] = "binary"
    _name: ClassVar[str] = "logistic regression"

    @property
    def n_classes(self) -> int:
        """2 (labels 0 and 1)."""
        return 2

    def loss_and_grad(
        self, w: ArrayLike, X: ArrayLike, y: ArrayLike, *, sample_weight: ArrayLike | None = None
    ) -> tuple[float, FloatArray]:
        """Summed logistic loss over the rows and its gradient.

        Parameters
        ----------
        w, X, sample_weight
            As in :meth:`Model.loss_and_grad`.
        y : array_like, shape (n_rows,)
            Labels 0 or 1 (any numeric or bool dtype).

        Returns
        -------
        loss : float
            ``sum_i log(1 + exp(-(2 y_i - 1) z_i))`` (a sum, not a mean; no regularizer).
        grad : ndarray, shape (n_params,)
            ``[X.T @ r, sum(r)]`` with ``r = sigmoid(z) - y``.

        Raises
        ------
        distbelief.errors.DatasetError
            If a label is not 0 or 1, or shapes do not match.

        Examples
        --------
        >>> loss, grad = Logistic(1, fit_intercept=False).loss_and_grad([0.0], [[2.0]], [1])
        >>> round(loss, 6), grad
        (0.693147, array([-1.]))
        """
        w_arr, X_arr = self._checked(w, X)
        rows = _block_rows(X_arr, 1)
        y_raw = _checks.as_targets(y, X_arr.shape[0], self._name)
        y_arr = _checks.binary_labels(y_raw, self._name)
        # loss_i = log(1 + exp(t_i)) with t_i = (1 - 2 y_i) z_i (the margin form avoids the cancellation of
        # the equivalent log(1 + exp(z)) - y z), evaluated stably by _log1pexp_sum.
        # dloss/dz = sigmoid(z) - y = (1 - 2 y) * sigmoid(t): no cancellation of sigmoid(z) - 1 when y = 1.
        sign = np.multiply(y_arr, -2.0)
        sign += 1.0  # 1 - 2 y: +1 for label 0, -1 for label 1
        compiled = self._weighted_or_csr(w_arr, X_arr, y_arr, sample_weight, partial(_logistic_rows, sign))
        if compiled is not None:
            loss, grad = compiled
        elif rows:
            t = np.empty(X_arr.shape[0])
            r_buf = np.empty(min(rows, X_arr.shape[0]))

            def residual_(z_b: FloatArray, start: int, stop: int) -> tuple[FloatArray, float]:
                sign_b = sign[start:stop]
                t_b = np.multiply(sign_b, z_b, out=z_b)  # kept in t: the loss is taken on all of it after
                r_b = expit(t_b, out=r_buf[: stop - start])
                r_b *= sign_b
                return r_b, 0.0

            # Numpy blocks: the loss on all of t after the pass, rather than per block (6 fewer ufunc calls
            # per block). The compiled kernel takes the same loss row by row.
            fused = _FusedLoss(
                residual_,
                compiled=partial(self._compiled_glm, "logistic", y_arr),
                total=lambda _: _log1pexp_sum(t),
            )
            loss, grad = self._fused_pass(w_arr, X_arr, rows, fused, t)
        else:
            z = self._product(w_arr, X_arr)
            t = np.multiply(sign, z, out=z)  # z itself is not needed again
            loss = _log1pexp_sum(t)
            r = expit(t, out=t)
            r *= sign
            grad = self._grad_from_residual(X_arr, r)
        if not np.isfinite(loss):
            loss = _checks.diagnose_nonfinite(loss, X_arr, y_raw, self._name)
        return loss, grad

    def decision_function(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """The logits ``z = X @ coef + b``, shape (n_rows,).

        Examples
        --------
        >>> Logistic(1).decision_function([2.0, -1.0], [[1.0]])
        array([1.])
        """
        return self._linear(w, X)[1]

    def predict_proba(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """``P(y = 1 | x)`` for every row, shape (n_rows,) (not (n_rows, 2)).

        Examples
        --------
        >>> Logistic(1).predict_proba([0.0, 0.0], [[5.0]])
        array([0.5])
        """
        z = self.decision_function(w, X)
        expit(z, out=z)
        return z

    def predict(self, w: ArrayLike, X: ArrayLike) -> NDArray[np.int64]:
        """Predicted labels 0/1 (int64), 1 where ``P(y = 1 | x) > 0.5``.

        Examples
        --------
        >>> Logistic(1).predict([1.0, 0.0], [[-2.0], [3.0]])
        array([0, 1])
        """
        return (self.decision_function(w, X) > 0).astype(np.int64)


class Softmax(_Linear, ClassifierBase):
    """Multinomial logistic (softmax) regression on class labels ``0..n_classes-1``.

    ``Z = X @ W + b`` with ``W`` of shape (n_features, n_classes); ``loss_i = logsumexp(Z_i) - Z_{i, y_i}``.
    Parameter layout: ``w = [W.ravel() (row-major, n_features * n_classes), b (n_classes)]``, so
    ``W = w[:n_features * n_classes].reshape(n_features, n_classes)`` (``b`` only when ``fit_intercept``).

    Parameters
    ----------
    n_features : int
        Number of input features (>= 1).
    n_classes : int
        Number of classes (>= 2).
    fit_intercept : bool, optional
        Learn one intercept per class (the last ``n_classes`` parameters). Default True.

    Raises
    ------
    distbelief.errors.ModelSpecError
        If a size is out of range or ``fit_intercept`` is not a bool.

    Examples
    --------
    >>> import numpy as np
    >>> m = Softmax(2, 3)
    >>> m.n_params
    9
    >>> loss, grad = m.loss_and_grad(m.init_params(), np.eye(2), np.array([0, 2]))
    >>> bool(np.isclose(loss, 2 * np.log(3)))  # two rows, each uniform over 3 classes
    True
    """

    kind: ClassVar[str] = "softmax"
    label_kind: ClassVar[LabelKind] = "classes"
    _name: ClassVar[str] = "softmax regression"

    def __init__(self, n_features: int, n_classes: int, *, fit_intercept: bool = True) -> None:
        spec = validate_spec(
            {
                "kind": self.kind,
                "n_features": n_features,
                "n_classes": n_classes,
                "fit_intercept": fit_intercept,
            }
        )
        assert isinstance(spec, SoftmaxSpec)
        super().__init__(spec.n_features, spec.fit_intercept, spec.n_classes)

    @property
    def n_classes(self) -> int:
        """Number of classes."""
        return self._n_outputs

    @property
    def spec(self) -> dict[str, Any]:
        """``{"kind": "softmax", "n_features": ..., "n_classes": ..., "fit_intercept": ...}``."""
        fields = self._spec_fields()
        fields["n_classes"] = self._n_outputs
        return fields

    def unpack(self, w: ArrayLike) -> tuple[FloatArray, FloatArray | None]:
        """Views ``(W, b)`` into ``w``: ``W`` of shape (n_features, n_classes), ``b`` (n_classes,) or None.

        Examples
        --------
        >>> import numpy as np
        >>> W, b = Softmax(2, 3).unpack(np.arange(9.0))
        >>> W.shape, b
        ((2, 3), array([6., 7., 8.]))
        """
        w_arr = _checks.as_params(w, self.n_params, self._name)
        n_coef = self._n_features * self._n_outputs
        W = w_arr[:n_coef].reshape(self._n_features, self._n_outputs)
        return W, (w_arr[n_coef:] if self._fit_intercept else None)

    def loss_and_grad(
        self, w: ArrayLike, X: ArrayLike, y: ArrayLike, *, sample_weight: ArrayLike | None = None
    ) -> tuple[float, FloatArray]:
        """Summed cross-entropy over the rows and its gradient.

        Parameters
        ----------
        w, X, sample_weight
            As in :meth:`Model.loss_and_grad`.
        y : array_like, shape (n_rows,)
            Class labels 0..n_classes-1, as integers or integral floats.

        Returns
        -------
        loss : float
            ``sum_i logsumexp(Z_i) - Z_{i, y_i}`` (a sum, not a mean; no regularizer).
        grad : ndarray, shape (n_params,)
            ``[(X.T @ R).ravel(), R.sum(0)]`` with ``R = softmax(Z) - onehot(y)``.

        Raises
        ------
        distbelief.errors.DatasetError
            If a label is not an integer in range, or shapes do not match.

        Examples
        --------
        >>> loss, grad = Softmax(1, 2, fit_intercept=False).loss_and_grad([0.0, 0.0], [[1.0]], [1])
        >>> round(loss, 6), grad
        (0.693147, array([ 0.5, -0.5]))
        """
        w_arr, X_arr = self._checked(w, X)
        rows = _block_rows(X_arr, self._n_outputs)
        y_raw = _checks.as_targets(y, X_arr.shape[0], self._name)
        labels = _checks.class_labels(y_raw, self._n_outputs, self._name)
        compiled = self._weighted_or_csr(
            w_arr, X_arr, labels, sample_weight, partial(softmax_xent_rows, labels)
        )
        if compiled is not None:
            loss, grad = compiled
        elif rows:

            def residual_(Z_b: FloatArray, start: int, stop: int) -> tuple[FloatArray, float]:
                # Z_b is a leading row slice of a C-contiguous buffer, so C-contiguous as softmax_xent_ needs.
                return Z_b, softmax_xent_(Z_b, labels[start:stop])

            fused = _FusedLoss(residual_, compiled=partial(self._compiled_softmax, labels))
            loss, grad = self._fused_pass(w_arr, X_arr, rows, fused)
        else:
            Z = self._product(w_arr, X_arr)
            loss = softmax_xent_(Z, labels)
            grad = self._grad_from_residual(X_arr, Z)
        if not np.isfinite(loss):
            loss = _checks.diagnose_nonfinite(loss, X_arr, y_raw, self._name)
        return loss, grad

    def decision_function(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """The logits ``Z = X @ W + b``, shape (n_rows, n_classes)."""
        return self._linear(w, X)[1]

    _logits = decision_function

    def predict_proba(self, w: ArrayLike, X: ArrayLike) -> FloatArray:
        """Class probabilities ``softmax(Z)``, shape (n_rows, n_classes); each row sums to 1.

        Examples
        --------
        >>> Softmax(1, 2).predict_proba([0.0, 0.0, 0.0, 0.0], [[1.0]])
        array([[0.5, 0.5]])
        """
        return softmax_(self.decision_function(w, X))
