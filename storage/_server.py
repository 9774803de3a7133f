"""The sharded parameter server: one Dask actor per chunk-aligned slice, persisted to zarr.

The server handle lives in the caller's process (the Sandblaster coordinator, a test, the service) and
sends every op to all shards at once, so one op costs one actor round trip whatever the number of shards;
only scalars come back (DistBelief paper, section 4.2 and the Sandblaster appendix).

Store layout (zarr v3, no compressor: random floats barely compress and compression costs 3x)::

    <store>/                 group; attrs["distbelief_ps"] = layout, current slot, names, shard states, meta
    <store>/slot0/<name>     float64 (layout.stored_size,), chunked on the layout's chunk grid; shard i
                             at ``layout.offsets()[i]`` (its place in the vector unless the layout pads);
                             float32 for a vector the shards store as float32 (checkpoint's ``dtypes``)
    <store>/slot1/<name>     the other half of a double buffer: a checkpoint writes the slot that is *not*
                             current and flips ``current`` only when every shard has written, so a crash in
                             the middle of a checkpoint leaves the previous one intact.

Dask actors are not resilient: when a worker dies its actors are gone for good. Each op notices a lost
shard, rebuilds it on a live worker from the last checkpoint and raises :class:`errors.ShardLostError`
naming the shard, so the caller can decide how to go on (Sandblaster rolls every shard back; Downpour just
continues with the restored shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import pickle
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import zarr
from distributed import Client, Future

from distbelief.errors import ClusterError, InvalidOptionError, ShardLostError, StoreError

from ._actor import ShardActor
from ._calls import (
    DEAD_STATES,
    actor_gone,
    await_call,
    confirm_dead,
    current_worker,
    gather_calls,
    start_call,
)
from ._direct import direct_call
from ._layout import DEFAULT_TARGET_CHUNK, Layout
from ._session import NO_WORKERS, worker_addresses
from ._shard import OPS
from ._store import normalize_url, open_group
from ._wire import SMALL_BYTES, array_bytes, unpack

#: What an op method of :class:`_Ops` returns (an index in a batch, or the op's result).
R = TypeVar("R")

__all__ = ["Batch", "ParameterServer", "ServerStats", "ShardMap", "reduce_results"]

ATTR = "distbelief_ps"
#: Format 2: shards are stored at ``Layout.offsets()``, each on chunks of its own with padding between
#: (partition-aligned layouts, whose bounds are not chunk multiples). A store that needs no padding is
#: written as format 1, byte for byte as before, so older versions still open it; format 1 stores are read
#: as they always were (their offsets are their bounds).
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)


@dataclass
class ServerStats:
    """What the handle has sent and received, to count round trips and prove what the caller sees.

    ``max_received`` is the largest number of float values any single call returned: a coordinator that
    never holds a vector keeps it at O(m^2) scalars.
    """

    round_trips: int = 0
    shard_calls: int = 0
    values_received: int = 0
    max_received: int = 0
    by_method: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Zero every counter."""
        self.round_trips = self.shard_calls = self.values_received = self.max_received = 0
        self.by_method = {}


def _count_values(obj: Any) -> int:
    if obj is None or isinstance(obj, bool | str):
        return 0
    if isinstance(obj, int | float | np.floating | np.integer):
        return 1
    if isinstance(obj, np.ndarray):
        return int(obj.size)
    if isinstance(obj, list | tuple):
        return sum(_count_values(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_count_values(v) for v in obj.values())
    return 1


def _reduce(kind: str | None, partials: Sequence[Any]) -> Any:
    if kind is None:
        return None
    if kind == "max":
        return float(max(partials))
    if kind == "min":
        return min(partials)
    if isinstance(partials[0], list):
        return [math.fsum(col) for col in zip(*partials, strict=True)]
    total = math.fsum(partials)
    return math.sqrt(total) if kind == "sqrt_sum" else total


def reduce_results(ops: Sequence[Sequence[Any]], partials: Sequence[Sequence[Any]]) -> list[Any]:
    """Combine every shard's partial results of ``ops`` (sums of dots, max of norms, ...)."""
    if any(len(p) != len(ops) for p in partials):
        return [None] * len(ops)  # a shard ran nothing (an old epoch): no results
    return [_reduce(OPS[op[0]], [p[k] for p in partials]) for k, op in enumerate(ops)]


class _Ops(Generic[R]):
    """The shards' vector ops, one method each, written once for :class:`Batch` (a method appends its op
    and returns the op's index in the batch) and :class:`ParameterServer` (a method runs its op on every
    shard at once and returns its reduced result: None for the ops that only change vectors)."""

    def _op(self, *op: Any) -> R:
        raise NotImplementedError

    def fill(self, name: str, value: float) -> R:
        """``name[:] = value`` on every shard (creates ``name``)."""
        return self._op("fill", name, float(value))

    def copy(self, src: str, dst: str) -> R:
        """``dst = src`` (creates ``dst``)."""
        return self._op("copy", src, dst)

    def scale(self, alpha: float, name: str) -> R:
        """``name *= alpha``."""
        return self._op("scale", float(alpha), name)

    def axpy(self, alpha: float, x: str, y: str) -> R:
        """``y += alpha * x``."""
        return self._op("axpy", float(alpha), x, y)

    def lincomb(self, dst: str, coeffs: Sequence[float], names: Sequence[str]) -> R:
        """``dst = sum_i coeffs[i] * names[i]`` (``dst`` may be among ``names``)."""
        return self._op("lincomb", dst, [float(c) for c in coeffs], list(names))

    def mul(self, x: str, y: str, dst: str) -> R:
        """``dst = x * y`` elementwise."""
        return self._op("mul", x, y, dst)

    def delete(self, name: str) -> R:
        """Drop vector ``name`` from every shard."""
        return self._op("delete", name)

    def dot(self, a: str, b: str) -> R:
        """``a . b``."""
        return self._op("dot", a, b)

    def dots(self, pairs: Sequence[tuple[str, str]]) -> R:
        """``[a . b for a, b in pairs]``, in one round trip."""
        return self._op("dots", [(a, b) for a, b in pairs])

    def norm2(self, name: str) -> R:
        """Euclidean norm of ``name``."""
        return self._op("norm2", name)

    def norm_inf(self, name: str) -> R:
        """Max-abs norm of ``name``."""
        return self._op("norm_inf", name)

    def sum(self, name: str) -> R:
        """Sum of the elements of ``name``."""
        return self._op("sum", name)


class Batch(_Ops[int]):
    """Ops collected to be sent to every shard in one call (one round trip for the lot).

    Each op method appends one op and returns its index into the list that :meth:`run` returns.

    Examples
    --------
    >>> b = ps.batch()                                   # doctest: +SKIP
    >>> b.axpy(0.5, "d", "x"); i = b.dot("x", "x")        # doctest: +SKIP
    >>> b.run()[i]                                       # doctest: +SKIP
    """

    def __init__(self, server: ParameterServer) -> None:
        self._server = server
        self.ops: list[tuple[Any, ...]] = []

    def _op(self, *op: Any) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def run(self) -> list[Any]:
        """Send the ops to every shard in one call each; return the reduced result of every op."""
        return self._server.run(self.ops)


#: Above this many bytes, :meth:`ParameterServer.get` fetches shard by shard into one array.
GATHER_PIECEWISE_BYTES = 64 << 20

#: Bytes of a shard's slice per ``timeout`` of waiting: a call may wait for as many times its timeout as its
#: shard's slice holds of these (an op on a wide shard streams tens of its vectors from spill files, and
#: queues behind the one before it). 64 MiB: at 2**26 parameters a shard, 8 times the base timeout.
TIMEOUT_SLICE_BYTES = 64 << 20


def scaled_timeout(timeout: float | None, layout: Layout) -> float | None:
    """``timeout`` stretched for wide shards: times ``max(1, largest slice bytes / TIMEOUT_SLICE_BYTES)``.

    A lost worker is detected by a liveness poll whatever the timeout (:func:`storage._calls.await_call`);
    the timeout only catches a live but hung worker, and must not fire on a big op that is merely slow.

    Examples
    --------
    >>> scaled_timeout(60.0, Layout.split(1 << 20, 2)), scaled_timeout(60.0, Layout.split(1 << 27, 2))
    (60.0, 480.0)
    """
    if timeout is None:
        return None
    widest = max((hi - lo for lo, hi in layout.ranges()), default=0)
    return float(timeout) * max(1.0, 8 * widest / TIMEOUT_SLICE_BYTES)


@dataclass(frozen=True)
class ShardMap:
    """A picklable map of the shards, for code running *on workers* (replicas) to fetch and push.

    A shard on the caller's own worker is called in-process (no RPC to itself); the others over RPC.
    """

    layout: Layout
    actors: tuple[Any, ...]

    def _local(self, shard: int) -> Any | None:
        """Shard ``shard``'s actor object when it lives in this worker process (else None: use RPC)."""
        actor = self.actors[shard]
        worker = current_worker()
        if worker is not None and getattr(actor, "_address", None) == worker.address:
            return worker.state.actors.get(actor.key)
        return None

    async def call(self, shard: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on shard ``shard``, from a worker's event loop.

        A shard on the caller's own worker is called in-process (no RPC to itself); a call to another
        worker with small arrays travels as one pickled frame (:mod:`storage._wire`), a bigger one as
        Dask sends it.
        """
        local = self._local(shard)
        if local is not None:
            return await getattr(local, method)(*args, **kwargs)
        actor = self.actors[shard]
        message = (method, args, kwargs)
        if array_bytes(message) <= SMALL_BYTES:
            request = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            worker = current_worker()
            if worker is not None:
                # A plain RPC to the shard's worker: half an actor call's cost (storage._direct).
                return unpack(await direct_call(worker.rpc, actor, "packed", request))
            return unpack(await actor.packed(request))
        return await getattr(actor, method)(*args, **kwargs)

    async def ask(
        self,
        shard: int,
        method: str,
        *args: Any,
        timeout: float | None = 60.0,
        scale: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Await ``method`` on shard ``shard`` from a worker's event loop.

        ``timeout`` is stretched for wide shards (:func:`scaled_timeout`) unless ``scale=False``: pass that
        with a timeout stretched already (:attr:`ParameterServer.timeout`), or it is stretched twice.

        Fails fast with :class:`errors.ClusterError` when the shard's worker dies meanwhile. A small shard
        in this very process runs the op inline on this loop: there is no message to wait for and no worker
        to lose, so it is awaited as it is (``await_call``'s task and timers cost ~0.1 ms, and a replica
        beside its shard makes two such calls an evaluation).
        """
        local = self._local(shard)
        if local is not None and getattr(local, "runs_inline", False):
            return await getattr(local, method)(*args, **kwargs)
        address = getattr(self.actors[shard], "_address", None)

        async def gone() -> bool:
            # The scheduler query may block: keep it off the event loop the shards run on.
            return not await asyncio.to_thread(worker_alive, address)

        return await await_call(
            self.call(shard, method, *args, **kwargs),
            timeout=scaled_timeout(timeout, self.layout) if scale else timeout,
            gone=gone,
            what=f"shard {shard}",
        )

    async def prepare_and_fetch(
        self, epoch: int, ops: Sequence[Sequence[Any]], names: Sequence[str], *, timeout: float | None = 60.0
    ) -> tuple[list[np.ndarray], list[Any]]:
        """Run ``ops`` once per ``epoch`` on every shard (first caller wins), then fetch ``names``.

        Returns the full vectors and the ops' results reduced over shards (as :meth:`ParameterServer.run`).
        The shards are asked in parallel, from a worker's event loop.
        """
        asks = [
            self.ask(i, "prepare_and_fetch", epoch, list(ops), list(names), timeout=timeout)
            for i in range(self.layout.shards)
        ]
        # One shard (a model below ~128 Ki parameters): awaited as it is, without gather's task.
        parts = [await asks[0]] if len(asks) == 1 else await asyncio.gather(*asks)
        vectors = [np.concatenate([p[1][k] for p in parts]) for k in range(len(names))]
        return vectors, reduce_results(ops, [p[2] for p in parts])

    async def prepare_and_gather(
        self,
        epoch: int,
        ops: Sequence[Sequence[Any]],
        name: str,
        keys: Sequence[np.ndarray | None],
        *,
        timeout: float | None = 60.0,
    ) -> tuple[list[np.ndarray], list[Any]]:
        """:meth:`prepare_and_fetch` of ``name`` at ``keys[i]`` (local offsets) of every shard ``i`` only;
        ``keys[i] = None`` fetches shard ``i``'s whole slice.

        Returns the values per shard (in ``keys`` order) and the ops' reduced results. A shard with no key
        is still asked when ``ops`` must run there (the first fetch of an epoch), else skipped.
        """
        asked = [i for i in range(self.layout.shards) if ops or (k := keys[i]) is None or k.size]
        parts = await asyncio.gather(
            *(
                self.ask(i, "prepare_and_gather", epoch, list(ops), name, keys[i], timeout=timeout)
                for i in asked
            )
        )
        values = [np.zeros(0)] * self.layout.shards
        for i, p in zip(asked, parts, strict=True):
            values[i] = p[1][0]
        return values, reduce_results(ops, [p[2] for p in parts]) if ops else []

    def slices(self, vector: np.ndarray) -> list[np.ndarray]:
        """``vector`` cut into the shards' ranges along its last axis (views, no copy): a gradient, or a
        binned sum of gradients (:mod:`storage._exactsum`, one row per bin)."""
        return [vector[..., lo:hi] for lo, hi in self.layout.ranges()]


#: Initial vectors up to this many bytes per shard travel with the shards' construction (see
#: :meth:`ParameterServer.create`); the arguments of a construction stay in the scheduler's task graph.
INLINE_VECTOR_BYTES = 1 << 20


class ParameterServer(_Ops[Any]):
    """A vector space of ``n`` float64 parameters sharded over Dask actors and checkpointed to zarr.

    Create with :meth:`create` or reopen with :meth:`open`; do not call the constructor directly.

    Examples
    --------
    >>> ps = ParameterServer.create(client, 10, shards=2, store="/tmp/ps")   # doctest: +SKIP
    >>> ps.scatter("a", np.arange(10.0)); ps.dot("a", "a")                   # doctest: +SKIP
    285.0
    """

    def __init__(
        self,
        client: Client,
        url: str,
        layout: Layout,
        futures: list[Future[Any]],
        *,
        timeout: float,
        meta: dict[str, Any],
        memory_budget: int | str | None = "auto",
    ) -> None:
        self.client = client
        self.url = url
        self.layout = layout
        self._futures = futures
        self._actors = [f.result() for f in futures]
        #: Seconds a call to the shards may take (stretched for wide shards: :func:`scaled_timeout`).
        self.timeout = scaled_timeout(timeout, layout) or timeout
        self.stats = ServerStats()
        self._meta = meta  # what the store's attributes hold now (written or read by the caller)
        self._slot_arrays: dict[str, dict[str, str]] = {}  # slot -> {array name: its dtype}
        self._group: Any = None
        #: Per-shard RAM budget the shards were made with (see :meth:`create`), reused for rebuilt shards.
        self.memory_budget = memory_budget

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        client: Client,
        n: int,
        *,
        shards: int = 1,
        store: str,
        workers: Sequence[str] | None = None,
        target_chunk: int = DEFAULT_TARGET_CHUNK,
        overwrite: bool = False,
        timeout: float = 120.0,
        vectors: Mapping[str, np.ndarray] | None = None,
        layout: Layout | None = None,
        memory_budget: int | str | None = "auto",
    ) -> ParameterServer:
        """Create a new server for ``n`` parameters in ``shards`` shards, persisted at ``store``.

        Parameters
        ----------
        client : distributed.Client
            The cluster to put the shard actors on.
        n : int
            Number of parameters (>= 1).
        shards : int
            Number of shards (1 <= shards <= n). Shard ``i`` goes to ``workers[i % len(workers)]``.
        store : str
            Directory or fsspec URL of the zarr store (it must be reachable from every worker).
        workers : list of str, optional
            Worker addresses to place shards on (default: every worker, sorted).
        target_chunk : int
            Elements per zarr chunk to aim for.
        overwrite : bool
            Replace a parameter server already stored at ``store``.
        timeout : float
            Seconds a single shard call may take before it is reported as failed.
        vectors : mapping of str to numpy.ndarray, optional
            Vectors of ``n`` values the shards start with, as :meth:`scatter` would set them. When they
            come to at most :data:`INLINE_VECTOR_BYTES` per shard, each shard's slices travel with its
            construction (no round trip of their own); bigger ones are scattered once the shards exist
            (a construction's arguments stay in the scheduler's task graph).
        layout : storage.Layout, optional
            The shards' ranges, instead of ``shards`` balanced ones (e.g. aligned to a model's partitions:
            :func:`storage.partition_layout`).
        memory_budget : int, "auto" or None
            Bytes of vectors each shard keeps in RAM; the others spill to local files on its worker and
            the ops stream them in chunks (:mod:`storage._vectorstore`). ``"auto"``: a share
            (``SHARD_MEMORY_FRACTION``) of the worker's ``memory_limit`` split over the shards placed on
            it; ``None``: no limit.
        """
        if layout is None:
            layout = Layout.split(n, shards, target_chunk=target_chunk)
        elif layout.n != n:
            raise InvalidOptionError(f"the layout covers {layout.n} parameters, the server holds {n}")
        initial = {name: _as_vector(values) for name, values in (vectors or {}).items()}
        for name, values in initial.items():
            if values.size != n:
                raise InvalidOptionError(f"vector {name!r} has {values.size} values, the server holds {n}")
        _check_budget(memory_budget)  # before the store is touched
        url = normalize_url(store)
        group = zarr.open_group(store=_store_for(url), mode="a")
        if ATTR in group.attrs and not overwrite:
            raise StoreError(
                f"{url!r} already holds a parameter server; open it with ParameterServer.open, "
                "or pass overwrite=True to replace it"
            )
        placement = _placement(client, layout.shards, workers)
        largest = max((hi - lo for lo, hi in layout.ranges()), default=0)
        inline = 8 * largest * len(initial) <= INLINE_VECTOR_BYTES
        # The actors are built while the store is prepared below: a new shard reads nothing from it.
        vectors = initial if inline else None
        futures = [
            _submit_shard(client, url, layout, i, placement, memory_budget, vectors=vectors)
            for i in range(layout.shards)
        ]
        meta: dict[str, Any] = {
            "format": FORMAT_VERSION if layout.padded else 1,
            "layout": layout.to_dict(),
            "current": None,
            "checkpoint_id": 0,
            "names": [],
            "states": [],
            "meta": {},
        }
        try:
            for slot in ("slot0", "slot1"):
                if slot in group:
                    del group[slot]
            group.attrs[ATTR] = meta
            server = cls(
                client, url, layout, futures, timeout=timeout, meta=json.loads(json.dumps(meta)),
                memory_budget=memory_budget,
            )  # fmt: skip
        except BaseException:
            _release(futures)
            raise
        if not inline:
            try:
                for name, values in initial.items():
                    server.scatter(name, values)
            except BaseException:
                server.close()
                raise
        return server

    @classmethod
    def open(
        cls,
        client: Client,
        *,
        store: str,
        workers: Sequence[str] | None = None,
        timeout: float = 120.0,
        memory_budget: int | str | None = "auto",
    ) -> ParameterServer:
        """Reopen the server at ``store``: new actors, every vector restored from the last checkpoint.

        ``memory_budget`` is as in :meth:`create`.
        """
        url = normalize_url(store)
        meta = read_attrs(url)
        layout = Layout.from_dict(meta["layout"])
        placement = _placement(client, layout.shards, workers)
        futures = [
            _submit_shard(client, url, layout, i, placement, memory_budget, restore=_restore(meta, i))
            for i in range(layout.shards)
        ]
        try:
            return cls(client, url, layout, futures, timeout=timeout, meta=meta, memory_budget=memory_budget)
        except BaseException:
            _release(futures)  # e.g. a shard that could not be restored: the others must not linger
            raise

    # -- introspection ---------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of parameters."""
        return self.layout.n

    @property
    def shards(self) -> int:
        """Number of shards."""
        return self.layout.shards

    @property
    def checkpoint_meta(self) -> dict[str, Any]:
        """The ``meta`` dict saved with the last checkpoint (empty if none)."""
        return dict(self._meta.get("meta") or {})

    @property
    def checkpoint_dtypes(self) -> dict[str, str]:
        """``{name: dtype}`` of the last checkpoint's vectors that are not float64 (shard 0's state says)."""
        states = self._meta.get("states") or [{}]
        return {str(k): str(v) for k, v in dict(states[0].get("dtypes", {})).items()}

    @property
    def checkpoint_id(self) -> int:
        """How many checkpoints this store has taken (0: none)."""
        return int(self._meta.get("checkpoint_id") or 0)

    def workers(self) -> list[str]:
        """The worker address of each shard."""
        who = self.client.who_has(self._futures)
        return [next(iter(who.get(f.key, ())), "?") for f in self._futures]

    def shard_map(self) -> ShardMap:
        """A picklable handle for code on workers (replicas) to fetch from and push to the shards."""
        return ShardMap(self.layout, tuple(self._actors))

    def names(self) -> list[str]:
        """Names of the vectors on the shards."""
        names: list[str] = self._call_all("names", [()] * self.shards)[0]
        return names

    def begin_rounds(self, replicas: int) -> None:
        """Every shard applies Downpour pushes round by round in replica order from now on, and answers a
        round's fetches with the round start's parameters (``downpour.train(deterministic=True)``,
        :mod:`storage._rounds`)."""
        self._call_all("begin_rounds", [(int(replicas),)] * self.shards)

    def memory(self) -> list[dict[str, Any]]:
        """Every shard's memory report, in one round trip: ``ram_bytes``, ``budget`` (bytes, or None for no
        limit), ``spilled`` names and the spill files' bytes and seconds (``ShardActor.memory``)."""
        out: list[dict[str, Any]] = self._call_all("memory", [()] * self.shards)
        return out

    def counters(self) -> list[dict[str, Any]]:
        """Every shard's Downpour counters (:meth:`Shard.counters`): updates applied, in one round trip."""
        out: list[dict[str, Any]] = self._call_all("counters", [()] * self.shards)
        return out

    # -- calls -----------------------------------------------------------------------------------------
    def _call_all(self, method: str, args: Sequence[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        """Call ``method`` on every shard at once (one round trip) and return the per-shard results."""
        results = self._call(list(range(self.shards)), method, args, **kwargs)
        self.stats.round_trips += 1
        return results

    def _call(
        self,
        which: list[int],
        method: str,
        args: Sequence[tuple[Any, ...]],
        *,
        members: dict[int, list[int]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``method`` on the shards ``which`` at once and return their results.

        ``members[i]`` lists the shards the call to shard ``i`` serves (itself first, all on its worker):
        they are lost with it, and its result is a list with one entry per member.
        """
        group = members or {}
        self.stats.shard_calls += sum(len(group.get(i, [i])) for i in which)
        self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
        lost: list[int] = []
        futures: list[Any] = []
        for i, a in zip(which, args, strict=True):
            call = start_call(self._actors[i], method, *a, **kwargs)
            if isinstance(call, RuntimeError):  # "Worker holding Actor was lost"
                lost.extend(group.get(i, [i]))
            elif isinstance(call, Exception):
                raise call
            futures.append(call)
        results: list[Any] = [None] * len(which)
        if not lost:
            outcome = gather_calls(
                self.client,
                futures,
                timeout=self.timeout,
                gone=lambda k: self._futures[which[k]].status in DEAD_STATES,
                timeout_error=lambda k: self._timeout_error(which[k]),
            )
            for k, (ok, value) in enumerate(outcome):
                if ok:
                    results[k] = value
                elif self._is_lost(which[k], value):
                    lost.extend(group.get(which[k], [which[k]]))
                else:
                    raise value
        if lost:
            self._recover(sorted(set(lost)), method)
        for i, r in zip(which, results, strict=True):
            for part in r if i in group else [r]:
                n_values = _count_values(part)
                self.stats.values_received += n_values
                self.stats.max_received = max(self.stats.max_received, n_values)
        return results

    def _groups(self) -> list[list[int]]:
        """The shards grouped by the worker that holds them (shard order within a group)."""
        by_worker: dict[str, list[int]] = {}
        for i, actor in enumerate(self._actors):
            by_worker.setdefault(getattr(actor, "_address", None) or f"unknown-{i}", []).append(i)
        return list(by_worker.values())

    def _timeout_error(self, shard: int) -> ClusterError:
        return ClusterError(
            f"shard {shard} did not answer within {self.timeout:.0f} s; its worker may be overloaded or "
            "hung: check the Dask dashboard, or pass a larger timeout= to ParameterServer.create/open"
        )

    def _is_lost(self, shard: int, error: BaseException | None = None) -> bool:
        """Whether ``shard``'s worker is gone (as opposed to the op itself having failed)."""
        return confirm_dead(lambda: actor_gone(self.client, self._futures[shard], self._actors[shard]), error)

    def _recover(self, lost: list[int], method: str) -> None:
        """Rebuild the lost shards from the last checkpoint on live workers, then raise ShardLostError."""
        self._meta = self._read_meta()
        restored = self._meta.get("current") is not None
        placement = _placement(self.client, len(lost), None)
        for k, i in enumerate(lost):
            # Its worker's other shards are unknown here: the budget as if it were alone there.
            fut = _submit_shard(
                self.client, self.url, self.layout, i, [placement[k]], self.memory_budget,
                restore=_restore(self._meta, i), worker=0,
            )  # fmt: skip
            self._actors[i] = fut.result(timeout=self.timeout)
            self._futures[i] = fut
        names = ", ".join(f"{i} [{self.layout.bounds[i]}, {self.layout.bounds[i + 1]})" for i in lost)
        if restored:
            msg = (
                f"parameter-server shard {names} was lost with its worker during {method!r}; it was rebuilt "
                f"on a live worker from checkpoint #{self._meta.get('checkpoint_id')} — its vectors are as "
                "they "
                "were at that checkpoint. Call ps.rollback() to bring every shard back to that checkpoint, "
                "then repeat the work since."
            )
        else:
            msg = (
                f"parameter-server shard {names} was lost with its worker during {method!r} and there is no "
                "checkpoint to rebuild it from; it was recreated empty. Call ps.checkpoint() regularly to be "
                "able to recover; re-scatter the vectors to go on."
            )
        raise ShardLostError(msg, shard=lost[0], restored=restored)

    # -- ops -------------------------------------------------------------------------------------------
    def batch(self) -> Batch:
        """A :class:`Batch` that sends many ops in one call per shard."""
        return Batch(self)

    def run(self, ops: Sequence[Sequence[Any]]) -> list[Any]:
        """Apply ``ops`` (tuples ``(name, *args)``) on every shard in one round trip; reduced results."""
        for op in ops:
            if op[0] not in OPS:
                raise InvalidOptionError(f"unknown op {op[0]!r}; known ops: {sorted(OPS)}")
        groups = self._groups()
        if all(len(g) == 1 for g in groups):
            return reduce_results(ops, self._call_all("run", [(list(ops),)] * self.shards))
        # A worker holding several shards gets one call for all of them: each call costs the caller
        # ~0.3-0.5 ms of CPU, and the worker runs its shards' ops one at a time anyway.
        leaders = [g[0] for g in groups]
        keys = [[self._futures[i].key for i in g[1:]] for g in groups]
        results = self._call(
            leaders, "run_with", [(k, list(ops)) for k in keys], members={g[0]: g for g in groups}
        )
        self.stats.round_trips += 1
        partials: list[Any] = [None] * self.shards
        for g, per_shard in zip(groups, results, strict=True):
            for i, part in zip(g, per_shard, strict=True):
                partials[i] = part
        return reduce_results(ops, partials)

    def _op(self, *op: Any) -> Any:
        return self.run([op])[0]

    # -- slices ----------------------------------------------------------------------------------------
    def _shards_of(self, lo: int, hi: int) -> list[int]:
        if not 0 <= lo <= hi <= self.n:
            raise InvalidOptionError(f"range [{lo}, {hi}) is outside the vector of {self.n} parameters")
        return [i for i, (a, b) in enumerate(self.layout.ranges()) if a < hi and b > lo]

    def get(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The values ``name[lo:hi]`` (only the shards holding that range are asked)."""
        hi = self.n if hi is None else hi
        which = self._shards_of(lo, hi)
        if 8 * (hi - lo) > GATHER_PIECEWISE_BYTES and len(which) > 1:
            # A wide range (a result's x at 1e8 parameters: 1 GB) comes one shard at a time into one array,
            # so the caller holds the array and one slice at most, not every slice and their concatenation.
            out = np.empty(hi - lo)
            for i in which:
                (part,) = self._call([i], "get", [(name, lo, hi)])
                a = max(lo, self.layout.bounds[i]) - lo
                out[a : a + part.shape[0]] = part
                del part
            self.stats.round_trips += len(which)
            return out
        parts = self._call(which, "get", [(name, lo, hi)] * len(which))
        self.stats.round_trips += 1
        return np.concatenate(parts) if parts else np.empty(0)

    def set(self, name: str, lo: int, values: np.ndarray) -> None:
        """Write ``values`` to ``name[lo:lo+len(values)]``; ``name`` must exist unless the range is whole."""
        values = _as_vector(values)
        hi = lo + values.shape[0]
        which = self._shards_of(lo, hi)
        args = []
        for i in which:
            a, b = max(lo, self.layout.bounds[i]), min(hi, self.layout.bounds[i + 1])
            args.append((name, a, b, values[a - lo : b - lo]))
        self._call(which, "set", args)
        self.stats.round_trips += 1

    def scatter(self, name: str, array: np.ndarray) -> None:
        """Store the whole vector ``array`` (length ``n``) as ``name``, each shard getting its slice."""
        array = _as_vector(array)
        if array.shape[0] != self.n:
            raise InvalidOptionError(f"scatter {name!r}: expected {self.n} values, got {array.shape[0]}")
        self.set(name, 0, array)

    def gather(self, name: str) -> np.ndarray:
        """The whole vector ``name`` as one numpy array (for tests and results: it moves n floats)."""
        return self.get(name, 0, self.n)

    # -- persistence -----------------------------------------------------------------------------------
    def checkpoint(
        self,
        names: Sequence[str] | None = None,
        *,
        meta: dict[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
    ) -> int:
        """Write ``names`` (default: every vector) of every shard to zarr; returns the checkpoint number.

        Shards write the slot that is not current, each only its own chunks; the slot becomes current only
        after every shard has written, so an interrupted checkpoint leaves the previous one intact.
        ``meta`` (JSON-able) is saved with it and read back by :attr:`checkpoint_meta`.

        ``dtypes`` (``{name: "float32"}``) names the vectors the shards store as float32 (an L-BFGS history
        with ``history_dtype="float32"``): their arrays are float32, half the bytes. Those of the last
        checkpoint are known without it. A float32 vector written to a float64 array anyway is restored as
        float32 (the shards' states list their dtypes), with the same values.
        """
        if dtypes is not None:
            for name, dtype in dtypes.items():
                if dtype not in ("float64", "float32"):
                    raise InvalidOptionError(
                        f"checkpoint dtypes: {name!r} as {dtype!r}; vectors are stored as 'float64' or "
                        "'float32'"
                    )
        names = sorted(self.names()) if names is None else sorted(set(names))
        known = {**self.checkpoint_dtypes, **(dtypes or {})}
        # This handle is the store's only writer: its own copy of the attributes is current.
        current = self._meta.get("current")
        target = 0 if current != 0 else 1
        if self._group is None:
            self._group = open_group(self.url, mode="r+")
        group = self._group
        slot = f"slot{target}"
        # The slot's arrays are made once and then overwritten in place: creating zarr arrays costs far
        # more than writing a small vector. Arrays of names not in this checkpoint are simply ignored.
        sub = group.require_group(slot)
        existing = self._slot_arrays.get(slot)
        if existing is None:
            existing = self._slot_arrays[slot] = {key: str(a.dtype) for key, a in sub.arrays()}
        for name in names:
            dtype = known.get(name, "float64")
            if existing.get(name) == dtype:
                continue
            existing[name] = dtype
            sub.create_array(
                name,
                shape=(self.layout.stored_size,),
                chunks=(self.layout.chunk,),
                dtype=dtype,
                compressors=None,
                fill_value=0.0,
                overwrite=True,  # an array of this name in another dtype (a run resumed with another one)
            )
        narrow = {name: existing[name] for name in names if existing[name] != "float64"}
        # The float32 arrays ride along only when there are some: a float64 run's messages are as before.
        args = (slot, names, narrow) if narrow else (slot, names)
        states = self._call_all("checkpoint", [args] * self.shards)
        checkpoint_id = int(self._meta.get("checkpoint_id") or 0) + 1
        new = dict(self._meta)
        new.update(
            current=target,
            checkpoint_id=checkpoint_id,
            names=names,
            states=states,
            meta=dict(meta or {}),
            time=time.time(),
        )
        group.attrs[ATTR] = new
        self._meta = new
        return checkpoint_id

    def rollback(self) -> None:
        """Bring every shard back to the last checkpoint (vectors created since are dropped)."""
        self._meta = self._read_meta()
        slot = self._meta.get("current")
        if slot is None:
            raise StoreError(f"{self.url!r} has no checkpoint to roll back to; call checkpoint() first")
        states = self._meta["states"]
        self._call(
            list(range(self.shards)),
            "restore",
            [(f"slot{slot}", self._meta["names"], states[i]) for i in range(self.shards)],
        )
        self.stats.round_trips += 1

    def final_results(self, name: str, epoch: int, shards: Sequence[int]) -> list[Any]:
        """Each listed shard's stored finalize results of ``epoch`` (see ``Shard.push_portions``)."""
        results = self._call(list(shards), "final_results", [(name, epoch)] * len(shards))
        self.stats.round_trips += 1
        return results

    def ping(self) -> None:
        """Check every shard answers (restoring lost ones, which raises :class:`errors.ShardLostError`)."""
        self._call_all("ping", [()] * self.shards)

    def close(self) -> None:
        """Release the actors (the store stays; :meth:`open` brings the server back)."""
        with contextlib.suppress(Exception):
            self._call_all("close", [()] * self.shards)
        _release(self._futures)
        self._actors = []

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_meta(self) -> dict[str, Any]:
        return read_attrs(self.url)

    def __repr__(self) -> str:
        return f"ParameterServer(n={self.n}, shards={self.shards}, store={self.url!r})"


def _release(futures: Sequence[Future[Any]]) -> None:
    """Let go of shard actors (the server's at close, or those of a server that was never made)."""
    for f in futures:
        with contextlib.suppress(Exception):
            f.release()


def worker_alive(address: str | None) -> bool:
    """Whether the scheduler still lists the worker at ``address`` (True when that cannot be told)."""
    if address is None:
        return True
    try:
        from distributed import get_client

        return address in worker_addresses(get_client())
    except Exception:
        return True


def _as_vector(values: Any) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise InvalidOptionError(f"expected a 1-D vector, got shape {array.shape}")
    return array


def _store_for(url: str) -> Any:
    from ._store import open_store

    return open_store(url)


def read_attrs(url: str) -> dict[str, Any]:
    """The parameter-server metadata stored at ``url`` (StoreError when none, or an unreadable format)."""
    try:
        group = open_group(url, mode="r")
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"cannot read the parameter-server store {url!r}: {exc}") from exc
    meta = group.attrs.get(ATTR)
    if not isinstance(meta, dict):
        raise StoreError(
            f"{url!r} holds no parameter server; create one with ParameterServer.create(client, n, store=...)"
        )
    if meta.get("format") not in READABLE_FORMATS:
        raise StoreError(
            f"{url!r} was written by parameter-server format {meta.get('format')}; this version reads "
            f"formats {list(READABLE_FORMATS)}: open it with the distbelief version that wrote it"
        )
    if meta["format"] == 1 and Layout.from_dict(meta["layout"]).padded:
        # Format 1 stored every shard at its own bounds; a layout that pads cannot have written it.
        raise StoreError(f"{url!r} says format 1 but its layout is not chunk-aligned: the store is damaged")
    return dict(meta)


def _check_budget(budget: object) -> None:
    """Refuse a ``memory_budget`` that is not bytes (an int >= 0, not a bool), ``"auto"`` or None."""
    if budget is None or budget == "auto":
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidOptionError(f"memory_budget must be bytes (an int >= 0), 'auto' or None, got {budget!r}")


def _submit_shard(
    client: Client,
    url: str,
    layout: Layout,
    index: int,
    placement: Sequence[str],
    budget: int | str | None,
    *,
    worker: int | None = None,
    vectors: Mapping[str, np.ndarray] | None = None,
    restore: tuple[str, Sequence[str], Any] | None = None,
) -> Future[Any]:
    """Start shard ``index`` of ``layout`` as a :class:`ShardActor` on ``placement[worker]`` (default
    ``placement[index]``), its memory ``budget`` shared with the other shards ``placement`` puts there: new
    (with its slices of ``vectors``, or empty), or restored from a checkpoint, ``restore = (slot, names,
    scalar state)``. The one place a shard actor is built (create, open and recovery)."""
    _check_budget(budget)
    lo, hi = layout.ranges()[index]
    address = placement[index if worker is None else worker]
    slot, names, state = restore if restore is not None else (None, (), None)
    return client.submit(
        ShardActor,
        index,
        lo,
        hi,
        url,
        slot=slot,
        names=names,
        state=state,
        vectors=None if vectors is None else {name: values[lo:hi] for name, values in vectors.items()},
        memory_budget=budget,
        shards_here=max(1, list(placement).count(address)),
        offset=layout.offsets()[index],
        actor=True,
        workers=[address],
        allow_other_workers=False,
        key=f"shard-{index}-{uuid.uuid4().hex[:12]}",
        pure=False,
    )


def _restore(meta: Mapping[str, Any], i: int) -> tuple[str, Sequence[str], Any] | None:
    """Shard ``i``'s ``restore`` from the last checkpoint the store's ``meta`` names (None: no checkpoint)."""
    slot = meta.get("current")
    return None if slot is None else (f"slot{slot}", meta.get("names", []), meta["states"][i])


def _placement(client: Client, count: int, workers: Sequence[str] | None) -> list[str]:
    """``count`` worker addresses, round robin over ``workers`` (default: all live workers, sorted)."""
    if workers is None:
        workers = worker_addresses(client, required=True)
    workers = list(workers)
    if not workers:
        raise ClusterError(NO_WORKERS)
    return [workers[i % len(workers)] for i in range(count)]
