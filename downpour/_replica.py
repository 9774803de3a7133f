"""A Downpour model replica as a Dask actor: compute, fetch and push weakly synchronized (paper, section 4.1).

The paper runs fetching, pushing and computing in "three only weakly synchronized threads" (Appendix,
Algorithm 7.1). Here:

* **compute** is a thread of the replica's own, started by :meth:`DownpourReplica.start`, so the actor's
  methods (all ``async def``, on the worker's event loop) stay responsive while it runs. It drives a
  :class:`~downpour._core.ReplicaCore` over the replica's mini-batches, with BLAS limited to one thread
  (two cores are shared by every replica and shard of a worker).
* **fetch and push** are coroutines on the worker's event loop, one *channel* per shard. The compute thread
  only hands them messages and never waits for them (unless the staleness bound says it must); answers come
  back through a queue that the compute thread drains between steps. A channel sends one message at a time,
  in order, so a fetch sees every push sent before it (the core relies on this) and a push's sequence token
  is never overtaken by the next one. A shard on the same worker is called directly (no RPC to itself).
  With ``n_push == n_fetch`` a push carries the next fetch (``ReplicaConfig.fuse``): one ``push_fetch``
  message per shard answers both, so a step costs one message per shard instead of two.

After a shard was lost and restored on another worker, the driver hands every replica the new shard map
(:meth:`DownpourReplica.set_shard_map`); calls in flight to the old actor are abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from distbelief.models import Model
from distbelief.storage import Dataset, ShardMap, reuse_freed_memory
from distbelief.storage.internal import (
    Sample,
    SparsePortion,
    await_call,
    compact_batch,
    install_worker,
    param_keys,
    rows_keys,
    sparse_layout_of,
    split_keys,
    union_keys,
)
from distbelief.storage.internal import nbytes as rows_nbytes

from ._batches import BatchPlan
from ._compress import Compression
from ._core import FetchRequest, PushMessage, ReplicaCore

__all__ = ["DownpourReplica", "RecordPlan", "ReplicaConfig"]

#: A replica keeps the segments it read in memory up to this many bytes (data affinity); beyond, it
#: re-reads them from the store each epoch.
CACHE_BYTES = 1 << 30
#: How long the compute thread sleeps at most while waiting for the shards (seconds).
_WAIT_SLICE = 0.02
#: Parameter copies a replica holds for the driver (history records not yet polled) up to this many bytes;
#: past it, records go without their copy (the driver polls every ``poll_every`` seconds, so this binds
#: only for a model of hundreds of megabytes or a driver that stopped polling).
MAX_PENDING_RECORD_BYTES = 256 << 20


@dataclass(frozen=True)
class RecordPlan:
    """When a replica records a history point: every ``every_steps`` of its steps (None: not by steps; and
    no sooner than ``min_s`` seconds after the last record) or every ``every_s`` seconds, whichever comes
    first, with a copy of its parameters on every ``x_every``-th record (0: never). The driver sets it
    (:mod:`downpour._train`) and may change it with each poll.

    Examples
    --------
    >>> RecordPlan(every_steps=3).x_every
    1
    """

    every_steps: int | None = None
    every_s: float = 1.0
    x_every: int = 1
    min_s: float = 0.0


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica needs to know of the run's options (built by :func:`downpour.train`).

    Examples
    --------
    >>> ReplicaConfig("run", "sgd", 0.1, None, 1, 1, 0.0, 32, 0, True, None, 100, None, False, 30.0, False).lr
    0.1
    """

    run_id: str
    rule: str
    lr: float
    local_lr: float | None
    n_fetch: int
    n_push: int
    l2: float
    batch_size: int
    seed: int
    shuffle: bool
    epochs: int | None
    step_limit: int | None
    max_staleness: int | None
    staleness_scale: bool
    call_timeout: float
    trace: bool
    #: "sparse": fetch only the parameters this replica's rows touch, push only the nonzero gradient
    #: entries, as key-value pairs per shard (storage._keys); "dense": whole slices.
    communication: str = "dense"
    #: With ``n_push == n_fetch``: each due push carries the next fetch, one message per shard a step.
    fuse: bool = False
    #: Compressed pushes (Strom 2015, downpour._compress), or None.
    compression: Compression | None = None
    #: When to record history points (changed later through :meth:`DownpourReplica.status`).
    record: RecordPlan = RecordPlan()
    #: The most steps a push may sum while every push is outstanding (None: no limit); see downpour._core.
    max_coalesce: int | None = None
    #: Rounds in a fixed order (storage/_rounds.py): the same bits on every rerun.
    deterministic: bool = False


class DownpourReplica:
    """Dask actor: one model replica training on the rows ``[lo, hi)`` of ``dataset``.

    Parameters
    ----------
    index : int
        Replica number.
    model : Model
        Anything with ``loss_and_grad(w, X, y)``.
    dataset : storage.Dataset
        The training rows (the replica reads only its own, portion by portion).
    lo, hi : int
        The rows this replica owns.
    shard_map : storage.ShardMap
        Where to fetch from and push to.
    config : ReplicaConfig
        The run's options.

    Examples
    --------
    >>> fut = client.submit(DownpourReplica, 0, model, dataset, 0, dataset.n_rows, ps.shard_map(), config,
    ...                     actor=True)                                   # doctest: +SKIP
    >>> replica = fut.result(); replica.start().result()                  # doctest: +SKIP
    >>> replica.status().result()["steps"]                                # doctest: +SKIP
    """

    def __init__(
        self,
        index: int,
        model: Model,
        dataset: Dataset,
        lo: int,
        hi: int,
        shard_map: ShardMap,
        config: ReplicaConfig,
    ) -> None:
        # Dask's workers start with MALLOC_TRIM_THRESHOLD_ set, which makes every step's temporaries fresh
        # mmap'ed pages: the MLP of issue 30 stepped at 10 ms instead of 6.7 ms (storage/_malloc.py).
        reuse_freed_memory()
        install_worker()  # its worker's metrics page shows what this replica does (storage._monitor)
        self.index = index
        self.model = model
        self.dataset = dataset
        self.config = config
        self.plan = BatchPlan.for_rows(
            dataset, lo, hi, batch_size=config.batch_size, seed=config.seed, replica=index,
            shuffle=config.shuffle,
        )  # fmt: skip
        self.core = ReplicaCore(
            shard_map.layout.ranges(),
            rule=config.rule,
            lr=config.lr,
            local_lr=config.local_lr,
            n_fetch=config.n_fetch,
            n_push=config.n_push,
            l2=config.l2,
            max_staleness=config.max_staleness,
            staleness_scale=config.staleness_scale,
            trace=config.trace,
            fuse=config.fuse,
            compression=config.compression,
            max_coalesce=config.max_coalesce,
            deterministic=config.deterministic,
        )
        self._map = shard_map
        self._source = f"{config.run_id}/replica-{index}"
        self.step_limit = config.step_limit
        #: Warm start: pause (pushes flushed) once this many steps are done, until :meth:`release`.
        self.hold_at: int | None = None
        self.holding = False
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: list[asyncio.Queue[tuple[Any, ...] | None]] = []
        self._channels: list[asyncio.Task[None]] = []
        self._current: list[asyncio.Future[Any] | None] = []
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: The last segment read that did not fit the cache.
        self._last_segment: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None
        self._cache_bytes = 0
        self._reads: dict[int, Future[tuple[np.ndarray, np.ndarray]]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"downpour-read-{index}")
        self._retry_at = 0.0
        self._backoff = 0.05
        self.started = False
        self.done = False
        self.stop_reason: str | None = None
        self.error: str | None = None
        self._error_obj: BaseException | None = None
        self.epoch = 0
        #: Mini-batches of the current epoch done before a resume (skipped once).
        self._skip = 0
        self.wait_s = 0.0
        self.compute_s = 0.0
        # History records (downpour._train): appended by the compute thread, taken by status() on the event
        # loop, under the lock (with the bytes of the parameter copies they hold).
        self._plan = config.record
        self._records: list[dict[str, Any]] = []
        self._records_bytes = 0
        self._records_lock = threading.Lock()
        self._record_count = 0
        self._record_steps = 0
        self._record_t = time.monotonic()
        #: Windowed key-value mode (:meth:`_use_windows`): the mini-batches from the current step on,
        #: ``[epoch, segment, rows, compact rows or None]``, read ahead as far as the fetches ask.
        self._ahead: deque[list[Any]] = deque()
        self._ahead_first = 0
        self._stream: Iterator[tuple[int, int, np.ndarray]] | None = None
        self._layout: tuple[int, int, bool] | None = None
        self._table = np.zeros(0, dtype=np.int32)
        self._mask = np.zeros(0, dtype=bool)
        #: A built-in linear model's ``rows_residuals`` (windowed mode), None once it declined a step.
        self._rows_step: Callable[..., Any] | None = None
        self._unions: dict[tuple[int, int], np.ndarray] = {}

    # -- actor methods (event loop) ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the channels and the compute thread (returns at once)."""
        if self.started:
            return
        self.started = True
        self._loop = asyncio.get_running_loop()
        n = self.core.n_shards
        self._queues = [asyncio.Queue() for _ in range(n)]
        self._current = [None] * n
        self._channels = [asyncio.ensure_future(self._channel(i)) for i in range(n)]
        self._thread = threading.Thread(target=self._run, name=f"downpour-replica-{self.index}", daemon=True)
        self._thread.start()

    async def status(self, plan: RecordPlan | None = None) -> dict[str, Any]:
        """Counters, losses and state, for the driver's poll (cheap; ``staleness_max`` since the last record),
        with the history records taken since the last poll (``records``) and the wall ``time``.

        ``plan`` replaces the record plan from now on.
        """
        if plan is not None:
            self._plan = plan
        with self._records_lock:
            records, self._records, self._records_bytes = self._records, [], 0
        out = self.core.snapshot()
        out.update(
            time=time.time(),
            records=records,
            index=self.index,
            started=self.started,
            holding=self.holding,
            done=self.done,
            stop_reason=self.stop_reason,
            error=self.error,
            error_obj=self._error_obj,
            epoch=self.epoch,
            wait_s=self.wait_s,
            compute_s=self.compute_s,
            rows_owned=self.plan.n_rows,
        )
        return out

    def monitor(self) -> list[Sample]:
        """This replica's counters for the metrics page (:mod:`storage._monitor`; read on the worker's
        event loop while the compute thread updates them, each a single number)."""
        c = self.core.counters
        me = {"replica": str(self.index), "algorithm": "downpour"}
        return [
            ("distbelief_replica_steps_total", me, c.steps),
            ("distbelief_replica_rows_total", me, c.rows),
            ("distbelief_replica_fetches_total", me, sum(c.fetches)),
            ("distbelief_replica_pushes_total", me, c.pushes_sent),
            ("distbelief_replica_bytes_total", {**me, "direction": "pulled"}, c.bytes_fetched),
            ("distbelief_replica_bytes_total", {**me, "direction": "pushed"}, c.bytes_pushed),
            ("distbelief_replica_seconds_total", {**me, "doing": "compute"}, self.compute_s),
            ("distbelief_replica_seconds_total", {**me, "doing": "wait"}, self.wait_s),
        ]

    async def resume_at(self, steps: int, rows: int, epoch: int) -> None:
        """Before :meth:`start`, continue a resumed run: its counters at the checkpoint. Epoch ``epoch`` goes
        on after the mini-batches its rows counter says were done (the plan is the same on a rerun), so a
        resumed run stops at ``epochs`` exactly (see :mod:`downpour._resume`)."""
        self.core.counters.steps = int(steps)
        self.core.counters.rows = int(rows)
        self.epoch = int(epoch)
        self._skip = self.plan.batches_within(max(0, int(rows) - int(epoch) * self.plan.n_rows))

    async def hold(self, steps: int) -> None:
        """Pause after ``steps`` steps (the warm start), with everything accrued pushed, until released."""
        self.hold_at = steps

    async def release(self) -> None:
        """End a :meth:`hold`."""
        self.hold_at = None

    async def set_shard_map(self, shard_map: ShardMap) -> None:
        """Use ``shard_map`` from now on (a shard was restored); calls in flight to replaced actors end."""
        old = self._map
        self._map = shard_map
        for i, task in enumerate(self._current):
            changed = getattr(old.actors[i], "key", None) != getattr(shard_map.actors[i], "key", None)
            if changed and task is not None and not task.done():
                task.cancel()
        self._inbox.put(("map",))

    async def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop computing, push what has accrued, wait for the answers; return the final :meth:`status`."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        return await self.status()

    async def losses(self) -> list[float]:
        """Every step's mini-batch loss (only with ``trace=True``)."""
        return list(self.core.losses)

    # -- channels (event loop) ---------------------------------------------------------------------------
    def _enqueue(self, ops: list[tuple[int, tuple[Any, ...]]]) -> None:
        for i, op in ops:
            self._queues[i].put_nowait(op)

    def _close_channels(self) -> None:
        for q in self._queues:
            q.put_nowait(None)

    async def _channel(self, i: int) -> None:
        q = self._queues[i]
        me = asyncio.current_task()
        while True:
            op = await q.get()
            if op is None:
                return
            task = asyncio.ensure_future(
                await_call(self._send(i, op), timeout=self.config.call_timeout, what=f"shard {i}")
            )
            self._current[i] = task
            try:
                result = await task
            except asyncio.CancelledError:
                if me is not None and me.cancelling():
                    raise
                self._inbox.put((f"{op[0]}_failed", i, op, "abandoned: the shard map changed"))
            except Exception as exc:
                self._inbox.put((f"{op[0]}_failed", i, op, repr(exc)))
            else:
                self._inbox.put((f"{op[0]}ed", i, op, result))
            finally:
                self._current[i] = None

    async def _send(self, i: int, op: tuple[Any, ...]) -> Any:
        smap = self._map
        if op[0] == "fetch":
            request: FetchRequest = op[1]
            keys = self.core.fetch_keys if request.keys is None else request.keys
            at = {} if request.round is None else {"round": request.round}  # deterministic: the round's start
            if keys is not None:
                return await smap.call(i, "gather", list(request.names), keys[i], **at)
            return await smap.call(i, "fetch", list(request.names), **at)
        msg: PushMessage = op[1]
        kwargs: dict[str, Any] = {
            "source": self._source,
            "seq": msg.seq,
            "rule": self.config.rule,
            "lr": self.config.lr,
            "fetched_version": msg.fetched_versions[i],
            "staleness_scale": self.config.staleness_scale,
            "steps": msg.steps,
        }
        if len(op) > 3 and op[3] is not None:
            kwargs["keys"] = op[3]  # key-value pairs, or sign-coded keys of a compressed push
        if msg.tau is not None:
            kwargs["tau"] = msg.tau
        if msg.round is not None:
            # Deterministic mode: the shards apply it in its place (round, then replica) of the fixed order.
            kwargs.update(round=msg.round, replica=self.index, last=msg.last)
        if msg.fetch is None:
            return await smap.call(i, "push", op[2], **kwargs)
        # Fused: the shard applies the push and answers with its fresh slice (one message for both).
        keys = self.core.fetch_keys if msg.fetch.keys is None else msg.fetch.keys
        if keys is not None:
            kwargs["fetch_keys"] = keys[i]
        return await smap.call(i, "push_fetch", op[2], list(msg.fetch.names), **kwargs)

    # -- compute thread ----------------------------------------------------------------------------------
    def _dispatch(self, ops: list[tuple[int, tuple[Any, ...]]]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._enqueue, ops)

    def _send_fetch(self) -> None:
        request = self.core.start_fetch()
        self._dispatch([(i, ("fetch", request)) for i in range(self.core.n_shards)])

    def _send_push(self, msg: PushMessage) -> None:
        if msg.keys is not None:
            kv = msg.parts(self._map.layout.bounds)
            self._dispatch([(i, ("push", msg, values, keys)) for i, (values, keys) in enumerate(kv)])
            return
        parts = self._map.slices(msg.grad)
        self._dispatch([(i, ("push", msg, part)) for i, part in enumerate(parts)])

    def _maybe_fetch(self) -> None:
        if self.core.fetch_wanted() and time.monotonic() >= self._retry_at:
            self._send_fetch()

    def _drain(self, timeout: float | None) -> None:
        """Feed the shards' answers to the core; wait up to ``timeout`` for the first one."""
        try:
            event = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        core = self.core
        if kind == "map":
            core.reset_shards()
            self._retry_at = 0.0
            return
        _, i, op, result = event
        if kind == "fetched":
            version, arrays = result
            core.on_fetched(op[1].fid, i, int(version), arrays)
            self._backoff = 0.05
        elif kind == "fetch_failed":
            core.on_fetch_failed(op[1].fid, i)
            # A shard that does not answer is usually being restored: do not hammer it.
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(1.0, 2 * self._backoff)
        elif kind == "pushed":
            msg: PushMessage = op[1]
            if msg.fetch is not None:
                result, (version, arrays) = result
            applied, version_after, staleness = result
            core.on_pushed(msg.seq, i, bool(applied), int(version_after), int(staleness), msg.gen)
            if msg.fetch is not None:
                core.on_fetched(msg.fetch.fid, i, int(version), arrays)
                self._backoff = 0.05
        elif kind == "push_failed":
            core.on_push_failed(op[1].seq, i)
            if op[1].fetch is not None:
                core.on_fetch_failed(op[1].fetch.fid, i)
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(1.0, 2 * self._backoff)

    def _segment(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        data = self._cache.get(s)
        if data is None and self._last_segment is not None and self._last_segment[0] == s:
            data = self._last_segment[1]  # past the cache budget: the segment read last is kept still
        if data is None:
            pending = self._reads.pop(s, None)
            lo, hi = self.plan.segments[s]
            data = pending.result() if pending is not None else self.dataset.read_rows(lo, hi)
            nbytes = rows_nbytes(data[0]) + data[1].nbytes
            if self._cache_bytes + nbytes <= CACHE_BYTES:
                self._cache[s] = data
                self._cache_bytes += nbytes
            else:
                # Steps in a row read the same segment (and a windowed replica's window keys read it
                # again): one read each, not one a call.
                self._last_segment = (s, data)
        nxt = (s + 1) % len(self.plan.segments)
        if nxt not in self._cache and nxt not in self._reads and nxt != s:
            # Read the next segment while this one is being computed.
            lo, hi = self.plan.segments[nxt]
            self._reads[nxt] = self._reader.submit(self.dataset.read_rows, lo, hi)
        return data

    def _run(self) -> None:
        try:
            with threadpool_limits(limits=1):
                if self.config.communication == "sparse":
                    if self.config.compression is None and not self.config.deterministic:
                        self._use_windows()
                    else:
                        self._use_keys()
                self._steps()
                self._flush()
        except BaseException as exc:
            self.error = "".join(traceback.format_exception(exc))
            with contextlib.suppress(Exception):
                pickle.dumps(exc)
                self._error_obj = exc
            self.stop_reason = "error"
        finally:
            self.done = True
            self._reader.shutdown(wait=False)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._close_channels)

    def _batches(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(epoch, segment, rows)`` of every mini-batch from here on, epoch after epoch."""
        epochs, epoch = self.config.epochs, self.epoch
        skip, self._skip = self._skip, 0
        while epochs is None or epoch < epochs:
            for s, rows in itertools.islice(self.plan.epoch(epoch), skip, None):
                yield epoch, s, rows
            skip = 0
            epoch += 1

    def _step_at(self, step: int) -> list[Any] | None:
        """The mini-batch of step number ``step`` (``core.counters.steps`` counting), read ahead as needed;
        None past the last one."""
        assert self._stream is not None
        while self._ahead_first + len(self._ahead) <= step:
            item = next(self._stream, None)
            if item is None:
                return None
            self._ahead.append([*item, None])
        return self._ahead[step - self._ahead_first]

    def _compact(self, item: list[Any]) -> SparsePortion:
        """The step's rows narrowed to the parameters they touch (computed once, when first asked)."""
        if item[3] is None:
            assert self._layout is not None
            X, y = self._segment(item[1])
            item[3] = compact_batch(self._layout, X, y, item[2], self._table).for_model(self.model)
        part: SparsePortion = item[3]
        return part

    def _window_keys(self, start: int, end: int) -> np.ndarray:
        """Sorted global keys of steps ``[start, end)`` (as many as there are; the last few answers are
        kept: a window's push asks for the keys its fetch asked for)."""
        if self.step_limit is not None:
            end = min(end, self.step_limit)
        known = self._unions.get((start, end))
        if known is not None:
            return known
        if len(self._unions) >= 4:
            del self._unions[next(iter(self._unions))]
        keys = self._unions[(start, end)] = self._union_of(start, end)
        return keys

    def _union_of(self, start: int, end: int) -> np.ndarray:
        items = []
        for step in range(start, end):
            item = self._step_at(step)
            if item is None:
                break
            items.append(item)
        assert self._layout is not None
        if not items:
            return np.zeros(0, dtype=np.int64)  # past the last step: no keys (not even the intercepts)
        if self._rows_step is not None:
            # The columns the steps' rows touch, marked in one pass (no step's rows narrowed for it).
            keys = rows_keys(self._layout, [(self._segment(it[1])[0], it[2]) for it in items], self._mask)
            if keys is not None:
                return keys
        parts = [self._compact(item).keys for item in items]
        if len(parts) == 1:
            return np.sort(parts[0])  # a step's keys are distinct but in the order its rows touch them
        return union_keys(parts, self.model.n_params)

    def _use_windows(self) -> None:
        """Windowed key-value communication (:meth:`ReplicaCore.use_windows`): each fetch asks for the keys
        of the steps ahead, and each step computes on its rows narrowed to their keys."""
        self._layout = sparse_layout_of(self.model)
        width = self._layout[0] if self._layout is not None else 0
        self._table = np.full(width, -1, dtype=np.int32)
        self._mask = np.zeros(width, dtype=bool)
        # A built-in linear model computes a step on the rows as they are (models' rows_residuals), and the
        # core adds its gradient straight from them: no narrowed copy of the rows, no narrowed model a step.
        rows_step = getattr(self.model, "rows_residuals", None)
        layout = self._layout
        single_output = layout is not None and layout[1] == 1
        self._rows_step = rows_step if callable(rows_step) and single_output else None
        self._stream = self._batches()
        self._ahead_first = self.core.counters.steps
        self.core.use_windows(self._window_keys)

    def _steps(self) -> None:
        core = self.core
        if self._stream is None:
            self._stream = self._batches()
            self._ahead_first = core.counters.steps
        windowed = self._layout is not None
        while True:
            step = core.counters.steps
            # The steps done and pushed (a push asks for the keys of the steps it sums: see _window_keys).
            done = core.first_unpushed_step
            while self._ahead and self._ahead_first < done:
                self._ahead.popleft()
                self._ahead_first += 1
            item = self._step_at(step)
            if item is None:
                self.epoch = self.config.epochs or self.epoch
                self.stop_reason = "epochs"
                return
            if self._stop.is_set():
                self.stop_reason = "stopped"
                return
            limit = self.step_limit
            if limit is not None and step >= limit:
                self.stop_reason = "max_steps"
                return
            self.epoch = item[0]
            self._drain(None)
            if self.hold_at is not None and step >= self.hold_at:
                self._hold()
                continue
            # The rows first, then the parameters. A read between the fetch and the gradient (a replica's
            # first read opens the store on its worker: 30-100 ms at load average ~15) made the gradient
            # stale: a replica's first step ran at x0 while the shard had applied 7 pushes of another,
            # and its lone ln 2 mini-batch loss in a history row read as divergence.
            part = self._compact(item) if windowed and self._rows_step is None else None
            X, y = self._segment(item[1]) if part is None else (part.X, part.y)
            core.begin_step()
            self._maybe_fetch()
            if core.must_wait():
                if core.ready:
                    core.counters.stale_waits += 1
                t_wait = time.perf_counter()
                while core.must_wait() and not self._stop.is_set():
                    self._maybe_fetch()
                    self._drain(_WAIT_SLICE)
                self.wait_s += time.perf_counter() - t_wait
                if self._stop.is_set():
                    continue
            if core.push_backlogged():
                t_wait = time.perf_counter()
                while core.push_backlogged() and not self._stop.is_set():
                    self._drain(_WAIT_SLICE)
                self.wait_s += time.perf_counter() - t_wait
                msg = core.take_push()
                if msg is not None:
                    self._send_push(msg)
            t_compute = time.perf_counter()
            if windowed and part is None:
                rows = item[2]
                assert self._rows_step is not None
                got = self._rows_step(core.x, X, y, rows)
                if got is not None:
                    assert self._layout is not None
                    d, _, fit_intercept = self._layout
                    core.accrue_rows(X, rows, got[1], got[0], intercept=d if fit_intercept else None)
                else:  # rows the compiled pass does not take: narrow them, from now on
                    self._rows_step = None
                    part = self._compact(item)
                    core.compute_at(part.model, part.keys, part.X, part.y)
            elif part is not None:
                core.compute_at(part.model, part.keys, X, y)
            else:
                rows = item[2]
                core.compute(self.model, X[rows], y[rows])
            self.compute_s += time.perf_counter() - t_compute
            if core.diverged:
                self.stop_reason = "diverged"
                return
            msg = core.take_push()
            if msg is not None:
                self._send_push(msg)
            self._maybe_record()

    def _maybe_record(self) -> None:
        """Record a history point when the plan says one is due (a counters dict, perhaps a copy of x)."""
        plan, steps, now = self._plan, self.core.counters.steps, time.monotonic()
        since = now - self._record_t
        by_steps = plan.every_steps is not None and steps - self._record_steps >= plan.every_steps
        if not ((by_steps and since >= plan.min_s) or since >= plan.every_s):
            return
        size = self.core.x.nbytes
        with_x = plan.x_every > 0 and self._record_count % plan.x_every == 0
        with_x = with_x and self._records_bytes + size <= MAX_PENDING_RECORD_BYTES
        record = self.core.record(with_x=with_x)
        record["time"] = time.time()
        with self._records_lock:
            self._records.append(record)
            self._records_bytes += size if with_x else 0
        self._record_count += 1
        self._record_steps, self._record_t = steps, now

    def _use_keys(self) -> None:
        """Key-value communication: the parameters this replica's rows touch, found in one pass over its
        segments (read now, and kept in memory within the cache budget, as the steps would read them)."""
        parts = [param_keys(self.model, self._segment(s)[0]) for s in range(len(self.plan.segments))]
        keys = union_keys(parts, self.model.n_params)
        self.core.use_keys(split_keys(self._map.layout.bounds, keys))

    def _hold(self) -> None:
        """Warm start: push what has accrued and idle until released or stopped."""
        self.holding = True
        while (
            self.hold_at is not None and self.core.counters.steps >= self.hold_at and not self._stop.is_set()
        ):
            msg = self.core.take_push(force=True)
            if msg is not None:
                self._send_push(msg)
            self._drain(_WAIT_SLICE)
        self.holding = False

    def _flush(self) -> None:
        """Push whatever has accrued and wait (bounded) until every push is answered."""
        core = self.core
        deadline = time.monotonic() + self.config.call_timeout
        while time.monotonic() < deadline:
            self._drain(None)
            if not core.diverged:
                msg = core.take_push(force=True, last=True)
                if msg is not None:
                    self._send_push(msg)
            if (core.accrued_steps == 0 or core.diverged) and core.pushes_in_flight == 0:
                return
            self._drain(_WAIT_SLICE)
        self.stop_reason = f"{self.stop_reason} (some pushes were not answered in time)"
