"""Opening zarr (v3) stores from a directory path or any fsspec URL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zarr
import zarr.storage

from distbelief.errors import StoreError

__all__ = ["normalize_url", "open_group", "open_store"]


def normalize_url(path_or_url: str | os.PathLike[str]) -> str:
    """A canonical string for a store location: an absolute local path, or the URL unchanged.

    Examples
    --------
    >>> normalize_url("file:///tmp/x")
    '/tmp/x'
    """
    text = os.fspath(path_or_url)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" in text:
        return text.rstrip("/")
    return str(Path(text).expanduser().absolute())


def open_store(url: str, *, read_only: bool = False) -> zarr.storage.StoreLike:
    """The zarr store object for ``url`` (a local directory, or fsspec for anything with a scheme)."""
    url = normalize_url(url)
    if "://" in url:
        try:
            return zarr.storage.FsspecStore.from_url(url, read_only=read_only)
        except Exception as exc:  # fsspec raises many kinds for unknown protocols
            raise StoreError(
                f"cannot open the store {url!r}: {exc}; check the URL and its fsspec driver"
            ) from exc
    return zarr.storage.LocalStore(url, read_only=read_only)


def open_group(url: str, *, mode: str = "r") -> Any:
    """Open the zarr group at ``url`` (``mode`` as in :func:`zarr.open_group`)."""
    try:
        return zarr.open_group(store=open_store(url, read_only=mode == "r"), mode=mode)  # type: ignore[arg-type]
    except FileNotFoundError as exc:
        raise StoreError(f"no zarr store at {url!r}; create it first or check the path") from exc
