"""Compiled (numba) single-pass kernels for the linear models' loss and gradient on a big ``X``.

Why: when ``X`` is much larger than the CPU cache, ``loss_and_grad`` of a linear model is bound by memory
bandwidth, not by arithmetic. The two-pass form (``Z = X @ coef``, then ``grad = R.T @ X``) reads ``X`` from
memory twice. :meth:`models._linear._Linear._fused_pass` reads it once, in ~512 KiB row blocks, but pays
~10-30 us of Python and ufunc calls per block, which keeps it at ~12 GB/s. The kernels here are that pass
compiled, with no Python per block:

* least squares and logistic regression (:func:`_glm_pass`): row after row, ``z_i = x_i . coef + b``, the
  row's loss and residual ``r_i``, then ``grad += r_i x_i`` while the row is still in the L1 cache. ``X`` is
  read from memory once, as one sequential stream, at about the machine's streaming bandwidth;
* softmax regression (:func:`_softmax_pass`): the row blocks of the numpy pass, with the two products still
  done by BLAS (through numba's ``np.dot``) and the softmax between them compiled, with a vectorizable
  ``exp`` (:func:`_exp_nonpositive`). The gain there is the per-block Python and ufunc overhead.

Least squares and logistic regression, ``loss_and_grad`` on 100,000 x 500 float64 (400 MB), medians of 9,
on the current development machine (2-core AMD EPYC, 2 MiB L2 per core, 32 MiB L3, numba 0.68), one
process alone and two processes at once (as the two workers of a run compute):

=============  =============  =====================  ======================  =========================
model          numpy blocked  compiled, row by row   earlier 4-row kernel    two processes at once
=============  =============  =====================  ======================  =========================
least squares  30.9 ms        15.1-15.5 ms           28.7 ms                 22 ms (4-row: 30.5 ms)
logistic       34.3 ms        17.2-17.5 ms           31.2-31.6 ms            22.5 ms (4-row: 33 ms)
=============  =============  =====================  ======================  =========================

For scale, ``X.sum()`` streams the same 400 MB in 13 ms alone and 23 ms two at once (~31 and ~35 GB/s):
the row-by-row pass reaches the machine's bandwidth when both cores run it. Why rows one at a time: the
earlier kernel took four rows at a time (four dot products in one sweep, reading ``coef`` once for four
rows), which makes four streams 4000 bytes apart, each crossing a 4 KiB page every row, where the L2
stream prefetcher stops; one sequential stream it follows. The alternatives, measured in another run on
the kernels themselves (logistic, one process / two at once, medians of 9): four rows 31.2 / 35.4 ms, two
rows 28.0 / 33.5 ms, blocks of 32 rows (all dot products, then all ``grad`` updates from L2) 24.0 /
26.7 ms, one row 16.5 / 22.6 ms. In the L2 cache the four-row kernel
ran at ~42 GB/s: memory latency, not arithmetic, was its limit.

Softmax, measured earlier on a 2-core Xeon with AVX-512 (2 MiB L2 per core, numba 0.68), 100,000 x 500
float64, one BLAS thread, medians of 7 interleaved runs of ``loss_and_grad`` (the first two rows are that
machine's, with the four-row kernel):

====================  =============  ========  ===============================================
model                 numpy blocked  compiled  notes
====================  =============  ========  ===============================================
least squares         41 ms          32.5 ms   one BLAS ``X @ coef`` alone takes 29 ms
logistic              43 ms          34.5 ms
softmax, 3 classes    75 ms          59 ms
softmax, 10 classes   104 ms         86.5 ms
softmax, 20 classes   124 ms         105 ms
softmax, 50 classes   265 ms         237 ms
softmax, 100 classes  494 ms         470 ms    libm's scalar ``exp`` made it 516 ms: slower
====================  =============  ========  ===============================================

On that Xeon, with the four-row kernel: two threads of one process (as a Dask worker with two threads),
logistic on 2 x 100,000 x 500: 37 ms
compiled against 91 ms for the numpy blocks, whose many short calls serialize on the GIL (least squares:
40 against 103 ms; softmax, 10 classes: 94 against 169 ms). While one thread runs logistic on
200,000 rows, a pure-Python loop in another one (an event loop) stalls for at most 1.3 ms, against 9 ms.

For softmax, compiled matrix products (a micro-kernel of 4 rows x C classes) lost to BLAS:
for 10 classes 152 ms with C = 4 and 91 ms with C = 5, against 86 ms, and LLVM's code for them varies
erratically with the micro-kernel's shape; so the products stay BLAS calls.

Compile time: the first big ``X`` of a process imports numba (~0.2-0.35 s) and compiles the kernels,
~0.8 s (least squares and logistic share one) and ~1.7 s (softmax); with numba's cache filled, the first
call takes ~0.4 s and ~15 ms.

Accuracy: the results equal the two-pass numpy ones up to the order of summation (~1e-14 relative on the
problem above). ``fastmath`` is limited to ``reassoc``, ``contract`` and ``nsz`` (what vectorized sums and
FMAs need): no ``nnan``/``ninf``, so a NaN in ``X`` still makes the loss NaN and an inf makes it non-finite
whenever the numpy pass's is (and :func:`models._checks.diagnose_nonfinite` then explains it); no ``afn``
(approximate libm functions) either. The softmax's own ``exp`` is within 1 ulp of numpy's.

Laziness: numba is imported, and the kernels compiled (or loaded from numba's on-disk cache, ``cache=True``),
only when :func:`fused_kernel` is first called, i.e. when a model first gets an ``X`` big enough for the
fused pass. Small problems (and the test suite's small models) never pay numba's import or compile time.
Without numba (not installed, failing to import or compile, or ``NUMBA_DISABLE_JIT=1``),
:func:`fused_kernel` returns None and the models keep their numpy blocked pass.

The kernels are written as plain Python functions at module level and compiled by :func:`_build`, which
replaces each module global by its compiled dispatcher: the kernels call their helpers through these
globals, and module-level functions (unlike closures) can be cached on disk by numba.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import NDArray

__all__ = ["GLMKernel", "SoftmaxKernel", "fused_kernel", "sparse_kernel"]

logger = logging.getLogger(__name__)

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.intp]

#: ``kernel(X, y, coef, intercept, grad_coef) -> (loss, residual_sum)``, see :func:`fused_kernel`.
GLMKernel = Callable[[FloatArray, FloatArray, FloatArray, float, FloatArray], tuple[float, float]]

#: ``kernel(X, labels, W, intercept, grad_W, grad_b, rows) -> loss``, see :func:`fused_kernel`.
SoftmaxKernel = Callable[[FloatArray, IntArray, FloatArray, FloatArray, FloatArray, FloatArray, int], float]

KernelKind = Literal["least_squares", "logistic", "softmax"]

#: ``fastmath`` flags of the kernels: reassociation lets LLVM vectorize the sums, contraction gives FMAs,
#: ``nsz`` ignores the sign of zero. Not ``nnan``/``ninf`` (NaN/inf must propagate into the loss) nor ``afn``.
_FASTMATH: set[str] = {"reassoc", "contract", "nsz"}

#: ``2 ** -i`` for ``i = 0..1099`` (0.0 past ``2 ** -1074``, the smallest subnormal): the scale factors of
#: :func:`_exp_nonpositive`, looked up rather than built from bits (numba has no scalar bit cast).
_POW2_NEG: FloatArray = np.ldexp(1.0, -np.arange(1100))

_LOG2E = 1.4426950408889634
#: ``log(2)`` split for Cody-Waite range reduction (fdlibm's ``ln2HI``/``ln2LO``): ``k * _LN2_HI`` is exact.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
#: Taylor coefficients ``1 / i!`` of ``exp`` on ``|r| <= log(2) / 2``; the degree-13 remainder is < 1e-17.
_E2, _E3, _E4, _E5, _E6, _E7 = 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040
_E8, _E9, _E10, _E11 = 1 / 40320, 1 / 362880, 1 / 3628800, 1 / 39916800
_E12, _E13 = 1 / 479001600, 1 / 6227020800


# ----------------------------------------------------------------------------------------------------------
# Kernels: plain Python here; _build() compiles them with numba and rebinds these names to the dispatchers.
# ----------------------------------------------------------------------------------------------------------


def _glm_row(z: float, y: float, logistic: bool) -> tuple[float, float]:
    """Loss and residual ``dloss/dz`` of one row of least squares or logistic regression.

    Least squares: ``r = z - y``, loss ``r ** 2 / 2``. Logistic (labels 0/1), in the margin form of the numpy
    path: ``t = s z`` with ``s = 1 - 2 y``, loss ``max(t, 0) + log1p(exp(-|t|))`` (never overflows), and
    ``r = sigmoid(z) - y = s * sigmoid(t)`` (no cancellation of ``sigmoid(z) - 1`` for label 1).

    Examples
    --------
    >>> _glm_row(3.0, 1.0, False)
    (2.0, 2.0)
    >>> loss, r = _glm_row(0.0, 1.0, True)
    >>> round(float(loss), 6), float(r)
    (0.693147, -0.5)
    """
    if logistic:
        s = 1.0 - 2.0 * y
        t = s * z
        e = np.exp(-abs(t))
        if t > 0.0:
            return t + np.log1p(e), s / (1.0 + e)
        return np.log1p(e), s * e / (1.0 + e)
    r = z - y
    return 0.5 * r * r, r


def _glm_pass(
    X: FloatArray, y: FloatArray, coef: FloatArray, intercept: float, grad: FloatArray, logistic: bool
) -> tuple[float, float]:
    """Summed loss of least squares or logistic regression over the rows of ``X``, in one pass.

    Row after row: its dot product with ``coef``, its loss and residual ``r_i`` (:func:`_glm_row`), then
    ``grad += r_i x_i`` while the row (4 KB at 500 features) is still in the L1 cache. Memory is read as
    one sequential stream, which the hardware prefetcher follows; see the module docstring for why this
    beats interleaving several rows.

    Parameters
    ----------
    X : ndarray, shape (n, d), C-contiguous float64
    y : ndarray, shape (n,)
        Targets (least squares) or 0/1 labels (logistic).
    coef : ndarray, shape (d,), C-contiguous
    intercept : float
        Added to every ``z_i`` (0.0 for no intercept).
    grad : ndarray, shape (d,), C-contiguous
        ``X.T @ r`` is *added* to it.
    logistic : bool
        Logistic regression, else least squares.

    Returns
    -------
    loss : float
        ``sum_i loss_i``.
    residual_sum : float
        ``sum_i r_i``: the gradient in the intercept.
    """
    n, d = X.shape
    loss = 0.0
    r_sum = 0.0
    for i in range(n):
        xi = X[i]
        z = 0.0
        for j in range(d):
            z += xi[j] * coef[j]
        li, ri = _glm_row(z + intercept, y[i], logistic)
        loss += li
        r_sum += ri
        for j in range(d):
            grad[j] += ri * xi[j]
    return loss, r_sum


def _exp_nonpositive(x: float) -> float:
    """``exp(x)`` for ``x <= 0`` (or NaN), in a form LLVM vectorizes (libm's ``exp`` is a scalar call).

    Cody-Waite reduction ``x = k log(2) + r`` with ``|r| <= log(2) / 2``, the degree-13 Taylor polynomial
    of ``exp(r)``, and ``2 ** k`` from a table. Within 1 ulp of ``np.exp`` for normal results (measured
    on 1e6 points), exact at 0, subnormal results within one subnormal step, 0 below ~-745.1, NaN for NaN;
    about 1.2 ns a value against ~6 ns for libm's. For ``x > 0`` the result is wrong (``exp(0)``'s scale),
    never an out-of-bounds read. Compiled without ``reassoc``, which would undo the reduction.

    Examples
    --------
    >>> float(_exp_nonpositive(0.0)), float(np.float64(_exp_nonpositive(-1.0)) / np.exp(-1.0))
    (1.0, 1.0)
    """
    xc = x if x > -746.0 else -746.0  # NaN -> -746 too, so that the table index stays defined
    xc = xc if xc < 0.0 else 0.0
    kf = np.floor(xc * _LOG2E + 0.5)
    r = (xc - kf * _LN2_HI) - kf * _LN2_LO
    p = _E13 * r + _E12
    p = p * r + _E11
    p = p * r + _E10
    p = p * r + _E9
    p = p * r + _E8
    p = p * r + _E7
    p = p * r + _E6
    p = p * r + _E5
    p = p * r + _E4
    p = p * r + _E3
    p = p * r + _E2
    p = p * r + 1.0
    p = p * r + 1.0
    e = p * _POW2_NEG[-int(kf)]
    return e if x == x else x


def _softmax_block(
    Z: FloatArray,
    flat: FloatArray,
    labels: IntArray,
    intercept: FloatArray,
    grad_b: FloatArray,
    top: IntArray,
) -> float:
    """Summed cross-entropy of the rows of ``Z + intercept``; overwrites ``Z`` with the residual.

    The same formula as :func:`models._linear.softmax_xent_`: with ``m = max_c z_c`` (at ``c = a``),
    ``loss = log1p(sum_{c != a} exp(z_c - m)) - (z_y - m)``, and the label entry of the residual
    ``softmax(z) - onehot(y)`` formed as ``-sum_{c != y} p_c``. ``sum(residual)`` of every row is added to
    ``grad_b``. The exponentials of the whole block are taken in one vectorized loop over ``flat``, which
    is ``Z``'s memory as a 1-D array (LLVM does not vectorize that loop over ``Z.reshape(-1)`` made here);
    ``top`` is scratch space for ``len(Z)`` indices.
    """
    rows, k = Z.shape
    loss = 0.0
    for i in range(rows):
        z = Z[i]
        for c in range(k):
            z[c] += intercept[c]
        a = 0
        m = z[0]
        for c in range(1, k):
            if z[c] > m:
                m = z[c]
                a = c
        top[i] = a
        loss -= z[labels[i]] - m
        for c in range(k):
            z[c] -= m  # the largest entry becomes exactly 0
    for t in range(rows * k):
        flat[t] = _exp_nonpositive(flat[t])
    for i in range(rows):
        z = Z[i]
        a = top[i]
        z[a] = 0.0
        total = 0.0  # sum of the exponentials other than the largest (which is exactly 1)
        for c in range(k):
            total += z[c]
        loss += np.log1p(total)
        z[a] = 1.0
        inv = 1.0 / (1.0 + total)
        for c in range(k):
            z[c] *= inv
        y = labels[i]
        z[y] = 0.0
        others = 0.0
        for c in range(k):
            others += z[c]
        z[y] = -others
        for c in range(k):
            grad_b[c] += z[c]
    return loss


def _softmax_pass(
    X: FloatArray,
    labels: IntArray,
    W: FloatArray,
    intercept: FloatArray,
    grad_W: FloatArray,
    grad_b: FloatArray,
    rows: int,
) -> float:
    """Summed softmax cross-entropy over the rows of ``X``, in one pass of blocks of ``rows`` rows.

    Per block: ``Z_b = X_b @ W`` (BLAS), :func:`_softmax_block`, ``grad_W += X_b.T @ Z_b`` (BLAS, while
    ``X_b`` is in cache). Parameters as :func:`fused_kernel`'s softmax kernel.
    """
    n, d = X.shape
    k = W.shape[1]
    step = max(1, min(rows, n))
    flat = np.empty(step * k)
    Z = flat.reshape(step, k)
    part = np.empty((d, k))
    top = np.empty(step, np.intp)
    loss = 0.0
    for start in range(0, n, step):
        stop = min(start + step, n)
        X_b = X[start:stop]
        Z_b = Z[: stop - start]
        np.dot(X_b, W, Z_b)
        loss += _softmax_block(Z_b, flat, labels[start:stop], intercept, grad_b, top)
        np.dot(X_b.T, Z_b, part)
        grad_W += part
    return loss


def _glm_csr_pass(
    indptr: IntArray,
    indices: IntArray,
    data: FloatArray,
    y: FloatArray,
    coef: FloatArray,
    intercept: float,
    grad: FloatArray,
    logistic: bool,
    fused: bool,
) -> tuple[float, float]:
    """:func:`_glm_pass` on CSR rows: the loss and the gradient from the nonzeros, in one or two sweeps.

    Row ``i``'s nonzeros ``indptr[i]:indptr[i + 1]`` give ``z_i`` (a gather from ``coef``), then its loss and
    residual (:func:`_glm_row`), then ``grad[indices] += r_i * data`` (a scatter). ``fused``: the scatter
    follows each row's gather while its nonzeros are in the L1 cache (one sweep over the nonzeros). Else
    all gathers first (residuals kept, 8 bytes a row), then all scatters: the nonzeros are read twice, but
    each sweep's random accesses touch one vector instead of two, which wins once ``coef`` and ``grad`` no
    longer fit in the cache together (see :func:`sparse_kernel`). The indices are unsigned (views of
    scipy's), which spares numba's negative-index wraparound on every access (2.5x on the gather).
    Duplicate columns in a row add up, as in scipy.
    """
    n = indptr.shape[0] - 1
    loss = 0.0
    r_sum = 0.0
    if fused:
        for i in range(n):
            a, b = indptr[i], indptr[i + 1]
            z = 0.0
            for t in range(a, b):
                z += data[t] * coef[indices[t]]
            li, ri = _glm_row(z + intercept, y[i], logistic)
            loss += li
            r_sum += ri
            for t in range(a, b):
                grad[indices[t]] += ri * data[t]
        return loss, r_sum
    r = np.empty(n)
    for i in range(n):
        z = 0.0
        for t in range(indptr[i], indptr[i + 1]):
            z += data[t] * coef[indices[t]]
        li, ri = _glm_row(z + intercept, y[i], logistic)
        loss += li
        r_sum += ri
        r[i] = ri
    for i in range(n):
        ri = r[i]
        for t in range(indptr[i], indptr[i + 1]):
            grad[indices[t]] += ri * data[t]
    return loss, r_sum


def _glm_rows_pass(
    indptr: IntArray,
    indices: IntArray,
    data: FloatArray,
    rows: IntArray,
    y: FloatArray,
    coef: FloatArray,
    intercept: float,
    residuals: FloatArray,
    logistic: bool,
) -> float:
    """The summed loss of least squares or logistic regression over rows ``rows`` of a CSR matrix (target
    ``y[i]`` for row ``rows[i]``), each row's residual ``dloss/dz`` written to ``residuals[i]``.

    ``z`` gathers straight from the full-width ``coef``: nothing is narrowed. The gradient is
    ``X[rows].T @ residuals`` (and their sum for the intercept); a Downpour step on a wide model adds it
    into its vectors row by row (``storage.internal.accrue_rows``, issue 29), so that no pass numbers the
    columns the rows touch.
    """
    loss = 0.0
    for i in range(rows.shape[0]):
        row = rows[i]
        z = 0.0
        for t in range(indptr[row], indptr[row + 1]):
            z += data[t] * coef[indices[t]]
        li, ri = _glm_row(z + intercept, y[i], logistic)
        loss += li
        residuals[i] = ri
    return loss


def _softmax_csr_pass(
    indptr: IntArray,
    indices: IntArray,
    data: FloatArray,
    labels: IntArray,
    W: FloatArray,
    intercept: FloatArray,
    grad_W: FloatArray,
    grad_b: FloatArray,
    rows: int,
) -> float:
    """:func:`_softmax_pass` on CSR rows, in blocks of ``rows`` rows.

    Per block: ``Z_b = X_b @ W`` by gathering the rows ``W[j]`` of the nonzeros' columns, the softmax of
    :func:`_softmax_block` (the same arithmetic as the dense kernel), then ``grad_W[j] += x_ij * R_i`` by
    scattering into the same rows. Parameters as :func:`fused_kernel`'s softmax kernel, with ``X`` as
    ``(indptr, indices, data)``.
    """
    n = indptr.shape[0] - 1
    k = W.shape[1]
    step = max(1, min(rows, n))
    flat = np.empty(step * k)
    Z = flat.reshape(step, k)
    top = np.empty(step, np.intp)
    loss = 0.0
    for start in range(0, n, step):
        stop = min(start + step, n)
        Z_b = Z[: stop - start]
        for i in range(stop - start):
            z = Z_b[i]
            z[:] = 0.0
            for t in range(indptr[start + i], indptr[start + i + 1]):
                v = data[t]
                w_row = W[indices[t]]
                for c in range(k):
                    z[c] += v * w_row[c]
        loss += _softmax_block(Z_b, flat, labels[start:stop], intercept, grad_b, top)
        for i in range(stop - start):
            z = Z_b[i]
            for t in range(indptr[start + i], indptr[start + i + 1]):
                v = data[t]
                g_row = grad_W[indices[t]]
                for c in range(k):
                    g_row[c] += v * z[c]
    return loss


# ----------------------------------------------------------------------------------------------------------
# Compilation
# ----------------------------------------------------------------------------------------------------------

#: The plain Python kernels, by name, before _build() rebinds the module globals to dispatchers.
_PY_FUNCS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        _glm_row,
        _glm_pass,
        _exp_nonpositive,
        _softmax_block,
        _softmax_pass,
        _glm_csr_pass,
        _glm_rows_pass,
        _softmax_csr_pass,
    )
}

_lock = threading.Lock()
#: Built kernels by family ("glm", "softmax", "glm_csr", "glm_rows", "softmax_csr"); None once building
#: failed or numba is unavailable.
_built: dict[str, Any] = {}


def _import_numba() -> Any | None:
    """The numba module, or None if it is missing, fails to import or is disabled (``NUMBA_DISABLE_JIT``)."""
    try:
        import numba
    except Exception as exc:  # ImportError, or e.g. a numba built for another numpy
        logger.info("numba is not usable (%s); the linear models use their numpy blocked pass", exc)
        return None
    if getattr(numba.config, "DISABLE_JIT", False):  # the "kernels" would run as pure Python: far too slow
        return None
    return numba


def _jit(nb: Any, name: str, signature: Any = None, *, cache: bool, fastmath: Any = None) -> Any:
    """Compile the plain kernel ``name`` and rebind the module global of that name to the dispatcher."""
    options: dict[str, Any] = {
        "nogil": True,
        "cache": cache,
        "boundscheck": False,
        "error_model": "numpy",
        "fastmath": _FASTMATH if fastmath is None else fastmath,
    }
    py_func = _PY_FUNCS[name]
    if signature is None and hasattr(globals()[name], "py_func"):
        return globals()[name]  # a helper another family already compiled
    jit = nb.njit(signature, **options) if signature is not None else nb.njit(**options)
    dispatcher = jit(py_func)
    globals()[name] = dispatcher
    return dispatcher


def _build(nb: Any, family: str, cache: bool) -> Any:
    """Compile (or load from numba's cache) the kernels of ``family``; returns the top-level dispatcher.

    The top-level kernels get explicit signatures, so they are compiled here, once, and calls with other
    types (say a strided ``X``, or float32) raise TypeError instead of compiling again.
    """
    f8, i8, array = nb.float64, nb.intp, nb.types.Array

    def given(dtype: Any, ndim: int, layout: str) -> Any:
        # Read-only (a writeable array converts to it), so that read-only inputs (e.g. X deserialized from
        # a buffer by a Dask worker) are taken as they are, by the one compiled version.
        return array(dtype, ndim, layout, readonly=True)

    if family == "glm_rows":
        _jit(nb, "_glm_row", cache=cache)
        sigs = [
            f8(
                given(it, 1, "C"), given(it, 1, "C"), given(f8, 1, "C"), given(nb.int64, 1, "C"),
                given(f8, 1, "A"), given(f8, 1, "A"), f8, f8[::1], nb.boolean,
            )
            for it in (nb.uint32, nb.uint64)
        ]  # fmt: skip
        return _jit(nb, "_glm_rows_pass", sigs, cache=cache)
    if family in ("glm_csr", "softmax_csr"):
        # One version for 32-bit and one for 64-bit indices (scipy picks int32 while they fit), unsigned.
        if family == "glm_csr":
            _jit(nb, "_glm_row", cache=cache)
            sigs = [
                nb.types.Tuple((f8, f8))(
                    given(it, 1, "C"), given(it, 1, "C"), given(f8, 1, "C"), given(f8, 1, "A"),
                    given(f8, 1, "C"), f8, f8[::1], nb.boolean, nb.boolean,
                )
                for it in (nb.uint32, nb.uint64)
            ]  # fmt: skip
            return _jit(nb, "_glm_csr_pass", sigs, cache=cache)
        _jit(nb, "_exp_nonpositive", cache=cache, fastmath={"contract"})
        _jit(nb, "_softmax_block", cache=cache)
        sigs = [
            f8(
                given(it, 1, "C"), given(it, 1, "C"), given(f8, 1, "C"), given(i8, 1, "A"), given(f8, 2, "C"),
                given(f8, 1, "C"), f8[:, ::1], f8[::1], i8,
            )
            for it in (nb.uint32, nb.uint64)
        ]  # fmt: skip
        return _jit(nb, "_softmax_csr_pass", sigs, cache=cache)
    if family == "glm":
        _jit(nb, "_glm_row", cache=cache)
        signature = nb.types.Tuple((f8, f8))(
            given(f8, 2, "C"), given(f8, 1, "A"), given(f8, 1, "C"), f8, f8[::1], nb.boolean
        )
        return _jit(nb, "_glm_pass", signature, cache=cache)
    # Only contraction (FMAs): reassociation would undo the Cody-Waite reduction (200+ ulp errors).
    _jit(nb, "_exp_nonpositive", cache=cache, fastmath={"contract"})
    _jit(nb, "_softmax_block", cache=cache)
    signature = f8(
        given(f8, 2, "C"), given(i8, 1, "A"), given(f8, 2, "C"), given(f8, 1, "C"), f8[:, ::1], f8[::1], i8
    )
    return _jit(nb, "_softmax_pass", signature, cache=cache)


def _forget_compiled_helpers() -> None:
    """Rebind the module globals :func:`_jit` bound to dispatchers back to the plain functions, so that an
    uncached build compiles its helpers anew (a cached helper would load the same failing entry)."""
    for name, fn in _PY_FUNCS.items():
        if hasattr(globals()[name], "py_func"):
            globals()[name] = fn


def _family_kernel(family: str) -> Any | None:
    """The compiled top-level kernel of ``family``, built on first use (thread-safe), or None."""
    if family in _built:
        return _built[family]
    with _lock:
        if family in _built:
            return _built[family]
        kernel = None
        nb = _import_numba()
        if nb is not None:
            start = time.perf_counter()
            try:
                try:
                    kernel = _build(nb, family, cache=True)
                except Exception as exc:
                    # No writable cache directory (RuntimeError), or a cache entry this file wrote while
                    # imported under another name (``models._compiled`` from a checkout's root, where the
                    # package's folders sit beside ``distbelief/``): loading it imports that name, which a
                    # worker may not have (ModuleNotFoundError; every linear model then took the numpy
                    # pass, at half the speed). Compile in this process instead.
                    logger.info("numba cannot cache the %s kernels (%r); compiling uncached", family, exc)
                    _forget_compiled_helpers()
                    kernel = _build(nb, family, cache=False)
            except Exception as exc:
                warnings.warn(
                    f"compiling the {family} kernels with numba failed ({exc!r}); "
                    "the linear models fall back to their (slower) numpy blocked pass",
                    RuntimeWarning,
                    stacklevel=3,
                )
                kernel = None
            logger.debug("numba %s kernels ready in %.2f s", family, time.perf_counter() - start)
        _built[family] = kernel
        return kernel


def _glm_caller(glm: Any, logistic: bool, *, csr: bool) -> Any:
    """The compiled least squares / logistic pass ``glm`` called as :func:`fused_kernel` and
    :func:`sparse_kernel` document: ``kernel(X, y, coef, intercept, grad_coef) -> (loss, residual_sum)``."""

    def kernel(
        X: Any, y: FloatArray, coef: FloatArray, intercept: float, grad_coef: FloatArray
    ) -> tuple[float, float]:
        if csr:
            indptr, indices = _unsigned(X)
            fused = 16 * coef.shape[0] <= _CSR_FUSED_MAX_BYTES
            loss, r_sum = glm(indptr, indices, X.data, y, coef, intercept, grad_coef, logistic, fused)
        else:
            loss, r_sum = glm(X, y, coef, intercept, grad_coef, logistic)
        return float(loss), float(r_sum)

    return kernel


@overload
def fused_kernel(kind: Literal["least_squares", "logistic"]) -> GLMKernel | None: ...


@overload
def fused_kernel(kind: Literal["softmax"]) -> SoftmaxKernel | None: ...


def fused_kernel(kind: KernelKind) -> GLMKernel | SoftmaxKernel | None:
    """The compiled single-pass loss-and-gradient kernel of a linear model, or None without numba.

    The first call for a kind imports numba and compiles the kernel, or loads it from numba's on-disk
    cache (``__pycache__`` next to this file, or the user cache directory); the kernels release the GIL.

    Parameters
    ----------
    kind : {"least_squares", "logistic", "softmax"}
        The model's ``kind``.

    Returns
    -------
    callable or None
        None when numba is not installed, fails to import or to compile, or ``NUMBA_DISABLE_JIT`` is set.
        Otherwise, for ``"least_squares"`` and ``"logistic"``:
        ``kernel(X, y, coef, intercept, grad_coef) -> (loss, residual_sum)`` with ``X`` a C-contiguous
        float64 array (n, d), ``y`` the float64 targets or 0/1 labels (n,), ``coef`` (d,) C-contiguous,
        ``intercept`` a float (0.0 for none), and ``X.T @ r`` *added* to ``grad_coef`` (d,); ``loss`` is
        ``sum_i loss_i`` and ``residual_sum`` is ``sum_i r_i`` (the intercept's gradient), with
        ``z = X @ coef + intercept`` and ``r = z - y`` (loss ``r ** 2 / 2``) or ``r = sigmoid(z) - y``
        (logistic loss). For ``"softmax"``:
        ``kernel(X, labels, W, intercept, grad_W, grad_b, rows) -> loss`` with ``labels`` intp (n,),
        ``W`` (d, k) and ``intercept`` (k,) C-contiguous (zeros for none), ``X.T @ R`` added to ``grad_W``
        (d, k) and ``sum(R, axis=0)`` to ``grad_b`` (k,), for ``R = softmax(Z) - onehot(labels)``; ``X`` is
        processed in blocks of ``rows`` rows (``models._linear._block_rows`` chooses them).

    Raises
    ------
    ValueError
        If ``kind`` is not one of the three.

    Examples
    --------
    >>> import numpy as np
    >>> kernel = fused_kernel("least_squares")
    >>> X, y, grad = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([1.0, 0.0]), np.zeros(2)
    >>> if kernel is not None:  # numba is installed
    ...     loss, r_sum = kernel(X, y, np.array([1.0, 0.0]), 0.5, grad)
    ...     assert (loss, r_sum) == (6.25, 4.0) and grad.tolist() == [11.0, 15.0]
    >>> kernel = fused_kernel("softmax")
    >>> grad_W, grad_b = np.zeros((2, 3)), np.zeros(3)
    >>> if kernel is not None:
    ...     loss = kernel(X, np.array([0, 2]), np.zeros((2, 3)), np.zeros(3), grad_W, grad_b, 64)
    ...     assert np.isclose(loss, 2 * np.log(3)) and np.allclose(grad_b, [-1 / 3, 2 / 3, -1 / 3])
    """
    if kind in ("least_squares", "logistic"):
        glm = _family_kernel("glm")
        return None if glm is None else _glm_caller(glm, kind == "logistic", csr=False)
    if kind == "softmax":
        softmax: SoftmaxKernel | None = _family_kernel("softmax")
        return softmax
    raise ValueError(f"no compiled kernel for model kind {kind!r}; expected least_squares, logistic, softmax")


#: The CSR least squares / logistic kernel sweeps the nonzeros once while ``coef`` and ``grad`` take at most
#: this many bytes together (2**17 features), else twice (see :func:`sparse_kernel`).
_CSR_FUSED_MAX_BYTES = 2 << 20


def _unsigned(X: Any) -> tuple[IntArray, IntArray]:
    """``X.indptr`` and ``X.indices`` viewed as unsigned (no copy): numba skips wraparound checks then."""
    kind = {4: np.uint32, 8: np.uint64}[X.indices.dtype.itemsize]
    # A view where the widths agree (astype with copy=False still copies to another dtype: a whole
    # segment's indptr a Downpour step, when a step passes only some of its rows).
    width = X.indices.dtype.itemsize
    indptr = X.indptr.view(kind) if X.indptr.dtype.itemsize == width else X.indptr.astype(kind)
    return indptr, X.indices.view(kind)


#: ``kernel(X, y, coef, intercept, grad_coef) -> (loss, residual_sum)`` with ``X`` a CSR matrix.
CSRGLMKernel = Callable[[Any, FloatArray, FloatArray, float, FloatArray], tuple[float, float]]
#: ``kernel(X, labels, W, intercept, grad_W, grad_b, rows) -> loss`` with ``X`` a CSR matrix.
CSRSoftmaxKernel = Callable[[Any, IntArray, FloatArray, FloatArray, FloatArray, FloatArray, int], float]


#: ``kernel(X, rows, y, coef, intercept, logistic) -> (loss, residuals)``.
RowsKernel = Callable[[Any, IntArray, FloatArray, FloatArray, float, bool], tuple[float, FloatArray]]


def rows_kernel() -> RowsKernel | None:
    """The compiled least squares / logistic pass over chosen rows of a CSR matrix that gives their summed
    loss and each row's residual (:func:`_glm_rows_pass`), or None without numba.

    ``kernel(X, rows, y, coef, intercept, logistic)``: ``y`` the rows' float64 targets (``y[i]`` of row
    ``rows[i]``), ``coef`` the full-width coefficients. The gradient is ``X[rows].T @ residuals``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> kernel = rows_kernel()
    >>> X = sp.csr_array(np.array([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]]))
    >>> if kernel is not None:  # numba is installed
    ...     loss, r = kernel(X, np.array([1]), np.array([1.0]), np.ones(3), 0.0, False)
    ...     assert (loss, r.tolist()) == (4.5, [3.0])
    """
    glm = _family_kernel("glm_rows")
    if glm is None:
        return None

    def kernel(
        X: Any, rows: IntArray, y: FloatArray, coef: FloatArray, intercept: float, logistic: bool
    ) -> tuple[float, FloatArray]:
        indptr, indices = _unsigned(X)
        residuals = np.empty(rows.size)
        loss = glm(indptr, indices, X.data, rows, y, coef, intercept, residuals, logistic)
        return float(loss), residuals

    return kernel


@overload
def sparse_kernel(kind: Literal["least_squares", "logistic"]) -> CSRGLMKernel | None: ...


@overload
def sparse_kernel(kind: Literal["softmax"]) -> CSRSoftmaxKernel | None: ...


def sparse_kernel(kind: KernelKind) -> CSRGLMKernel | CSRSoftmaxKernel | None:
    """The compiled one-pass loss-and-gradient kernel of a linear model on CSR rows, or None without numba.

    As :func:`fused_kernel`, with ``X`` a ``scipy.sparse`` CSR matrix or array (float64 ``data``, int32 or
    int64 ``indices``/``indptr``, sorted or not; duplicates add up; every index in ``0..n_features-1``, as
    :func:`models._checks.as_csr` makes sure: the kernels do not check bounds). Per row a gather from the
    coefficients, the loss and residual, and a scatter into the gradient.

    Least squares and logistic: one sweep over the nonzeros while ``coef`` and ``grad`` fit in the cache
    together (``16 * n_features <= _CSR_FUSED_MAX_BYTES``), else a sweep of gathers then a sweep of
    scatters. CPU time (not wall: the machine was shared, load ~11 on 2 cores), medians of 7, 200,000 rows
    with 40 random sorted columns each, plain numba loops:

    ============  ==========  ====================  =====================
    n_features    one sweep   gathers, scatters     scipy X @ w, X.T @ r
    ============  ==========  ====================  =====================
    2**14         15.7 ms     19.1 ms               20.2 ms
    2**17         26.7 ms     22.6 ms               23.7 ms
    2**20         104 ms      72.5-81 ms            84-91 ms
    2**23         138-144 ms  128-131 ms            140-157 ms
    ============  ==========  ====================  =====================

    With signed indices (numba then adds a wraparound branch to every access) the gather alone took
    57-80 ms at 2**20, against 26-30 ms unsigned and 20-35 ms for scipy's ``X @ w``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> kernel = sparse_kernel("least_squares")
    >>> X, y, grad = sp.csr_array(np.array([[1.0, 0.0], [0.0, 4.0]])), np.array([1.0, 0.0]), np.zeros(2)
    >>> if kernel is not None:  # numba is installed
    ...     loss, r_sum = kernel(X, y, np.array([1.0, 0.0]), 0.5, grad)
    ...     assert (loss, r_sum) == (0.25, 1.0) and grad.tolist() == [0.5, 2.0]
    """
    if kind in ("least_squares", "logistic"):
        glm = _family_kernel("glm_csr")
        return None if glm is None else _glm_caller(glm, kind == "logistic", csr=True)
    if kind == "softmax":
        softmax = _family_kernel("softmax_csr")
        if softmax is None:
            return None

        def softmax_kernel(
            X: Any,
            labels: IntArray,
            W: FloatArray,
            intercept: FloatArray,
            grad_W: FloatArray,
            grad_b: FloatArray,
            rows: int,
        ) -> float:
            indptr, indices = _unsigned(X)
            return float(softmax(indptr, indices, X.data, labels, W, intercept, grad_W, grad_b, rows))

        return softmax_kernel
    raise ValueError(f"no compiled kernel for model kind {kind!r}; expected least_squares, logistic, softmax")
