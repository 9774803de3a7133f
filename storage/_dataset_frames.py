"""Datasets from tables: Parquet files (one, a directory, a glob) and Dask DataFrames, encoded on the workers.

Behind :meth:`Dataset.from_parquet` and :meth:`Dataset.from_dask` given a Dask DataFrame.

A table is a list of *parts* (a Parquet file's row groups, or a partition of a Dask DataFrame), each read
and encoded by one task on a worker. Rows are counted without the data: for Parquet from the files' footers
(metadata only), for a Dask DataFrame by ``len`` of every partition, computed on the workers.

Why not ``dask.dataframe.read_parquet(...).to_dask_array(lengths=True)`` (what this replaced): dask computes
``lengths=True`` as ``frame.map_partitions(len).compute()``, and ``compute`` *optimizes* the expression:
once the columns are projected, dask's Parquet reader fuses several files into one partition (fewer
columns, fewer bytes a file), so it returns fewer lengths than the unoptimized frame's ``.values`` has
blocks (``'lengths' does not match the number of partitions. 2 != 4``) on every directory or glob of more
than one file. Here the parts are fixed once (``to_delayed()`` optimizes the Dask DataFrame a single time)
and both the lengths and the blocks come from the same parts.

Columns are encoded by kind (errors name the column):

numbers
    As they are (float64); NaN/inf refused.
bool
    0/1.
strings, categoricals, objects
    Refused unless an encoding is chosen. ``categorical="onehot"``: one 0/1 column per category, the
    categories of every column found in one pass over the parts on the workers and sorted (so the columns
    do not depend on the order the parts finish in); at most ``max_categories`` a column.
    ``hash_features=2**k``: the dataset is sparse; its columns are the numeric and bool columns, then
    ``2**k`` hashed columns. A value ``v`` of column ``c`` is the token ``"c=v"`` (``str(v)``), hashed as
    scikit-learn's ``FeatureHasher(n_features=2**k, input_type="string", alternate_sign=True)`` does
    (signed 32-bit MurmurHash3, seed 0: column ``abs(h) % 2**k``, value ``+1`` if ``h >= 0`` else ``-1``).
    Missing values (None/NaN) in such columns are refused.
"""

from __future__ import annotations

import posixpath
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError

from ._dataset import Dataset, _commit, _precheck
from ._dataset_location import PathLike, _location
from ._dataset_meta import WriteOptions, _Meta
from ._dataset_sources import _check_features, compute_on, dataset_from_dask
from ._dataset_validation import _detect_labels

__all__ = ["Encoding", "dataset_from_frame", "dataset_from_parquet"]

Categorical = Literal["error", "onehot"]

#: The options of dataset_from_dask that a table passes on (besides path and client).
_WRITE_OPTIONS = frozenset(WriteOptions.__annotations__)
#: Parquet parts aim at about this many uncompressed bytes (whole row groups; a bigger group is one part).
_PART_BYTES = 64 << 20


@dataclass(frozen=True)
class Encoding:
    """How the columns of a table become the float64 columns of ``X`` (built on the client, sent to tasks)."""

    numeric: tuple[str, ...]
    bools: tuple[str, ...]
    categorical: tuple[str, ...]
    label: str
    categories: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    hash_features: int | None = None

    @property
    def feature_names(self) -> list[str]:
        """The names of the encoded columns (hashed ones as ``hash[i]``)."""
        names = [*self.numeric, *self.bools]
        if self.hash_features is not None:
            return [*names, *(f"hash[{i}]" for i in range(self.hash_features))]
        for col in self.categorical:
            names += [f"{col}={v}" for v in self.categories[col]]
        return names

    @property
    def n_features(self) -> int:
        n = len(self.numeric) + len(self.bools)
        if self.hash_features is not None:
            return n + self.hash_features
        return n + sum(len(self.categories[c]) for c in self.categorical)


# ------------------------------------------------------------------------------------ column kinds


def _kinds(
    dtypes: dict[str, Any],
    features: Sequence[str],
    label: str,
    categorical: object,
    hash_features: object,
    max_categories: object,
) -> Encoding:
    """Sort the features by kind and check the options; refuse what cannot be encoded, naming the column."""
    import pandas as pd

    if categorical not in ("error", "onehot"):
        raise InvalidOptionError(f"categorical must be 'error' or 'onehot', got {categorical!r}")
    if hash_features is not None:
        if isinstance(hash_features, bool) or not isinstance(hash_features, int) or hash_features < 1:
            raise InvalidOptionError(
                f"hash_features must be a positive int such as 2**20, got {hash_features!r}"
            )
        if categorical == "onehot":
            raise InvalidOptionError("choose one encoding: categorical='onehot' or hash_features, not both")
    if isinstance(max_categories, bool) or not isinstance(max_categories, int) or max_categories < 1:
        raise InvalidOptionError(f"max_categories must be a positive int, got {max_categories!r}")
    numeric: list[str] = []
    bools: list[str] = []
    cats: list[str] = []
    for col in features:
        dt = dtypes[col]
        if pd.api.types.is_bool_dtype(dt):
            bools.append(col)
        elif pd.api.types.is_numeric_dtype(dt) and not pd.api.types.is_complex_dtype(dt):
            numeric.append(col)
        elif (
            isinstance(dt, pd.CategoricalDtype)
            or pd.api.types.is_string_dtype(dt)
            or pd.api.types.is_object_dtype(dt)
        ):
            if categorical == "error" and hash_features is None:
                raise DatasetError(
                    f"column {col!r} holds {dt} values, not numbers; encode it with categorical='onehot' "
                    "(few distinct values) or hash_features=2**20 (many), or leave it out of features"
                )
            cats.append(col)
        else:
            raise DatasetError(
                f"column {col!r} has dtype {dt}, which cannot be a feature; convert it to numbers or "
                "leave it out of features"
            )
    ldt = dtypes[label]
    if not (pd.api.types.is_numeric_dtype(ldt) or pd.api.types.is_bool_dtype(ldt)) or (
        pd.api.types.is_complex_dtype(ldt)
    ):
        raise DatasetError(
            f"label column {label!r} has dtype {ldt}; labels must be numbers (classes as 0..K-1): encode "
            "it first, e.g. df[label].cat.codes"
        )
    hashed = None if hash_features is None else int(hash_features)
    return Encoding(tuple(numeric), tuple(bools), tuple(cats), label, {}, hashed)


def _values(df: Any, col: str) -> Any:
    """The values of a categorical column, refusing missing ones (runs on a worker)."""
    s = df[col]
    if s.isna().any():
        row = int(np.flatnonzero(s.isna().to_numpy())[0])
        raise DatasetError(
            f"column {col!r} has a missing value (part row {row}); fill it first, e.g. "
            f"df[{col!r}].fillna('missing')"
        )
    return s


def _scan(df: Any, cats: tuple[str, ...], limit: int) -> tuple[int, dict[str, list[Any]]]:
    """Rows and distinct values of the categorical columns of one part (runs on a worker).

    At most ``limit + 1`` values a column come back: one more than allowed is enough to refuse the column,
    and a column of ids (a million distinct values) does not travel to the client.
    """
    return len(df), {c: list(_values(df, c).astype(object).unique()[: limit + 1]) for c in cats}


def _sort_key(v: Any) -> tuple[str, str]:
    return (type(v).__name__, str(v))


# ------------------------------------------------------------------------------------------ encoding


def _numbers(df: Any, enc: Encoding) -> np.ndarray[Any, Any]:
    """The numeric and bool columns as float64, refusing NaN/inf by column name (runs on a worker)."""
    cols = [*enc.numeric, *enc.bools]
    out = np.empty((len(df), len(cols)), dtype=np.float64)
    for j, col in enumerate(cols):
        out[:, j] = _finite(df, col, "column", "clean or impute it first")
    return out


def _label(df: Any, enc: Encoding) -> np.ndarray[Any, Any]:
    return _finite(df, enc.label, "label column", "drop those rows first")


def _finite(df: Any, col: str, what: str, fix: str) -> np.ndarray[Any, Any]:
    """Column ``col`` as float64, refused by name (``what`` and ``fix`` say how) unless every value is a
    finite number."""
    try:
        v = df[col].to_numpy(dtype=np.float64, na_value=np.nan)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{what} {col!r} does not convert to numbers: {exc}") from exc
    bad = ~np.isfinite(v)
    if bad.any():
        raise DatasetError(
            f"{what} {col!r} holds NaN, inf or a missing value "
            f"(part row {int(np.flatnonzero(bad)[0])}); {fix}"
        )
    return np.asarray(v)


def encode_dense(df: Any, enc: Encoding) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(X, y)`` of one part, one-hot encoding the categorical columns (runs on a worker)."""
    import pandas as pd

    blocks = [_numbers(df, enc)]
    for col in enc.categorical:
        cats = enc.categories[col]
        codes = pd.Categorical(_values(df, col).astype(object), categories=list(cats)).codes
        if (codes < 0).any():  # pragma: no cover - the categories come from the same data
            raise DatasetError(f"column {col!r} changed while it was read; build the dataset again")
        onehot = np.zeros((len(df), len(cats)), dtype=np.float64)
        onehot[np.arange(len(df)), codes] = 1.0
        blocks.append(onehot)
    return np.concatenate(blocks, axis=1), _label(df, enc)


def _hash_tokens(tokens: Sequence[str], n_features: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Column and sign of every token: scikit-learn's ``FeatureHasher`` of each alone (one +-1 a row)."""
    from sklearn.feature_extraction import FeatureHasher

    if not tokens:  # (FeatureHasher refuses no rows at all)
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    hashed = FeatureHasher(n_features=n_features, input_type="string").transform([[t] for t in tokens])
    return hashed.indices.astype(np.int64), hashed.data.astype(np.float64)


def encode_hashed(df: Any, enc: Encoding) -> tuple[Any, np.ndarray[Any, Any]]:
    """``(X, y)`` of one part, ``X`` a CSR array: numeric columns, then the hashed tokens (on a worker)."""
    import pandas as pd
    import scipy.sparse as sp

    assert enc.hash_features is not None
    n, d0 = len(df), len(enc.numeric) + len(enc.bools)
    num = _numbers(df, enc)
    r, c = np.nonzero(num)
    rows, cols, vals = [r], [c], [num[r, c]]
    for col in enc.categorical:
        codes, uniques = pd.factorize(_values(df, col).astype(object), sort=False)
        where, sign = _hash_tokens([f"{col}={v}" for v in uniques], enc.hash_features)
        rows.append(np.arange(n))
        cols.append(where[codes] + d0)
        vals.append(sign[codes])
    coo = (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols)))
    X = sp.csr_array(coo, shape=(n, enc.n_features))  # duplicates (collisions) add up
    X.sum_duplicates()
    X.eliminate_zeros()  # colliding tokens of opposite signs cancel, as in FeatureHasher
    return X, _label(df, enc)


def _hashed_counts(df: Any, enc: Encoding) -> tuple[int, int]:
    X, _ = encode_hashed(df, enc)
    return X.shape[0], int(X.nnz)


# ------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _ParquetPart:
    fs: Any
    path: str
    row_groups: tuple[int, ...]
    n_rows: int


def _read_part(part: _ParquetPart, columns: list[str]) -> Any:
    """One part of a Parquet file as a pandas DataFrame (runs on a worker)."""
    import pyarrow.parquet as pq

    with part.fs.open(part.path, "rb") as f:
        table = pq.ParquetFile(f).read_row_groups(list(part.row_groups), columns=columns)
    return table.to_pandas()


def _parquet_files(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, list[str]]:
    """The filesystem and the sorted Parquet files of a file, a directory (recursively) or a glob."""
    import fsspec

    try:
        fs, where = fsspec.core.url_to_fs(url, **(storage_options or {}))
        paths = sorted(fs.glob(where)) if any(m in where for m in "*?[") else [where]
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read {url!r} as Parquet: {exc}") from exc
    files: list[str] = []
    for p in paths:
        if fs.isdir(p):
            for f in fs.find(p):
                parts = posixpath.relpath(f, p).split("/")
                # Hive-style metadata files (_metadata, _SUCCESS) and hidden files are not data.
                if not any(s.startswith(("_", ".")) for s in parts):
                    files.append(f)
        elif fs.isfile(p) and (p == where or not posixpath.basename(p).startswith(("_", "."))):
            files.append(p)  # a glob such as rows/* skips _SUCCESS as a directory does; a named file is read
    if not files:
        raise DatasetError(f"cannot read {url!r} as Parquet: no files there; check the path or glob")
    return fs, sorted(files)


def _parquet_parts(url: str, storage_options: dict[str, Any] | None) -> tuple[list[_ParquetPart], Any]:
    """The parts (row groups of about ``_PART_BYTES``) of every file, and the first file's pandas dtypes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, files = _parquet_files(url, storage_options)
    parts: list[_ParquetPart] = []
    schema: Any = None
    for path in files:
        try:
            with fs.open(path, "rb") as f:
                md = pq.ParquetFile(f).metadata  # the footer only
                file_schema = md.schema.to_arrow_schema()
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise DatasetError(f"cannot read {path!r} (of {url!r}) as Parquet: {exc}") from exc
        if schema is None:
            schema, first = file_schema, path
        elif file_schema.names != schema.names:
            raise DatasetError(
                f"{path!r} has columns {file_schema.names} but {first!r} has {schema.names}; every file of "
                f"{url!r} must have the same columns"
            )
        group: list[int] = []
        rows = size = 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            if group and size + rg.total_byte_size > _PART_BYTES:
                parts.append(_ParquetPart(fs, path, tuple(group), rows))
                group, rows, size = [], 0, 0
            group.append(g)
            rows += rg.num_rows
            size += rg.total_byte_size
        if rows:
            parts.append(_ParquetPart(fs, path, tuple(group), rows))
    if not parts:
        raise DatasetError(f"{url!r} holds no rows")
    dtypes = dict(schema.empty_table().to_pandas().dtypes.items())
    return parts, dtypes


# ------------------------------------------------------------------------------------------- building


def _columns(columns: list[str], features: Sequence[str] | None, label: str, where: str) -> list[str]:
    wanted = [c for c in columns if c != label] if features is None else list(features)
    _check_features(wanted, label)
    missing = [c for c in [*wanted, label] if c not in columns]
    if missing:
        raise DatasetError(f"{where} has no column {missing[0]!r} (it has {columns}); pass its column names")
    if len(set(wanted)) != len(wanted):
        raise DatasetError(f"features list a column twice: {wanted}")
    return wanted


def _build(
    parts: list[Any],
    lengths: list[int] | None,
    dtypes: dict[str, Any],
    features: list[str],
    label: str,
    *,
    path: PathLike,
    categorical: Categorical,
    max_categories: int,
    hash_features: int | None,
    client: Any,
    kw: dict[str, Any],
) -> Dataset:
    """Encode the delayed pandas parts on the workers and write the dataset (see the module docstring)."""
    import dask
    import dask.array as da

    if client is not None:
        from ._cluster import as_client

        client = as_client(client)

    unknown = sorted(set(kw) - _WRITE_OPTIONS)
    if unknown:
        raise InvalidOptionError(
            f"unexpected options {unknown}; the options are those of Dataset.from_dask: "
            f"{sorted(_WRITE_OPTIONS)}"
        )
    enc = _kinds(dtypes, features, label, categorical, hash_features, max_categories)
    # Refuse an existing target before any pass over the data.
    _precheck(_location(path, kw.get("storage_options")), kw.get("overwrite", False))
    if lengths is None or (enc.categorical and enc.hash_features is None):
        scans = compute_on(
            client,
            [
                dask.delayed(_scan)(p, enc.categorical if enc.hash_features is None else (), max_categories)
                for p in parts
            ],
        )
        lengths = [n for n, _ in scans]
        cats: dict[str, tuple[Any, ...]] = {}
        for col in enc.categorical if enc.hash_features is None else ():
            seen = {v for _, found in scans for v in found[col]}
            if len(seen) > max_categories:
                raise DatasetError(
                    f"column {col!r} has more than max_categories={max_categories} distinct values; pass "
                    "hash_features=2**20 to hash it, or a larger max_categories"
                )
            cats[col] = tuple(sorted(seen, key=_sort_key))
        enc = Encoding(enc.numeric, enc.bools, enc.categorical, label, cats, enc.hash_features)
    if sum(lengths) == 0:
        raise DatasetError("the table has no rows")
    if enc.hash_features is not None:
        return _write_hashed(parts, enc, path=path, client=client, kw=kw)
    d = enc.n_features
    xs, ys = [], []
    for p, n in zip(parts, lengths, strict=True):
        if n == 0:
            continue
        out = dask.delayed(encode_dense, nout=2)(p, enc)
        xs.append(da.from_delayed(out[0], shape=(n, d), dtype=np.float64))
        ys.append(da.from_delayed(out[1], shape=(n,), dtype=np.float64))
    extra = {"feature_names": tuple(enc.feature_names), "encoding": _encoding_attrs(enc)}
    return dataset_from_dask(
        da.concatenate(xs), da.concatenate(ys), path=path, client=client, _extra=extra, **kw
    )


def _encoding_attrs(enc: Encoding) -> dict[str, Any]:
    """How the columns were encoded, as JSON for the dataset's attributes."""
    return {
        "numeric": list(enc.numeric),
        "bool": list(enc.bools),
        "categorical": list(enc.categorical),
        "categories": {c: [str(v) for v in vs] for c, vs in enc.categories.items()},
        "hash_features": enc.hash_features,
        "label": enc.label,
    }


def _write_hashed(
    parts: list[Any], enc: Encoding, *, path: PathLike, client: Any, kw: dict[str, Any]
) -> Dataset:
    """Hash on the workers; the CSR blocks come back one part at a time and are appended to the dataset.

    The client holds about two parts' nonzeros at a time (never the whole table).
    """
    import dask

    from . import _sparse

    loc = _location(path, kw.get("storage_options"))
    overwrite = kw.get("overwrite", False)
    _precheck(loc, overwrite)
    counts = compute_on(client, [dask.delayed(_hashed_counts)(p, enc) for p in parts])
    n = sum(c[0] for c in counts)
    nnz = sum(c[1] for c in counts)
    if n == 0:
        raise DatasetError("the table has no rows")
    d = enc.n_features
    c, p, chunk_nnz = _sparse.sparse_layout(n, nnz, d, kw.get("portion_rows"), kw.get("chunk_rows"))
    meta = _sparse._new_meta(n, d, c, p, "real", None)
    final: list[_Meta] = []

    def blocks() -> Iterator[_sparse._Block]:
        futures: deque[Any] = deque()
        for part, (rows, _) in zip(parts, counts, strict=True):
            if not rows:
                continue
            task = dask.delayed(encode_hashed)(part, enc)
            if client is None:
                yield _as_block(dask.compute(task)[0])
                continue
            futures.append(client.compute(task))  # the next part is encoded while this one is written
            if len(futures) > 1:
                yield _as_block(futures.popleft().result())
        while futures:
            yield _as_block(futures.popleft().result())

    def write(group: Any) -> None:
        _sparse._write_csr(group, blocks(), meta, nnz, chunk_nnz)
        y = np.asarray(group["y"][:], dtype=np.float64)
        kind, k = _detect_labels(y, kw.get("label_kind"), kw.get("n_classes"))
        done = _named_meta(meta, enc, kind, k)
        group.attrs.update(done.to_attrs())
        final.append(done)

    _commit(loc, meta, write, overwrite=bool(overwrite))
    return _sparse.SparseDataset(loc, final[0], final[0].portion_rows)


def _as_block(out: tuple[Any, np.ndarray[Any, Any]]) -> Any:
    X, y = out
    return X.indptr, X.indices, X.data, y


def _named_meta(meta: Any, enc: Encoding, kind: Any, k: int | None) -> Any:
    import dataclasses

    return dataclasses.replace(
        meta,
        label_kind=kind,
        n_classes=k,
        feature_names=(*enc.numeric, *enc.bools),  # the hashed columns' names are made on demand
        encoding=_encoding_attrs(enc),
    )


def dataset_from_parquet(
    url: str,
    *,
    features: Sequence[str] | None = None,
    label: str,
    path: PathLike,
    storage_options: dict[str, Any] | None = None,
    target_storage_options: dict[str, Any] | None = None,
    categorical: Categorical = "error",
    max_categories: int = 100,
    hash_features: int | None = None,
    client: Any = None,
    **kw: Any,
) -> Dataset:
    """See :meth:`Dataset.from_parquet`."""
    try:
        import dask
        import pyarrow  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InvalidOptionError(
            f"from_parquet needs pyarrow and dask: pip install 'distbelief[parquet]' ({exc})"
        ) from exc
    parts, dtypes = _parquet_parts(url, storage_options)
    wanted = _columns(list(map(str, dtypes)), features, label, repr(url))
    columns = [*wanted, label]
    delayed = [dask.delayed(_read_part)(p, columns) for p in parts]
    return _build(
        delayed, [p.n_rows for p in parts], dtypes, wanted, label, path=path, categorical=categorical,
        max_categories=max_categories, hash_features=hash_features, client=client,
        kw={**kw, "storage_options": target_storage_options},
    )  # fmt: skip


def dataset_from_frame(
    frame: Any,
    label: Any,
    *,
    path: PathLike,
    features: Sequence[str] | None = None,
    categorical: Categorical = "error",
    max_categories: int = 100,
    hash_features: int | None = None,
    client: Any = None,
    **kw: Any,
) -> Dataset:
    """A dataset from a Dask DataFrame and its label column (a name, or a Dask Series), on the workers.

    See :meth:`Dataset.from_dask`.
    """
    import dask.dataframe as dd

    if isinstance(label, dd.Series):
        name = str(label.name) if label.name is not None else "__label__"
        if name in frame.columns:
            name = "__label__"
        frame = frame.assign(**{name: label})
        label = name
    if not isinstance(label, str):
        raise DatasetError(
            f"with a Dask DataFrame X, y must be the name of its label column or a Dask Series, got "
            f"{type(label).__name__}"
        )
    columns = [str(c) for c in frame.columns]
    wanted = _columns(columns, features, label, "the Dask DataFrame")
    frame = frame[[*wanted, label]]
    dtypes = {str(k): v for k, v in frame.dtypes.items()}
    # to_delayed optimizes the graph once: the lengths and the blocks are computed from the same parts.
    parts = frame.to_delayed(optimize_graph=True)
    return _build(
        list(parts), None, dtypes, wanted, label, path=path, categorical=categorical,
        max_categories=max_categories, hash_features=hash_features, client=client, kw=kw,
    )  # fmt: skip
