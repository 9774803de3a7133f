"""Calls to the cluster, written once: a call with a time limit, a dead worker confirmed with grace, and the
recovery loop after a parameter-server shard was lost.

Sandblaster, Downpour, the parameter server and the service's job runner all talk to Dask actors (and
tasks) that can vanish with their worker. What they need from a call is the same everywhere:

* **a time limit** — a call that does not answer in time has failed (:func:`gather_calls`,
  :func:`await_call`, :func:`task_result`);
* **is the worker really gone?** — a connection error can reach the caller before the scheduler has noticed
  the death, so a worker is only taken for dead once the scheduler agrees, and the caller waits up to
  :data:`LOSS_GRACE` seconds for it to (:func:`confirm_dead`, :func:`confirm_dead_async`,
  :func:`actor_gone`);
* **a lost shard** — the parameter server rebuilds it from the last zarr checkpoint and raises
  :class:`errors.ShardLostError`; the caller brings its own state in line (Sandblaster rolls every shard
  back, Downpour hands its replicas the new shard map) and retries, a bounded number of times
  (:class:`ShardRecovery`).

Examples
--------
>>> recovery = ShardRecovery(ps, max_recoveries=3, on_restored=lambda lost: ps.rollback())  # doctest: +SKIP
>>> x = recovery.run(lambda: ps.gather("x"))                                                 # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

from distributed import Client
from distributed.utils import sync

from distbelief.errors import ClusterError, ShardLostError

from ._session import worker_addresses

__all__ = [
    "DEAD_STATES",
    "LOSS_GRACE",
    "POLL",
    "ShardRecovery",
    "actor_gone",
    "await_call",
    "confirm_dead",
    "confirm_dead_async",
    "gather_calls",
    "start_call",
    "task_result",
]

T = TypeVar("T")

#: Statuses of the future of an actor (or task) whose worker is gone for good.
DEAD_STATES = ("error", "lost", "cancelled")
#: How long a connection error may take to be confirmed as a dead worker by the scheduler (seconds).
LOSS_GRACE = 10.0
#: How often a wait re-checks whether a worker is still alive (seconds).
POLL = 0.25
#: Errors that may mean the worker died (anything else is the call's own failure).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OSError, ClusterError)


class _Pinged(Protocol):
    def ping(self) -> None: ...


# ------------------------------------------------------------------------------------------- dead workers


def actor_gone(client: Client, future: Any, actor: Any = None) -> bool:
    """Whether the worker holding the actor of ``future`` is gone, as the scheduler sees it now.

    Parameters
    ----------
    client : distributed.Client
        The cluster.
    future : distributed.Future
        The future the actor was made by (its status turns ``"lost"`` once the scheduler knows).
    actor : distributed.Actor, optional
        The actor handle; without it only the future's status is looked at (no scheduler round trip).

    Examples
    --------
    >>> actor_gone(client, fut, fut.result())   # doctest: +SKIP
    False
    """
    if future.status in DEAD_STATES:
        return True
    address = getattr(actor, "_address", None)
    if address is None:
        return False  # no actor, or one that cannot tell where it lives: only the status can say
    return address not in worker_addresses(client)


def _grace(
    gone: Callable[[], bool],
    error: BaseException | None,
    grace: float,
    poll: float,
    errors: tuple[type[BaseException], ...],
) -> Generator[float, None, bool]:
    """The one rule of :func:`confirm_dead` and :func:`confirm_dead_async`: yields how long to sleep
    before looking again, returns the verdict (each caller sleeps its own way)."""
    if gone():
        return True
    if not isinstance(error, errors):
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        yield poll
        if gone():
            return True
    return False


def confirm_dead(
    gone: Callable[[], bool],
    error: BaseException | None = None,
    *,
    grace: float = LOSS_GRACE,
    poll: float = POLL,
    errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS,
) -> bool:
    """Whether a worker is dead: ``gone()`` now, or within ``grace`` seconds when ``error`` is one of
    ``errors`` (a connection error can arrive before the scheduler has noticed the death).

    Any other ``error`` (or none) is the call's own failure: no waiting.

    Examples
    --------
    >>> confirm_dead(lambda: False, ValueError("bad op"))
    False
    >>> confirm_dead(lambda: True, OSError("connection reset"))
    True
    """
    steps = _grace(gone, error, grace, poll, errors)
    try:
        while True:
            time.sleep(next(steps))
    except StopIteration as verdict:
        return bool(verdict.value)


async def confirm_dead_async(
    gone: Callable[[], bool],
    error: BaseException | None = None,
    *,
    grace: float = LOSS_GRACE,
    poll: float = POLL,
    errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS,
) -> bool:
    """:func:`confirm_dead` for code on an event loop: it sleeps with ``asyncio.sleep``.

    ``gone`` must be cheap and must not block (e.g. a future's status, not a scheduler query).

    Examples
    --------
    >>> asyncio.run(confirm_dead_async(lambda: True, OSError()))
    True
    """
    steps = _grace(gone, error, grace, poll, errors)
    try:
        while True:
            await asyncio.sleep(next(steps))
    except StopIteration as verdict:
        return bool(verdict.value)


def current_worker() -> Any:
    """The Dask worker this code runs on, or None outside a worker."""
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------- timed calls


def start_call(actor: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``actor.method(*args, **kwargs)``, or the exception making the call raised.

    Making a call to an actor whose worker was lost raises ``RuntimeError`` at once; returned, it can be
    told apart from a call that was sent (see :func:`gather_calls`).

    Examples
    --------
    >>> isinstance(start_call(object(), "ping"), AttributeError)
    True
    """
    try:
        return getattr(actor, method)(*args, **kwargs)
    except Exception as exc:
        return exc


def gather_calls(
    client: Client,
    calls: Sequence[Any],
    *,
    timeout: float,
    gone: Callable[[int], bool] | None = None,
    timeout_error: Callable[[int], BaseException] | None = None,
    poll: float = POLL,
) -> list[tuple[bool, Any]]:
    """Wait (from the caller's thread) for calls to actors made at once; ``[(ok, result or exception)]``.

    Parameters
    ----------
    client : distributed.Client
        Whose event loop the calls are awaited on.
    calls : sequence
        What :func:`start_call` returned for each call (an actor future, or the exception making it raised).
    timeout : float
        Seconds all the calls together may take; a call still running then fails with
        ``timeout_error(k)`` (default: a :class:`errors.ClusterError` saying so).
    gone : callable, optional
        ``gone(k)`` tells (cheaply, without blocking) whether call ``k``'s worker is gone; checked every
        ``poll`` seconds while nothing answers, so a dead worker's call is given up without waiting for the
        time limit.

    Examples
    --------
    >>> calls = [start_call(actor, "ping") for actor in actors]          # doctest: +SKIP
    >>> [ok for ok, _ in gather_calls(client, calls, timeout=5.0)]       # doctest: +SKIP
    [True, True]
    """

    def late(k: int) -> BaseException:
        if timeout_error is not None:
            return timeout_error(k)
        return ClusterError(
            f"call {k} did not answer within {timeout:.3g} s; its worker may be overloaded or hung: check "
            "the Dask dashboard, or allow a longer timeout"
        )

    async def wait_all() -> list[tuple[bool, Any]]:
        out: list[tuple[bool, Any]] = [(False, None)] * len(calls)
        pending: dict[asyncio.Future[Any], int] = {}
        for k, call in enumerate(calls):
            if isinstance(call, BaseException):
                out[k] = (False, call)
            else:
                pending[asyncio.ensure_future(call._result())] = k
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait(
                list(pending), timeout=max(0.0, min(poll, left)), return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                k = pending.pop(task)
                exc = task.exception()
                out[k] = (False, exc) if exc is not None else (True, task.result())
            if not done and gone is not None:
                for task, k in list(pending.items()):
                    if gone(k):
                        task.cancel()
                        pending.pop(task)
                        out[k] = (False, ClusterError(f"the worker of call {k} is gone"))
            if pending and time.monotonic() >= deadline:
                for task, k in pending.items():
                    task.cancel()
                    out[k] = (False, late(k))
                pending = {}
        return out

    loop = client.loop
    if loop is None:
        raise ClusterError("the Dask client is closed; connect a client and try again")
    result: list[tuple[bool, Any]] = sync(loop, wait_all)
    return result


async def await_call(
    call: Awaitable[T],
    *,
    timeout: float | None,
    gone: Callable[[], Awaitable[bool]] | None = None,
    what: str = "the call",
    poll: float = POLL,
) -> T:
    """Await ``call`` on an event loop for at most ``timeout`` seconds.

    With ``gone``, it is asked every ``poll`` seconds while the call runs whether the worker answering it
    is gone; the call then fails at once. Either failure is a :class:`errors.ClusterError`; cancelling the
    waiter cancels the call too.

    Examples
    --------
    >>> async def answer() -> int:
    ...     return 42
    >>> asyncio.run(await_call(answer(), timeout=1.0))
    42
    """
    pending = asyncio.ensure_future(call)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            wait = poll if gone is not None else None
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if done:
                return pending.result()
            if gone is not None and await gone():
                raise ClusterError(f"{what} was lost with its worker")
            if deadline is not None and time.monotonic() >= deadline:
                raise ClusterError(
                    f"{what} did not answer within {timeout:.3g} s; its worker may be overloaded or hung"
                )
    finally:
        if not pending.done():
            pending.cancel()


def task_result(future: Any, *, timeout: float, what: str) -> Any:
    """The result of a Dask task, waited for at most ``timeout`` seconds.

    Unlike an actor, a task whose worker dies is run again elsewhere by the scheduler: a dead worker only
    makes it take longer, so a time limit is all the caller needs.

    Raises
    ------
    distbelief.errors.ClusterError
        The task did not finish in time (it is cancelled).

    Examples
    --------
    >>> task_result(client.submit(sum, [1, 2]), timeout=30.0, what="a sum")   # doctest: +SKIP
    3
    """
    try:
        return future.result(timeout=timeout)
    except TimeoutError as exc:
        future.cancel()
        raise ClusterError(
            f"{what} did not finish within {timeout:.3g} s; the workers may be overloaded or gone: check the "
            "Dask dashboard and that workers are running"
        ) from exc


# ------------------------------------------------------------------------------------------- lost shards


class ShardRecovery:
    """The shard-loss recovery loop: restore, bring the caller in line, retry — at most N times per run.

    A parameter-server op that finds a shard lost rebuilds it on a live worker from the last zarr
    checkpoint and raises :class:`errors.ShardLostError`; a call that merely failed (a
    :class:`errors.ClusterError`, e.g. a replica that could not reach a shard) is checked by pinging every
    shard, which restores a lost one the same way. After a restore, ``on_restored(lost)`` brings the
    caller's state in line (Sandblaster rolls every shard back to the checkpoint and repoints its replicas;
    Downpour hands its replicas the new shard map), and the work is retried.

    Parameters
    ----------
    ps : ParameterServer
        The server whose shards may be lost (anything with ``ping()``).
    max_recoveries : int
        Restores allowed over the object's life; one more loss re-raises the error.
    on_restored : callable
        Called with the :class:`errors.ShardLostError` after every restore.

    Attributes
    ----------
    recoveries : int
        Restores handled so far.

    Examples
    --------
    >>> recovery = ShardRecovery(ps, max_recoveries=5, on_restored=repoint_replicas)   # doctest: +SKIP
    >>> recovery.run(lambda: ps.checkpoint())                                          # doctest: +SKIP
    """

    def __init__(
        self, ps: _Pinged, *, max_recoveries: int, on_restored: Callable[[ShardLostError], None]
    ) -> None:
        self.ps = ps
        self.max_recoveries = max_recoveries
        self.on_restored = on_restored
        self.recoveries = 0

    def probe(self) -> ShardLostError | None:
        """Ping every shard; a lost one is restored and handled (as :meth:`recover`), and returned.

        Raises the :class:`errors.ShardLostError` when the shard could not be restored from a checkpoint
        or the run is out of recoveries.
        """
        try:
            self.ps.ping()
        except ShardLostError as lost:
            self.recover(lost)
            return lost
        return None

    def recover(self, exc: BaseException) -> None:
        """Recover from ``exc`` (a lost shard, or a failed call that a probe explains) or re-raise it."""
        if isinstance(exc, ShardLostError):
            if not exc.restored or self.recoveries >= self.max_recoveries:
                raise exc
            self.recoveries += 1
            self.on_restored(exc)
            return
        if self.probe() is None:
            raise exc  # no shard was lost: the failure is the call's own

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()``, retried after every shard it (or a failed call of it) lost was restored."""
        while True:
            try:
                return fn()
            except (ShardLostError, ClusterError) as exc:
                self.recover(exc)
