"""Elementwise vector kernels that round each element the same way on every CPU and every cut of a vector.

Why not BLAS: OpenBLAS's ``daxpy`` and ``dscal`` pick a kernel by CPU (and by ``OPENBLAS_CORETYPE``); some of
them compute the vector's body with fused multiply-adds and its tail without, so the same element gets other
bits when a vector is cut in chunks (a spilled vector streamed by :func:`storage._vectorstore.run_chunked`),
when a subset is updated (a key-value push) or when it is split over shards. The kernels here compute
``y + a * x`` as a product rounded to float64 and then a sum rounded to float64, element by element, which
is what numpy's elementwise ufuncs do: an element's bits depend on its own operands only. So a key-value push
equals a dense push with zeros elsewhere, a spilled vector's ops equal the in-RAM ones, and a sharded run's
vector ops equal one process's, bit for bit, on any machine.

Speed: the compiled loops (numba, no ``fastmath``: LLVM then contracts nothing into an FMA) run at one BLAS
thread's speed, which is what a Dask worker's shard gets anyway (``daxpy`` and this ``axpy`` on 1e8
float64: 46 and 47 ms alone on the development machine, memory bound). Without numba (not installed, or
``NUMBA_DISABLE_JIT=1``), and for short vectors where numba's import would cost more than it saves, numpy's
ufuncs compute the same bits.

:func:`lincomb` is fused: ``out = sum_j c_j v_j`` goes through ``out`` block by block, each block of
``out`` staying in the CPU cache while every term is added to it, in the order of the terms. It reads every
term once and writes ``out`` once, instead of reading and writing ``out`` once per term; the rounding per
element is that of the unfused loop (``((c_0 v_0 + c_1 v_1) + c_2 v_2) + ...``).

Mixed precision (L-BFGS history stored as float32, issue 29): a float32 operand is read as it is stored
(half the bytes of float64) and each element is upcast exactly where it is used, so every product and sum
is a float64 one. :func:`dots_mixed` accumulates such a pair in float64 (:func:`dot_mixed`), :func:`axpy` and
:func:`lincomb` take float32 terms, and a float32 destination of :func:`lincomb` receives the float64
result rounded once per element (computed block by block in a float64 scratch block, never a whole-vector
temporary).

Examples
--------
>>> y = np.ones(3); axpy(0.5, np.arange(3.0), y); y
array([1. , 1.5, 2. ])
>>> out = np.empty(2); lincomb(out, [2.0, -1.0], [np.ones(2), np.arange(2.0)]); out
array([2., 1.])
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BLOCK",
    "COMPILED_FROM",
    "DOT_BLOCK",
    "accrue_at",
    "accrue_rows",
    "accrue_step",
    "adagrad_step",
    "adagrad_step_at",
    "add_at",
    "add_at_positions",
    "add_rows_at_positions",
    "axpy",
    "axpy_at",
    "compiled",
    "dot_mixed",
    "dots",
    "dots_mixed",
    "lincomb",
    "norm_inf",
    "scale",
    "scaled_gradient",
    "take_at",
]

logger = logging.getLogger(__name__)

#: Elements per block of :func:`lincomb` (1 MiB of float64: in a core's L2 cache with a term's block).
BLOCK = 1 << 17

_F64 = np.dtype(np.float64)

#: Vectors of at least this many elements use the compiled loops (once numba is imported); shorter ones
#: use numpy's ufuncs, which give the same bits.
COMPILED_FROM = 1 << 15


def _axpy_loop(a: float, x: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(y.size):
        y[i] = y[i] + a * x[i]


def _scale_loop(a: float, x: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        x[i] = x[i] * a


def _scaled_into_loop(out: np.ndarray, a: float, x: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(out.size):
        out[i] = a * x[i]


def _add_at_loop(out: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:  # pragma: no cover
    for i in range(keys.size):
        out[keys[i]] = out[keys[i]] + values[i]


def _adagrad_loop(
    w: np.ndarray, g: np.ndarray, acc: np.ndarray, minus_lr: float, eps: float
) -> None:  # pragma: no cover - compiled
    for i in range(w.size):
        acc[i] = acc[i] + g[i] * g[i]
        w[i] = w[i] + minus_lr * (g[i] / (np.sqrt(acc[i]) + eps))


def _adagrad_at_loop(
    w: np.ndarray, g: np.ndarray, acc: np.ndarray, keys: np.ndarray, minus_lr: float, eps: float
) -> None:  # pragma: no cover - compiled
    for i in range(keys.size):
        k = keys[i]
        a = acc[k] + g[i] * g[i]
        acc[k] = a
        w[k] = w[k] + minus_lr * (g[i] / (np.sqrt(a) + eps))


def _axpy_at_loop(a: float, x: np.ndarray, y: np.ndarray, keys: np.ndarray) -> None:  # pragma: no cover
    for i in range(keys.size):
        y[keys[i]] = y[keys[i]] + a * x[i]


def _scaled_gradient_loop(
    out: np.ndarray, grad: np.ndarray, a: float, l2: float, x: np.ndarray
) -> bool:  # pragma: no cover - compiled
    finite = True
    for i in range(out.size):
        v = grad[i] * a
        if l2 != 0.0:
            v = v + l2 * x[i]
        out[i] = v
        if not np.isfinite(v):
            finite = False
    return finite


def _accrue_loop(
    g: np.ndarray, acc: np.ndarray, a: float, x: np.ndarray, dx: np.ndarray
) -> None:  # pragma: no cover - compiled
    for i in range(g.size):
        acc[i] = acc[i] + g[i]
        step = a * g[i]
        x[i] = x[i] + step
        dx[i] = dx[i] + step


def _accrue_at_loop(
    keys: np.ndarray, g: np.ndarray, acc: np.ndarray, a: float, x: np.ndarray, dx: np.ndarray | None
) -> None:  # pragma: no cover - compiled
    for i in range(keys.size):
        k = keys[i]
        acc[k] = acc[k] + g[i]
        step = a * g[i]
        x[k] = x[k] + step
        if dx is not None:  # numba compiles a version without it for None
            dx[k] = dx[k] + step


def _accrue_rows_loop(
    indptr: np.ndarray,
    indices: np.ndarray,
    data: np.ndarray,
    rows: np.ndarray,
    r: np.ndarray,
    acc: np.ndarray,
    a: float,
    x: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for i in range(rows.size):
        row = rows[i]
        ri = r[i]
        for t in range(indptr[row], indptr[row + 1]):
            c = indices[t]
            g = ri * data[t]
            acc[c] = acc[c] + g
            x[c] = x[c] + a * g


def _add_rows_at_positions_loop(
    out: np.ndarray,
    positions: np.ndarray,
    indptr: np.ndarray,
    indices: np.ndarray,
    data: np.ndarray,
    rows: np.ndarray,
    r: np.ndarray,
    a: float,
) -> None:  # pragma: no cover - compiled
    for i in range(rows.size):
        row = rows[i]
        ri = r[i]
        for t in range(indptr[row], indptr[row + 1]):
            p = positions[indices[t]]
            if p >= 0:
                out[p] = out[p] + a * (ri * data[t])


def _add_at_positions_loop(
    out: np.ndarray, positions: np.ndarray, keys: np.ndarray, values: np.ndarray
) -> None:  # pragma: no cover - compiled
    for i in range(keys.size):
        p = positions[keys[i]]
        if p >= 0:
            out[p] = out[p] + values[i]


def _dot_mixed_loop(a: np.ndarray, b: np.ndarray) -> float:  # pragma: no cover - compiled
    # Eight partial sums in a fixed pattern (element i goes to sum i % 8, the tail to its own), combined in
    # a fixed order: the same bits on every run, and eight independent chains instead of one long one, which
    # LLVM packs into SIMD lanes without reassociating anything (no fastmath): ~3x one accumulator's speed.
    n = a.size
    m = n - n % 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for i in range(0, m, 8):
        s0 += np.float64(a[i]) * np.float64(b[i])
        s1 += np.float64(a[i + 1]) * np.float64(b[i + 1])
        s2 += np.float64(a[i + 2]) * np.float64(b[i + 2])
        s3 += np.float64(a[i + 3]) * np.float64(b[i + 3])
        s4 += np.float64(a[i + 4]) * np.float64(b[i + 4])
        s5 += np.float64(a[i + 5]) * np.float64(b[i + 5])
        s6 += np.float64(a[i + 6]) * np.float64(b[i + 6])
        s7 += np.float64(a[i + 7]) * np.float64(b[i + 7])
    tail = 0.0
    for i in range(m, n):
        tail += np.float64(a[i]) * np.float64(b[i])
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + tail


_lock = threading.Lock()
#: Compiled dispatchers by plain function; None for every function once numba turned out unusable.
_compiled: dict[Callable[..., Any], Any] = {}
_numba: Any = None
_tried = False


def _import_numba() -> Any | None:
    global _numba, _tried
    if not _tried:
        try:
            import numba

            if getattr(numba.config, "DISABLE_JIT", False):
                raise ImportError("NUMBA_DISABLE_JIT is set")
            _numba = numba
        except Exception as exc:  # ImportError, or a numba built for another numpy
            logger.info("numba is not usable (%s); vector ops use numpy's ufuncs", exc)
        _tried = True
    return _numba


def compiled(fn: Callable[..., Any]) -> Any | None:
    """``fn`` (a plain module-level loop) compiled by numba on first use, or None without numba.

    No ``fastmath``: LLVM then contracts no product and sum into an FMA, so the loops round as numpy's
    ufuncs do. ``nogil``: a shard's or replica's loop runs while the worker's event loop answers. Cached on
    disk (numba's cache next to the module), so a new worker process loads instead of compiling.
    """
    if fn in _compiled:
        return _compiled[fn]
    with _lock:
        if fn not in _compiled:
            nb = _import_numba()
            if nb is None:
                _compiled[fn] = None
            else:
                try:
                    _compiled[fn] = nb.njit(nogil=True, cache=True, boundscheck=False)(fn)
                except RuntimeError:  # no writable cache directory: compile in every process
                    _compiled[fn] = nb.njit(nogil=True, boundscheck=False)(fn)
    return _compiled[fn]


_module_loops: list[dict[str, Any] | None] = []  # built once: lincomb calls axpy once per block and term


def _loops() -> dict[str, Any] | None:
    """The compiled loops of this module (None without numba)."""
    if not _module_loops:
        loops = {
            "axpy": compiled(_axpy_loop),
            "scale": compiled(_scale_loop),
            "scaled_into": compiled(_scaled_into_loop),
            "adagrad": compiled(_adagrad_loop),
            "scaled_gradient": compiled(_scaled_gradient_loop),
            "accrue": compiled(_accrue_loop),
            "dot_mixed": compiled(_dot_mixed_loop),
        }
        _module_loops.append(None if any(f is None for f in loops.values()) else loops)
    return _module_loops[0]


def _compiled_for(n: int) -> dict[str, Any] | None:
    return _loops() if n >= COMPILED_FROM else None


def axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a * x`` in place, rounding the product and then the sum (no FMA), element by element.

    Examples
    --------
    >>> y = np.zeros(2); axpy(-2.0, np.ones(2), y); y
    array([-2., -2.])
    """
    if not y.size:
        return
    loops = _compiled_for(y.size)
    if loops is not None and x.flags.c_contiguous and y.flags.c_contiguous:
        loops["axpy"](float(a), np.asarray(x), np.asarray(y))  # a memmap as a plain view
    else:
        # dtype: a float32 x (a stored history vector) is upcast, never ``a`` rounded to float32 (NEP 50).
        np.add(y, np.multiply(x, a, dtype=np.float64), out=y)


def scale(a: float, x: np.ndarray) -> None:
    """``x *= a`` in place.

    Examples
    --------
    >>> x = np.arange(3.0); scale(2.0, x); x
    array([0., 2., 4.])
    """
    if not x.size:
        return
    loops = _compiled_for(x.size)
    if loops is not None and x.flags.c_contiguous:
        loops["scale"](float(a), np.asarray(x))
    else:
        np.multiply(x, a, out=x, dtype=np.float64)  # a float32 x: the product in float64, rounded once


def _scaled_into(out: np.ndarray, a: float, x: np.ndarray) -> None:
    loops = _compiled_for(out.size)
    if loops is not None and x.flags.c_contiguous and out.flags.c_contiguous:
        loops["scaled_into"](np.asarray(out), float(a), np.asarray(x))
    else:
        np.multiply(x, a, out=out, dtype=np.float64)


def lincomb(
    out: np.ndarray, coeffs: Sequence[float], vectors: Sequence[np.ndarray], *, own: float | None = None
) -> None:
    """``out = own * out + sum_j coeffs[j] * vectors[j]`` (``own=None``: ``out`` is not a term), fused.

    Terms are added in order, each rounded as :func:`axpy` rounds; a zero coefficient skips its term.
    With ``own=None`` the first term initialises ``out`` (``out = c_0 v_0``) and may not be skipped.

    Examples
    --------
    >>> out = np.ones(3); lincomb(out, [1.0], [np.arange(3.0)], own=2.0); out
    array([2., 3., 4.])
    """
    if len(coeffs) != len(vectors):
        raise ValueError("lincomb needs as many coefficients as vectors")
    n = out.size
    if not n:
        return
    if own is None and not vectors:
        raise ValueError("lincomb without the destination among its terms needs at least one term")
    if out.dtype != np.float64:
        _lincomb_narrow(out, coeffs, vectors, own)
        return
    if n < COMPILED_FROM:
        # One block, and numpy's ufuncs (as axpy, scale and _scaled_into below COMPILED_FROM), without
        # their per-term checks: a small in-process fit runs ~20 terms an iteration. ``dtype``: a float32
        # term (a stored history vector) is upcast, never its coefficient rounded to float32 (NEP 50).
        start = 0
        if own is None:
            np.multiply(vectors[0], float(coeffs[0]), out=out, dtype=np.float64)
            start = 1
        elif own != 1.0:
            np.multiply(out, own, out=out)
        for c, v in zip(coeffs[start:], vectors[start:], strict=True):
            if c != 0.0:
                np.add(out, np.multiply(v, float(c), dtype=np.float64), out=out)
        return
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        block = out[a:b]
        if own is None:
            _scaled_into(block, float(coeffs[0]), vectors[0][a:b])
            start = 1
        else:
            if own != 1.0:
                scale(own, block)
            start = 0
        for c, v in zip(coeffs[start:], vectors[start:], strict=True):
            if c != 0.0:
                axpy(float(c), v[a:b], block)


def _lincomb_narrow(
    out: np.ndarray, coeffs: Sequence[float], vectors: Sequence[np.ndarray], own: float | None
) -> None:
    """:func:`lincomb` into a float32 ``out``: each block is formed in a float64 scratch block exactly as
    :func:`lincomb` forms a float64 one, then rounded to ``out``'s dtype once per element.

    Rounding once matters: ``y = g_new - g`` formed in ``out`` itself would round ``g_new`` to float32 first,
    and the difference of two close gradients would lose most of its digits to that rounding.
    """
    n = out.size
    scratch = np.empty(min(n, BLOCK))
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        block = scratch[: b - a]
        if own is not None:
            block[:] = out[a:b]  # upcast: exact
        lincomb(block, coeffs, [v[a:b] for v in vectors], own=own)
        out[a:b] = block  # round to nearest, once


def add_at(out: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """``out[keys] += values`` in place (``keys`` unique): one pass, no gathered temporaries.

    Examples
    --------
    >>> out = np.ones(4); add_at(out, np.array([0, 3]), np.array([0.5, -1.0])); out
    array([1.5, 1. , 1. , 0. ])
    """
    if not keys.size:
        return
    loop = compiled(_add_at_loop) if keys.size >= COMPILED_FROM else None
    if loop is not None and values.flags.c_contiguous:
        loop(np.asarray(out), np.asarray(keys), np.asarray(values, dtype=np.float64))
    else:
        out[keys] += values


def _row_products(X: Any, rows: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The columns of rows ``rows`` of CSR ``X`` and ``r[i] * X[rows[i], c]`` at each, row by row."""
    Xr = X[rows]
    return Xr.indices, Xr.data * np.repeat(r, np.diff(Xr.indptr))


def accrue_rows(X: Any, rows: np.ndarray, r: np.ndarray, acc: np.ndarray, a: float, x: np.ndarray) -> None:
    """:func:`accrue_at` of the gradient ``X[rows].T @ r`` (CSR ``X``), added nonzero by nonzero, row by row:
    ``g = r[i] * X[rows[i], c]``, then ``acc[c] += g`` and ``x[c] += a * g``.

    A Downpour step of a linear model on a wide sparse model (issue 29): the model gives each row's residual
    ``r`` and the step adds into the replica's vectors straight from the rows, no pass numbering the columns
    they touch (a column two rows share gets two additions: the same sum as one of their total, rounded
    twice).

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> X = sp.csr_array(np.array([[1.0, 0.0], [2.0, 3.0]]))
    >>> acc, x = np.zeros(2), np.ones(2)
    >>> accrue_rows(X, np.array([0, 1]), np.array([1.0, 0.5]), acc, -1.0, x); acc, x
    (array([2. , 1.5]), array([-1. , -0.5]))
    """
    loop = compiled(_accrue_rows_loop)
    if loop is not None:
        loop(X.indptr, X.indices, X.data, np.asarray(rows), np.asarray(r, dtype=np.float64), acc, float(a), x)
        return
    cols, g = _row_products(X, rows, r)
    np.add.at(acc, cols, g)
    np.add.at(x, cols, a * g)


def add_rows_at_positions(
    out: np.ndarray, positions: np.ndarray, X: Any, rows: np.ndarray, r: np.ndarray, a: float
) -> None:
    """:func:`add_at_positions` of the step :func:`accrue_rows` adds to ``x``: ``out[positions[c]] += a *
    (r[i] * X[rows[i], c])`` for every nonzero whose column has a position (``-1``: not held).

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> X = sp.csr_array(np.array([[1.0, 0.0], [2.0, 3.0]]))
    >>> out, positions = np.zeros(1), np.array([-1, 0])
    >>> add_rows_at_positions(out, positions, X, np.array([1]), np.array([2.0]), -1.0); out
    array([-6.])
    """
    loop = compiled(_add_rows_at_positions_loop)
    if loop is not None:
        loop(
            out,
            positions,
            X.indptr,
            X.indices,
            X.data,
            np.asarray(rows),
            np.asarray(r, dtype=np.float64),
            float(a),
        )
        return
    cols, g = _row_products(X, rows, r)
    at = positions[cols]
    held = at >= 0
    np.add.at(out, at[held], a * g[held])


def add_at_positions(out: np.ndarray, positions: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """``out[positions[k]] += v`` for every key ``k`` (unique) and value ``v`` whose position is not negative.

    ``positions`` maps a key to its place in ``out`` (``-1``: not held). A Downpour replica adds each step to
    the fetches in flight that hold the step's keys (:meth:`downpour._core.ReplicaCore.compute_at`) this way:
    a search per step of the step's keys among a fetch's cost more than the step's gradient.

    Examples
    --------
    >>> out = np.zeros(2)
    >>> add_at_positions(out, np.array([-1, 1, 0]), np.array([0, 1, 2]), np.array([5.0, 6.0, 7.0])); out
    array([7., 6.])
    """
    if not keys.size:
        return
    loop = compiled(_add_at_positions_loop) if keys.size >= ACCRUE_AT_COMPILED_FROM else None
    if loop is not None and values.flags.c_contiguous and values.dtype == np.float64:
        loop(np.asarray(out), np.asarray(positions), np.asarray(keys), np.asarray(values))
        return
    at = positions[keys]
    held = at >= 0
    out[at[held]] += values[held]


#: Elements per block of :func:`dots` (512 KiB of float64: a vector's block stays in the CPU cache for every
#: pair it is in).
DOT_BLOCK = 1 << 16


def dots(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """The dot products of ``pairs`` of equal-length vectors, in one pass over the distinct vectors.

    L-BFGS's new Gram entries are ~``3(2m + 1)`` dot products of three new vectors with every history
    vector: one ``np.dot`` a pair reads ``2 x 63`` vectors at ``m = 10``, this ~24. Vectors longer than
    :data:`DOT_BLOCK` are cut into blocks; each pair's product is the sum of its blocks' ``np.dot``, added
    in block order (the same bits on every run of one machine; not those of one whole-vector ``np.dot``).
    Pairs that share a vector are taken one after the other, so its block is read from memory once.

    Examples
    --------
    >>> a, b = np.arange(3.0), np.ones(3)
    >>> dots([(a, b), (a, a)])
    [3.0, 5.0]
    """
    if not pairs:
        return []
    n = pairs[0][0].size
    if n <= DOT_BLOCK:
        if not n:
            return [0.0] * len(pairs)
        # ``ndarray.dot`` is ``np.dot`` (the same routine, the same bits) without its dispatch: a small
        # in-process fit asks for ~60 products an iteration.
        return [float(a.dot(b)) for a, b in pairs]
    return _blocked(pairs, n, _dot_f64)


def _dot_f64(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b))


def _blocked(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], n: int, dot: Callable[[np.ndarray, np.ndarray], float]
) -> list[float]:
    """Each pair's product as the sum of ``dot`` of its blocks of :data:`DOT_BLOCK`, in block order."""
    # The vectors in most pairs stay in cache; pairs are ordered by their other vector, so that each
    # other vector's block is used by all its pairs in a row.
    uses: dict[int, int] = {}
    for a, b in pairs:
        for v in {id(a): a, id(b): b}:
            uses[v] = uses.get(v, 0) + 1
    order = sorted(range(len(pairs)), key=lambda i: min((uses[id(v)], id(v)) for v in pairs[i]))
    totals = [0.0] * len(pairs)
    for lo in range(0, n, DOT_BLOCK):
        hi = min(n, lo + DOT_BLOCK)
        for i in order:
            a, b = pairs[i]
            totals[i] += dot(a[lo:hi], b[lo:hi])
    return totals


def dot_mixed(a: np.ndarray, b: np.ndarray) -> float:
    """``a . b`` accumulated in float64 for operands of any float dtype (float32 elements upcast exactly).

    ``np.dot`` of two float32 vectors would accumulate in float32, and of a float32 and a float64 one would
    first copy the float32 one to float64. Compiled (numba) from :data:`COMPILED_FROM` elements on: the
    float32 operand is read at half the bytes, eight partial sums in a fixed order (the same bits on every
    run; not those of ``np.dot``). Shorter vectors: ``np.dot`` of float64 copies.

    Examples
    --------
    >>> a = np.array([1.0, 2.0 ** -15], dtype=np.float32)
    >>> dot_mixed(a, a), float(np.dot(a, a))  # float32 accumulation loses 2**-30 beside 1
    (1.0000000009313226, 1.0)
    """
    if not a.size:
        return 0.0
    loops = _compiled_for(a.size)
    if loops is not None and a.flags.c_contiguous and b.flags.c_contiguous:
        return float(loops["dot_mixed"](np.asarray(a), np.asarray(b)))
    return float(np.dot(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)))


def dots_mixed(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """:func:`dots` for vectors of which some are float32 (a float32 L-BFGS history), all in float64.

    The blocks and their order are :func:`dots`'s, each pair's blocks added in block order: a pair of
    float64 vectors gets the bits :func:`dots` gives it, a pair with a float32 vector is
    :func:`dot_mixed`'s, block by block (the float32 vector read at half the bytes, no float64 copy of
    it). Callers that may hold float32 vectors call this one (a shard whose store holds some, an
    in-process space that made some); :func:`dots` itself checks no dtype (a small fit's ~60 products an
    iteration would pay for it).

    Examples
    --------
    >>> s = np.array([1.0, 2.0 ** -15], dtype=np.float32)
    >>> dots_mixed([(s, s), (s, np.ones(2))])
    [1.0000000009313226, 1.000030517578125]
    """
    if not pairs:
        return []
    n = pairs[0][0].size
    if n <= DOT_BLOCK:
        return [_dot_block(a, b) for a, b in pairs]
    return _blocked(pairs, n, _dot_block)


def _dot_block(a: np.ndarray, b: np.ndarray) -> float:
    if a.dtype == _F64 and b.dtype == _F64:
        return float(a.dot(b)) if a.size else 0.0  # dots' own routine and bits
    return dot_mixed(a, b)


def norm_inf(x: np.ndarray) -> float:
    """``max |x_i|`` without a temporary ``|x|`` (NaN if any element is NaN); 0 for an empty vector.

    Examples
    --------
    >>> norm_inf(np.array([1.0, -3.0, 2.0]))
    3.0
    """
    if not x.size:
        return 0.0
    return float(np.maximum(x.max(), -x.min()))


def adagrad_step(w: np.ndarray, g: np.ndarray, acc: np.ndarray, *, lr: float, eps: float) -> None:
    """Adagrad in place: ``acc += g * g``, then ``w += -lr * (g / (sqrt(acc) + eps))``, element by element.

    Examples
    --------
    >>> w = np.zeros(2); acc = np.zeros(2)
    >>> adagrad_step(w, np.array([2.0, -4.0]), acc, lr=0.1, eps=0.0); w
    array([-0.1,  0.1])
    """
    if not w.size:
        return
    loops = _compiled_for(w.size)
    if loops is not None and all(v.flags.c_contiguous for v in (w, g, acc)):
        loops["adagrad"](np.asarray(w), np.asarray(g), np.asarray(acc), -float(lr), float(eps))
        return
    np.add(acc, g * g, out=acc)
    step = g / (np.sqrt(acc) + eps)
    np.add(w, np.multiply(step, -float(lr)), out=w)


def adagrad_step_at(
    w: np.ndarray, g: np.ndarray, acc: np.ndarray, keys: np.ndarray, *, lr: float, eps: float
) -> None:
    """:func:`adagrad_step` on the entries of ``w`` and ``acc`` at ``keys`` (unique), ``g`` holding one
    value a key: one pass, where gathering, updating and scattering back took five (a shard's key-value
    push, :meth:`storage.Shard.push`). The same floats as :func:`adagrad_step` on those entries.

    Examples
    --------
    >>> w = np.zeros(3); acc = np.zeros(3)
    >>> adagrad_step_at(w, np.array([2.0]), acc, np.array([1]), lr=0.1, eps=0.0); w
    array([ 0. , -0.1,  0. ])
    """
    if not keys.size:
        return
    loop = compiled(_adagrad_at_loop) if keys.size >= ACCRUE_AT_COMPILED_FROM else None
    g = np.asarray(g, dtype=np.float64)
    if loop is not None and all(v.flags.c_contiguous and v.dtype == np.float64 for v in (w, g, acc)):
        loop(np.asarray(w), g, np.asarray(acc), np.asarray(keys), -float(lr), float(eps))
        return
    w_at, acc_at = w[keys], acc[keys]
    adagrad_step(w_at, g, acc_at, lr=lr, eps=eps)
    w[keys], acc[keys] = w_at, acc_at


def axpy_at(a: float, x: np.ndarray, y: np.ndarray, keys: np.ndarray) -> None:
    """:func:`axpy` on the entries of ``y`` at ``keys`` (unique): ``y[keys] += a * x``, one pass.

    Examples
    --------
    >>> y = np.zeros(3); axpy_at(-2.0, np.array([1.0]), y, np.array([2])); y
    array([ 0.,  0., -2.])
    """
    if not keys.size:
        return
    loop = compiled(_axpy_at_loop) if keys.size >= ACCRUE_AT_COMPILED_FROM else None
    x = np.asarray(x, dtype=np.float64)
    if loop is not None and x.flags.c_contiguous and y.flags.c_contiguous and y.dtype == np.float64:
        loop(float(a), x, np.asarray(y), np.asarray(keys))
        return
    y[keys] = y[keys] + np.multiply(x, a)


def scaled_gradient(out: np.ndarray, grad: np.ndarray, a: float, *, l2: float = 0.0, x: np.ndarray) -> bool:
    """``out = a * grad + l2 * x`` (the ``l2`` term only when it is not 0); returns whether all of ``out`` is
    finite. One pass where numpy takes four (scale, add, ``isfinite``, ``all``): a Downpour step's gradient
    (:meth:`downpour._core.ReplicaCore.compute`). Rounds as ``np.multiply`` then :func:`axpy` do.

    Examples
    --------
    >>> out = np.empty(2)
    >>> scaled_gradient(out, np.array([2.0, 4.0]), 0.5, l2=0.1, x=np.array([10.0, 0.0])), out
    (True, array([2., 2.]))
    """
    loops = _compiled_for(out.size)
    if loops is not None and all(v.flags.c_contiguous and v.dtype == np.float64 for v in (out, grad, x)):
        return bool(loops["scaled_gradient"](out, np.asarray(grad), float(a), float(l2), np.asarray(x)))
    with np.errstate(over="ignore", invalid="ignore"):  # the answer says it; the caller decides
        np.multiply(np.asarray(grad, dtype=np.float64), a, out=out)
        if l2:
            np.add(out, np.multiply(x, l2), out=out)
    return bool(np.isfinite(out).all())


def accrue_step(g: np.ndarray, acc: np.ndarray, a: float, x: np.ndarray, dx: np.ndarray) -> None:
    """``acc += g``, ``x += a * g`` and ``dx += a * g`` in one pass over the four vectors.

    A Downpour replica's step: the gradient joins the sum it pushes, and its local copy and the steps no
    fetch contains yet move by ``a * g`` (:meth:`downpour._core.ReplicaCore.apply`). Rounds as three
    :func:`axpy` calls do.

    Examples
    --------
    >>> acc, x, dx = np.zeros(2), np.ones(2), np.zeros(2)
    >>> accrue_step(np.array([1.0, 2.0]), acc, -0.5, x, dx); acc, x, dx
    (array([1., 2.]), array([0.5, 0. ]), array([-0.5, -1. ]))
    """
    loops = _compiled_for(g.size)
    if loops is not None and all(v.flags.c_contiguous for v in (g, acc, x, dx)):
        loops["accrue"](np.asarray(g), np.asarray(acc), float(a), np.asarray(x), np.asarray(dx))
        return
    axpy(1.0, g, acc)
    axpy(a, g, x)
    axpy(a, g, dx)


def _take_at_loop(
    keys: np.ndarray, acc: np.ndarray, out_keys: np.ndarray, out_values: np.ndarray
) -> int:  # pragma: no cover - compiled
    k = 0
    for i in range(keys.size):
        key = keys[i]
        v = acc[key]
        if v != 0.0:
            out_keys[k] = key
            out_values[k] = v
            k += 1
        acc[key] = 0.0
    return k


def take_at(keys: np.ndarray, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nonzero entries of ``acc`` at ``keys`` (unique), as ``(keys, values)`` in the order of ``keys``;
    ``acc`` is zeroed at every one of ``keys``. One pass over the keys: a Downpour replica's push of what
    its steps since the last one accrued (:meth:`downpour._core.ReplicaCore.take_push`), where a compare, a
    gather and a scatter cost three passes.

    Examples
    --------
    >>> acc = np.array([0.0, 2.0, 0.0, 3.0, 4.0])
    >>> take_at(np.array([0, 1, 3]), acc)
    (array([1, 3]), array([2., 3.]))
    >>> acc.tolist()
    [0.0, 0.0, 0.0, 0.0, 4.0]
    """
    loop = compiled(_take_at_loop) if keys.size >= ACCRUE_AT_COMPILED_FROM else None
    if loop is not None and acc.flags.c_contiguous and acc.dtype == np.float64:
        keys = np.asarray(keys, dtype=np.int64)
        out_keys, out_values = np.empty(keys.size, np.int64), np.empty(keys.size)
        k = loop(keys, acc, out_keys, out_values)
        return out_keys[:k], out_values[:k]
    keys = np.asarray(keys, dtype=np.int64)
    nonzero = keys[acc[keys] != 0]
    values = acc[nonzero]
    acc[keys] = 0.0
    return nonzero, values


#: Keys from which :func:`accrue_at` runs its compiled loop (below, numpy's fancy indexing is as quick).
ACCRUE_AT_COMPILED_FROM = 256


def accrue_at(
    keys: np.ndarray, g: np.ndarray, acc: np.ndarray, a: float, x: np.ndarray, dx: np.ndarray | None
) -> None:
    """:func:`accrue_step` at ``keys`` only (unique): ``acc[keys] += g``, ``x[keys] += a * g`` and
    ``dx[keys] += a * g`` (none for ``dx=None``), in one pass over the keys.

    A Downpour step on sparse rows (:meth:`downpour._core.ReplicaCore.compute_at`): its cost is the step's
    keys, not the model's width (four fancy-indexed numpy passes over 5,000 keys of a 2^20-wide model cost
    ~0.2 ms; the step's gradient ~0.03 ms). Rounds as numpy's elementwise operations do.

    Examples
    --------
    >>> acc, x, dx = np.zeros(3), np.ones(3), np.zeros(3)
    >>> accrue_at(np.array([2]), np.array([4.0]), acc, -0.5, x, dx); acc, x, dx
    (array([0., 0., 4.]), array([ 1.,  1., -1.]), array([ 0.,  0., -2.]))
    """
    if not keys.size:
        return
    loop = compiled(_accrue_at_loop) if keys.size >= ACCRUE_AT_COMPILED_FROM else None
    vectors = (g, acc, x) if dx is None else (g, acc, x, dx)
    if loop is not None and all(v.flags.c_contiguous and v.dtype == np.float64 for v in vectors):
        loop(np.asarray(keys), np.asarray(g), np.asarray(acc), float(a), np.asarray(x), dx)
        return
    acc[keys] += g
    step = np.multiply(g, a)
    x[keys] += step
    if dx is not None:
        dx[keys] += step
