"""Where the service keeps its state: job records (JSON), metrics (xarray in zarr), results and datasets.

Layout under the store root (a directory or any fsspec URL)::

    datasets/<name>/             datasets written by the service (storage.Dataset)
    dataset-links/<name>.json    datasets registered by URL: {"url": ...}
    jobs/<id>/job.json           the job record
    jobs/<id>/metrics.zarr       one row per iteration (xarray: values[<dim>, metric])
    jobs/<id>/params.npy         the parameters the run ended with
    jobs/<id>/run/               the run's parameter-server checkpoints (sandblaster's store=)

Metrics are one 2-D float64 array with the metric names in the attributes rather than one array per
metric: writing 15 small zarr arrays costs ~0.1 s, one costs ~0.02 s, and a running job rewrites its metrics
about once a second.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import posixpath
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import xarray as xr
from pydantic import ValidationError

from distbelief.errors import ConflictError, StoreError
from distbelief.storage import resolve_name

from .schemas import JobPublic

__all__ = ["JobStore", "json_safe"]

_log = logging.getLogger("distbelief.api")

METRICS_FORMAT = "distbelief.metrics"

# Markers in the hidden names of interrupted writes (see JobStore.clean_leftovers): ``.NAME.tmp-*`` is a copy
# being written, ``.NAME.old-*`` the copy it replaces, ``.NAME.del-*`` one being deleted.
_STAGED = ".tmp-"
_REPLACED = ".old-"
_DELETED = ".del-"
_SET_ASIDE = ".aside-"
_ASIDE = re.compile(r"\.(?P<id>.+)\.aside-[0-9a-f]+")
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]+")


class SharedLock:
    """A lock with a shared side (many holders at once) and an exclusive side (one holder, re-entrant for its
    thread, which may also take the shared side). A waiting exclusive holder goes before new shared ones.

    Examples
    --------
    >>> lock = SharedLock()
    >>> with lock.shared(), lock.shared():
    ...     pass
    >>> with lock.exclusive(), lock.exclusive(), lock.shared():
    ...     pass
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the shared side."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
            else:
                self._cond.wait_for(lambda: self._owner is None and not self._waiting)
                self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                if self._owner == me:
                    self._depth -= 1
                else:
                    self._readers -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the exclusive side."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and not self._readers)
                finally:
                    self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._cond.notify_all()


class JobStore:
    """Reads and writes the service's state under one root directory or fsspec URL.

    Parameters
    ----------
    url : str
        Root of the store (created if missing).

    Examples
    --------
    >>> import tempfile
    >>> store = JobStore(tempfile.mkdtemp())
    >>> store.save_record(JobPublic(id="0123456789abcdef", algorithm="sandblaster-lbfgs", status="queued",
    ...     model={"kind": "logistic", "n_features": 4}, dataset="d", options={}, created_at="2026-01-01"))
    >>> [r.status for r in store.load_records()]
    ['queued']
    """

    def __init__(self, url: str) -> None:
        text = os.path.expanduser(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(text)
        except (ValueError, ImportError) as exc:
            raise StoreError(f"cannot open the store {url!r}: {exc}; check DISTBELIEF_STORE") from exc
        self.local = "file" in _protocols(self.fs)
        self._join: Callable[..., str] = os.path.join if self.local else posixpath.join
        #: Held exclusively while the set of dataset names changes (an upload installed, a dataset deleted or
        #: registered), shared while a job is admitted: a job is never accepted on a dataset that is going
        #: away, and submissions do not wait for each other.
        self.datasets_lock = SharedLock()
        #: Bumped whenever a dataset is installed, deleted, registered or forgotten: what was read of the
        #: datasets at an older version may be stale (see JobRunner.open_dataset, which caches by it).
        self.datasets_version = 0
        self._version_lock = threading.Lock()
        self._writing: set[str] = set()
        self.root: str = os.path.abspath(root) if self.local else root.rstrip("/")
        try:
            self.fs.makedirs(self._path("jobs"), exist_ok=True)
            self.fs.makedirs(self._path("datasets"), exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store at {url!r}: {exc}; check DISTBELIEF_STORE") from exc

    # -- locations ----------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return self._join(self.root, *parts)

    def url(self, *parts: str) -> str:
        """A location under the root, as a plain path (local) or a URL with its protocol."""
        path = self._path(*parts)
        return path if self.local else self.fs.unstrip_protocol(path)

    @property
    def datasets_root(self) -> str:
        """Where datasets live (the root for :func:`storage.resolve_name`)."""
        return self.url("datasets")

    def run_dir(self, job_id: str) -> str:
        """The ``store=`` of a job's run (its checkpoints)."""
        return self.url("jobs", job_id, "run")

    def contains(self, url: str) -> bool:
        """Whether a local path or URL lies inside the store root (after resolving ``..`` and links)."""
        if not self.local:
            return url.rstrip("/").startswith(self.url().rstrip("/") + "/")
        text = url.removeprefix("file://")
        if "://" in text or "\x00" in text:
            return False  # a URL elsewhere, or no path (none holds a NUL byte)
        real_root = os.path.realpath(self.root)
        target = os.path.realpath(os.path.join(self.root, text))
        return os.path.commonpath([real_root, target]) == real_root and target != real_root

    def shown(self, url: str) -> str:
        """``url`` as a response may show it: a local path inside the store relative to the store's root
        (which registration takes back as it is), so that no response holds an absolute path of the
        server; a URL as it is.

        Examples
        --------
        >>> store = JobStore("/tmp/db-store")
        >>> store.shown("/tmp/db-store/imports/d"), store.shown("s3://bucket/d")
        ('imports/d', 's3://bucket/d')
        """
        text = url.removeprefix("file://")
        if not self.local or "://" in text:
            return url
        if self.contains(text):
            return os.path.relpath(os.path.realpath(text), os.path.realpath(self.root))
        return "(a path outside the store)"

    # -- small files --------------------------------------------------------------------------------
    def _write_atomic(self, path: str, data: bytes) -> None:
        # Write aside, then rename: a reader (or a crash) never sees half a record.
        self.fs.makedirs(posixpath.dirname(path) if not self.local else os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{_STAGED}{uuid.uuid4().hex[:8]}"
        self.fs.pipe_file(tmp, data)
        self._rename(tmp, path)

    def _read_json(self, path: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.fs.cat_file(path))
        except (ValueError, OSError):
            return None  # a missing, torn or foreign file: skipped, never fatal
        return data if isinstance(data, dict) else None

    # -- job records --------------------------------------------------------------------------------
    def save_record(self, record: JobPublic) -> None:
        """Write a job record as ``jobs/<id>/job.json``: every field of ``JobPublic``, keys sorted."""
        self._write_atomic(self._path("jobs", record.id, "job.json"), _dumps(record.model_dump()))

    def load_records(self) -> list[JobPublic]:
        """Every job record in the store. A field that an older record lacks takes its default (a record
        written before ``placement`` existed has none); a record that cannot be read as a ``JobPublic`` is
        set aside (see :meth:`set_aside`) rather than stop the service."""
        out = []
        for job_id in list(self._children("jobs")):
            if job_id.startswith("."):
                continue  # set aside, or a leftover (clean_leftovers)
            try:
                data = json.loads(self.fs.cat_file(self._path("jobs", job_id, "job.json")))
            except FileNotFoundError:
                continue  # no record yet (a server killed before its first write): nothing to serve
            except (ValueError, OSError) as exc:
                reason = f"its job.json is not valid JSON ({type(exc).__name__}: {exc})"
            else:
                record = _record_of(data, job_id)
                if isinstance(record, JobPublic):
                    out.append(record)
                    continue
                reason = record
            self.set_aside(job_id, reason)
        return out

    def set_aside(self, job_id: str, reason: str) -> str:
        """Move a job whose record is unusable out of the way, to a hidden folder beside the jobs that holds
        ``SET_ASIDE.txt`` (the reason); log it. Returns the folder's new path (see :meth:`set_aside_jobs`)."""
        aside = self._hide("jobs", job_id, _SET_ASIDE)
        with contextlib.suppress(OSError):
            self.fs.pipe_file(self._join(aside, "SET_ASIDE.txt"), f"{reason}\n".encode())
        _log.warning("job %s was set aside as %s: %s", job_id, aside, reason)
        return aside

    def set_aside_jobs(self) -> dict[str, tuple[str, str]]:
        """Jobs set aside by :meth:`load_records`: id -> (folder, reason)."""
        out = {}
        for entry in self._children("jobs"):
            match = _ASIDE.fullmatch(entry)
            if match is None:
                continue
            path = self._path("jobs", entry)
            try:
                reason = bytes(self.fs.cat_file(self._join(path, "SET_ASIDE.txt"))).decode("utf-8", "replace")
            except OSError:
                reason = "its record was unusable"
            out[match["id"]] = (path, reason.strip())
        return out

    def delete_set_aside(self, path: str) -> None:
        """Remove a folder of :meth:`set_aside_jobs`."""
        self._remove(path)

    def delete_job(self, job_id: str) -> None:
        """Remove everything the store holds for a job, all at once: the folder is first renamed to a hidden
        name (a reader, or a restart after a crash, sees the whole job or none of it), then removed."""
        if self.fs.exists(self._path("jobs", job_id)):
            self._remove(self._hide("jobs", job_id, _DELETED))

    def _hide(self, folder: str, name: str, marker: str) -> str:
        """Rename ``folder/name`` to a new hidden name beside it (see :meth:`clean_leftovers`); that name."""
        hidden = self._path(folder, f".{name}{marker}{uuid.uuid4().hex[:8]}")
        self._rename(self._path(folder, name), hidden)
        return hidden

    def _remove(self, path: str) -> None:
        # Best effort: what is left of a hidden folder is removed again by clean_leftovers on the next start.
        try:
            if self.local and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except OSError:
            pass

    def clean_leftovers(self) -> list[str]:
        """Remove what interrupted writes left behind (a server killed mid-upload, mid-delete, mid-record);
        run once when the service starts, before anything else writes. Returns what was removed.

        A dataset that was being replaced when the server died (its old copy set aside, the new one not yet
        in place) is put back.
        """
        removed: list[str] = []
        for entry in list(self._children("datasets")):
            match = _LEFTOVER.fullmatch(entry)
            if match is None:
                continue
            path = self._path("datasets", entry)
            name, kind = match["name"], match["kind"]
            if kind == _REPLACED[1:-1] and not self.fs.exists(self._path("datasets", name)):
                self._rename(path, self._path("datasets", name))  # the old copy, back in its place
            else:
                removed.append(path)
        for entry in list(self._children("jobs")):
            if _LEFTOVER.fullmatch(entry):
                removed.append(self._path("jobs", entry))
            else:
                removed += map(str, self.fs.glob(self._path("jobs", entry, f"*{_STAGED}*")))
        removed += map(str, self.fs.glob(self._path("dataset-links", f"*{_STAGED}*")))
        for path in removed:
            self._remove(path)
        return removed

    def _children(self, *parts: str) -> Iterator[str]:
        path = self._path(*parts)
        if not self.fs.isdir(path):
            return
        for entry in self.fs.ls(path, detail=False):
            yield str(entry).rstrip("/").rpartition("/")[2]

    # -- metrics ------------------------------------------------------------------------------------
    def save_metrics(
        self, job_id: str, dim: str, columns: Sequence[str], rows: Sequence[Sequence[float]]
    ) -> None:
        """Write a job's metrics (the first column is the index, named ``dim``) to ``metrics.zarr``."""
        values = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(columns))
        ds = xr.Dataset(
            {"values": ((dim, "metric"), values[:, 1:])},
            coords={dim: values[:, 0].astype(np.int64)},
            attrs={"format": METRICS_FORMAT, "dim": dim, "metrics": list(columns[1:])},
        )
        # Written aside and swapped in, so a server killed mid-write leaves the previous metrics readable
        # (as metrics.zarr, or as metrics.zarr.old between the two renames).
        final = self._path("jobs", job_id, "metrics.zarr")
        old = final + ".old"
        tmp = f"{final}{_STAGED}{uuid.uuid4().hex[:8]}"
        for leftover in self.fs.glob(f"{final}{_STAGED}*"):
            self.fs.rm(leftover, recursive=True)
        ds.to_zarr(tmp if self.local else self.fs.unstrip_protocol(tmp), mode="w", consolidated=False)
        if self.fs.exists(final):
            self._rename(final, old)
        self._rename(tmp, final)
        if self.fs.exists(old):
            self.fs.rm(old, recursive=True)

    def _rename(self, src: str, dst: str) -> None:
        if self.local:
            os.replace(src, dst)
        else:
            self.fs.mv(src, dst, recursive=True)

    def load_metrics(self, job_id: str) -> tuple[str, list[str], list[list[float]]] | None:
        """``(dim, columns, rows)`` of a job's stored metrics, or None if it has none.

        Raises
        ------
        distbelief.errors.StoreError
            The metrics are there but unreadable.
        """
        final = self._path("jobs", job_id, "metrics.zarr")
        problems = []
        for path in (final, final + ".old"):
            if not self.fs.exists(path):
                continue
            try:
                with xr.open_dataset(
                    path if self.local else self.fs.unstrip_protocol(path),
                    engine="zarr",
                    consolidated=False,
                    chunks=None,
                ) as ds:
                    dim = str(ds.attrs["dim"])
                    names = [str(n) for n in ds.attrs["metrics"]]
                    index = ds[dim].values.astype(np.float64)
                    values = np.asarray(ds["values"].values, dtype=np.float64)
            except (OSError, KeyError, ValueError) as exc:
                problems.append(f"{path}: {exc}")
                continue
            rows = np.column_stack([index, values.reshape(index.size, len(names))]).tolist()
            return dim, [dim, *names], rows
        if problems:
            raise StoreError(f"the metrics of job {job_id} are unreadable ({'; '.join(problems)})")
        return None

    # -- results ------------------------------------------------------------------------------------
    def save_params(self, job_id: str, x: np.ndarray) -> None:
        """Write the parameters a job ended with as ``params.npy``."""
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(x, dtype=np.float64), allow_pickle=False)
        self._write_atomic(self._path("jobs", job_id, "params.npy"), buf.getvalue())

    def load_params_bytes(self, job_id: str) -> bytes | None:
        """The ``.npy`` bytes of a job's parameters, or None."""
        try:
            return bytes(self.fs.cat_file(self._path("jobs", job_id, "params.npy")))
        except FileNotFoundError:
            return None

    # -- uploaded datasets --------------------------------------------------------------------------
    def reserve_name(self, name: str) -> None:
        """Claim ``name`` for an upload in progress (call with :attr:`datasets_lock` held).

        Raises
        ------
        distbelief.errors.ConflictError
            Another upload under that name is in progress.
        """
        if name in self._writing:
            raise ConflictError(
                f"another request is uploading a dataset named {name!r} right now; wait for it to finish "
                "(GET /api/datasets/{name}), then choose another name or send overwrite=true"
            )
        self._writing.add(name)

    def release_name(self, name: str) -> None:
        """Give up the claim of :meth:`reserve_name`."""
        with self.datasets_lock.exclusive():
            self._writing.discard(name)

    def is_being_written(self, name: str) -> bool:
        """Whether an upload under ``name`` is in progress."""
        return name in self._writing

    def staging_url(self, name: str) -> str:
        """A fresh hidden location beside the dataset ``name`` to build a new copy in (see
        :meth:`install_dataset`); a hidden name never matches a dataset name, so nothing lists it."""
        resolve_name(self.datasets_root, name)
        return self.url("datasets", f".{name}{_STAGED}{uuid.uuid4().hex[:12]}")

    def install_dataset(self, name: str, staged: str) -> None:
        """Move a dataset built at ``staged`` (from :meth:`staging_url`) into place as ``name``, replacing
        the one there: the old copy is renamed aside first and removed once the new one is in place."""
        final = self._path("datasets", posixpath.basename(resolve_name(self.datasets_root, name)))
        source = self._path("datasets", posixpath.basename(staged.rstrip("/")))
        old = None
        if self.fs.exists(final):
            old = self._hide("datasets", name, _REPLACED)
        try:
            self._rename(source, final)
        except BaseException:
            if old is not None:
                self._rename(old, final)
            raise
        self._bump_datasets_version()
        if old is not None:
            self._remove(old)

    def _bump_datasets_version(self) -> None:
        """Count one change of the datasets, under a lock: ``+=`` on an attribute is a read and a write,
        which CPython 3.11's GIL happens not to split, but a free-threaded Python would (two request threads
        changing datasets at once would count one change, and a runner would keep a stale dataset)."""
        with self._version_lock:
            self.datasets_version += 1

    def discard_staged(self, staged: str) -> None:
        """Remove a staged copy that will not be installed."""
        self._remove(self._path("datasets", posixpath.basename(staged.rstrip("/"))))

    def delete_dataset(self, name: str) -> None:
        """Remove an uploaded dataset (``name`` is checked by :func:`storage.resolve_name`) all at once: it is
        renamed to a hidden name first, so no reader ever sees half of it."""
        final = self._path("datasets", posixpath.basename(resolve_name(self.datasets_root, name)))
        if self.fs.exists(final):
            doomed = self._hide("datasets", name, _DELETED)
            self._bump_datasets_version()
            self._remove(doomed)

    # -- registered datasets ------------------------------------------------------------------------
    def save_link(self, name: str, url: str) -> None:
        """Register an existing dataset at ``url`` under ``name``."""
        self._write_atomic(self._path("dataset-links", f"{name}.json"), _dumps({"name": name, "url": url}))
        self._bump_datasets_version()

    def links(self) -> dict[str, str]:
        """Registered datasets: name -> URL."""
        out = {}
        for entry in self._children("dataset-links"):
            if entry.endswith(".json"):
                data = self._read_json(self._path("dataset-links", entry))
                if data and isinstance(data.get("url"), str) and data.get("name") == entry[:-5]:
                    out[entry[:-5]] = data["url"]
        return out

    def delete_link(self, name: str) -> bool:
        """Forget a registered dataset; whether there was one."""
        path = self._path("dataset-links", f"{name}.json")
        if not self.fs.exists(path):
            return False
        self.fs.rm(path)
        self._bump_datasets_version()
        return True


def _record_of(data: Any, job_id: str) -> JobPublic | str:
    """The content of ``jobs/<job_id>/job.json`` as that job's record, or why it is not one.

    Examples
    --------
    >>> _record_of({"id": "0123456789abcdef", "status": "queued"}, "0123456789abcdef")
    'its job.json does not hold a job record (algorithm: Field required; model: Field required; ...)'
    """
    if not isinstance(data, dict):
        return "its job.json holds no JSON object"
    if data.get("id") != job_id:
        return f"its job.json names another id ({str(data.get('id'))[:40]!r})"
    try:
        return JobPublic.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)[:5]
        )
        return f"its job.json does not hold a job record ({problems})"


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _dumps(obj: Any) -> bytes:
    return json.dumps(json_safe(obj), indent=1, sort_keys=True).encode("utf-8")


def json_safe(obj: Any) -> Any:
    """``obj`` as plain JSON: NaN and inf become null (JSON has neither), numpy scalars Python ones, and
    anything else that JSON cannot hold its ``str``.

    Examples
    --------
    >>> json_safe({"a": float("nan"), "b": (np.int64(2), 1.5)})
    {'a': None, 'b': [2, 1.5]}
    """
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)
