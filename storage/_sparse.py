"""Sparse datasets: rows kept in zarr as CSR (``indptr``, ``indices``, ``data``), split into portions by rows.

Wide sparse problems (hashed features for click-through or text: 1e7-1e9 columns, tens of nonzeros a row;
DESIGN.md "Next") cannot be stored dense. A sparse dataset is a zarr v3 group like a dense one (same
metadata, ``layout = "csr"`` and ``format_version = 2``) with four 1-D arrays:

``indptr``  int64, ``n_rows + 1``, chunks of ``chunk_rows``
    *Global* offsets: row ``i`` holds the nonzeros ``indptr[i]:indptr[i + 1]`` of ``indices``/``data``.
    They are the per-portion nonzero offsets too: portion ``[start, stop)`` owns
    ``indptr[start]:indptr[stop]``.
``indices`` int32 (int64 beyond ``2**31 - 1`` features), ``nnz``, chunks of ``chunk_nnz`` nonzeros
    Column of every nonzero, sorted within each row, no duplicates.
``data``    float64, ``nnz``, chunks of ``chunk_nnz``
    The (finite, nonzero) values.
``y``       float64, ``n_rows``, chunks of ``chunk_rows`` (as in a dense dataset)

``chunk_nnz`` is about the nonzeros of one row chunk, so a portion (several row chunks) spans a few nonzero
chunks. Reading portion ``[start, stop)`` reads ``indptr[start:stop + 1]`` (8 bytes a row, from at most two
chunks when ``stop`` ends a chunk), then ``indices``/``data`` ``[indptr[start]:indptr[stop]]``, then ``y``.
On a local store with raw chunks (the layout written here) those are byte-range reads of exactly the bytes
asked for: ``16 + 12 * nnz`` bytes a row plus 8 (int32 indices), never a neighbour's nonzeros. Through
fsspec, zarr reads whole chunks: at most one ``chunk_nnz`` chunk of each array more at either end.

Rows come back as :class:`scipy.sparse.csr_array` (int32/int64 indices, float64 data, sorted, no
duplicates, no stored zeros).

:func:`from_svmlight` streams svmlight/libsvm text (gzip too), ``batch_lines`` lines at a time, in two
passes: the first validates every line and counts rows and nonzeros (so bad input fails before anything is
written, and the chunk layout is known), the second writes whole chunks as they fill. What it holds is a
batch of lines and their arrays, one partly filled chunk per array, and at the end the labels (8 bytes a
row, to detect their kind, as :meth:`Dataset.read_labels` would hold them anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
import zarr

from distbelief.errors import DatasetError, InvalidOptionError, StoreError

from ._dataset import Dataset, _commit, _precheck
from ._dataset_location import PathLike, _location
from ._dataset_meta import _Meta
from ._dataset_readers import _plain_layout, _read_exact, _ShortReadError
from ._dataset_validation import _as_labels, _check_int, _detect_labels, _layout

__all__ = [
    "LAYOUT",
    "SparseDataset",
    "as_csr",
    "freeze",
    "from_sparse",
    "from_svmlight",
    "is_sparse",
    "nbytes",
    "row_of",
]

#: ``layout`` attribute of a sparse dataset (a dense one has ``"dense"``).
LAYOUT = "csr"
#: Format version written for sparse datasets: readers of version 1 refuse them instead of misreading them.
FORMAT_VERSION = 2
#: Nonzero chunks hold at least this many entries (tiny chunks would mean one file per few rows).
_MIN_CHUNK_NNZ = 4096
#: from_arrays writes the CSR input in blocks of about this many nonzeros (bounded temporary copies).
_BLOCK_NNZ = 1 << 22
_INT32_MAX = 2**31 - 1

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
CSR = Any  # scipy.sparse.csr_array or csr_matrix (scipy ships no usable type stubs)


def is_sparse(X: object) -> bool:
    """Whether ``X`` is a ``scipy.sparse`` matrix or array."""
    return bool(sp.issparse(X))


def nbytes(X: Any) -> int:
    """Bytes held by rows ``X``, dense or sparse (``data + indices + indptr``)."""
    if sp.issparse(X):
        return int(X.data.nbytes + X.indices.nbytes + X.indptr.nbytes)
    return int(X.nbytes)


def freeze(X: Any) -> None:
    """Make rows ``X`` (dense or CSR) read-only: a cache shares them, and a write would corrupt the others."""
    for arr in (X.data, X.indices, X.indptr) if sp.issparse(X) else (X,):
        arr.flags.writeable = False


def index_dtype(n_features: int) -> type[np.integer[Any]]:
    """int32 column indices while they fit (12 instead of 16 bytes a nonzero), else int64."""
    return np.int32 if n_features - 1 <= _INT32_MAX else np.int64


def row_of(indptr: npt.NDArray[np.integer[Any]], k: int) -> int:
    """The row of CSR nonzero number ``k``: the last row starting at or before it.

    Examples
    --------
    >>> row_of(np.array([0, 2, 2, 5]), 2)
    2
    """
    return int(np.searchsorted(indptr, k, side="right")) - 1


# ------------------------------------------------------------------------------------------ validation


def as_csr(X: Any) -> CSR:
    """``X`` as a checked canonical CSR (sorted, no duplicates, no stored zeros, float64); X is unchanged."""
    if X.ndim != 2:
        raise DatasetError(f"X must be 2-D (rows x features); got a sparse array of shape {X.shape}")
    if X.dtype.kind not in "biuf":
        what = "complex numbers" if X.dtype.kind == "c" else f"dtype {X.dtype}"
        raise DatasetError(f"X holds {what}; values must be real numbers: convert them first")
    n, d = X.shape
    if n == 0 or d == 0:
        raise DatasetError(f"X is empty (shape {X.shape}); a dataset needs at least one row and one feature")
    csr = X.tocsr()
    indptr, indices = np.asarray(csr.indptr), np.asarray(csr.indices)
    # A CSR built from raw arrays is only shape-checked by scipy: check the structure before using it.
    if indptr.shape != (n + 1,) or indptr[0] != 0 or (np.diff(indptr) < 0).any():
        raise DatasetError(
            "X is a malformed CSR matrix (indptr must start at 0, rise monotonically and have n_rows + 1 "
            "entries); rebuild it, e.g. with scipy.sparse.csr_array((data, (rows, cols)), shape=...)"
        )
    nnz = int(indptr[-1])
    if indices.shape[0] < nnz or np.asarray(csr.data).shape[0] < nnz:
        raise DatasetError("X is a malformed CSR matrix (indptr points past its indices/data); rebuild it")
    bad = (indices[:nnz] < 0) | (indices[:nnz] >= d)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise DatasetError(
            f"X has column index {int(indices[k])} at row {row_of(indptr, k)}, outside 0..{d - 1}; "
            f"fix the indices or build X with shape (n_rows, {int(indices[:nnz].max()) + 1})"
        )
    data = np.asarray(csr.data[:nnz])
    nonfinite = ~np.isfinite(data) if data.dtype.kind == "f" else np.zeros(0, bool)
    if nonfinite.any():
        k = int(np.flatnonzero(nonfinite)[0])
        raise DatasetError(
            f"X has {int(nonfinite.sum())} non-finite values (NaN or inf), the first at row "
            f"{row_of(indptr, k)}, column {int(indices[k])}; remove or impute them before building a dataset"
        )
    canonical = (
        csr.has_canonical_format
        and data.dtype == np.float64
        and indices.shape[0] == nnz
        and (data != 0).all()
    )
    if not canonical:
        csr = sp.csr_array(
            (data.astype(np.float64), indices[:nnz].copy(), indptr.copy()), shape=(n, d), copy=False
        )
        csr.sum_duplicates()  # sorts too; duplicates add up, which is what the matrix means
        csr.eliminate_zeros()
    return cast(CSR, csr)


def sparse_layout(
    n_rows: int, nnz: int, n_features: int, portion_rows: object, chunk_rows: object
) -> tuple[int, int, int]:
    """``(chunk_rows, portion_rows, chunk_nnz)`` of a sparse dataset.

    Rows are laid out like a dense dataset whose rows take as many bytes as a sparse row on average
    (``12`` or ``16`` bytes a nonzero, plus ``indptr`` and ``y``), so the dense defaults (about 64 portions,
    1024 rows to 8 MiB a portion) carry over; a nonzero chunk holds about one row chunk's nonzeros.
    """
    per_nnz = np.dtype(index_dtype(n_features)).itemsize + 8
    row_bytes = per_nnz * nnz / n_rows + 16
    c, p = _layout(n_rows, max(1, math.ceil(row_bytes / 8)), portion_rows, chunk_rows)
    chunk_nnz = max(_MIN_CHUNK_NNZ, math.ceil(nnz * c / n_rows))
    return c, p, chunk_nnz


def _new_meta(n_rows: int, n_features: int, c: int, p: int, kind: Any, k: int | None) -> _Meta:
    """A dense dataset's fresh metadata, marked as CSR and as the format version that older readers refuse."""
    meta = _Meta.fresh(n_rows, n_features, c, p, kind, k)
    return dataclasses.replace(meta, format_version=FORMAT_VERSION, layout=LAYOUT)


# ---------------------------------------------------------------------------------------------- writing


class _Appender:
    """Appends to a 1-D zarr array, writing whole chunks only.

    zarr rewrites a chunk on every partial write (read, patch, write), so writing batch by batch would
    rewrite a chunk once per batch that touches it; buffering up to a chunk writes each chunk once.
    """

    def __init__(self, arr: zarr.Array[Any]) -> None:
        self.arr = arr
        self.chunk = int(arr.chunks[0])
        self.pos = 0
        self.parts: list[np.ndarray[Any, Any]] = []
        self.buffered = 0

    def add(self, values: np.ndarray[Any, Any]) -> None:
        if values.size:
            self.parts.append(values)
            self.buffered += values.size
        if self.buffered >= self.chunk:
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        if not self.buffered:
            return
        values = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        k = values.size if final else values.size - values.size % self.chunk
        if self.pos + values.size > self.arr.shape[0]:
            raise DatasetError(
                "the input changed while it was being written (more values than counted); write it again"
            )
        self.arr[self.pos : self.pos + k] = values[:k]
        self.pos += k
        rest = values[k:]
        self.parts = [rest] if rest.size else []
        self.buffered = rest.size

    def close(self) -> None:
        self._flush(final=True)
        if self.pos != self.arr.shape[0]:
            raise DatasetError(
                "the input changed while it was being written (fewer values than counted); write it again"
            )


def _create(group: zarr.Group, name: str, size: int, chunk: int, dtype: Any) -> zarr.Array[Any]:
    # The options of the dense arrays (storage/_dataset.py _write_arrays): raw chunks, no empty-chunk scan.
    return group.create_array(
        name,
        shape=(size,),
        chunks=(max(1, min(chunk, size)),),
        dtype=dtype,
        compressors=None,
        filters=None,
        fill_value=0,
        config={"write_empty_chunks": True},
        dimension_names=("nonzero" if name in ("indices", "data") else "row",),
    )


#: One block of rows: ``(indptr, indices, data, y)``, ``indptr`` local (starting at the block's first
#: nonzero, not necessarily 0), ``indices`` already as stored (zero-based).
_Block = tuple[IntArray, npt.NDArray[np.integer[Any]], FloatArray, FloatArray]


def _write_csr(
    group: zarr.Group,
    blocks: Iterable[_Block],
    meta: _Meta,
    nnz: int,
    chunk_nnz: int,
) -> None:
    n, c = meta.n_rows, meta.chunk_rows
    idx_dtype = index_dtype(meta.n_features)
    out = {
        "indptr": _Appender(_create(group, "indptr", n + 1, c, np.int64)),
        "indices": _Appender(_create(group, "indices", nnz, chunk_nnz, idx_dtype)),
        "data": _Appender(_create(group, "data", nnz, chunk_nnz, np.float64)),
        "y": _Appender(_create(group, "y", n, c, np.float64)),
    }
    out["indptr"].add(np.zeros(1, np.int64))
    offset = 0
    for ptr, ind, dat, yb in blocks:
        out["indptr"].add(np.asarray(ptr[1:], dtype=np.int64) - int(ptr[0]) + offset)
        offset += int(ptr[-1] - ptr[0])
        out["indices"].add(np.asarray(ind, dtype=idx_dtype))
        out["data"].add(np.asarray(dat, dtype=np.float64))
        out["y"].add(np.asarray(yb, dtype=np.float64))
    for appender in out.values():
        appender.close()


def from_sparse(
    X: Any,
    y: Any,
    *,
    path: PathLike,
    portion_rows: int | None,
    chunk_rows: int | None,
    label_kind: Any,
    n_classes: int | None,
    overwrite: bool,
    storage_options: dict[str, Any] | None,
) -> SparseDataset:
    """:meth:`Dataset.from_arrays` for a ``scipy.sparse`` ``X`` (see there); returns a sparse dataset."""
    loc = _location(path, storage_options)
    _precheck(loc, overwrite)
    csr = as_csr(X)
    n, d = csr.shape
    ya = _as_labels(y, n)
    kind, k = _detect_labels(ya, label_kind, n_classes)
    indptr, indices, data = csr.indptr, csr.indices, csr.data
    c, p, chunk_nnz = sparse_layout(n, int(indptr[-1]), d, portion_rows, chunk_rows)
    meta = _new_meta(n, d, c, p, kind, k)
    per_block = max(c, c * (_BLOCK_NNZ // max(1, chunk_nnz)))

    def blocks() -> Iterator[_Block]:
        for r0 in range(0, n, per_block):
            r1 = min(n, r0 + per_block)
            a, b = int(indptr[r0]), int(indptr[r1])
            yield indptr[r0 : r1 + 1], indices[a:b], data[a:b], ya[r0:r1]

    _commit(
        loc,
        meta,
        lambda group: _write_csr(group, blocks(), meta, int(indptr[-1]), chunk_nnz),
        overwrite=overwrite,
    )
    return SparseDataset(loc, meta, p)


# -------------------------------------------------------------------------------------------- svmlight


@dataclasses.dataclass
class _Parsed:
    """One batch of svmlight lines as arrays (indices as written in the file, before any shift)."""

    indptr: IntArray
    indices: IntArray
    data: FloatArray
    y: FloatArray
    lines: list[int]  # the line number of every row

    def line_of(self, k: int) -> int:
        """Line number of the row holding nonzero ``k``."""
        return self.lines[row_of(self.indptr, k)]


@dataclasses.dataclass
class _Scan:
    n_rows: int = 0
    nnz: int = 0
    min_index: int | None = None
    max_index: int | None = None


def _open_source(source: str, storage_options: dict[str, Any] | None) -> Callable[[], Any]:
    """A function opening ``source`` (a local path or an fsspec URL) as binary lines, gunzipped if needed."""

    @contextlib.contextmanager
    def opener() -> Iterator[Any]:
        import fsspec

        try:
            raw = fsspec.open(source, "rb", **(storage_options or {})).open()
        except (OSError, ValueError) as exc:
            raise DatasetError(f"cannot read {source!r}: {exc}") from exc
        try:
            head = raw.read(2)
            raw.seek(0)
            # By content, not by name: a gzipped file need not end in .gz. (GzipFile does not close raw.)
            yield gzip.GzipFile(fileobj=raw, mode="rb") if head == b"\x1f\x8b" else raw
        finally:
            raw.close()

    return opener


def _batches(
    opener: Callable[[], Any], batch_lines: int, where: str
) -> Iterator[tuple[list[int], list[bytes]]]:
    """``(line numbers, lines)`` of at most ``batch_lines`` lines at a time; only one batch is held."""
    try:
        with opener() as f:
            numbers: list[int] = []
            lines: list[bytes] = []
            for lineno, line in enumerate(f, 1):
                numbers.append(lineno)
                lines.append(line)
                if len(lines) >= batch_lines:
                    yield numbers, lines
                    numbers, lines = [], []
            if lines:
                yield numbers, lines
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetError(f"cannot read {where}: {exc}") from exc


def _parse(numbers: list[int], lines: list[bytes], where: str, ignore_qid: bool) -> _Parsed:
    """Parse a batch of svmlight lines ``label [qid:q] index:value ... [# comment]``."""
    labels: list[bytes] = []
    feats: list[bytes] = []
    counts: list[int] = []
    rows_at: list[int] = []  # line number of every row (blank and comment lines are not rows)
    for lineno, line in zip(numbers, lines, strict=True):
        toks = line.partition(b"#")[0].split()
        if not toks:
            continue
        rest = toks[1:]
        if rest and rest[0].startswith(b"qid:"):
            if not ignore_qid:
                raise DatasetError(
                    f"{where}, line {lineno}: has a query id ({rest[0].decode(errors='replace')}), i.e. "
                    "ranking data; no model here uses query ids: pass ignore_qid=True to drop them"
                )
            rest = rest[1:]
        labels.append(toks[0])
        feats.extend(rest)
        counts.append(len(rest))
        rows_at.append(lineno)
    n = len(labels)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])

    def line_of(k: int) -> int:  # line number of the nonzero k
        return rows_at[row_of(indptr, k)]

    y = _numbers(labels, np.float64, lambda i: f"{where}, line {rows_at[i]}: label", is_label=True)
    bad = ~np.isfinite(y)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DatasetError(
            f"{where}, line {rows_at[i]}: label {float(y[i])!r} is not finite; fix or drop that line"
        )
    if not feats:
        return _Parsed(indptr, np.zeros(0, np.int64), np.zeros(0), y, rows_at)
    # Split every "index:value" at once: one colon per token, two fields per token. Python's int/float over
    # the fields are ~10x faster than numpy's conversion from bytes arrays (measured: 0.74 s a batch of
    # 4096 lines x 40 features with np.strings.partition + astype, see the report of issue 13).
    joined = b" ".join(feats)
    fields = joined.replace(b":", b" ").split()
    if joined.count(b":") != len(feats) or len(fields) != 2 * len(feats) or b"_" in joined:
        for k, tok in enumerate(feats):
            i_s, colon, v_s = tok.partition(b":")
            if not (colon and i_s and v_s) or b":" in v_s or b"_" in tok:
                raise DatasetError(
                    f"{where}, line {line_of(k)}: {tok.decode(errors='replace')!r} is not a feature "
                    "'index:value'; every field after the label must be index:value (a comment starts with #)"
                )
    indices = _numbers(fields[0::2], np.int64, lambda k: f"{where}, line {line_of(k)}: feature index")
    data = _numbers(fields[1::2], np.float64, lambda k: f"{where}, line {line_of(k)}: value")
    bad = indices < 0
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise DatasetError(f"{where}, line {line_of(k)}: feature index {int(indices[k])} is negative")
    bad = ~np.isfinite(data)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise DatasetError(
            f"{where}, line {line_of(k)}: the value of feature {int(indices[k])} is {float(data[k])!r}; "
            "every value must be finite: remove or impute it"
        )
    # Sorted within each row, no duplicates (scipy's canonical CSR): sort stably by (row, index).
    row = np.repeat(np.arange(n), counts)
    if (np.diff(indices) <= 0).any():
        order = np.lexsort((indices, row))
        indices, data = indices[order], data[order]
        dup = (np.diff(indices) == 0) & (np.diff(row) == 0)
        if dup.any():
            k = int(np.flatnonzero(dup)[0])
            raise DatasetError(
                f"{where}, line {line_of(k)}: feature index {int(indices[k])} appears twice; "
                "give every feature at most once a line"
            )
    zero = data == 0.0
    if zero.any():  # stored zeros are not nonzeros: drop them, as from_arrays does
        keep = ~zero
        indices, data = indices[keep], data[keep]
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(row[keep], minlength=n), out=indptr[1:])
    return _Parsed(indptr, indices, data, y, rows_at)


def _numbers(
    tokens: list[bytes], dtype: Any, what: Callable[[int], str], *, is_label: bool = False
) -> np.ndarray[Any, Any]:
    convert = int if dtype is np.int64 else float
    try:
        return np.array(list(map(convert, tokens)), dtype=dtype)
    except (ValueError, OverflowError):
        pass
    # Only on failure: find the first token that does not convert, to say where it is.
    for k, tok in enumerate(tokens):
        try:
            np.array([convert(tok)], dtype=dtype)
        except (ValueError, OverflowError):
            text = tok.decode(errors="replace")
            hint = "an integer" if dtype is np.int64 else "a number"
            if is_label and b"," in tok:
                hint += " (multilabel lines are not supported)"
            raise DatasetError(f"{what(k)} {text!r} is not {hint}") from None
    raise AssertionError("unreachable: a conversion failed but every token converts")


def _shift(p: _Parsed, zero_based: bool, n_features: int | None, where: str) -> None:
    """Check the indices of a batch against ``zero_based``/``n_features``, and make them zero-based."""
    if not zero_based:
        if p.indices.size and int(p.indices.min()) == 0:
            k = int(np.flatnonzero(p.indices == 0)[0])
            raise DatasetError(
                f"{where}, line {p.line_of(k)}: feature index 0, but zero_based=False (indices start at 1); "
                "pass zero_based=True or 'auto'"
            )
        p.indices -= 1
    if n_features is not None:
        _check_past(p, n_features, n_features, where, shown_offset=0 if zero_based else 1)


def _check_past(p: _Parsed, limit: int, n_features: int, where: str, *, shown_offset: int = 0) -> None:
    """Refuse an index ``>= limit`` (as shown in the file: ``+ shown_offset``), naming its line."""
    if p.indices.size and int(p.indices.max()) >= limit:
        k = int(np.flatnonzero(p.indices >= limit)[0])
        raise DatasetError(
            f"{where}, line {p.line_of(k)}: feature index {int(p.indices[k]) + shown_offset} is past "
            f"n_features={n_features}; pass a larger n_features (or None to take it from the file)"
        )


def from_svmlight(
    source: PathLike,
    *,
    path: PathLike,
    n_features: int | None = None,
    zero_based: bool | Literal["auto"] = "auto",
    ignore_qid: bool = False,
    batch_lines: int = 4096,
    portion_rows: int | None = None,
    chunk_rows: int | None = None,
    label_kind: Any = None,
    n_classes: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
) -> SparseDataset:
    """:meth:`Dataset.from_svmlight` (see there)."""
    loc = _location(path, storage_options)
    _precheck(loc, overwrite)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise InvalidOptionError(
            f"source must be a path or an fsspec URL of an svmlight file, got {source!r} (file objects "
            "cannot be read twice, which streaming needs: save it to a file first)"
        )
    if zero_based not in (True, False, "auto"):
        raise InvalidOptionError(f"zero_based must be True, False or 'auto', got {zero_based!r}")
    if not isinstance(ignore_qid, bool):
        raise InvalidOptionError(f"ignore_qid must be True or False, got {ignore_qid!r}")
    d_opt = _check_int(n_features, "n_features")
    _detect_labels(np.zeros(1), label_kind, n_classes)  # the options alone (labels: after pass 2)
    batch = cast(int, _check_int(batch_lines, "batch_lines", allow_none=False))
    where = repr(source)
    opener = _open_source(source, source_options)

    # Pass 1: validate every line and count, writing nothing.
    scan = _Scan()
    for numbers, lines in _batches(opener, batch, where):
        parsed = _parse(numbers, lines, where, ignore_qid)
        if zero_based != "auto":
            _shift(dataclasses.replace(parsed, indices=parsed.indices.copy()), bool(zero_based), d_opt, where)
        elif d_opt is not None:  # the base is known only at the end, but past d is too large either way
            _check_past(parsed, d_opt + 1, d_opt, where)
        scan.n_rows += len(parsed.y)
        scan.nnz += parsed.indices.size
        if parsed.indices.size:
            lo, hi = int(parsed.indices.min()), int(parsed.indices.max())
            scan.min_index = lo if scan.min_index is None else min(scan.min_index, lo)
            scan.max_index = hi if scan.max_index is None else max(scan.max_index, hi)
    if scan.n_rows == 0:
        raise DatasetError(
            f"{where} holds no rows (only blank or comment lines); a dataset needs at least one"
        )
    # "auto", as scikit-learn's load_svmlight_file: zero-based exactly when some index is 0.
    zb = (scan.min_index == 0) if zero_based == "auto" else bool(zero_based)
    top = -1 if scan.max_index is None else scan.max_index - (0 if zb else 1)
    if d_opt is None:
        if top < 0:
            raise DatasetError(f"{where} has no nonzero features; pass n_features to say how many there are")
        d = top + 1
    else:
        d = d_opt
        if top >= d:
            raise DatasetError(
                f"{where} has feature index {scan.max_index} but n_features={d}; pass a larger n_features"
            )
    c, p, chunk_nnz = sparse_layout(scan.n_rows, scan.nnz, d, portion_rows, chunk_rows)
    meta = _new_meta(scan.n_rows, d, c, p, "real", None)
    final: list[_Meta] = []

    def blocks() -> Iterator[_Block]:
        for numbers, lines in _batches(opener, batch, where):
            parsed = _parse(numbers, lines, where, ignore_qid)
            _shift(parsed, zb, d, where)
            yield parsed.indptr, parsed.indices, parsed.data, parsed.y

    def write(group: zarr.Group) -> None:
        _write_csr(group, blocks(), meta, scan.nnz, chunk_nnz)
        y = np.asarray(cast("zarr.Array[Any]", group["y"])[:], dtype=np.float64)
        kind, k = _detect_labels(y, label_kind, n_classes)
        done = dataclasses.replace(meta, label_kind=kind, n_classes=k)
        group.attrs.update(done.to_attrs())
        final.append(done)

    _commit(loc, meta, write, overwrite=overwrite)
    return SparseDataset(loc, final[0], final[0].portion_rows)


# ---------------------------------------------------------------------------------------------- reading


def checked_arrays(group: zarr.Group, meta: _Meta, where: str) -> tuple[zarr.Array[Any], ...]:
    """The arrays ``(indptr, y, indices, data)`` of a sparse dataset, checked against its metadata."""
    try:
        arrays = tuple(group[name] for name in ("indptr", "y", "indices", "data"))
    except KeyError as exc:
        raise StoreError(f"{where}: the sparse dataset is damaged (missing array {exc}); rebuild it") from exc
    if not all(isinstance(a, zarr.Array) for a in arrays):
        raise StoreError(f"{where}: the sparse dataset is damaged (not an array); rebuild it")
    indptr, y, indices, data = cast("tuple[zarr.Array[Any], ...]", arrays)
    n, c = meta.n_rows, meta.chunk_rows
    ok = (
        indptr.shape == (n + 1,)
        and indptr.dtype == np.int64
        and y.shape == (n,)
        and y.dtype == np.float64
        and y.chunks == (c,)
        and indptr.chunks == (min(c, n + 1),)
        and indices.ndim == 1
        and indices.shape == data.shape
        and indices.chunks == data.chunks
        and indices.dtype == np.dtype(index_dtype(meta.n_features))
        and data.dtype == np.float64
    )
    if not ok:
        raise StoreError(
            f"{where}: the sparse dataset is damaged (arrays indptr {indptr.shape} {indptr.dtype}, indices "
            f"{indices.shape} {indices.dtype}, data {data.shape} {data.dtype}, y {y.shape} do not match "
            f"n_rows={n}, chunk_rows={c}); rebuild it"
        )
    return indptr, y, indices, data


class SparseDataset(Dataset):
    """A :class:`Dataset` whose rows are sparse: :meth:`read_rows` returns a ``scipy.sparse.csr_array``.

    Made by :meth:`Dataset.from_arrays` with a ``scipy.sparse`` ``X``, by :meth:`Dataset.from_svmlight`, or
    by :meth:`Dataset.open` on a sparse dataset; the zarr layout is in the module docstring.

    Examples
    --------
    >>> import os, tempfile, numpy as np, scipy.sparse as sp
    >>> X = sp.csr_array(np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0]]))
    >>> ds = Dataset.from_arrays(X, [0, 1, 0], path=os.path.join(tempfile.mkdtemp(), "s"), portion_rows=2)
    >>> ds.layout, ds.nnz, ds.n_portions
    ('csr', 3, 2)
    >>> Xp, yp = ds.read_portion(0)
    >>> Xp.toarray().tolist(), yp.tolist()
    ([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]], [0.0, 1.0])
    """

    _plain: dict[str, bool]

    @property
    def nnz(self) -> int:
        """Number of stored nonzeros."""
        return int(self._get_arrays()[2].shape[0])

    def _set_arrays(self, arrays: tuple[zarr.Array[Any], ...]) -> None:
        self._arrays = arrays
        names = ("indptr", "y", "indices", "data")
        self._plain = {
            name: self._loc.local and _plain_layout(arr, tuple(arr.chunks), arr.dtype.str)
            for name, arr in zip(names, arrays, strict=True)
        }
        self._direct = self._plain["y"]

    # Returns CSR where the base class says ndarray (scipy's types are Any to mypy, so no override error).
    def read_rows(self, start: int, stop: int) -> tuple[sp.csr_array, FloatArray]:
        """``(X[start:stop], y[start:stop])``: a fresh ``csr_array`` and a float64 array.

        Reads ``indptr[start:stop + 1]``, then exactly the nonzeros of those rows (see the module
        docstring).
        """
        start, stop = self._check_rows(start, stop)
        indptr_arr, _, indices_arr, data_arr = self._get_arrays()
        ptr = self._read_range("indptr", indptr_arr, start, stop + 1)
        lo, hi = int(ptr[0]), int(ptr[-1])
        indices = self._read_range("indices", indices_arr, lo, hi)
        data = self._read_range("data", data_arr, lo, hi)
        ptr -= lo
        if indices.dtype != np.int64:
            ptr = ptr.astype(indices.dtype)  # scipy wants indptr and indices of one dtype
        X = sp.csr_array((data, indices, ptr), shape=(stop - start, self.n_features), copy=False)
        X.has_canonical_format = True  # written canonical: saves scipy a pass to find out
        return X, self._read("y", start, stop)

    def _read_range(self, name: str, arr: zarr.Array[Any], a: int, b: int) -> np.ndarray[Any, Any]:
        out = np.empty(b - a, dtype=arr.dtype)
        if a == b:
            return out
        if self._plain[name]:
            buf = memoryview(out.data).cast("B")
            chunk, size = int(arr.chunks[0]), out.itemsize
            try:
                for ci in range(a // chunk, (b - 1) // chunk + 1):
                    r0, r1 = max(a, ci * chunk), min(b, (ci + 1) * chunk)
                    _read_exact(
                        os.path.join(self._loc.url, name, "c", str(ci)),
                        (r0 - ci * chunk) * size,
                        buf[(r0 - a) * size : (r1 - a) * size],
                    )
                return out
            except _ShortReadError:
                pass  # let zarr fill in what is missing
            except OSError as exc:
                raise StoreError(f"cannot read {name}[{a}:{b}] of {self.url}: {exc}") from exc
        try:
            out[:] = arr[a:b]
        except (OSError, ValueError, KeyError) as exc:
            raise StoreError(f"cannot read {name}[{a}:{b}] of {self.url}: {exc}") from exc
        return out
