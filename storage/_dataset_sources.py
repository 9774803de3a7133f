"""Datasets built from data where it lives: Dask arrays (written by the workers), xarray.

Behind :meth:`Dataset.from_dask` and :meth:`Dataset.from_xarray` (tables: Parquet and Dask DataFrames are in
:mod:`storage._dataset_frames`).

:func:`dataset_from_dask` never brings the rows to the client: the client creates the (empty) zarr arrays
and the metadata, and every worker writes the chunks of the blocks it computes (``dask.array.store`` into
the zarr arrays). The Dask array is first rechunked along rows onto the dataset's chunk grid, so every
block is a whole number of zarr chunks and no two writers touch one chunk. The checks the client cannot
make without the rows (no NaN/inf, the kind of labels) are reductions computed on the workers: only a few
scalars (and, for integer labels, the classes that occur) come back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError

from ._dataset import Dataset, _commit, _create_arrays, _precheck
from ._dataset_location import PathLike, _location
from ._dataset_meta import _LABEL_KINDS, LabelKind, _Meta
from ._dataset_validation import _detect_labels, _layout

__all__ = ["compute_on", "dataset_from_dask", "dataset_from_xarray"]


def _finite_block(
    block: np.ndarray[Any, Any], block_info: dict[Any, Any] | None = None
) -> np.ndarray[Any, Any]:
    """The block as float64, or a :class:`DatasetError` naming the first NaN/inf (run on a worker)."""
    out = np.ascontiguousarray(block, dtype=np.float64)
    bad = ~np.isfinite(out)
    if bad.any():
        where = np.argwhere(bad)[0]
        row0 = block_info[0]["array-location"][0][0] if block_info else 0
        what = "X" if out.ndim == 2 else "y"
        at = f"row {int(where[0]) + row0}" + (f", column {int(where[1])}" if out.ndim == 2 else "")
        raise DatasetError(f"{what} holds NaN or inf at {at}; clean or impute the data first")
    return out


def _label_kind(y: Any, label_kind: object, n_classes: object, compute: Any) -> tuple[LabelKind, int | None]:
    """The kind of labels of the Dask array ``y``, from reductions on the workers (never ``y`` itself)."""
    import dask.array as da

    if label_kind is not None and label_kind not in _LABEL_KINDS:
        raise InvalidOptionError(f"label_kind must be one of {_LABEL_KINDS} or None, got {label_kind!r}")
    is_int = (y == da.floor(y)).all()
    is01 = ((y == 0.0) | (y == 1.0)).all()
    all_int, all01, low, high = compute(is_int, is01, y.min(), y.max())
    if all01 or (all_int and low >= 0):
        if high >= y.shape[0]:
            # Classes 0..max cannot all occur in fewer rows: no need to count them (a bincount of
            # integer-valued regression targets, e.g. 1e10, would not fit in memory). 0 and max stand in.
            return _detect_labels(np.array([0.0, float(high)]), label_kind, n_classes)
        # Integer labels: the classes that occur (at most max+1 <= rows of them) stand in for y in the
        # usual check.
        counts = compute(da.bincount(y.astype(np.int64), minlength=1))
        sample = np.flatnonzero(np.asarray(counts)).astype(np.float64)
        return _detect_labels(sample, label_kind, n_classes)
    if label_kind in ("binary", "classes"):
        raise DatasetError(
            f"label_kind={label_kind!r} needs integer labels 0..K-1 (0/1 for binary), but y holds "
            "other values; "
            "encode the classes first, e.g. with numpy.unique(y, return_inverse=True)"
        )
    return _detect_labels(np.array([0.5]), label_kind, n_classes)


def dataset_from_dask(
    X: Any,
    y: Any,
    *,
    path: PathLike,
    portion_rows: int | None = None,
    chunk_rows: int | None = None,
    label_kind: LabelKind | None = None,
    n_classes: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    client: Any = None,
    _extra: dict[str, Any] | None = None,
) -> Dataset:
    """Write the Dask arrays ``X`` and ``y`` as a dataset at ``path``, each worker writing its own chunks.

    See :meth:`Dataset.from_dask`. ``_extra``: more metadata fields (feature names, encoding) to record.
    """
    import dask.array as da

    for name, arr, ndim in (("X", X, 2), ("y", y, 1)):
        if not isinstance(arr, da.Array):
            raise DatasetError(
                f"{name} must be a dask.array.Array, got {type(arr).__name__}: use from_arrays"
            )
        if arr.ndim != ndim:
            raise DatasetError(f"{name} must be {ndim}-D, got shape {arr.shape}")
        if any(np.isnan(s) for s in arr.shape):
            raise DatasetError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first")
        if arr.dtype.kind not in "biuf":
            raise DatasetError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    n, d = (int(s) for s in X.shape)
    if n == 0 or d == 0:
        raise DatasetError(f"X must have at least one row and one column, got shape {X.shape}")
    if int(y.shape[0]) != n:
        raise DatasetError(f"X has {n} rows but y has {y.shape[0]} labels; give exactly one label per row")
    if client is not None:
        from ._cluster import as_client

        client = as_client(client)  # a scheduler address too
    loc = _location(path, storage_options)
    _precheck(loc, overwrite)
    c, p = _layout(n, d, portion_rows, chunk_rows)

    def compute(*values: Any) -> Any:
        out = compute_on(client, list(values))
        return tuple(out) if len(values) > 1 else out[0]

    Xc = X.rechunk({0: c, 1: -1}).map_blocks(_finite_block, dtype=np.float64)
    yc = y.rechunk(c).map_blocks(_finite_block, dtype=np.float64)
    kind, k = _label_kind(yc, label_kind, n_classes, compute)
    meta = _Meta.fresh(n, d, c, p, kind, k)
    if _extra:
        meta = dataclasses.replace(meta, **_extra)

    def write(group: Any) -> None:
        targets: list[Any] = list(_create_arrays(group, meta))
        stored = da.store([Xc, yc], targets, lock=False, compute=False)
        compute(stored)

    _commit(loc, meta, write, overwrite=overwrite)
    return Dataset(loc, meta, p)


def compute_on(client: Any, values: list[Any]) -> list[Any]:
    """``values`` (Dask collections, delayed objects) computed on ``client``, or on Dask's default
    scheduler for None."""
    import dask

    return list(client.compute(values, sync=True)) if client is not None else list(dask.compute(*values))


def _check_features(features: Sequence[Any], label: object) -> None:
    """Refuse no features, or the label among them (a model would learn the label from itself)."""
    if not features:
        raise DatasetError("features must list at least one column (or None: every column but the label)")
    if label in features:
        raise DatasetError(f"{label!r} is the label; drop it from features")


def _columns(ds: Any, names: str | Sequence[str], what: str) -> Any:
    """``ds[names]`` as a 2-D (rows x features) array, lazy if the variables are Dask-backed."""
    import dask.array as da

    listed = [names] if isinstance(names, str) else list(names)
    missing = [v for v in listed if v not in ds.variables]
    if not listed or missing:
        raise DatasetError(
            f"{what}: no variable {missing[0] if missing else names!r} in the xarray dataset (it has "
            f"{sorted(map(str, ds.data_vars))}); pass the names of its variables"
        )
    arrays = [ds[v].data for v in listed]
    if len(arrays) == 1 and arrays[0].ndim == 2:
        return arrays[0]
    if any(a.ndim != 1 for a in arrays):
        raise DatasetError(
            f"{what}: pass one 2-D variable (rows x features) or several 1-D variables along the rows; "
            f"got shapes {[a.shape for a in arrays]}"
        )
    if any(isinstance(a, da.Array) for a in arrays):
        return da.stack([da.asarray(a) for a in arrays], axis=1)
    return np.column_stack(arrays)


def dataset_from_xarray(
    ds: Any, *, features: str | Sequence[str], label: str, path: PathLike, **kw: Any
) -> Dataset:
    """See :meth:`Dataset.from_xarray`."""
    import dask.array as da
    import xarray as xr

    if not isinstance(ds, xr.Dataset):
        raise DatasetError(f"from_xarray needs an xarray.Dataset, got {type(ds).__name__}")
    _check_features([features] if isinstance(features, str) else list(features), label)
    X = _columns(ds, features, "features")
    if isinstance(label, str) and label in ds.variables:
        y = ds[label].data
    else:
        raise DatasetError(
            f"label: no variable {label!r} in the xarray dataset (it has {sorted(map(str, ds.data_vars))})"
        )
    if isinstance(X, da.Array) or isinstance(y, da.Array):
        return dataset_from_dask(da.asarray(X), da.asarray(y), path=path, **kw)
    kw.pop("client", None)
    return Dataset.from_arrays(X, y, path=path, **kw)
