"""The Dask actor around a :class:`~storage._shard.Shard`: it only forwards.

Every method is ``async def`` so that it runs on the worker's event loop and never queues behind a gradient
computation in the worker's actor thread (the deadlock and latency lessons in DESIGN.md). Tiny shards run
their ops inline on the loop (~microseconds); large shards hand each op to a thread of their own, one op at a
time and in arrival order, so no lock is needed. Only kernels that release the GIL (``np.dot``, ufuncs) leave
the loop free meanwhile: ``scipy.linalg.blas`` (``daxpy``, ``dscal``) holds it for the whole call, so calls to
this worker wait for the op (benchmarks/shard_ops.py measures both).
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import numpy as np

from distbelief.errors import InvalidOptionError

from ._direct import install as install_direct_calls
from ._layout import Layout
from ._monitor import Sample, shard_samples
from ._monitor import install_worker as install_metrics_page
from ._rounds import RoundOrder
from ._shard import Shard
from ._store import open_group
from ._vectorstore import default_budget, storage_dtype
from ._wire import pack_if_small

__all__ = [
    "INLINE_MAX_ELEMENTS",
    "LOOP_SWITCH_INTERVAL",
    "HandOut",
    "HandedPush",
    "ShardActor",
    "keep_loop_responsive",
    "read_checkpoint",
    "read_stored_vector",
    "write_checkpoint",
]

#: Shards up to this many elements run ops inline on the worker's event loop (an op on 64 Ki floats takes
#: ~10-50 us, less than handing it to a thread would cost).
INLINE_MAX_ELEMENTS = 1 << 16

#: GIL switch interval for processes hosting shards and replicas (Python's default: 5 ms).
LOOP_SWITCH_INTERVAL = 0.0005

T = TypeVar("T")


class HandOut(NamedTuple):
    """What :meth:`ShardActor.hand_out` is asked (pickled): run ``ops`` once for ``epoch``, read ``names``
    and call ``method`` of the actor ``key`` at ``address`` with ``payload`` and them."""

    epoch: int
    ops: list[Any]
    names: list[str]
    key: str
    address: str
    method: str
    payload: bytes


class HandedPush(NamedTuple):
    """A gradient the target of a :class:`HandOut` gives back for the shard to accumulate: ``values`` (or
    each portion's own ``(keys or None, values)`` pairs, a list) of ``portions``, as :meth:`ShardActor.
    accumulate` takes them."""

    name: str
    values: Any
    portions: list[int]
    epoch: int
    solo: bool


def keep_loop_responsive() -> None:
    """Let this worker's event loop take the GIL within ~0.5 ms while a compute thread runs numpy code.

    A thread looping over many short numpy calls (a row-blocked gradient: ~60 us BLAS calls with Python in
    between) takes the GIL back the moment each call returns, before the woken event-loop thread gets it;
    the loop then waits for Python's forced switch, 5 ms by default, for every message it handles. Measured
    here: an actor call to a worker whose replica computes such a gradient took 5.7 ms (median) instead of
    1.5 ms; with a 0.5 ms switch interval, 1.7 ms. The interval is process-wide and only ever lowered.
    """
    if sys.getswitchinterval() > LOOP_SWITCH_INTERVAL:
        sys.setswitchinterval(LOOP_SWITCH_INTERVAL)


def write_checkpoint(
    url: str,
    slot: str,
    lo: int,
    hi: int,
    vectors: dict[str, np.ndarray],
    cache: dict[str, Any] | None = None,
    narrow: Mapping[str, str] | None = None,
) -> None:
    """Write one shard's slices into ``lo:hi`` of the arrays ``{slot}/{name}`` (already created by the
    server; ``lo`` is the shard's stored offset, :meth:`Layout.offsets`). ``narrow`` names the arrays the
    server made float32 (the others are float64).

    ``cache`` keeps the opened arrays between checkpoints: opening costs metadata reads per array. An
    array the server made anew in another dtype is opened again.
    """
    cache = {} if cache is None else cache
    narrow = narrow or {}
    for name, values in vectors.items():
        if np.dtype(narrow.get(name, "float64")).itemsize < values.dtype.itemsize:
            # Refused before anything is written (the slot is the one that is not current anyway).
            raise InvalidOptionError(
                f"checkpoint: vector {name!r} is stored as {values.dtype} but its checkpoint array as "
                f"{narrow[name]}, which would round it; pass dtypes={{{name!r}: '{values.dtype}'}} to "
                "ParameterServer.checkpoint"
            )
    group = None
    for name, values in vectors.items():
        key = f"{slot}/{name}"
        array = cache.get(key)
        if array is None or array.dtype != np.dtype(narrow.get(name, "float64")):
            group = open_group(url, mode="r+") if group is None else group
            array = cache[key] = group[key]
        array[lo:hi] = values


def read_checkpoint(url: str, slot: str, lo: int, hi: int, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Read one shard's slices of ``names`` from checkpoint slot ``slot`` (``lo:hi`` in the stored arrays,
    see :meth:`Layout.offsets`), each in its stored dtype (float32 history stays float32)."""
    group = open_group(url, mode="r")
    out = {}
    for name in names:
        array = group[f"{slot}/{name}"]
        out[name] = np.ascontiguousarray(array[lo:hi], dtype=storage_dtype(array.dtype))
    return out


def read_stored_vector(url: str, slot: str, layout: Layout, name: str) -> np.ndarray:
    """The whole vector ``name`` of checkpoint slot ``slot``, without the padding between shards."""
    stored = read_checkpoint(url, slot, 0, layout.stored_size, [name])[name]
    if not layout.padded:
        return stored
    return np.concatenate(
        [stored[o : o + hi - lo] for o, (lo, hi) in zip(layout.offsets(), layout.ranges(), strict=True)]
    )


class ShardActor:
    """Dask actor holding one shard; restored from checkpoint ``slot`` of ``url`` when ``slot`` is given,
    else starting with ``vectors`` (this shard's slices, by name).

    ``memory_budget`` is the bytes of vectors the shard keeps in RAM (the rest spill to local files, see
    :mod:`storage._vectorstore`): ``"auto"`` takes a share of this worker's ``memory_limit`` split over its
    ``shards_here`` shards, ``None`` keeps everything in RAM. ``offset`` is where the shard's range starts in
    the checkpoint arrays (:meth:`Layout.offsets`; default ``lo``)."""

    #: Methods other workers may call straight through the worker's handler (:mod:`storage._direct`).
    DIRECT_METHODS = frozenset({"packed", "hand_out"})

    def __init__(
        self,
        index: int,
        lo: int,
        hi: int,
        url: str,
        slot: str | None = None,
        names: Sequence[str] = (),
        state: dict[str, Any] | None = None,
        vectors: dict[str, np.ndarray] | None = None,
        memory_budget: int | str | None = None,
        shards_here: int = 1,
        spill_dir: str | None = None,
        offset: int | None = None,
    ) -> None:
        keep_loop_responsive()
        install_direct_calls()  # its worker answers direct calls of ``packed`` (:mod:`storage._direct`)
        install_metrics_page()  # its worker shows what this shard does (:mod:`storage._monitor`)
        budget = default_budget(shards_here) if memory_budget == "auto" else memory_budget
        assert budget is None or isinstance(budget, int)
        self.core = Shard(index, lo, hi, memory_budget=budget, spill_dir=spill_dir)
        for name, values in (vectors or {}).items():
            self.core.set(name, lo, hi, values)
        self.url = url
        #: This shard's range in the checkpoint arrays (its range in the vector unless the layout pads).
        self.stored = (lo, hi) if offset is None else (offset, offset + hi - lo)
        self._arrays: dict[str, Any] = {}  # opened checkpoint arrays, by "slot/name"
        inline = hi - lo <= INLINE_MAX_ELEMENTS
        #: Whether ops run on the event loop itself (a small slice), not on the shard's own thread.
        self.runs_inline = inline
        self._executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix=f"shard{index}")
        if slot is not None:
            for name in names:  # one vector at a time: the budget places each before the next is read
                self.core.vectors.update(read_checkpoint(url, slot, *self.stored, [name]))
            self.core.load_state(state or {})
        #: Deterministic Downpour (storage/_rounds.py): the push order, and the round start's version and
        #: slices that the round's fetches are answered from; None in the usual asynchronous mode.
        self._rounds: RoundOrder | None = None
        self._round_start: tuple[int, dict[str, np.ndarray]] = (0, {})
        self._round_changed: asyncio.Condition | None = None

    async def _do(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def packed(self, request: bytes) -> Any:
        """Any method, called as one pickled frame ``(method, args, kwargs)`` (see :mod:`storage._wire`);
        the answer comes back pickled too when its arrays are small."""
        method, args, kwargs = pickle.loads(request)
        if method.startswith("_") or method == "packed":
            raise AttributeError(f"no shard method {method!r}")
        return pack_if_small(await getattr(self, method)(*args, **kwargs))

    async def hand_out(self, request: bytes) -> bytes:
        """Prepare, hand the parameters to a worker actor with its work, and take its gradient back.

        One message from the coordinator does what a fetch, a push and their answers did: ``request`` is a
        pickled :class:`HandOut`. This shard runs its ``ops`` once for its ``epoch`` (:meth:`Shard.prepare`),
        reads ``names``, and calls ``method`` of the actor ``key`` on the worker at ``address`` (in-process
        when it lives here) with one pickled frame ``(payload, slices, op results)``. That actor answers
        ``(answer, pushes)``: its own answer (bytes, passed back as they are) and the :class:`HandedPush`
        gradients to accumulate here. Returns a pickled ``(answer, finalized)``: the finalize ops' results
        if one of those pushes completed this shard's batch, else None.

        For a model on one shard, the parameters then travel with the work and the gradient with the
        answer: two messages fewer on a remote replica's path than a fetch and a push of its own, and the
        replica never waits for this worker's loop while its neighbour computes (Sandblaster, section 4.2).
        A lost target fails the call with the ``OSError`` its worker's connection raised.
        """
        from distributed import get_worker

        from ._direct import call_from_worker

        call: HandOut = pickle.loads(request)
        _, slices, results = await self.prepare_and_fetch(call.epoch, call.ops, call.names)
        frame = pickle.dumps((call.payload, slices, results), protocol=pickle.HIGHEST_PROTOCOL)
        reply = await call_from_worker(get_worker(), call.address, call.key, call.method, frame)
        answer, pushes = pickle.loads(reply)
        finalized = None
        push: HandedPush
        for push in pushes:
            if isinstance(push.values, list):  # each portion's own gradient: (keys or None, values) pairs
                _, done = await self.accumulate_parts(push.name, push.values, push.portions, push.epoch)
            else:
                _, done = await self.accumulate(push.name, push.values, push.portions, push.epoch, push.solo)
            if done is not None:
                finalized = done
        return pickle.dumps((answer, finalized), protocol=pickle.HIGHEST_PROTOCOL)

    async def ping(self) -> tuple[int, int, int]:
        """``(index, lo, hi)``: a cheap liveness check."""
        return self.core.index, self.core.lo, self.core.hi

    async def run(self, ops: Sequence[Sequence[Any]]) -> list[Any]:
        """Forward to :meth:`Shard.run`."""
        return await self._do(self.core.run, ops)

    async def run_with(self, keys: Sequence[str], ops: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Run ``ops`` on this shard, then on the shards with actor keys ``keys`` (on this same worker).

        Returns one list of partial results per shard, this one first. The server sends one call per
        *worker* rather than per shard: each call costs ~0.3-0.5 ms of the caller's CPU, and a worker runs
        its shards' ops one at a time anyway (one core per worker, and scipy's BLAS holds the GIL).
        """
        from distributed import get_worker

        actors = get_worker().state.actors
        out = [await self.run(ops)]
        for key in keys:
            sibling = actors[key]
            assert isinstance(sibling, ShardActor)
            out.append(await sibling.run(ops))
        return out

    async def get(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """Forward to :meth:`Shard.get`."""
        return await self._do(self.core.get, name, lo, hi)

    async def fetch(self, names: Sequence[str], round: int | None = None) -> tuple[int, list[np.ndarray]]:
        """``(version, [slice of each name])`` for a replica's fetch, in one round trip (with ``round``,
        deterministic mode: the slices at that round's start)."""
        if round is not None:
            return await self._round_fetch(round, names)

        def _fetch() -> tuple[int, list[np.ndarray]]:
            return self.core.version, [self.core.get(name) for name in names]

        return await self._do(_fetch)

    async def prepare_and_fetch(
        self, epoch: int, ops: Sequence[Sequence[Any]], names: Sequence[str]
    ) -> tuple[int, list[np.ndarray], list[Any]]:
        """:meth:`Shard.prepare` then a fetch, in one round trip: ``(version, slices, op results)``."""

        def _both() -> tuple[int, list[np.ndarray], list[Any]]:
            results = self.core.prepare(epoch, ops)
            return self.core.version, [self.core.get(name) for name in names], results

        return await self._do(_both)

    async def gather(
        self, names: Sequence[str], keys: np.ndarray, round: int | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """``(version, [values of each name at keys])``: a key-value fetch (see :mod:`storage._keys`)."""
        if round is not None:
            return await self._round_fetch(round, names, keys)

        def _gather() -> tuple[int, list[np.ndarray]]:
            return self.core.version, [self.core.gather(name, keys) for name in names]

        return await self._do(_gather)

    async def prepare_and_gather(
        self, epoch: int, ops: Sequence[Sequence[Any]], name: str, keys: np.ndarray | None
    ) -> tuple[int, list[np.ndarray], list[Any]]:
        """:meth:`prepare_and_fetch` of the values of ``name`` at ``keys`` only (``None``: the whole
        slice), in one round trip."""

        def _both() -> tuple[int, list[np.ndarray], list[Any]]:
            results = self.core.prepare(epoch, ops)
            return self.core.version, [self.core.gather(name, keys)], results

        return await self._do(_both)

    async def set(self, name: str, lo: int, hi: int, values: np.ndarray) -> None:
        """Forward to :meth:`Shard.set`."""
        await self._do(self.core.set, name, lo, hi, values)

    async def push(
        self,
        grad: np.ndarray | None,
        *,
        round: int | None = None,
        replica: int = 0,
        last: bool = False,
        **kwargs: Any,
    ) -> tuple[bool, int, int]:
        """Forward to :meth:`Shard.push`; with ``round`` (deterministic mode), in the order of
        :mod:`storage._rounds` (``replica``'s push of that round; ``last``: its final one)."""
        if round is not None:
            return await self._ordered_push(grad, round, replica, last, kwargs)
        return await self._do(self.core.push, grad, **kwargs)

    async def push_fetch(
        self,
        grad: np.ndarray | None,
        names: Sequence[str],
        *,
        round: int | None = None,
        replica: int = 0,
        last: bool = False,
        fetch_keys: np.ndarray | None = None,
        **kwargs: Any,
    ) -> tuple[tuple[bool, int, int], tuple[int, list[np.ndarray]]]:
        """Forward to :meth:`Shard.push_and_fetch` (Downpour's fused push and fetch: one round trip); in
        deterministic mode the push of ``round`` and the fetch for the next round."""
        if round is not None:
            answer = await self._ordered_push(grad, round, replica, last, kwargs)
            return answer, await self._round_fetch(round + 1, names, fetch_keys)
        return await self._do(self.core.push_and_fetch, grad, names, fetch_keys=fetch_keys, **kwargs)

    # -- deterministic Downpour (storage/_rounds.py) ------------------------------------------------------
    async def begin_rounds(self, replicas: int, names: Sequence[str] = ("x",)) -> None:
        """From now on apply Downpour pushes round by round in replica order, and answer a round's fetches
        with the round start's slices (``downpour.train(deterministic=True)``)."""
        self._rounds = RoundOrder(int(replicas))
        self._round_changed = asyncio.Condition()
        self._snapshot_round(names)

    def _snapshot_round(self, names: Sequence[str] | None = None) -> None:
        names = list(self._round_start[1]) if names is None else list(names)
        self._round_start = (self.core.version, {name: self.core.get(name).copy() for name in names})

    async def _ordered_push(
        self, grad: np.ndarray | None, round_: int, replica: int, last: bool, kwargs: dict[str, Any]
    ) -> tuple[bool, int, int]:
        if self._rounds is None or self._round_changed is None:
            raise RuntimeError(
                "a push for a round before begin_rounds: the run was not set up as deterministic"
            )
        done: asyncio.Future[tuple[bool, int, int]] = asyncio.get_running_loop().create_future()
        async with self._round_changed:  # one coroutine at a time offers and applies: the order holds
            for (g, kw, fut), completes in self._rounds.offer(
                round_, replica, (grad, kwargs, done), last=last
            ):
                try:
                    fut.set_result(await self._do(self.core.push, g, **kw))
                except Exception as exc:
                    fut.set_exception(exc)
                if completes:
                    self._snapshot_round()
                    self._round_changed.notify_all()
        return await done

    async def _round_fetch(
        self, round_: int, names: Sequence[str], keys: np.ndarray | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """The slices of ``names`` at the start of round ``round_`` (waits for the rounds before it)."""
        assert self._rounds is not None and self._round_changed is not None
        rounds = self._rounds
        async with self._round_changed:
            await self._round_changed.wait_for(lambda: rounds.ready(round_))
            version, slices = self._round_start
        if keys is None:
            return version, [slices[name] for name in names]
        return version, [slices[name][np.asarray(keys)] for name in names]

    async def accumulate(
        self, name: str, values: np.ndarray, portions: Sequence[int], epoch: int, solo: bool = False
    ) -> tuple[bool, list[Any] | None]:
        """Forward to :meth:`Shard.push_portions`."""
        return await self._do(self.core.push_portions, name, values, portions, epoch=epoch, solo=solo)

    async def accumulate_parts(
        self,
        name: str,
        parts: Sequence[tuple[np.ndarray | None, np.ndarray]],
        portions: Sequence[int],
        epoch: int,
    ) -> tuple[bool, list[Any] | None]:
        """Forward to :meth:`Shard.push_parts` (several portions, each its own gradient, one message)."""
        return await self._do(self.core.push_parts, name, parts, portions, epoch=epoch)

    async def final_results(self, name: str, epoch: int) -> list[Any] | None:
        """Forward to :meth:`Shard.final_results`."""
        return await self._do(self.core.final_results, name, epoch)

    async def checkpoint(
        self, slot: str, names: Sequence[str], narrow: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Write this shard's vectors ``names`` to ``slot`` (``narrow``: the float32 arrays among them);
        return its scalar state."""

        def _snapshot() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            # Copies, so that ops arriving while the write is in flight cannot tear the checkpoint.
            return {n: self.core.vector(n).copy() for n in names}, self.core.state()

        if self._executor is None:
            vectors, state = _snapshot()
            await asyncio.to_thread(
                write_checkpoint, self.url, slot, *self.stored, vectors, self._arrays, narrow
            )
            return state

        def _write() -> dict[str, Any]:
            # Large shard: ops are serialized on its one thread, so writing in place is consistent.
            vectors = {n: self.core.vector(n) for n in names}
            write_checkpoint(self.url, slot, *self.stored, vectors, self._arrays, narrow)
            return self.core.state()

        return await self._do(_write)

    async def restore(self, slot: str, names: Sequence[str], state: dict[str, Any]) -> None:
        """Replace every vector by the checkpoint in ``slot`` (a rollback)."""
        lo, hi = self.stored
        if self._executor is not None:
            # Large shard: read one vector at a time on its op thread (ops wait, as they would for the
            # swap), so a restore never holds every vector in RAM at once beside the memory budget.
            def _reload() -> None:
                self.core.vectors.clear()
                self.core.accumulators = {}
                for name in names:
                    self.core.vectors.update(read_checkpoint(self.url, slot, lo, hi, [name]))
                self.core.load_state(state)

            await self._do(_reload)
            return
        vectors = await asyncio.to_thread(read_checkpoint, self.url, slot, lo, hi, names)

        def _swap() -> None:
            # Cleared and refilled rather than replaced: the store keeps its memory budget and spill files.
            self.core.vectors.clear()
            self.core.vectors.update(vectors)
            self.core.accumulators = {}
            self.core.load_state(state)

        await self._do(_swap)

    async def counters(self) -> dict[str, Any]:
        """Forward to :meth:`Shard.counters` (on the event loop: a few scalars)."""
        return self.core.counters()

    def monitor(self) -> list[Sample]:
        """The shard's counters for the metrics page (:mod:`storage._monitor`; a plain method, read on the
        worker's event loop, not an actor call)."""
        return shard_samples(self.core)

    async def memory(self) -> dict[str, Any]:
        """Where the vectors are: RAM bytes and budget, spilled names, bytes streamed to and from disk."""
        vs = self.core.vectors
        return {
            "ram_bytes": vs.ram_bytes,
            "budget": vs.budget,
            "spilled": sorted(vs.spilled),
            "bytes_read": vs.bytes_read,
            "bytes_written": vs.bytes_written,
            "seconds_read": vs.seconds_read,
            "seconds_written": vs.seconds_written,
        }

    async def names(self) -> list[str]:
        """Names of the vectors this shard holds."""
        return sorted(self.core.vectors)

    async def close(self) -> None:
        """Release the shard's thread and its spilled vector files."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self.core.close()
