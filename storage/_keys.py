"""Key-value pull and push for sparse portions: which parameters a portion touches, split per shard.

On a wide sparse problem (hashed features: 1e6-1e9 columns, tens of nonzeros a row; DESIGN.md "Next") a
portion of rows touches a small subset of the parameters, so a replica pulls and pushes only those *keys*,
as ps-lite's key-value ``Pull``/``Push`` (Li et al., OSDI 2014, section 3.2: "(key, value) pairs ... only
the keys in the range") and Angel's PS vectors do. This module holds the replica side of that, with no
Dask inside:

* :func:`sparse_layout_of` tells whether a model's parameters follow its CSR columns (the linear models:
  parameter ``c * k + j`` is column ``c``'s coefficient of output ``j``, the intercepts last) and how.
* :func:`compact_portion` computes a portion's keys (the sorted parameter indices its rows touch) once, with
  the rows renumbered to those keys and a model of that width: the compact model's parameter vector is
  exactly ``w[keys]`` and its gradient is ``grad[keys]``, entry for entry, in the same summation order (the
  renumbering keeps every row's column order), so sparse and dense runs give the same floats.
* :func:`split_keys` cuts sorted keys at the shards' bounds into *local* offsets, int32 whenever the shard is
  smaller than 2**31 entries: 4 bytes a key on the wire, next to 8 for its value.

Wire format (one message per shard, as the dense path): a pull sends ``keys`` (int32 local offsets,
sorted, unique) and gets back ``values`` (float64, same length); a push sends ``(keys, values)``. Bytes
moved are ``nbytes`` of those arrays (:func:`kv_bytes`); a dense message moves the shard's whole slice.
Per shard and message, the smaller of the two is sent (:func:`whole_slice_is_smaller`): keys cost 12
bytes each (20 in int64) against 8 a value, so a replica whose keys cover more than 2/3 of a shard's slice
pulls the whole slice (a binned push, 4 values a key, switches above 8/9).

A *sign-coded* push (Strom 2015's 1-bit quantized update, see ``downpour._compress``) sends no values at
all: every entry is ``+tau`` or ``-tau``, so the sign rides in the key itself (:func:`encode_signs`: a local
offset ``k`` for ``+tau``, ``~k = -k - 1`` for ``-tau``), 4 bytes an entry, plus the scalar ``tau``.

Examples
--------
>>> import scipy.sparse as sp
>>> from distbelief.models import Logistic
>>> X = sp.csr_array(np.array([[0.0, 2.0, 0.0, 1.0], [0.0, 3.0, 0.0, 0.0]]))
>>> part = compact_portion(Logistic(4), X, np.array([1.0, 0.0]))
>>> part.keys.tolist(), part.X.shape
([1, 3, 4], (2, 2))
>>> [k.tolist() for k in split_keys((0, 2, 5), part.keys)]
[[1], [1, 2]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from distbelief.errors import InvalidOptionError

from ._kernels import compiled

__all__ = [
    "COMMUNICATION",
    "Communication",
    "SparsePortion",
    "compact_batch",
    "compact_model",
    "compact_portion",
    "compact_rows",
    "decode_signs",
    "encode_signs",
    "kv_bytes",
    "param_keys",
    "rows_keys",
    "sorted_unique",
    "sparse_layout_of",
    "split_keys",
    "union_keys",
    "use_sparse",
    "whole_slice_is_smaller",
]

Communication = Literal["auto", "dense", "sparse"]
COMMUNICATION: tuple[str, ...] = get_args(Communication)
_INT32_MAX = 2**31 - 1
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SparsePortion:
    """A portion's rows renumbered to the parameters they touch.

    ``keys`` (int64, sorted, unique) are the global parameter indices; ``model`` is a model of the same kind
    whose parameter vector is ``w[keys]`` (``None`` in what :func:`compact_rows` returns: the rows and keys
    depend only on the layout, the model is the run's, see :meth:`for_model`); ``X`` has
    ``max(1, n_columns)`` columns, ``n_columns`` being the distinct columns the rows touch.
    """

    keys: IntArray
    X: Any
    y: np.ndarray
    model: Any
    layout: tuple[int, int, bool] = (0, 1, False)
    n_columns: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (keys and the renumbered rows), for cache accounting."""
        X = self.X
        return int(self.keys.nbytes + X.data.nbytes + X.indices.nbytes + X.indptr.nbytes + self.y.nbytes)

    def for_model(self, model: Any) -> SparsePortion:
        """These rows and keys with ``model`` narrowed to them (:func:`compact_model`).

        Raises if ``model``'s layout is not the one the keys were computed for.
        """
        if sparse_layout_of(model) != self.layout:
            raise InvalidOptionError(
                f"the portion's keys were computed for the layout {self.layout} (n_features, n_outputs, "
                f"fit_intercept), not for {type(model).__name__}'s {sparse_layout_of(model)}"
            )
        compact = compact_model(model, max(1, self.n_columns), self.keys)
        if self.n_columns == 0:
            # No nonzero at all: the one placeholder column has no entry; its key is never pulled or pushed.
            compact = _DropFirst(compact, self.layout[1])
        return replace(self, model=compact)


def sparse_layout_of(model: Any) -> tuple[int, int, bool] | None:
    """``(n_features, n_outputs, fit_intercept)`` for a model whose parameters follow its columns, else None.

    Only the built-in linear models qualify (least squares, logistic, softmax): their layout is
    ``[W.ravel() (n_features x n_outputs, row-major), b (n_outputs)]``. Anything else (an MLP, a user's
    model) is communicated dense.

    Examples
    --------
    >>> from distbelief.models import Softmax
    >>> sparse_layout_of(Softmax(5, 3))
    (5, 3, True)
    """
    spec = getattr(model, "spec", None)
    if not isinstance(spec, dict) or spec.get("kind") not in ("least_squares", "logistic", "softmax"):
        return None
    k = int(spec["n_classes"]) if spec["kind"] == "softmax" else 1
    layout = (int(spec["n_features"]), k, bool(spec.get("fit_intercept", True)))
    if model.n_params != (layout[0] + int(layout[2])) * k:
        return None
    return layout


def use_sparse(mode: str, model: Any, sparse_data: bool) -> bool:
    """Resolve ``communication``: ``"auto"`` is sparse for sparse data and a linear model, dense otherwise.

    Examples
    --------
    >>> from distbelief.models import Logistic
    >>> use_sparse("auto", Logistic(3), True), use_sparse("auto", Logistic(3), False)
    (True, False)
    """
    if mode not in COMMUNICATION:
        raise InvalidOptionError(f"communication must be one of {COMMUNICATION}, got {mode!r}")
    if mode == "dense":
        return False
    capable = sparse_data and sparse_layout_of(model) is not None
    if mode == "sparse" and not capable:
        raise InvalidOptionError(
            "communication='sparse' needs a sparse (CSR) dataset and a linear model (least_squares, "
            "logistic, softmax); use communication='dense' or 'auto'"
        )
    return capable


def compact_portion(model: Any, X: Any, y: np.ndarray) -> SparsePortion:
    """The keys of CSR rows ``X`` and the rows renumbered to them (see the module docstring).

    ``compact_rows(sparse_layout_of(model), X, y).for_model(model)``. Raises if the model's parameters do not
    follow its columns (:func:`sparse_layout_of`).
    """
    layout = sparse_layout_of(model)
    if layout is None:
        raise InvalidOptionError(f"{type(model).__name__} has no sparse parameter layout")
    return compact_rows(layout, X, y).for_model(model)


def compact_rows(layout: tuple[int, int, bool], X: Any, y: np.ndarray) -> SparsePortion:
    """The keys of CSR rows ``X`` under ``layout`` and the rows renumbered to them, without a model.

    What this returns depends on the rows and the layout only (``(n_features, n_outputs, fit_intercept)``,
    :func:`sparse_layout_of`), so it may be cached under both (a replica's row cache); a run then narrows its
    own model to it with :meth:`SparsePortion.for_model`.

    Examples
    --------
    >>> X = sp.csr_array(np.array([[0.0, 2.0, 0.0, 1.0]]))
    >>> part = compact_rows((4, 1, False), X, np.array([1.0]))
    >>> part.keys.tolist(), part.X.shape, part.model is None
    ([1, 3], (1, 2), True)
    """
    d, k, _ = layout
    X = sp.csr_array(X)
    cols, inverse = _distinct_columns(X.indices, X.shape[1])
    keys = _expand(cols, layout)
    # Renumbering with a monotone map keeps every row's columns sorted and in the same order, so the
    # compact kernels add the same products in the same order as the full ones.
    idx_dtype = np.int32 if cols.size <= _INT32_MAX else np.int64
    Xc = sp.csr_array(
        (X.data, inverse.astype(idx_dtype).reshape(-1), X.indptr.astype(idx_dtype, copy=False)),
        shape=(X.shape[0], max(1, cols.size)),
    )
    if cols.size == 0:
        keys = keys[keys >= d * k]
    return SparsePortion(keys=keys, X=Xc, y=y, model=None, layout=layout, n_columns=int(cols.size))


def _gather_rows_loop(
    indptr: np.ndarray,
    indices: np.ndarray,
    data: np.ndarray,
    rows: np.ndarray,
    table: np.ndarray,
    out_indptr: np.ndarray,
    out_indices: np.ndarray,
    out_data: np.ndarray,
    cols: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Copy ``rows`` of a CSR matrix into the ``out_*`` arrays, each column renumbered by first sight
    (``cols[j]`` is the column numbered ``j``); returns how many distinct columns. ``table`` (all negative
    on entry, and so again on return) holds the numbers while the rows are read."""
    nnz = 0
    k = 0
    out_indptr[0] = 0
    for r in range(rows.size):
        row = rows[r]
        for p in range(indptr[row], indptr[row + 1]):
            c = indices[p]
            j = table[c]
            if j < 0:
                j = k
                table[c] = k
                cols[k] = c
                k += 1
            out_indices[nnz] = j
            out_data[nnz] = data[p]
            nnz += 1
        out_indptr[r + 1] = nnz
    for j in range(k):
        table[cols[j]] = -1
    return k


def compact_batch(
    layout: tuple[int, int, bool], X: Any, y: np.ndarray, rows: np.ndarray, table: np.ndarray
) -> SparsePortion:
    """``compact_rows(layout, X[rows], y[rows])`` in one pass over the rows' nonzeros, up to the order of
    the columns: the mini-batch of a Downpour step on a wide model (issue 29), where scipy's row indexing,
    a sort of every nonzero and a search cost ~0.6 ms a 256-row batch at 2^20 columns (the gradient itself
    ~0.1 ms).

    The columns are numbered in the order the rows first touch them, not sorted (sorting the distinct
    columns and renumbering again took over half of this function's time): ``keys`` are distinct but not
    sorted, and ``X``'s column ``j`` is the column of key ``keys[j]`` (times the outputs, intercepts last),
    as in :func:`compact_rows`. Every row keeps its nonzeros in their order, so the compact kernels add the
    same products in the same order as the full ones.

    ``table`` is scratch space owned by the caller: ``X.shape[1]`` integers (int32 where a batch has fewer
    than 2^31 distinct columns), all negative (e.g. ``-1``) on entry, and so again on return. Without numba,
    or for rows that are not a CSR array, it is :func:`compact_rows` itself (sorted keys).

    Examples
    --------
    >>> X = sp.csr_array(np.array([[0.0, 2.0, 0.0, 1.0], [5.0, 0.0, 0.0, 0.0]]))
    >>> table = np.full(4, -1, dtype=np.int64)
    >>> part = compact_batch((4, 1, False), X, np.array([1.0, 0.0]), np.array([1, 0]), table)
    >>> part.keys.tolist(), part.X.toarray().tolist(), part.y.tolist(), bool((table < 0).all())
    ([0, 1, 3], [[5.0, 0.0, 0.0], [0.0, 2.0, 1.0]], [0.0, 1.0], True)
    """
    loop = compiled(_gather_rows_loop)
    d = X.shape[1]
    if loop is None or not sp.issparse(X) or X.format != "csr" or table.size < d:
        return compact_rows(layout, X[rows], y[rows])
    rows = np.asarray(rows, dtype=np.int64)
    nnz = int((X.indptr[rows + 1] - X.indptr[rows]).sum())
    if nnz == 0:
        return compact_rows(layout, X[rows], y[rows])
    idx_dtype = np.int32 if nnz <= _INT32_MAX else np.int64
    out_indptr = np.empty(rows.size + 1, dtype=idx_dtype)
    out_indices = np.empty(nnz, dtype=idx_dtype)
    out_data = np.empty(nnz, dtype=X.data.dtype)
    cols = np.empty(nnz, dtype=np.int64)
    k = int(loop(X.indptr, X.indices, X.data, rows, table, out_indptr, out_indices, out_data, cols))
    Xc = sp.csr_array((out_data, out_indices, out_indptr), shape=(rows.size, k))
    return SparsePortion(
        keys=_expand(cols[:k], layout), X=Xc, y=np.asarray(y)[rows], model=None, layout=layout, n_columns=k
    )


def _mark_columns_loop(
    indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray, mask: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``mask[c] = True`` for every column ``c`` of the rows ``rows`` of a CSR matrix."""
    for r in range(rows.size):
        row = rows[r]
        for p in range(indptr[row], indptr[row + 1]):
            mask[indices[p]] = True


def _collect_marked_loop(words: np.ndarray, mask: np.ndarray, out: np.ndarray) -> int:  # pragma: no cover
    """Write the positions of the True entries of ``mask`` (viewed as 8-byte ``words``) into ``out`` in
    order, clearing them; returns how many. ``out`` has room for one more than that.

    Empty words are skipped eight entries at a time; within a word every entry is written and counted
    only if marked (no branch per entry: a window marking a third of a 2^20 mask took 3.2 ms with one,
    0.6 ms without; at 2^24, 7.6 and 5.3 ms)."""
    k = 0
    for w in range(words.size):
        if words[w] != 0:
            base = 8 * w
            for i in range(base, base + 8):
                out[k] = i
                k += mask[i]
            words[w] = 0
    for i in range(8 * words.size, mask.size):  # the tail past the last whole word
        if mask[i]:
            out[k] = i
            k += 1
            mask[i] = False
    return k


def rows_keys(
    layout: tuple[int, int, bool], batches: Sequence[tuple[Any, np.ndarray]], mask: np.ndarray
) -> IntArray | None:
    """The sorted parameter keys that the rows of ``batches`` (``(X, rows)`` pairs, CSR ``X``) touch, by
    marking their columns in ``mask`` (``n_features`` booleans, all False on entry and again on return):
    the keys of a Downpour window's steps, one pass over their nonzeros and none narrowing the rows
    (issue 29). None without numba or for rows that are not CSR arrays: then unite :func:`compact_batch`'s
    keys.

    Examples
    --------
    >>> X = sp.csr_array(np.array([[0.0, 2.0, 0.0, 1.0], [5.0, 0.0, 0.0, 0.0]]))
    >>> mask = np.zeros(4, dtype=bool)
    >>> keys = rows_keys((4, 1, True), [(X, np.array([0])), (X, np.array([0, 1]))], mask)
    >>> keys is None or (keys.tolist(), bool(mask.any())) == ([0, 1, 3, 4], False)
    True
    """
    loop, collect = compiled(_mark_columns_loop), compiled(_collect_marked_loop)
    if loop is None or collect is None or any(not sp.issparse(X) or X.format != "csr" for X, _ in batches):
        return None
    batches = [(X, np.asarray(rows, np.int64)) for X, rows in batches]
    for X, rows in batches:
        # Unsigned views: numba then spares a wraparound branch on every index.
        unsigned = {4: np.uint32, 8: np.uint64}
        indptr = X.indptr.view(unsigned[X.indptr.dtype.itemsize])
        loop(indptr, X.indices.view(unsigned[X.indices.dtype.itemsize]), rows, mask)
    # One pass that lists and clears the marks (np.flatnonzero counts, then lists: two passes, ~3x slower).
    nnz = sum(int((X.indptr[r + 1] - X.indptr[r]).sum()) for X, r in batches)
    out = np.empty(min(mask.size, nnz) + 1, np.int64)  # + 1: a single-output model's intercept key
    words = mask[: mask.size - mask.size % 8].view(np.uint64)
    k = collect(words, mask, out)
    d, outputs, intercept = layout
    if outputs == 1:  # keys are the columns (and the intercept, d): no copy of the window's keys
        out[k] = d
        return out[: k + int(intercept)]
    return _expand(out[:k], layout)


def compact_model(model: Any, n_features: int, keys: IntArray) -> Any:
    """``model`` narrowed to ``n_features`` columns, its parameters being ``w[keys]`` of the full model.

    A model that wraps another (``sklearn._base.FreeParams``) narrows itself by its ``compact(n_features,
    keys)`` method; a built-in linear model is rebuilt as its own class from its ``spec`` at the new width
    (storage imports nothing from models: DESIGN.md "Layout").

    Raises
    ------
    InvalidOptionError
        If the model has no ``compact`` method and its class does not take its spec's fields.

    Examples
    --------
    >>> from distbelief.models import Logistic
    >>> compact_model(Logistic(1000), 3, np.array([5, 9, 11, 1000])).n_params
    4
    """
    compact = getattr(model, "compact", None)
    if callable(compact):
        return compact(int(n_features), keys)
    fields = {name: v for name, v in model.spec.items() if name != "kind"}
    fields["n_features"] = int(n_features)
    try:
        narrowed = type(model)(**fields)
    except TypeError as exc:
        raise InvalidOptionError(
            f"{type(model).__name__} has the spec of a {model.spec['kind']!r} model but is not rebuilt from "
            f"it ({exc}); give it a compact(n_features, keys) method for the sparse path, or use "
            'communication="dense"'
        ) from exc
    return narrowed


def _distinct_columns(indices: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct ``indices`` and each index's position among them.

    By a mark and a renumbering table over the ``width`` columns when that is at most 16 times the indices
    (two passes, ~10 ms for 2.5 M indices of 2^20 columns), else by a sort and a search (~250 ms there).

    Examples
    --------
    >>> cols, at = _distinct_columns(np.array([7, 2, 7, 5]), 8)
    >>> cols.tolist(), at.tolist()
    ([2, 5, 7], [2, 0, 2, 1])
    """
    if width <= 16 * max(1, indices.size):
        mark = np.zeros(width, dtype=bool)
        mark[indices] = True
        cols = np.flatnonzero(mark)
        table = np.empty(width, dtype=np.int64)
        table[cols] = np.arange(cols.size)
        return cols, table[indices]
    cols = sorted_unique(indices)
    return cols, np.searchsorted(cols, indices)


class _DropFirst:
    """A compact model with one placeholder column whose ``k`` coefficients are not among the keys."""

    def __init__(self, model: Any, k: int) -> None:
        self.model, self.k = model, k

    def loss_and_grad(self, w: np.ndarray, X: Any, y: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = self.model.loss_and_grad(np.concatenate([np.zeros(self.k), w]), X, y)
        return loss, np.asarray(grad)[self.k :]


def _expand(cols: np.ndarray, layout: tuple[int, int, bool]) -> IntArray:
    """Parameter keys of columns ``cols``: ``c * k + j`` for every output ``j``, intercepts last (sorted
    when ``cols`` are)."""
    d, k, intercept = layout
    keys = (cols.astype(np.int64)[:, None] * k + np.arange(k)).ravel()
    if intercept:
        keys = np.concatenate([keys, d * k + np.arange(k, dtype=np.int64)])
    return keys


def param_keys(model: Any, X: Any) -> IntArray:
    """The sorted parameter indices that CSR rows ``X`` touch (their columns' coefficients, intercepts).

    Examples
    --------
    >>> from distbelief.models import Softmax
    >>> X = sp.csr_array(np.array([[0.0, 1.0, 0.0]]))
    >>> param_keys(Softmax(3, 2), X).tolist()
    [2, 3, 6, 7]
    """
    layout = sparse_layout_of(model)
    if layout is None:
        raise InvalidOptionError(f"{type(model).__name__} has no sparse parameter layout")
    return _expand(sorted_unique(sp.csr_array(X).indices), layout)


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``a``, by a sort and a neighbour comparison.

    ``np.unique`` (numpy 2.4, hash-based by default) measured 8.2 s on 370,000 int64 here against 0.3 s
    for this (both on the loaded 2-core box): it sits on every portion's first use and every key union.

    Examples
    --------
    >>> sorted_unique(np.array([5, 1, 5, 3])).tolist()
    [1, 3, 5]
    """
    s = np.sort(a)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def union_keys(parts: Sequence[IntArray], n: int | None = None) -> IntArray:
    """Sorted unique union of key arrays; with ``n`` (keys lie in ``[0, n)``) by a mask when that is
    cheaper than sorting (``n`` at most 128 times the keys given: a mask costs about a byte an entry, the
    sort ~30 ns a key).

    Examples
    --------
    >>> union_keys([np.array([1, 5]), np.array([2, 5])]).tolist()
    [1, 2, 5]
    >>> union_keys([np.array([1, 5]), np.array([2, 5])], n=8).tolist()
    [1, 2, 5]
    """
    if not parts:
        return np.zeros(0, dtype=np.int64)
    if len(parts) == 1:
        return parts[0]
    total = sum(int(p.size) for p in parts)
    if n is not None and n <= 128 * total:
        mask = np.zeros(n, dtype=bool)
        for p in parts:
            mask[p] = True
        return np.flatnonzero(mask)
    return sorted_unique(np.concatenate(parts))


def split_keys(bounds: Sequence[int], keys: IntArray) -> list[np.ndarray]:
    """Sorted global ``keys`` cut at the shard ``bounds`` into local offsets (int32 where they fit).

    Examples
    --------
    >>> [k.dtype.name for k in split_keys((0, 4, 8), np.array([3, 4, 7]))]
    ['int32', 'int32']
    """
    cuts = np.searchsorted(keys, np.asarray(bounds, dtype=np.int64))
    out = []
    for i in range(len(bounds) - 1):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        dtype = np.int32 if hi - lo <= _INT32_MAX else np.int64
        out.append((keys[cuts[i] : cuts[i + 1]] - lo).astype(dtype))
    return out


def whole_slice_is_smaller(keys: np.ndarray, slice_size: int, value_rows: int = 1) -> bool:
    """Whether sending a shard's whole slice (``value_rows`` float64 a parameter) moves fewer bytes than
    sending ``keys`` with their values; ties go to the key-value message.

    A replica's keys on a shard cost ``keys.nbytes + 8 * value_rows * keys.size`` bytes as key-value pairs
    and ``8 * value_rows * slice_size`` as the whole slice: with int32 keys a pull (one value a key) is
    cheaper whole above 2/3 coverage, a binned push (:mod:`storage._exactsum`, 4 values a key) above 8/9.

    Examples
    --------
    >>> keys = np.arange(61, dtype=np.int32)   # 61 of 90 parameters: just over 2/3
    >>> whole_slice_is_smaller(keys[:60], 90), whole_slice_is_smaller(keys, 90)
    (False, True)
    >>> whole_slice_is_smaller(keys, 90, value_rows=4)   # a binned push: keys pay above 8/9 only
    False
    """
    return 8 * value_rows * int(slice_size) < int(keys.nbytes) + 8 * value_rows * int(keys.size)


def kv_bytes(*arrays: np.ndarray | None) -> int:
    """Bytes of the arrays of one message (keys and values), as they travel.

    Examples
    --------
    >>> kv_bytes(np.zeros(3, np.int32), np.zeros(3))
    36
    """
    return sum(int(a.nbytes) for a in arrays if a is not None)


def encode_signs(keys: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Sign-coded keys: local offset ``k`` where ``negative`` is False, ``~k`` (``-k - 1``) where True.

    The dtype of ``keys`` is kept (int32 local offsets stay 4 bytes an entry: Strom 2015 packs a 31-bit
    index and a sign bit into 32 bits the same way). ``keys`` must be >= 0; their order is kept.

    Examples
    --------
    >>> encode_signs(np.array([0, 3, 5], np.int32), np.array([True, False, True])).tolist()
    [-1, 3, -6]
    """
    keys = np.asarray(keys)
    negative = np.asarray(negative, dtype=bool)
    if keys.shape != negative.shape:
        raise InvalidOptionError(f"encode_signs: {keys.size} keys but {negative.size} signs")
    if keys.size and int(keys.min()) < 0:
        raise InvalidOptionError("encode_signs: keys must be local offsets >= 0")
    return np.where(negative, ~keys, keys).astype(keys.dtype, copy=False)


def decode_signs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_signs`: ``(keys, negative)``.

    Examples
    --------
    >>> keys, negative = decode_signs(np.array([-1, 3, -6], np.int32))
    >>> keys.tolist(), negative.tolist()
    ([0, 3, 5], [True, False, True])
    """
    codes = np.asarray(codes)
    if codes.dtype.kind != "i":
        raise InvalidOptionError(f"sign-coded keys must be signed integers, got dtype {codes.dtype}")
    negative = codes < 0
    return np.where(negative, ~codes, codes).astype(codes.dtype, copy=False), negative
