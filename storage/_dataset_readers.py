"""Reading a dataset: opening and checking its arrays, and the direct chunk reader behind portion reads.

Part of :mod:`storage._dataset` (split by concern: metadata, location, validation, readers, the class).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import zarr
from zarr.errors import BaseZarrError

from distbelief.errors import StoreError

from ._dataset_location import _Location
from ._dataset_meta import _Meta

# ------------------------------------------------------------------------------------------- readers


def _plain_layout(arr: zarr.Array[Any], chunk_shape: tuple[int, ...], dtype: str = "<f8") -> bool:
    """True when chunks are raw little-endian ``dtype`` at the standard keys, so they can be read directly."""
    try:
        # zarr's internals may move between versions: on any surprise, use zarr's own reader instead.
        from zarr.codecs import BytesCodec
        from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding
        from zarr.core.metadata import ArrayV3Metadata

        meta = arr.metadata
        if not isinstance(meta, ArrayV3Metadata):
            return False
        codecs = meta.codecs
        return (
            sys.byteorder == "little"
            and arr.dtype == np.dtype(dtype)
            and tuple(arr.chunks) == chunk_shape
            and len(codecs) == 1
            and isinstance(codecs[0], BytesCodec)
            and codecs[0].endian is not None
            and codecs[0].endian.value == "little"
            and isinstance(meta.chunk_key_encoding, DefaultChunkKeyEncoding)
            and meta.chunk_key_encoding.separator == "/"
        )
    except (AttributeError, ImportError, TypeError):
        return False


class _ShortReadError(Exception):
    """A chunk file is missing or shorter than the metadata says: fall back to zarr."""


def _read_exact(path: str, offset: int, buf: memoryview) -> None:
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(buf):
                got = f.readinto(buf[done:])
                if not got:
                    raise _ShortReadError(path)
                done += got
    except FileNotFoundError as exc:
        raise _ShortReadError(path) from exc


def _open_checked(loc: _Location, *, expected_id: str | None) -> tuple[_Meta, tuple[zarr.Array[Any], ...]]:
    where = loc.url
    hint = "build one with Dataset.from_arrays / from_npz / from_csv, or check the path"
    try:
        group = zarr.open_group(loc.store(read_only=True), mode="r")
    except FileNotFoundError as exc:
        raise StoreError(f"no dataset at {where}: {hint}") from exc
    except (BaseZarrError, OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"cannot open {where} as a dataset ({exc}); {hint}") from exc
    meta = _Meta.from_attrs(dict(group.attrs), where)
    if expected_id is not None and meta.dataset_id != expected_id:
        raise StoreError(
            f"the dataset at {where} was replaced after this Dataset object was made; open it again"
        )
    if meta.layout == "csr":
        from . import _sparse

        return meta, _sparse.checked_arrays(group, meta, where)
    try:
        X, y = group["X"], group["y"]
    except KeyError as exc:
        raise StoreError(f"{where}: the dataset is damaged (missing array {exc}); rebuild it") from exc
    n, d = meta.n_rows, meta.n_features
    if not isinstance(X, zarr.Array) or not isinstance(y, zarr.Array):
        raise StoreError(f"{where}: the dataset is damaged (X or y is not an array); rebuild it")
    if X.shape != (n, d) or y.shape != (n,) or X.dtype != np.float64 or y.dtype != np.float64:
        raise StoreError(
            f"{where}: the dataset is damaged (X {X.shape} {X.dtype}, y {y.shape} {y.dtype} do not match "
            f"the metadata n_rows={n}, n_features={d}, float64); rebuild it"
        )
    if X.chunks != (meta.chunk_rows, d) or y.chunks != (meta.chunk_rows,):
        raise StoreError(f"{where}: the dataset is damaged (chunks do not match chunk_rows); rebuild it")
    return meta, (X, y)
