"""Where a dataset lives: a local directory or an fsspec URL, dataset names, and listing a root.

Part of :mod:`storage._dataset` (split by concern: metadata, location, validation, readers, the class).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Literal, cast

from zarr.storage import FsspecStore, LocalStore

from distbelief.errors import DatasetError, InvalidOptionError

from ._dataset_meta import FORMAT_NAME

PathLike = str | os.PathLike[str]
#: The one rule for dataset names (no separators, no "..", a safe alphabet): the regular expression the API
#: schema publishes (the routes apply :func:`resolve_name` itself, with messages that say what to fix).
DATASET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
DATASET_NAME_RULE = "1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
_NAME_RE = re.compile(DATASET_NAME_PATTERN)


# --------------------------------------------------------------------------------------------- locations


def _is_url(path: str) -> bool:
    # Same rule as zarr's own store handling (zarr.storage._common._is_fsspec_uri).
    return "://" in path or ("::" in path and "local://" not in path)


@dataclass(frozen=True)
class _Location:
    """Where a dataset lives: an absolute local directory, or an fsspec URL (plus its storage options)."""

    url: str
    local: bool
    storage_options: dict[str, Any] | None = None

    def store(self, *, read_only: bool) -> LocalStore | FsspecStore:
        if self.local:
            return LocalStore(self.url, read_only=read_only)
        return FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)

    def _fs(self) -> tuple[Any, str]:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(self.url, **(self.storage_options or {}))
        return fs, cast(str, path)

    def sibling(self, name: str) -> _Location:
        if self.local:
            return _Location(os.path.join(os.path.dirname(self.url), name), True)
        head = self.url.rstrip("/").rpartition("/")[0]
        return _Location(f"{head}/{name}", False, self.storage_options)

    def child(self, name: str) -> _Location:
        if self.local:
            return _Location(os.path.join(self.url, name), True)
        return _Location(f"{self.url.rstrip('/')}/{name}", False, self.storage_options)

    @property
    def basename(self) -> str:
        return self.url.rstrip("/").rpartition("/")[2] or "dataset"

    def probe(self) -> Literal["missing", "empty", "dataset", "other"]:
        """Say what the location holds, without trusting it to be well formed."""
        if self.local:
            if not os.path.lexists(self.url):
                return "missing"
            if not os.path.isdir(self.url) or os.path.islink(self.url):
                return "other"
            if not os.listdir(self.url):
                return "empty"
            try:
                with open(os.path.join(self.url, "zarr.json"), "rb") as f:
                    raw = f.read()
            except OSError:
                return "other"
        else:
            fs, path = self._fs()
            if not fs.exists(path):
                return "missing"
            if not fs.isdir(path):
                return "other"
            if not fs.ls(path, detail=False):
                return "empty"
            try:
                raw = fs.cat_file(path.rstrip("/") + "/zarr.json")
            except (OSError, KeyError):
                return "other"
        try:
            doc = json.loads(raw)
        except ValueError:
            return "other"
        ok = isinstance(doc, dict) and (doc.get("attributes") or {}).get("format") == FORMAT_NAME
        return "dataset" if ok else "other"

    def make_parents(self) -> list[str]:
        """Create missing parent directories (local only); return the ones created, deepest first."""
        if not self.local:
            return []
        missing: list[str] = []
        parent = os.path.dirname(self.url)
        while parent and not os.path.exists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            os.mkdir(d)
        return missing

    def remove(self) -> None:
        if self.local:
            if os.path.lexists(self.url):
                if os.path.isdir(self.url) and not os.path.islink(self.url):
                    shutil.rmtree(self.url)
                else:
                    os.remove(self.url)
        else:
            fs, path = self._fs()
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def rename(self, target: _Location) -> None:
        if self.local:
            os.rename(self.url, target.url)
        else:
            fs, path = self._fs()
            _, target_path = target._fs()
            fs.mv(path, target_path, recursive=True)


def _location(path: object, storage_options: dict[str, Any] | None) -> _Location:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise InvalidOptionError(
            f"path must be a directory path or an fsspec URL (a non-empty string), got {path!r}"
        )
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidOptionError(
            f"storage_options must be a dict or None, got {type(storage_options).__name__}"
        )
    for prefix in ("file://", "local://"):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    else:
        if _is_url(path):
            return _Location(path.rstrip("/") or path, False, storage_options or None)
    if storage_options:
        raise InvalidOptionError(
            "storage_options only apply to fsspec URLs (such as 's3://bucket/data'); "
            f"{path!r} is a local path, so drop storage_options"
        )
    return _Location(os.path.abspath(os.path.expanduser(path)), True)


def resolve_name(root: PathLike, name: str) -> str:
    """Map a dataset *name* to its location directly under the directory (or URL) ``root``.

    This is how untrusted names (from the REST service) become paths: the name must be one plain path
    component, so it can never point outside ``root``.

    Parameters
    ----------
    root : str or os.PathLike
        Directory (or fsspec URL) that holds datasets, for example ``<store>/datasets``.
    name : str
        Dataset name: 1 to 128 characters from ``A-Z a-z 0-9 . _ -``, starting with a letter or digit.

    Returns
    -------
    str
        The absolute local path (or the URL) of the dataset.

    Raises
    ------
    DatasetError
        If the name is empty, contains a path separator, is ``.``/``..`` or otherwise does not match
        :data:`DATASET_NAME_PATTERN`.

    Examples
    --------
    >>> resolve_name("/srv/store/datasets", "digits-train")
    '/srv/store/datasets/digits-train'
    >>> resolve_name("/srv/store/datasets", "../etc")
    Traceback (most recent call last):
    ...
    distbelief.errors.DatasetError: dataset name '../etc' contains a path separator; ...
    """
    if not isinstance(name, str):
        raise DatasetError(f"dataset name must be a string, got {type(name).__name__}")
    rule = f"use {DATASET_NAME_RULE}"
    if not name:
        raise DatasetError(f"dataset name is empty; {rule}")
    if "/" in name or "\\" in name or os.sep in name or (os.altsep and os.altsep in name):
        raise DatasetError(f"dataset name {name!r} contains a path separator; {rule}")
    if name in (".", ".."):
        raise DatasetError(f"dataset name {name!r} would leave the dataset directory; {rule}")
    if not _NAME_RE.fullmatch(name):
        raise DatasetError(f"dataset name {name!r} is not allowed; {rule}")
    return _location(root, None).child(name).url


def list_datasets(root: PathLike, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Names of the datasets directly under ``root`` (sorted); temporary and foreign entries are skipped.

    Parameters
    ----------
    root : str or os.PathLike
        Directory (or fsspec URL) that holds datasets. A missing directory holds none.
    storage_options : dict, optional
        fsspec options when ``root`` is a URL.

    Returns
    -------
    list of str
        Names that :func:`resolve_name` maps back to the datasets.

    Examples
    --------
    >>> import numpy as np, tempfile
    >>> from distbelief.storage import Dataset
    >>> root = tempfile.mkdtemp()
    >>> _ = Dataset.from_arrays(np.ones((3, 2)), np.zeros(3), path=resolve_name(root, "ones"))
    >>> list_datasets(root)
    ['ones']
    """
    loc = _location(root, storage_options)
    if loc.local:
        names = os.listdir(loc.url) if os.path.isdir(loc.url) else []
    else:
        fs, path = loc._fs()
        names = (
            [p.rstrip("/").rpartition("/")[2] for p in fs.ls(path, detail=False)] if fs.isdir(path) else []
        )
    return sorted(n for n in names if _NAME_RE.fullmatch(n) and loc.child(n).probe() == "dataset")
