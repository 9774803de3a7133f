"""Which Dask cluster a call runs on: the caller's ``Client``, a scheduler address, or the process's one
embedded ``LocalCluster``; and the checks and bindings every front door needs on it.

Every front door (``sandblaster.minimize``, ``downpour.train``, partitioned runs, the estimators,
``Dataset.from_dask``) resolves its ``client=`` here (:func:`resolve_client`), and runs inside
:func:`bound_to` so that the Dask actor proxies it receives talk to *that* client.

Why the binding: a ``distributed.Actor`` proxy does not remember the client whose future produced it. It
finds one with ``distributed.get_client()``, i.e. ``Client.current()``: the client of an enclosing
``as_current`` block, else the process's *default* client (distributed 2026.8, ``actor.py``). With a client
that is not the default (``set_as_default=False``, or made after another one, or in another thread) the
proxy either binds to no client (its first method call fails with ``type object 'Replica' has no attribute
'_io_loop'``: the ``_io_loop`` property raises ``AttributeError`` on ``None.loop``, which Python turns into
a ``__getattr__`` lookup on the actor's class) or, worse, to the default client of another cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from typing import Any

from distributed import Client, LocalCluster

from distbelief.errors import ClusterError, InvalidOptionError

__all__ = [
    "as_client",
    "bound_to",
    "can_start_processes",
    "check_workers",
    "resolve_client",
    "shared_embedded_client",
]

#: What the workers are asked (``eval`` on the worker: builtins only, so it unpickles on a worker whatever it
#: has installed, and answers with the version, or with the error importing the package).
_PROBE = "__import__('distbelief').__version__"

_lock = threading.Lock()
_embedded: tuple[LocalCluster, Client] | None = None
_by_address: dict[str, Client] = {}
#: Schedulers (by id) whose workers were found to run this process's version of distbelief.
_checked: set[str] = set()


# ------------------------------------------------------------------------------------------- resolving


def check_address(address: str) -> str:
    """``address`` if it names a Dask scheduler (``tcp://host:port``, ``tls://...``, ``host:port``...),
    else :class:`InvalidOptionError` saying what to pass.

    Examples
    --------
    >>> check_address("tcp://127.0.0.1:8786")
    'tcp://127.0.0.1:8786'
    >>> check_address("127.0.0.1")
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: client='127.0.0.1' is not a Dask scheduler address ...
    """
    from distributed.comm import get_address_host_port

    hint = (
        "is not a Dask scheduler address (expected e.g. 'tcp://10.0.0.1:8786'; the scheduler prints it as "
        "'Scheduler at: ...')"
    )
    if not address or address != address.strip():
        raise InvalidOptionError(f"client={address!r} {hint}")
    try:
        host, port = get_address_host_port(address)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidOptionError(f"client={address!r} {hint}: {exc}") from None
    if not host or not port:
        raise InvalidOptionError(f"client={address!r} {hint}")
    return address


def as_client(client: Client | str) -> Client:
    """``client`` itself, or a client of the scheduler at the address ``client`` (made once per address,
    kept for the process's lifetime, never the process's default client).

    Raises
    ------
    InvalidOptionError
        ``client`` is neither a ``Client`` nor a well-formed scheduler address.
    ClusterError
        No scheduler answers at the address.
    """
    if isinstance(client, Client):
        if client.status in ("closed", "closing"):
            raise ClusterError(
                "the Dask client passed as client= is closed; pass a connected client (or its scheduler's "
                "address, or None for the embedded cluster)"
            )
        return client
    if not isinstance(client, str):
        raise InvalidOptionError(
            "client must be None (the default Dask client, else an embedded cluster), a scheduler address "
            f"such as 'tcp://10.0.0.1:8786', or a distributed.Client; got {type(client).__name__}"
        )
    address = check_address(client)
    with _lock:
        known = _by_address.get(address)
        if known is not None and known.status not in ("closed", "closing"):
            return known
        try:
            known = Client(address, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise ClusterError(
                f"no Dask scheduler answers at {address} ({exc}); start one there (`dask scheduler`), "
                "or pass client=None to run on an embedded cluster"
            ) from None
        _by_address[address] = known
        return known


def resolve_client(client: Client | str | None) -> Client:
    """The Dask client a call runs on.

    ``None``: the default Dask client (the last ``Client`` made with ``set_as_default=True``, or the one
    of an enclosing ``as_current`` block) if it is running, else the process's one embedded cluster
    (:func:`shared_embedded_client`). A ``str``: a client of the scheduler at that address, made once.
    A ``Client``: itself.

    Examples
    --------
    >>> resolve_client("tcp://127.0.0.1:8786").scheduler.address   # doctest: +SKIP
    'tcp://127.0.0.1:8786'
    """
    if client is not None:
        return as_client(client)
    from distributed import default_client

    try:
        found: Client = default_client()
    except ValueError:
        return shared_embedded_client()
    if found.status in ("running", "connecting") and not found.asynchronous:
        return found
    return shared_embedded_client()


def shared_embedded_client() -> Client:
    """The client of this process's one embedded ``LocalCluster``, started on first use, closed at exit.

    One worker per core (at most 4), one thread each, on 127.0.0.1, with the Dask dashboard on a free
    loopback port (``client.dashboard_link``) and direct connections from the client to the workers
    (~1.1 ms per actor call instead of ~1.7 ms through the scheduler). Worker processes, except where this
    process cannot start them (:func:`can_start_processes`): there, worker threads of this process.
    Starting one costs ~1-3 s; every later call reuses it.
    """
    global _embedded
    with _lock:
        if _embedded is not None and _embedded[1].status not in ("closed", "closing"):
            return _embedded[1]
        n_workers = max(1, min(os.cpu_count() or 1, 4))
        processes = can_start_processes()
        options: dict[str, Any] = {"host": "127.0.0.1"} if processes else {}  # threads: inproc:// comms
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=processes,
            # Its own free port on loopback: the dashboard link answers (with None the scheduler still
            # serves HTTP on the default port 8787, or another if that is taken, without the dashboard:
            # the link answered 404). Costs no measurable start time here (0.9-1.4 s either way).
            dashboard_address="127.0.0.1:0",
            **options,
        )
        client = Client(cluster, direct_to_workers=True, set_as_default=False)
        _embedded = (cluster, client)
        _checked.add(_scheduler_id(client))  # its workers run this very installation
        _install_metrics_page(client)
        return client


def can_start_processes() -> bool:
    """Whether this process can start the embedded cluster's worker processes (Dask's nannies spawn them).

    Not in a daemonic process (``multiprocessing`` forbids it children), nor in one whose start method is
    not a standard one: a joblib/loky worker (``GridSearchCV(n_jobs=k)``) reports ``'loky'``, which a spawned
    child then fails to set up ("cannot find context for 'loky'": every fit failed with "Nanny failed to
    start"). Such a process is one of a pool already: its embedded cluster runs worker threads.

    Examples
    --------
    >>> can_start_processes()
    True
    """
    method = multiprocessing.get_start_method(allow_none=True)
    daemon = multiprocessing.current_process().daemon
    return not daemon and method in (None, "fork", "spawn", "forkserver")


def close_embedded() -> None:
    """Close the embedded cluster if one was started (at exit; a later call starts a new one)."""
    global _embedded
    with _lock:
        started, _embedded = _embedded, None
    if started is not None:
        cluster, client = started
        with contextlib.suppress(Exception):
            client.close()
        with contextlib.suppress(Exception):
            cluster.close()


def _close_at_exit() -> None:
    """:func:`close_embedded` at interpreter exit, with distributed's INFO chatter about the closing
    (clients removed, streams closed) silenced: by then a test runner or a service may have closed the
    streams its handlers write to, and each record would print a "--- Logging error ---" traceback."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    close_embedded()


atexit.register(_close_at_exit)


# ------------------------------------------------------------------------------------------- checking


def _scheduler_id(client: Client) -> str:
    """The scheduler's id from the client's cached identity (no round trip), else its address."""
    info: Any = None
    with contextlib.suppress(Exception):
        info = client.scheduler_info()
    sid = info.get("id") if isinstance(info, dict) else None
    return str(sid or getattr(client.scheduler, "address", ""))


def check_workers(client: Client) -> None:
    """Raise :class:`ClusterError` if a worker cannot import ``distbelief`` or has another version of it.

    The workers run the package's code (actors, gradient kernels), found by import: they need the same
    version of ``distbelief`` installed, nothing from this process's working directory. Checked once per
    scheduler (by its id), with one ``client.run`` round trip; workers that join later are not checked.
    """
    from distbelief import __version__

    sid = _scheduler_id(client)
    if sid in _checked:
        return
    try:
        answers = client.run(eval, _PROBE, {}, on_error="return")
    except (OSError, TimeoutError) as exc:
        raise ClusterError(
            f"cannot reach the Dask workers to check them ({exc}); is the scheduler up?"
        ) from exc
    missing = sorted(w for w, a in answers.items() if isinstance(a, BaseException))
    versions = {w: a for w, a in answers.items() if not isinstance(a, BaseException)}
    other = sorted((w, a) for w, a in versions.items() if a != __version__)
    if missing:
        first = answers[missing[0]]
        raise ClusterError(
            f"{len(missing)} Dask worker(s) cannot import distbelief ({type(first).__name__}: {first}): "
            f"{', '.join(missing)}; install distbelief=={__version__} (the client's version) in every "
            "worker's environment and restart the workers"
        )
    if other:
        found = ", ".join(f"{w} has {a}" for w, a in other)
        raise ClusterError(
            f"the Dask workers run another version of distbelief than this process ({__version__}): "
            f"{found}; install distbelief=={__version__} on every worker (or this version of the workers' "
            "here) and restart them"
        )
    _install_metrics_page(client)
    _checked.add(sid)


def _install_metrics_page(client: Client) -> None:
    """Serve the shards' and replicas' counters on the cluster's dashboard port, once per cluster (see
    :mod:`storage._monitor`: a Dask actor's work is no task, the Dask dashboard shows none of it)."""
    from ._monitor import install_cluster

    install_cluster(client)


@contextlib.contextmanager
def bound_to(client: Client) -> Iterator[None]:
    """Make ``client`` the current Dask client of this thread (and of the coroutines it starts through
    ``client.sync``) for the ``with`` block: actor proxies received in the block bind to it.

    ``Client.as_current`` does this too but also sets ``dask.config`` (process-wide, restored on exit):
    runs in several threads would restore each other's setting out of order. This sets only the context
    variable ``Client.current`` reads (distributed 2026.8), falling back to ``as_current`` without it.
    """
    from distributed import client as dask_client

    current = getattr(dask_client, "_current_client", None)
    if current is None:  # pragma: no cover - another distributed
        with client.as_current():
            yield
        return
    token = current.set(client)
    try:
        yield
    finally:
        current.reset(token)
