"""What every front door (``sandblaster.minimize``, ``downpour.train``) needs before it runs: a Dask client
(the caller's, one at a scheduler address, or the process's embedded ``LocalCluster``) and the training
rows as a :class:`Dataset`."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ipaddress
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Client
from distributed.comm import get_address_host

from distbelief.errors import ClusterError, InvalidOptionError

from ._cluster import bound_to, check_workers, resolve_client
from ._dataset import Dataset

__all__ = [
    "as_dataset",
    "embedded_client",
    "is_loopback",
    "run_store",
    "scheduler_identity",
    "start_vector",
    "wait_for_removals",
    "worker_addresses",
]


#: What a run on a cluster without workers is told.
NO_WORKERS = "the Dask cluster has no workers; start some (or wait for them) and try again"


def scheduler_identity(client: Client) -> dict[str, Any]:
    """The scheduler's identity (address, services, every worker), asked of the scheduler now.

    Not ``client.scheduler_info()``: that returns a cache which the client's periodic refresh overwrites
    with a summary that lists no workers (distributed 2026.8 refreshes with ``n_workers=0``). A call that
    races the refresh sees an empty cluster, so a live worker looks lost, or a run finds no workers to
    place its replicas on: measured 219 empty answers in 3000 calls with a 5 ms refresh interval, and a
    service job failed with ``ZeroDivisionError`` under load. Costs one scheduler round trip.

    Examples
    --------
    >>> sorted(scheduler_identity(client)["workers"])  # doctest: +SKIP
    ['tcp://127.0.0.1:40575', 'tcp://127.0.0.1:40577']
    """
    scheduler = client.scheduler
    if scheduler is None:
        raise ClusterError("the Dask client is not connected to a scheduler; pass a connected client")
    return dict(client.sync(scheduler.identity, n_workers=-1))


def worker_addresses(client: Client, *, required: bool = False) -> list[str]:
    """The addresses of the workers the scheduler lists now, sorted (see :func:`scheduler_identity`).

    With ``required``, an empty cluster raises :class:`errors.ClusterError` (a run cannot be placed).

    Examples
    --------
    >>> worker_addresses(client)  # doctest: +SKIP
    ['tcp://127.0.0.1:40575', 'tcp://127.0.0.1:40577']
    """
    workers = sorted(scheduler_identity(client)["workers"])
    if required and not workers:
        raise ClusterError(NO_WORKERS)
    return workers


def start_vector(model: Any, x0: Any, seed: int | None) -> np.ndarray:
    """A fresh float64 copy of ``x0`` (default ``model.init_params(seed)``), checked against the model.

    Examples
    --------
    >>> class M:
    ...     n_params = 2
    ...     def init_params(self, seed): return np.zeros(2)
    >>> start_vector(M(), None, 0)
    array([0., 0.])
    """
    n = int(model.n_params)
    source = model.init_params(seed) if x0 is None else x0
    x = np.array(source, dtype=np.float64, copy=True).ravel()
    if x.shape != (n,):
        raise InvalidOptionError(f"x0 has {x.size} values but the model has {n} parameters")
    if not np.all(np.isfinite(x)):
        raise InvalidOptionError("x0 holds NaN or inf values; pass a finite starting point")
    return x


@contextlib.contextmanager
def embedded_client(client: Client | str | None) -> Iterator[Client]:
    """The client a front door runs on, for the ``with`` block (see :func:`storage._cluster.resolve_client`).

    ``client`` may be a ``Client`` (the default one or not, made in any thread), a scheduler address, or
    ``None``: the default Dask client if one runs, else this process's one embedded ``LocalCluster``
    (started on first use, closed at exit). In the block the client is the current one, so the actor
    proxies the run receives talk to it (:func:`storage._cluster.bound_to`); its workers were checked once
    to run this version of distbelief (:func:`storage._cluster.check_workers`). A client whose scheduler
    and workers all listen on this machine's loopback talks to the workers directly (~1.1 ms per actor call
    instead of ~1.7 ms through the scheduler), for the ``with`` block only (its setting is restored after);
    elsewhere the workers may not be reachable from here, so a remote cluster keeps the caller's setting.

    Raises
    ------
    InvalidOptionError
        ``client`` is not a ``Client``, an address or ``None``, or a malformed address.
    ClusterError
        No scheduler at the address, or workers without (this version of) distbelief.

    Examples
    --------
    >>> with embedded_client(None) as client:   # doctest: +SKIP
    ...     print(len(worker_addresses(client)))
    2
    """
    resolved = resolve_client(client)
    check_workers(resolved)
    with bound_to(resolved), _direct_when_local(resolved):
        yield resolved


@contextlib.contextmanager
def run_store(store: str | os.PathLike[str] | None, prefix: str, *, lazy: bool = False) -> Iterator[str]:
    """``store`` as a string, or a temporary directory (named ``prefix...``) deleted after the ``with`` block.

    A front door's ``store=None`` means "keep nothing": the run's vectors, checkpoints and rows go to the
    temporary directory. It is deleted by a background thread (:func:`wait_for_removals`), not by the
    call: removing a small fit's zarr trees cost ~18 ms here (~1.3 ms per directory on this filesystem),
    as much as the fit's shards and replicas together.

    ``lazy=True``: the temporary directory is only named (unique, in this process's own temporary
    directory), made by whatever writes in it first (as a ``store`` given by the caller that does not exist
    yet), and deleted only if it was. For a caller that may not write at all: an estimator's fit in this
    process, which a ``mkdtemp`` and its removal would cost ~0.2 ms (more on a loaded machine).

    Examples
    --------
    >>> import os
    >>> with run_store(None, "doc-") as root:
    ...     os.path.basename(root).startswith("doc-"), os.path.isdir(root)
    (True, True)
    >>> wait_for_removals(); os.path.isdir(root)
    False
    >>> with run_store(None, "doc-", lazy=True) as root:
    ...     os.path.isdir(root)
    False
    """
    if store is not None:
        yield str(store)
        return
    tmp = _named_store(prefix) if lazy else tempfile.mkdtemp(prefix=prefix)
    try:
        yield tmp
    finally:
        if not lazy or os.path.lexists(tmp):
            _removals.append(_remover().submit(shutil.rmtree, tmp, True))


#: This process's directory of lazily made stores, by the id of the process that made it (a forked child
#: makes its own: the names it hands out would repeat its parent's).
_named_root: tuple[int, str] | None = None
_named_count = itertools.count()


def _named_store(prefix: str) -> str:
    """A new path in this process's directory of stores, not made yet."""
    global _named_root
    with _remover_lock:
        pid = os.getpid()
        if _named_root is None or _named_root[0] != pid:
            _named_root = (pid, tempfile.mkdtemp(prefix="distbelief-stores-"))
            atexit.register(_remove_named_root, *_named_root)
        return os.path.join(_named_root[1], f"{prefix}{next(_named_count)}")


def _remove_named_root(pid: int, root: str) -> None:
    # At exit (after the removal thread has finished its queue): only by the process that made it.
    if os.getpid() == pid:
        shutil.rmtree(root, ignore_errors=True)


_removals: list[concurrent.futures.Future[None]] = []
_remover_pool: concurrent.futures.ThreadPoolExecutor | None = None
_remover_lock = threading.Lock()


def _remover() -> concurrent.futures.ThreadPoolExecutor:
    """One thread deleting the temporary stores (joined at exit: no store is left half deleted)."""
    global _remover_pool
    with _remover_lock:
        if _remover_pool is None:
            _remover_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="distbelief-rmtree")
        del _removals[: sum(1 for f in _removals if f.done())]  # done ones first: it is a FIFO
        return _remover_pool


def wait_for_removals() -> None:
    """Wait until the temporary stores of finished calls are deleted."""
    for f in list(_removals):
        f.result()


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    Examples
    --------
    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _on_loopback(address: str) -> bool:
    """Whether the Dask ``address`` (``tcp://host:port``, ``inproc://...``) is on this machine's loopback."""
    return address.startswith("inproc://") or is_loopback(get_address_host(address))


@contextlib.contextmanager
def _direct_when_local(client: Client) -> Iterator[None]:
    """Actor calls straight to the workers (not relayed by the scheduler) when they are all on loopback."""
    addresses = []
    if not client.direct_to_workers:
        with contextlib.suppress(Exception):
            addresses = [str(getattr(client.scheduler, "address", "")), *worker_addresses(client)]
    if not addresses or not all(_on_loopback(a) for a in addresses):
        yield  # already direct, or a remote cluster: the caller's setting stays
        return
    client.direct_to_workers = True
    try:
        yield
    finally:
        client.direct_to_workers = False


def as_dataset(data: Any, store: str) -> Dataset:
    """``data`` if it is a :class:`Dataset`; an ``(X, y)`` pair is first written to ``{store}/data``.

    Examples
    --------
    >>> ds = as_dataset((np.ones((4, 2)), np.zeros(4)), tempfile.mkdtemp())   # doctest: +SKIP
    >>> ds.n_rows                                                             # doctest: +SKIP
    4
    """
    if isinstance(data, Dataset):
        return data
    if isinstance(data, tuple) and len(data) == 2:
        # (scipy.sparse rows make a sparse dataset)
        return Dataset.from_arrays(*data, path=os.path.join(store, "data"), overwrite=True)
    raise InvalidOptionError(
        "data must be a storage.Dataset or a tuple (X, y) of arrays (X may be a scipy.sparse matrix)"
    )
