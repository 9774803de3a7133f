"""Helpers for the Downpour tests: a model with a known gradient, and an in-process Downpour simulator."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from distbelief.downpour import BatchPlan, FetchRequest, PushMessage, ReplicaCore
from distbelief.storage import Layout, Shard


class ConstantGradient:
    """``loss = sum over rows of c . w``: every row's gradient is ``c``, whatever ``w``.

    A mini-batch mean gradient is exactly ``c``, so the shards' final vector is known in closed form from how
    many steps they applied (and with what weight): the oracle for lost or doubled updates.
    """

    n_features = 1

    def __init__(self, n_params: int) -> None:
        self.n_params = n_params
        self.c = 1.0 + np.arange(n_params) % 7

    def init_params(self, seed: int | None = None) -> np.ndarray:
        return np.zeros(self.n_params)

    def loss_and_grad(self, w: ArrayLike, X: Any, y: ArrayLike) -> tuple[float, np.ndarray]:
        rows = X.shape[0]
        return float(rows * (self.c @ np.asarray(w))), rows * self.c


class Jittery:
    """A model whose steps take a random extra 0-``max_sleep`` seconds (from the OS's entropy, so no two runs
    share their timing): it scrambles which replica's push reaches a shard first."""

    def __init__(self, model: Any, max_sleep: float = 0.003) -> None:
        self.model = model
        self.max_sleep = max_sleep
        self.n_params = model.n_params

    def __getattr__(self, name: str) -> Any:
        # Only for the wrapped model's attributes (unpickling asks before __dict__ is filled).
        if name.startswith("__") or "model" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["model"], name)

    def loss_and_grad(self, w: np.ndarray, X: Any, y: np.ndarray) -> tuple[float, np.ndarray]:
        import os
        import time

        time.sleep(self.max_sleep * int.from_bytes(os.urandom(2), "little") / 65535)
        loss, grad = self.model.loss_and_grad(w, X, y)
        return float(loss), np.asarray(grad)


@dataclass
class _Replica:
    core: ReplicaCore
    batches: deque[np.ndarray]
    source: str
    inbox: deque[tuple[Any, ...]] = field(default_factory=deque)
    #: Staleness of every applied push, as the shards reported it.
    staleness: list[int] = field(default_factory=list)


class Simulator:
    """Downpour in one process: ReplicaCores against :class:`storage.Shard` objects, with random delays.

    Each (replica, shard) pair has a FIFO channel, as the Dask transport does. Every tick one thing happens,
    chosen by the seeded ``random.Random``: a replica takes a step (or, if it must wait, does nothing), a
    channel delivers its oldest message to its shard, or a replica receives its oldest answer. So every
    interleaving the real system allows (answers late by any number of steps) is a possible schedule.
    """

    def __init__(
        self,
        model: Any,
        X: np.ndarray,
        y: np.ndarray,
        x0: np.ndarray,
        plans: Sequence[list[np.ndarray]],
        *,
        shards: int,
        rule: str,
        lr: float,
        seed: int,
        staleness_scale: bool = False,
        **core_kwargs: Any,
    ) -> None:
        self.model, self.X, self.y = model, X, y
        self.layout = Layout.split(x0.size, shards, target_chunk=max(1, x0.size // shards))
        self.shards = [Shard(i, lo, hi) for i, (lo, hi) in enumerate(self.layout.ranges())]
        for s in self.shards:
            s.set("x", s.lo, s.hi, x0[s.lo : s.hi])
            s.set("x.adagrad", s.lo, s.hi, np.zeros(s.size))
        self.rule, self.lr, self.staleness_scale = rule, lr, staleness_scale
        self.rng = random.Random(seed)
        self.replicas = [
            _Replica(
                ReplicaCore(
                    self.layout.ranges(), rule=rule, lr=lr, staleness_scale=staleness_scale, **core_kwargs
                ),
                deque(batches),
                f"r{r}",
            )
            for r, batches in enumerate(plans)
        ]
        self.channels: dict[tuple[int, int], deque[tuple[Any, ...]]] = {
            (r, i): deque() for r in range(len(plans)) for i in range(shards)
        }

    @property
    def x(self) -> np.ndarray:
        return np.concatenate([s.get("x") for s in self.shards])

    def _send_fetch(self, r: int, req: FetchRequest) -> None:
        for i in range(len(self.shards)):
            self.channels[(r, i)].append(("fetch", req))

    def _send_push(self, r: int, msg: PushMessage) -> None:
        for i in range(len(self.shards)):
            self.channels[(r, i)].append(("push", msg))

    def _step(self, r: int) -> None:
        rep = self.replicas[r]
        core = rep.core
        if not rep.batches:
            msg = core.take_push(force=True)
            if msg is not None:
                self._send_push(r, msg)
            return
        core.begin_step()
        if core.fetch_wanted():
            self._send_fetch(r, core.start_fetch())
        if core.must_wait():
            return
        rows = rep.batches.popleft()
        core.compute(self.model, self.X[rows], self.y[rows])
        msg = core.take_push()
        if msg is not None:
            self._send_push(r, msg)

    def _deliver(self, r: int, i: int) -> None:
        kind, payload = self.channels[(r, i)].popleft()
        shard = self.shards[i]
        if kind == "fetch":
            self.replicas[r].inbox.append(
                ("fetch", i, payload, (shard.version, [shard.get(n) for n in payload.names]))
            )
        else:
            # As the replica sends it (downpour._replica): dense slices, key-value pairs or sign-coded keys,
            # and a fused push carries its fetch.
            values, keys = payload.parts(self.layout.bounds)[i]
            push = {
                "source": self.replicas[r].source,
                "seq": payload.seq,
                "rule": self.rule,
                "lr": self.lr,
                "fetched_version": payload.fetched_versions[i],
                "staleness_scale": self.staleness_scale,
                "steps": payload.steps,
            }
            if keys is not None:
                push["keys"] = keys
            if payload.tau is not None:
                push["tau"] = payload.tau
            if payload.fetch is None:
                answer = shard.push(values, **push)
                self.replicas[r].inbox.append(("push", i, payload, answer))
            else:
                answer, fetched = shard.push_and_fetch(values, list(payload.fetch.names), **push)
                self.replicas[r].inbox.append(("push", i, payload, answer))
                self.replicas[r].inbox.append(("fetch", i, payload.fetch, fetched))

    def _receive(self, r: int) -> None:
        rep = self.replicas[r]
        kind, i, payload, answer = rep.inbox.popleft()
        if kind == "fetch":
            version, arrays = answer
            rep.core.on_fetched(payload.fid, i, version, arrays)
        else:
            applied, version_after, staleness = answer
            if applied:
                rep.staleness.append(staleness)
            rep.core.on_pushed(payload.seq, i, applied, version_after, staleness, payload.gen)

    def run(self, *, max_ticks: int = 1_000_000) -> None:
        """Until every replica has used its batches and every message has been answered."""
        for _ in range(max_ticks):
            actions: list[tuple[str, int, int]] = []
            for r, rep in enumerate(self.replicas):
                if rep.batches or rep.core.accrued_steps:
                    actions.append(("step", r, 0))
                if rep.inbox:
                    actions.append(("receive", r, 0))
            actions += [("deliver", r, i) for (r, i), ch in self.channels.items() if ch]
            if not actions:
                return
            kind, r, i = self.rng.choice(actions)
            if kind == "step":
                self._step(r)
            elif kind == "deliver":
                self._deliver(r, i)
            else:
                self._receive(r)
        raise AssertionError("the simulation did not finish")


def global_batches(plan: BatchPlan, epochs: int) -> Iterator[np.ndarray]:
    """Every mini-batch of ``plan``'s first ``epochs`` epochs as global row indices (for references)."""
    for e in range(epochs):
        for s, rows in plan.epoch(e):
            yield plan.segments[s][0] + rows


def plan_batches(
    n_rows: int, replicas: int, *, batch_size: int, epochs: int, seed: int
) -> list[list[np.ndarray]]:
    """Every replica's mini-batches (global row indices), as :class:`BatchPlan` makes them."""
    out = []
    for r in range(replicas):
        lo, hi = r * n_rows // replicas, (r + 1) * n_rows // replicas
        plan = BatchPlan(((lo, hi),), batch_size=batch_size, seed=seed, replica=r)
        out.append(list(global_batches(plan, epochs)))
    return out
