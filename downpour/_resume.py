"""Resuming a Downpour run from its last shard checkpoint (``downpour.train(..., resume=True)``).

Every checkpoint of a Downpour run (``checkpoint_every_s``, and one at the end of the run, also when a
callback stops it) saves, beside the shards' vectors (``x``, the Adagrad accumulators ``x.adagrad``) and
their scalar state (the clock ``version``, the per-source push sequence numbers, the applied-push counters),
a ``meta`` dict written by :func:`checkpoint_meta`: the seconds the run had trained, and every replica's
step, row and epoch counters as last reported. A resumed run reopens the shards from that checkpoint
(:meth:`storage.ParameterServer.open`), hands each replica its counters back (a replica goes on in the
epoch it was in after the mini-batches its rows counter says it did: the plan of an epoch is the same on a
rerun), and counts its time from the checkpoint's, so ``epochs``, ``max_steps`` and ``time_limit`` keep
meaning the whole run, and a run resumed from its final checkpoint stops at ``epochs`` exactly.

Replica counters are polled, not frozen with the shards: a periodic checkpoint's counters are those of the
driver's last poll before it (a ``poll_every`` behind at most); the final checkpoint's are exact.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError, StoreError
from distbelief.storage import Layout
from distbelief.storage.internal import normalize_url, read_attrs, read_stored_vector

__all__ = [
    "CHECKPOINT_COST_SHARE",
    "CHECKPOINT_LOSS_SHARE",
    "MIN_CHECKPOINT_INTERVAL_S",
    "ResumePoint",
    "checkpoint_interval",
    "checkpoint_meta",
    "checkpoint_vector",
    "params_store",
    "resume_point",
]

#: A kill loses at most about this share of the run's steps: the time since the last checkpoint stays within
#: this share of the time trained (issue 27: with a fixed 5 s, a kill lost 21-39% of a 15-25 s run).
CHECKPOINT_LOSS_SHARE = 0.05
#: Checkpoints take at most about this share of the run: the interval is at least the last checkpoint's
#: duration divided by it.
CHECKPOINT_COST_SHARE = 0.05
#: Never closer together than this (before a checkpoint's cost is known, and for very short runs).
MIN_CHECKPOINT_INTERVAL_S = 0.25

#: Marks a checkpoint's meta as written by :func:`checkpoint_meta` (a resumable Downpour checkpoint).
KIND = "downpour"


@dataclass(frozen=True)
class ResumePoint:
    """Where a Downpour run would resume: its last checkpoint's counters.

    Attributes
    ----------
    step : int
        Mini-batch steps of all replicas together at the checkpoint.
    time : float
        Seconds the run had trained.
    replicas : list of dict
        Per replica: ``steps``, ``rows``, ``epoch``.
    checkpoint_id : int
        The checkpoint's number in the store.
    final : bool
        Whether it was taken at the end of a run (then the counters are exact).
    """

    step: int
    time: float
    replicas: list[dict[str, int]]
    checkpoint_id: int
    final: bool


def checkpoint_interval(elapsed: float, last_cost: float, every_s: float) -> float:
    """Seconds until the next periodic checkpoint of a run that has trained ``elapsed`` seconds.

    A checkpoint is due once :data:`CHECKPOINT_LOSS_SHARE` of the time trained has passed since the last
    one, so a kill loses about that share of the steps; but no sooner than the last checkpoint's duration
    ``last_cost`` over :data:`CHECKPOINT_COST_SHARE` (checkpoints take about that share of the run at most)
    or :data:`MIN_CHECKPOINT_INTERVAL_S`, and no later than ``every_s`` (the user's bound; 0: no periodic
    checkpoints, ``inf`` returned).

    Examples
    --------
    >>> checkpoint_interval(100.0, 0.02, 5.0)   # 5% of 100 s
    5.0
    >>> checkpoint_interval(20.0, 0.02, 5.0)    # 5% of 20 s
    1.0
    >>> checkpoint_interval(20.0, 0.2, 5.0)     # a 0.2 s checkpoint: 4 s apart, for 5% of the time
    4.0
    >>> checkpoint_interval(1.0, 0.0, 5.0), checkpoint_interval(50.0, 0.0, 0.0)
    (0.25, inf)
    """
    if every_s <= 0:
        return math.inf
    paced = max(CHECKPOINT_LOSS_SHARE * elapsed, last_cost / CHECKPOINT_COST_SHARE, MIN_CHECKPOINT_INTERVAL_S)
    return min(float(every_s), paced)


def params_store(store: str | os.PathLike[str]) -> str:
    """Where :func:`downpour.train` keeps the shards' checkpoints under its ``store=``."""
    return os.path.join(str(store), "params")


def checkpoint_meta(
    time: float, statuses: dict[int, dict[str, Any]], n_replicas: int, **extra: Any
) -> dict[str, Any]:
    """The ``meta`` a Downpour checkpoint carries: elapsed ``time`` and each replica's counters."""
    replicas = [
        {
            "steps": int(statuses.get(r, {}).get("steps", 0)),
            "rows": int(statuses.get(r, {}).get("rows", 0)),
            "epoch": int(statuses.get(r, {}).get("epoch", 0)),
        }
        for r in range(n_replicas)
    ]
    return {
        "kind": KIND,
        "step": sum(p["steps"] for p in replicas),
        "time": float(time),
        "replicas": replicas,
        **extra,
    }


def resume_point(store: str | os.PathLike[str]) -> ResumePoint | None:
    """The last resumable checkpoint of the Downpour run whose ``store=`` is ``store``, or ``None``.

    Examples
    --------
    >>> point = resume_point("/data/run")                # doctest: +SKIP
    >>> point.step, point.time                           # doctest: +SKIP
    (5312, 2.4)
    """
    url = params_store(store)
    try:
        attrs = read_attrs(normalize_url(url))
    except (StoreError, FileNotFoundError, KeyError):
        return None
    meta = attrs.get("meta") or {}
    if attrs.get("current") is None or meta.get("kind") != KIND:
        return None
    return ResumePoint(
        step=int(meta["step"]),
        time=float(meta["time"]),
        replicas=[{k: int(v) for k, v in p.items()} for p in meta["replicas"]],
        checkpoint_id=int(attrs.get("checkpoint_id") or 0),
        final=bool(meta.get("final", False)),
    )


def require_resume_point(store: str, n_replicas: int) -> ResumePoint:
    """:func:`resume_point`, or an error saying why the run cannot resume."""
    point = resume_point(store)
    if point is None:
        raise InvalidOptionError(
            f"resume=True, but {params_store(store)!r} holds no Downpour checkpoint; start the run with "
            "resume=False (checkpoints are taken every checkpoint_every_s seconds)"
        )
    if len(point.replicas) != n_replicas:
        raise InvalidOptionError(
            f"the checkpoint is of a run with {len(point.replicas)} replicas; resume it with "
            f"replicas={len(point.replicas)}"
        )
    return point


def checkpoint_vector(store: str | os.PathLike[str], name: str = "x") -> np.ndarray:
    """Vector ``name`` as the last checkpoint of the run at ``store`` holds it (read from zarr directly)."""
    url = normalize_url(params_store(store))
    attrs = read_attrs(url)
    if attrs.get("current") is None or name not in attrs.get("names", []):
        raise StoreError(f"{url!r} has no checkpoint of {name!r}; its vectors: {attrs.get('names')}")
    layout = Layout.from_dict(attrs["layout"])
    return np.asarray(read_stored_vector(url, f"slot{attrs['current']}", layout, name))
