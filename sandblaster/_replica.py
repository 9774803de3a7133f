"""A Sandblaster model replica: computes gradient portions and pushes them to the shards (paper, section 4.2).

A replica is a Dask actor whose methods are ``async``: they run on the worker's event loop, next to the
shards' ops, and the gradient work runs on a compute thread of the replica's own, so it never blocks the loop.
Calls overlap: while one call's summed gradient is on its way to the shards, the next call's portions are
already being computed (a synchronous actor method would hold the worker's one actor thread through the
push). Work too small to be worth a thread hop (~0.2 ms) runs inline on the loop.

It fetches the parameters once per evaluation (every call of the evaluation awaits the same fetch), computes
the loss and gradient of the portions it is given, and pushes them to the shards before it reports (each
portion's own gradient, several in one message; the shards add them in portion order, so the sum has the
same bits whatever replica computed which), so what it reports is already safe on the shards: a replica
that dies costs only the portions it had not pushed. Backup copies and recomputed portions are pushed
*solo* (one portion per push); the shards count every portion exactly once whichever copies arrive
(``Shard.accumulate``).

Data affinity: portions read once stay in memory (in the worker's :class:`storage.RowCache`, which outlives
the replica, so the next run on the worker skips the read), and the scheduler gives a replica the same
portions again.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import ClusterError
from distbelief.models import Model
from distbelief.storage import (
    Dataset,
    ShardMap,
    default_row_cache,
    keep_loop_responsive,
    reduce_results,
    reuse_freed_memory,
)
from distbelief.storage.internal import (
    HandedPush,
    Sample,
    SparsePortion,
    compact_rows,
    install_direct_calls,
    install_worker,
    kv_bytes,
    sparse_layout_of,
    split_keys,
    union_keys,
    whole_slice_is_smaller,
)

from ._messages import PortionResult, WorkCall, WorkReport, decode, encode

__all__ = ["INLINE_WORK", "Replica"]

#: Row-parameter products below which a call's portions are computed inline on the event loop: about
#: 0.2 ms of work, less than the hop to the compute thread and back costs here.
INLINE_WORK = 250_000

#: Pulled keys above which the pulled values are assembled on the compute thread instead of the loop.
INLINE_KEYS = 1 << 16

Portion = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _KV:
    """Parameters pulled by key: ``values[i]`` is parameter ``keys[i]`` (sorted global indices); or, when
    every shard sent its whole slice (the keys cover most of them), the whole vector ``full``, which holds
    every key (``values`` is then not formed: one copy of the slices instead of a gather of the keys)."""

    keys: np.ndarray
    values: np.ndarray | None
    full: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Number of parameters held (the width a gradient costs)."""
        return int(self.keys.size)

    def missing(self, keys: np.ndarray) -> np.ndarray:
        """Those of ``keys`` (sorted, unique) not held."""
        if self.full is not None:
            return keys[:0]
        return np.setdiff1d(keys, self.keys, assume_unique=True)

    def merged(self, other: _KV) -> _KV:
        """Both key sets' values (``other`` adds keys this one lacks)."""
        if self.full is not None:
            return self
        assert self.values is not None and other.values is not None
        keys = union_keys([self.keys, other.keys])  # rare (a backup's missing keys): no mask
        values = np.empty(keys.size)
        values[np.searchsorted(keys, self.keys)] = self.values
        values[np.searchsorted(keys, other.keys)] = other.values
        return _KV(keys, values)


class Replica:
    """Dask actor computing portions of ``sum_i loss_i`` and its gradient for the coordinator.

    Parameters
    ----------
    index : int
        Replica number.
    model : Model
        Anything with ``loss_and_grad(w, X, y)``.
    dataset : storage.Dataset
        The training rows, split into portions.
    shard_map : storage.ShardMap or None
        Where to fetch parameters from and push gradients to; ``None`` until :meth:`attach` tells (so a
        replica can be built while the shards are still being created).
    preload : sequence of int
        Portions to read into memory now (the ones this replica will most likely be given).
    slowdown : float
        Fault injection for tests and benchmarks: after computing a portion in ``t`` seconds, sleep
        ``(slowdown - 1) * t``, so this replica is ``slowdown`` times slower than it would be.
    communication : {"dense", "sparse"}
        ``"sparse"``: pull only the parameters the portions' rows touch and push only those gradient
        entries, as key-value pairs per shard (:mod:`storage._keys`); the model must be a linear one on
        CSR rows. ``"dense"``: whole slices (the default).
    """

    #: Methods the coordinator calls straight through the worker's handler (:mod:`storage._direct`).
    DIRECT_METHODS = frozenset({"work", "work_with"})

    def __init__(
        self,
        index: int,
        model: Model,
        dataset: Dataset,
        shard_map: ShardMap | None,
        preload: Sequence[int] = (),
        slowdown: float = 1.0,
        communication: str = "dense",
    ) -> None:
        keep_loop_responsive()  # its compute thread must not slow the shards' and its own messages
        reuse_freed_memory()  # a Dask worker's allocator would mmap every gradient temporary afresh
        install_direct_calls()  # the coordinator's work calls come straight to a worker handler
        install_worker()  # its worker's metrics page shows what this replica does (storage._monitor)
        self.sparse = communication == "sparse"
        #: Key-value mode: the union of the held portions' keys, and which portions it covers.
        self._kv_held: tuple[np.ndarray, frozenset[int]] = (np.zeros(0, dtype=np.int64), frozenset())
        #: Key-value mode: per portion, the pulled keys array and where the portion's keys sit in it.
        self._kv_positions: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: Key-value mode: key arrays cut at the shard bounds, per portion (-1: the pulled keys).
        self._kv_splits: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        #: Bytes of parameters and keys pulled, and of gradients and keys pushed (counted as sent).
        self.bytes_pulled = 0
        #: Seconds of gradient work (reading rows included) and of waiting for fetches and pushes, summed
        #: over calls: where a replica's time goes, for benchmarks.
        self.compute_s = self.read_s = self.fetch_s = self.push_s = 0.0
        self.bytes_pushed = 0
        self.index = index
        self.model = model
        self.dataset = dataset
        self._shards = shard_map
        self.slowdown = float(slowdown)
        self.cache: dict[int, Portion] = {}
        #: Portions renumbered to their keys, with this run's model narrowed to them (:meth:`_kv_portion`).
        self._kv_parts: dict[int, SparsePortion] = {}
        self._rows = default_row_cache()
        # One thread: the portions of overlapping calls are computed one after the other, as fast as the
        # core allows, while the loop moves parameters and gradients.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"sandblaster-replica-{index}")
        self._fetch: tuple[int, asyncio.Future[Any]] | None = None
        self.fetches = 0
        #: Work calls the shard handed out with the parameters (:meth:`work_with`).
        self.handed_out = 0
        #: Work calls answered, and the portions and rows whose gradient they computed (metrics page).
        self.work_calls = self.portions_done = self.rows_done = 0
        for p in preload:
            self._portion(p)
        # Portions an earlier run left in the worker's memory are as good as preloaded (views, no read).
        for p in range(dataset.n_portions):
            if p not in self.cache and self._rows.holds(dataset, *dataset.portion_bounds(p)):
                self._portion(p)

    @property
    def shards(self) -> ShardMap:
        """The shards this replica fetches from and pushes to (set at construction or by :meth:`attach`)."""
        if self._shards is None:
            raise ClusterError(f"replica {self.index} was given work before attach() told it the shards")
        return self._shards

    def _portion(self, p: int) -> Portion:
        data = self.cache.get(p)
        if data is None:
            data = self.cache[p] = self._rows.rows(self.dataset, *self.dataset.portion_bounds(p))
        return data

    def _kv_portion(self, p: int) -> SparsePortion:
        """Portion ``p`` renumbered to the parameters it touches, with this run's model narrowed to them.

        The keys and renumbered rows are computed once with the rows and kept in the worker's row cache,
        which outlives the run: they depend on the model's sparse layout (``n_features``, outputs,
        intercept), so the layout is part of their cache key, and a later run with another layout on the
        same dataset computes its own. The narrowed model is this run's (a wrapper's ``l2`` may differ
        between runs of the same layout), kept by this replica only.
        """
        part = self._kv_parts.get(p)
        if part is None:
            layout = sparse_layout_of(self.model)
            if layout is None:
                raise ClusterError(f"replica {self.index}: {type(self.model).__name__} has no sparse layout")
            rows = self._rows.derived(
                self.dataset,
                *self.dataset.portion_bounds(p),
                f"kv{layout}",
                lambda X, y: compact_rows(layout, X, y),
            )
            part = self._kv_parts.setdefault(p, rows.for_model(self.model))
        return part

    def _compute_portions_kv(
        self, w: _KV, assign: Sequence[int], solo: bool, eval_id: int | None = None
    ) -> tuple[list[PortionResult], list[tuple[list[int], Any]], float, float, list[int]]:
        """:meth:`_compute_portions` on key-value parameters: each portion's compact model at ``w``'s values
        of its keys. Each portion's gradient is pushed as its own, cut per shard into ``(local keys,
        values)`` or a whole slice (:meth:`_payloads`): a shard adding it at the keys adds the same floats as
        the dense path adds with zeros elsewhere."""
        if eval_id is not None and self._fetch is not None and self._fetch[0] > eval_id:
            return [], [], 0.0, 0.0, []
        t0 = time.perf_counter()
        read_s = 0.0
        reads: list[int] = []
        results = []
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for p in assign:
            if p not in self.cache:
                start = time.perf_counter()
                if not self._rows.holds(self.dataset, *self.dataset.portion_bounds(p)):
                    reads.append(int(p))
                self._portion(p)
                read_s += time.perf_counter() - start
            start = time.perf_counter()
            part = self._kv_portion(p)
            if w.full is not None:
                at = part.keys
                params = w.full[at]
            else:
                assert w.values is not None
                at = self._positions(p, part.keys, w.keys)
                params = w.values[at]
            loss, grad = part.model.loss_and_grad(params, part.X, part.y)
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))
            results.append((int(p), float(loss), int(part.X.shape[0])))
            # A copy: the next portion's loss_and_grad may reuse the array it returned, and the pushes
            # send views of this one.
            parts.append((part.keys, np.array(grad, dtype=np.float64), at))
        # Each portion's own gradient, cut per shard (the shards add the portions in order: the same bits
        # whichever replica computed which). Solo calls push one portion a message, others their group.
        payloads = [self._payloads(int(p), k, g) for p, (k, g, _) in zip(assign, parts, strict=True)]
        groups = [[i] for i in range(len(parts))] if solo else [list(range(len(parts)))] if parts else []
        grads: list[tuple[list[int], Any]] = [
            ([int(assign[i]) for i in group], [payloads[i] for i in group]) for group in groups
        ]
        return results, grads, *self._timing(t0, read_s, reads)

    def _positions(self, p: int, keys: np.ndarray, pulled: np.ndarray) -> np.ndarray:
        """Where portion ``p``'s ``keys`` sit among the ``pulled`` ones, kept while ``pulled`` is the same
        array (the held portions' union, from one evaluation to the next): one search per portion per
        change of the held set instead of one per evaluation."""
        cached = self._kv_positions.get(p)
        if cached is not None and cached[0] is pulled:
            return cached[1]
        at = np.searchsorted(pulled, keys)
        self._kv_positions[p] = (pulled, at)
        return at

    @staticmethod
    def _timing(t0: float, read_s: float, reads: list[int]) -> tuple[float, float, list[int]]:
        return time.perf_counter() - t0, read_s, reads

    def _split(self, keys: np.ndarray, slot: int = -1) -> list[np.ndarray]:
        """``keys`` cut into each shard's local offsets, kept per ``slot`` (a portion, or -1 for the pulled
        keys) while the keys are the same array: a portion's keys, and the held portions' union, are the
        same arrays from one evaluation to the next."""
        cached = self._kv_splits.get(slot)
        if cached is not None and cached[0] is keys:
            return cached[1]
        local = split_keys(self.shards.layout.bounds, keys)
        self._kv_splits[slot] = (keys, local)
        return local

    def _payloads(
        self, p: int, keys: np.ndarray, values: np.ndarray
    ) -> list[tuple[np.ndarray | None, np.ndarray]]:
        """Per shard, what portion ``p``'s gradient (``values`` at ``keys``) sends: ``(local keys, values)``,
        or ``(None, the whole slice)`` with zeros elsewhere where that is fewer bytes
        (:func:`storage._keys.whole_slice_is_smaller`; it adds the same floats). Built on the compute
        thread, so the event loop only sends."""
        bounds = self.shards.layout.bounds
        cuts = np.searchsorted(keys, bounds)
        out: list[tuple[np.ndarray | None, np.ndarray]] = []
        for shard, local in enumerate(self._split(keys, p)):
            part = values[cuts[shard] : cuts[shard + 1]]
            size = int(bounds[shard + 1] - bounds[shard])
            if whole_slice_is_smaller(local, size):
                whole = np.zeros(size)
                whole[local] = part
                out.append((None, whole))
            else:
                out.append((local, part))
        return out

    def _push_parts(
        self,
        acc_name: str,
        portions: list[int],
        payloads: list[list[tuple[np.ndarray | None, np.ndarray]]],
        eval_id: int,
    ) -> list[tuple[int, asyncio.Future[Any]]]:
        """One message per shard with every portion's part of it (every shard, keys or not: each counts
        every portion once). ``payloads[i][shard]`` is portion ``portions[i]``'s part for ``shard``."""
        out: list[tuple[int, asyncio.Future[Any]]] = []
        for shard in range(self.shards.layout.shards):
            parts = [per_shard[shard] for per_shard in payloads]
            self.bytes_pushed += sum(kv_bytes(local, part) for local, part in parts)
            ask = self.shards.ask(shard, "accumulate_parts", acc_name, parts, portions, eval_id)
            out.append((shard, asyncio.ensure_future(ask)))
        return out

    def _keys_for(self, assign: Sequence[int]) -> tuple[np.ndarray, frozenset[int]]:
        """The keys of every portion held and of ``assign``, and those portions (on the compute thread: it
        may read rows). The union over the held portions is kept until the held set changes."""
        held = frozenset(self.cache)
        if held != self._kv_held[1]:
            parts = [self._kv_portion(p).keys for p in sorted(held)]
            self._kv_held = (union_keys(parts, self.model.n_params), held)
        extra = [p for p in assign if p not in held]
        keys = self._kv_held[0]
        if extra:
            keys = union_keys([keys, *(self._kv_portion(p).keys for p in extra)], self.model.n_params)
        return keys, held | frozenset(assign)

    async def _first_pull(
        self, eval_id: int, prep: Sequence[Sequence[Any]], x_name: str, assign: Sequence[int]
    ) -> tuple[tuple[_KV, frozenset[int]], list[Any]]:
        loop = asyncio.get_running_loop()
        keys, covered = await loop.run_in_executor(self._compute, self._keys_for, assign)
        w, prep_results = await self._pull(eval_id, prep, x_name, keys)
        return (w, covered), prep_results

    async def _params_kv(
        self, eval_id: int, x_name: str, prep: Sequence[Sequence[Any]], assign: Sequence[int]
    ) -> tuple[_KV, list[Any], bool]:
        """:meth:`_params` by key: the first call of an evaluation pulls the keys of every portion this
        replica holds (data affinity makes those the likely work: the scheduler hands them back) and of
        its own, in the one round trip that carries the coordinator's ``prep`` ops; a later call with a
        portion outside those (a backup copy of another replica's portion) pulls the missing keys."""
        fetched = self._fetch is None or self._fetch[0] != eval_id
        if fetched:
            self._fetch = (eval_id, asyncio.ensure_future(self._first_pull(eval_id, prep, x_name, assign)))
            self.fetches += 1
        assert self._fetch is not None
        try:
            (w, covered), prep_results = await asyncio.shield(self._fetch[1])
            others = [p for p in assign if p not in covered]
            if others:
                loop = asyncio.get_running_loop()
                missing = await loop.run_in_executor(
                    self._compute, lambda: w.missing(self._keys_for(others)[0])
                )
                if missing.size:
                    extra, _ = await self._pull(eval_id, (), x_name, missing)
                    w = w.merged(extra)
        except Exception as exc:
            raise ClusterError(f"replica {self.index} could not fetch from the shards: {exc!r}") from exc
        return w, (prep_results if fetched else []), fetched

    async def _pull(
        self, eval_id: int, prep: Sequence[Sequence[Any]], x_name: str, keys: np.ndarray
    ) -> tuple[_KV, list[Any]]:
        bounds = self.shards.layout.bounds
        local = self._split(keys)
        # Per shard, the keys or (None) the whole slice, whichever moves fewer bytes.
        asked = [
            None if whole_slice_is_smaller(k, int(bounds[i + 1] - bounds[i])) else k
            for i, k in enumerate(local)
        ]
        values, prep_results = await self.shards.prepare_and_gather(eval_id, prep, x_name, asked)
        self.bytes_pulled += sum(kv_bytes(a, v) for a, v in zip(asked, values, strict=True))

        def pick() -> _KV:
            if all(a is None for a in asked):
                return _KV(keys, None, np.concatenate(values))  # every slice whole: no gather
            picked = [v if a is not None else v[k] for k, a, v in zip(local, asked, values, strict=True)]
            return _KV(keys, np.concatenate(picked) if picked else np.zeros(0))

        # Picking ~1e6 values out of whole slices takes milliseconds: on the compute thread (idle while the
        # parameters are on their way), not on the loop that answers the shards' messages.
        if keys.size > INLINE_KEYS:
            return await asyncio.get_running_loop().run_in_executor(self._compute, pick), prep_results
        return pick(), prep_results

    def _compute_portions(
        self, w: np.ndarray, assign: Sequence[int], solo: bool, eval_id: int | None = None
    ) -> tuple[list[PortionResult], list[tuple[list[int], np.ndarray]], float, float, list[int]]:
        """Loss of every portion, the gradients to push (each portion's own, one push per portion if
        ``solo``, else one for the group, as ``(portions, [(None, gradient), ...])``), the
        seconds it took (without the time queued behind other calls), the part of it spent reading
        portions that were not in memory yet, and those portions. Nothing at all once a later evaluation
        than ``eval_id`` has begun: the shards would refuse the gradient, and the thread is wanted there."""
        if eval_id is not None and self._fetch is not None and self._fetch[0] > eval_id:
            return [], [], 0.0, 0.0, []
        t0 = time.perf_counter()
        read_s = 0.0
        reads: list[int] = []
        results = []
        grads: list[tuple[list[int], Any]] = []
        own: list[np.ndarray] = []
        for p in assign:
            if p not in self.cache and not self._rows.holds(self.dataset, *self.dataset.portion_bounds(p)):
                start = time.perf_counter()
                self._portion(p)
                read_s += time.perf_counter() - start
                reads.append(int(p))
            start = time.perf_counter()
            X, y = self._portion(p)
            loss, returned = self.model.loss_and_grad(w, X, y)
            grad = np.asarray(returned, dtype=np.float64)
            if grad is returned and len(assign) > 1:
                # Kept past the next portion's loss_and_grad, which may reuse the array it returned (a
                # model writing into one buffer of its own): its own copy.
                grad = grad.copy()
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))
            results.append((int(p), float(loss), int(X.shape[0])))
            own.append(grad)
        # Each portion's own gradient (the shards add the portions in order: the same bits whichever
        # replica computed which): one push per portion if ``solo``, else one for the group, whose every
        # message carries each portion's slice.
        if solo:
            grads = [([int(p)], [(None, g)]) for p, g in zip(assign, own, strict=True)]
        elif own:
            grads = [([int(p) for p in assign], [(None, g) for g in own])]
        return results, grads, time.perf_counter() - t0, read_s, reads

    async def _params(
        self, eval_id: int, x_name: str, prep: Sequence[Sequence[Any]], given: Any = None
    ) -> tuple[np.ndarray, list[Any], bool]:
        """The parameters of evaluation ``eval_id``: fetched by its first call (or ``given`` with it, as
        ``([x], reduced prep results)``), awaited by the others."""
        fetched = self._fetch is None or self._fetch[0] != eval_id
        if fetched:
            if given is not None:
                ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                ready.set_result(given)
                self._fetch = (eval_id, ready)
            else:
                self._fetch = (
                    eval_id,
                    asyncio.ensure_future(self.shards.prepare_and_fetch(eval_id, prep, [x_name])),
                )
            self.fetches += 1
            self.bytes_pulled += 8 * self.shards.layout.n
        assert self._fetch is not None
        try:
            (w,), prep_results = await asyncio.shield(self._fetch[1])
        except Exception as exc:
            raise ClusterError(f"replica {self.index} could not fetch from the shards: {exc!r}") from exc
        return w, (prep_results if fetched else []), fetched

    async def work(self, request: bytes) -> bytes:
        """:meth:`compute` for the coordinator: an encoded :class:`WorkCall` in, an encoded
        :class:`WorkReport` out, each as one frame.

        Dask serializes every argument of an actor call on its own (a header and frames each): a call with
        the six arguments of :meth:`compute` and a dict report measured 2.1 ms here, the same call with one
        pickled request and report 1.4 ms, and an empty call 1.1 ms.
        """
        call = decode(request, WorkCall)
        report = await self.compute(
            call.eval_id, call.x_name, call.acc_name, call.portions, call.solo, call.prep, call.push_every
        )
        return encode(report)

    async def work_with(self, request: bytes) -> bytes:
        """:meth:`work` handed out by the shard (:meth:`storage.ShardActor.hand_out`).

        ``request`` is a pickled ``(encoded WorkCall, [x], the shard's prep results)``; the answer a pickled
        ``(encoded WorkReport, pushes)``, where ``pushes`` are the last group's gradients (:class:`storage.
        internal.HandedPush`) for the shard to
        accumulate itself (its answer to the coordinator then says the call is on the shard). A dense model
        on one shard only.
        """
        if self.sparse:
            raise ClusterError("a sparse replica pulls its keys itself: its work cannot be handed out")
        payload, (x,), prep_results = pickle.loads(request)
        call = decode(payload, WorkCall)
        self.handed_out += 1
        given = ([x], reduce_results(call.prep, [prep_results]))
        report, held = await self._work_on(
            call.eval_id,
            call.x_name,
            call.acc_name,
            call.portions,
            call.solo,
            call.prep,
            call.push_every,
            given=given,
        )
        pushes = [
            HandedPush(call.acc_name, grad, portions, call.eval_id, call.solo) for portions, grad in held
        ]
        return pickle.dumps((encode(report), pushes), protocol=pickle.HIGHEST_PROTOCOL)

    async def compute(
        self,
        eval_id: int,
        x_name: str,
        acc_name: str,
        assign: Sequence[int],
        solo: bool = False,
        prep: Sequence[Sequence[Any]] = (),
        push_every: int | None = None,
    ) -> WorkReport:
        """Compute the portions ``assign`` at the parameters ``x_name`` and push their gradient.

        The first call of an evaluation fetches ``x_name`` from the shards (once per evaluation); the
        coordinator's ``prep`` ops for this evaluation (forming ``x_name``, zeroing the accumulator) ride on
        that fetch and run once on each shard, whichever replica comes first. The portions are computed in
        groups of ``push_every`` (default: all of them), and each group's summed gradient is pushed to the
        shards while the next group is computed, so a replica that dies loses at most one group's work and
        the coordinator can hand a replica all its portions in one call (few messages). With ``solo`` every
        portion is pushed alone (backup copies, recomputations). Returns the :class:`WorkReport` once every
        shard has every group's gradient.
        """
        report, _ = await self._work_on(eval_id, x_name, acc_name, assign, solo, prep, push_every)
        return report

    async def _work_on(
        self,
        eval_id: int,
        x_name: str,
        acc_name: str,
        assign: Sequence[int],
        solo: bool,
        prep: Sequence[Sequence[Any]],
        push_every: int | None,
        given: Any = None,
    ) -> tuple[WorkReport, list[tuple[list[int], Any]]]:
        """:meth:`compute`; with ``given`` (the parameters and prep results, handed out by the shard) the
        last group's gradients are not pushed but returned, for the shard to accumulate."""
        t0 = time.perf_counter()
        if self._fetch is not None and eval_id < self._fetch[0]:
            # A backup copy or a late call of an evaluation that is over: its push would be refused.
            return WorkReport(), []
        w: Any
        if self.sparse:
            w, prep_results, fetched = await self._params_kv(eval_id, x_name, prep, assign)
        else:
            w, prep_results, fetched = await self._params(eval_id, x_name, prep, given)
        compute_portions: Any = self._compute_portions_kv if self.sparse else self._compute_portions
        t1 = time.perf_counter()
        step = max(1, push_every or len(assign) or 1)
        groups = [list(assign[k : k + step]) for k in range(0, len(assign), step)]
        results: list[PortionResult] = []
        reads: list[int] = []
        busy = read_s = 0.0
        pushes: list[tuple[int, asyncio.Future[Any]]] = []
        held: list[tuple[list[int], Any]] = []
        loop = asyncio.get_running_loop()
        # Never inline with an injected slowdown: its sleep would stall the loop and the shards on it.
        inline = [
            self.slowdown <= 1.0
            and all(p in self.cache for p in group)
            and sum(self.cache[p][0].shape[0] for p in group) * w.size <= INLINE_WORK
            for group in groups
        ]
        # The other groups are queued on the compute thread at once: it goes from one group to the next
        # without waiting for the loop to hand it the next one (a thread hop each, ~0.3-0.6 ms on 2 busy
        # cores), while the loop pushes each group's gradient as it lands.
        queued = {
            k: loop.run_in_executor(self._compute, compute_portions, w, group, solo, eval_id)
            for k, group in enumerate(groups)
            if not inline[k]
        }
        try:
            for k, group in enumerate(groups):
                out = compute_portions(w, group, solo) if inline[k] else await queued[k]
                group_results, grads, group_busy, group_read_s, group_reads = out
                results += group_results
                self.portions_done += len(group_results)
                self.rows_done += sum(rows for _, _, rows in group_results)
                reads += group_reads
                busy += group_busy
                read_s += group_read_s
                # Sent now, awaited at the end: the push travels while the next group is computed.
                if self.sparse:
                    for portions, payloads in grads:
                        pushes += self._push_parts(acc_name, portions, payloads, eval_id)
                    continue
                self.bytes_pushed += 8 * sum(g.size for _, parts in grads for _, g in parts)
                if given is not None and k == len(groups) - 1:
                    held = grads  # carried back with the answer: the shard that handed out accumulates it
                    continue
                for portions, parts in grads:
                    by_shard = [self.shards.slices(g) for _, g in parts]
                    pushes += [
                        (
                            shard,
                            asyncio.ensure_future(
                                self.shards.ask(
                                    shard,
                                    "accumulate_parts",
                                    acc_name,
                                    [(None, slices[shard]) for slices in by_shard],
                                    portions,
                                    eval_id,
                                )
                            ),
                        )
                        for shard in range(self.shards.layout.shards)
                    ]
        except BaseException:
            # Nothing of this call will be reported: its queued groups and sent pushes are abandoned.
            for pending in [*queued.values(), *(push for _, push in pushes)]:
                pending.cancel()
            raise
        t2 = time.perf_counter()
        final: dict[int, list[Any]] = {}
        try:
            answers = await asyncio.gather(*(push for _, push in pushes))
        except Exception as exc:
            for _, push in pushes:
                push.cancel()
            raise ClusterError(f"replica {self.index} could not push to the shards: {exc!r}") from exc
        for (shard, _), (_, finalized) in zip(pushes, answers, strict=True):
            if finalized is not None:
                final[shard] = finalized  # this push completed the shard's evaluation
        push_s = time.perf_counter() - t2
        self.work_calls += 1
        self.compute_s += busy
        self.read_s += read_s
        self.fetch_s += t1 - t0
        self.push_s += push_s
        report = WorkReport(
            results=tuple(results),
            prep=tuple(prep_results),
            final=final,
            fetched=fetched,
            fetch_s=t1 - t0,
            compute_s=busy,
            # An inline group can overlap a queued one: the wait is never negative.
            queued_s=max(0.0, t2 - t1 - busy),
            read_s=read_s,
            reads=tuple(reads),
            push_s=push_s,
        )
        return report, held

    async def stats(self) -> dict[str, Any]:
        """Counters for tests and benchmarks."""
        return {
            "fetches": self.fetches,
            "handed_out": self.handed_out,
            "cached_portions": sorted(self.cache),
            "bytes_pulled": self.bytes_pulled,
            "bytes_pushed": self.bytes_pushed,
            "sparse": self.sparse,
            "compute_s": self.compute_s,
            "read_s": self.read_s,
            "fetch_s": self.fetch_s,
            "push_s": self.push_s,
        }

    def monitor(self) -> list[Sample]:
        """This replica's counters for the metrics page (:mod:`storage._monitor`; read on the worker's
        event loop, not an actor call)."""
        me = {"replica": str(self.index), "algorithm": "sandblaster"}
        return [
            ("distbelief_replica_work_calls_total", me, self.work_calls),
            ("distbelief_replica_portions_total", me, self.portions_done),
            ("distbelief_replica_rows_total", me, self.rows_done),
            ("distbelief_replica_fetches_total", me, self.fetches),
            ("distbelief_replica_bytes_total", {**me, "direction": "pulled"}, self.bytes_pulled),
            ("distbelief_replica_bytes_total", {**me, "direction": "pushed"}, self.bytes_pushed),
            ("distbelief_replica_seconds_total", {**me, "doing": "compute"}, self.compute_s),
            ("distbelief_replica_seconds_total", {**me, "doing": "fetch"}, self.fetch_s),
            ("distbelief_replica_seconds_total", {**me, "doing": "push"}, self.push_s),
        ]

    async def attach(self, shard_map: ShardMap) -> dict[str, Any]:
        """Talk to these shards from now on (the run's new shards, or lost shards rebuilt on other
        workers); returns :meth:`stats`, so a new replica reports the portions it holds in the same call."""
        self._shards = shard_map
        self._fetch = None
        self._kv_splits = {}  # the new shards may cut the keys elsewhere
        return await self.stats()

    async def set_slowdown(self, slowdown: float) -> None:
        """Change the injected slowdown (fault injection)."""
        self.slowdown = float(slowdown)

    async def close(self) -> None:
        """Stop the compute thread (the coordinator calls this before releasing the replica)."""
        self._compute.shutdown(wait=False, cancel_futures=True)
