"""The partitions of one model replica exchanging activations, actor to actor (paper, section 3, Figure 1).

A partitioned model's pass (``models.MLPPlan.partition_pass``, ``models.LocallyConnectedPlan``...) is a
generator that yields messages to send to another partition and receives to wait for; :class:`PartitionPeer`
runs such a pass on a Dask actor: each generator step on a thread (the block's BLAS work must not block the
worker's event loop, where the shards' ops run), each message as an ``async`` call to the peer's
:meth:`PartitionPeer.deliver`, which only fills a mailbox (never waits: no synchronous method ever waits on
another actor; DESIGN.md, "deadlock"). Downpour's and Sandblaster's partition actors are this class with
their own loops on top (``downpour/_partitioned.py``, ``sandblaster/_partitioned.py``).

The pass protocol is duck-typed here (storage imports nothing from models): a yielded op with an ``array``
is a send (``dest``, ``tag``, ``array``), any other a receive (``src``, ``tag``), answered with the array.

Every pass has a *key* (a Downpour step, a Sandblaster ``(call, portion)``): messages are matched by
``(src, tag, key)``. A pass can be **aborted** (its replica lost a partition, or its evaluation is over): the
receives it waits for fail at once, and messages for it that arrive later are dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from distbelief.errors import ClusterError

from ._calls import current_worker
from ._monitor import Sample, install_worker

__all__ = ["PartitionPeer", "PassAborted", "call_peer"]


class PassAborted(ClusterError):
    """A partition pass was abandoned (a peer was lost, or its work is no longer wanted)."""


async def call_peer(actor: Any, method: str, *args: Any) -> Any:
    """Call ``method`` on another actor from an event loop; in-process when it lives on this worker.

    Examples
    --------
    >>> await call_peer(peers[1], "deliver", 0, "a0", 3, array)   # doctest: +SKIP
    """
    worker = current_worker()
    if worker is not None and getattr(actor, "_address", None) == worker.address:
        local = worker.state.actors.get(actor.key)
        if local is not None:
            return await getattr(local, method)(*args)
    return await getattr(actor, method)(*args)


def _advance(gen: Any, value: Any) -> tuple[bool, Any]:
    """``(False, next op)`` or ``(True, the pass's result)``: a StopIteration cannot cross a Future."""
    try:
        return False, gen.send(value)
    except StopIteration as stop:
        return True, stop.value


class PartitionPeer:
    """Partition ``k`` of replica ``replica``: a mailbox and a pass runner (base of the partition actors).

    Parameters
    ----------
    replica, k : int
        Replica and partition numbers.
    call_timeout : float
        Seconds a pass waits for a peer's message before it fails.

    Attributes
    ----------
    messages, bytes : int
        Messages and bytes this partition sent.
    by_kind : dict
        Messages sent by kind (the tag's letters).
    seconds : dict
        ``compute`` (pass steps) and ``wait`` (sending and waiting for messages), seconds.

    Examples
    --------
    >>> peer = PartitionPeer(0, 1, call_timeout=30.0)
    >>> peer.messages, peer.k
    (0, 1)
    """

    #: The algorithm a subclass runs, for the metrics page's ``algorithm`` label.
    ALGORITHM = ""

    def __init__(self, replica: int, k: int, *, call_timeout: float) -> None:
        install_worker()  # its worker's metrics page shows what this partition does (storage._monitor)
        self.replica, self.k, self.call_timeout = replica, k, call_timeout
        self.peers: list[Any] = []
        self.mailbox: dict[tuple[int, str, Hashable], asyncio.Future[np.ndarray]] = {}
        self.messages = 0
        self.bytes = 0
        self.by_kind: dict[str, int] = {}
        self.seconds: dict[str, float] = {"compute": 0.0, "wait": 0.0}
        self._aborted: set[Hashable] = set()

    def monitor(self) -> list[Sample]:
        """This partition's counters for the metrics page (:mod:`storage._monitor`; read on the worker's
        event loop, not an actor call): messages and bytes sent to its peers, seconds computing and waiting,
        and the steps, pushes and fetches of the subclasses that keep them.

        Examples
        --------
        >>> [(n, v) for n, _, v in PartitionPeer(0, 1, call_timeout=30.0).monitor()][:2]
        [('distbelief_partition_messages_total', 0), ('distbelief_partition_bytes_total', 0)]
        """
        me = {"replica": str(self.replica), "partition": str(self.k), "algorithm": self.ALGORITHM}
        out: list[Sample] = [
            ("distbelief_partition_messages_total", me, self.messages),
            ("distbelief_partition_bytes_total", me, self.bytes),
        ]
        out += [("distbelief_replica_seconds_total", {**me, "doing": k}, v) for k, v in self.seconds.items()]
        for attribute, metric in (
            ("steps", "distbelief_replica_steps_total"),
            ("pushes_sent", "distbelief_replica_pushes_total"),
            ("fetches", "distbelief_replica_fetches_total"),
        ):
            value = getattr(self, attribute, None)
            if isinstance(value, int):
                out.append((metric, me, value))
        return out

    async def connect(self, peers: Sequence[Any]) -> None:
        """The K partition actors of this replica (itself included), by partition number.

        Connecting again (a partition was rebuilt on another worker) aborts every pass under way: their
        messages may have gone to, or be awaited from, the lost partition.
        """
        self.abort_all()
        self.peers = list(peers)

    def abort_all(self) -> None:
        """Abort every pass waiting for a message (see :meth:`abort`)."""
        for key in {k[2] for k, fut in self.mailbox.items() if not fut.done()}:
            self.abort(key)

    def abort(self, key: Hashable) -> None:
        """Fail the receives of pass ``key`` (they raise :class:`PassAborted`) and drop its later messages.

        A pass whose key is a tuple starting with ``key`` is aborted too (a Sandblaster work call aborts
        the pass of every portion it carries, keyed ``(call, portion)``).
        """
        self._aborted.add(key)
        for slot, fut in list(self.mailbox.items()):
            if self._is_aborted(slot[2]):
                if not fut.done():
                    fut.set_exception(PassAborted(f"pass {key!r} of partition {self.k} was aborted"))
                    fut.exception()  # seen: nobody may be waiting yet
                del self.mailbox[slot]

    def _is_aborted(self, key: Hashable) -> bool:
        return key in self._aborted or (isinstance(key, tuple) and bool(key) and key[0] in self._aborted)

    async def abort_pass(self, key: Hashable) -> None:
        """:meth:`abort`, as an actor call from a peer."""
        self.abort(key)

    def _slot(self, src: int, tag: str, key: Hashable) -> asyncio.Future[np.ndarray]:
        slot = (src, tag, key)
        fut = self.mailbox.get(slot)
        if fut is None:
            fut = self.mailbox[slot] = asyncio.get_running_loop().create_future()
            if self._is_aborted(key):
                fut.set_exception(PassAborted(f"pass {key!r} of partition {self.k} was aborted"))
        return fut

    async def deliver(self, src: int, tag: str, key: Hashable, array: np.ndarray) -> None:
        """A message from partition ``src`` (never waits: it only fills the mailbox)."""
        if self._is_aborted(key):
            return
        fut = self._slot(src, tag, key)
        if not fut.done():
            fut.set_result(array)

    def _count(self, tag: str, array: np.ndarray) -> None:
        self.messages += 1
        self.bytes += int(array.nbytes)
        kind = tag.rstrip("0123456789")
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    async def run_pass(
        self,
        key: Hashable,
        gen: Any,
        *,
        run: Callable[..., Any] | None = None,
    ) -> tuple[Any, np.ndarray]:
        """Drive the pass ``gen`` (named ``key``) to its end: ``(loss or None, gradient slice)``.

        ``run(fn, *args)`` runs a step off the event loop (default: ``asyncio.to_thread``).

        Raises
        ------
        PassAborted
            The pass was aborted while it waited.
        distbelief.errors.ClusterError
            A peer's message did not come within ``call_timeout`` seconds.
        """
        step = run or asyncio.to_thread
        value: np.ndarray | None = None
        timeout = self.call_timeout
        while True:
            t0 = time.perf_counter()
            done, op = await step(_advance, gen, value)
            t1 = time.perf_counter()
            self.seconds["compute"] += t1 - t0
            if done:
                result: tuple[Any, np.ndarray] = op
                return result
            if hasattr(op, "array"):
                self._count(op.tag, op.array)
                try:
                    await asyncio.wait_for(
                        call_peer(self.peers[op.dest], "deliver", self.k, op.tag, key, op.array), timeout
                    )
                except TimeoutError:
                    raise ClusterError(
                        f"partition {self.k} of replica {self.replica} could not send {op.tag!r} to "
                        f"partition {op.dest} within {timeout:g} s; its worker may have died or be "
                        "overloaded: check the Dask dashboard"
                    ) from None
                value = None
            else:
                try:
                    value = await asyncio.wait_for(asyncio.shield(self._slot(op.src, op.tag, key)), timeout)
                except TimeoutError:
                    raise ClusterError(
                        f"partition {self.k} of replica {self.replica} waited {timeout:g} s for {op.tag!r} "
                        f"from partition {op.src}; its worker may have died or be overloaded: check the Dask "
                        "dashboard"
                    ) from None
                self.mailbox.pop((op.src, op.tag, key), None)
            self.seconds["wait"] += time.perf_counter() - t1
