"""Resuming a Downpour run from its last shard checkpoint (``downpour.train(..., resume=True)``).

Every checkpoint of a Downpour run (``checkpoint_every_s``, and one at the end of the run, also when a
callback stops it) saves, beside the shards' vectors (``x``, the Adagrad accumulators ``x.adagrad``) and
their scalar state (the clock ``version``, the per-source push sequence numbers, the applied-push counters),
a ``meta`` dict written by :func:`checkpoint_meta`: the seconds the run had trained, and every replica's
step, row and epoch counters as last reported. A resumed run reopens the shards from that checkpoint
(:meth:`storage.ParameterServer.open`), hands each replica its counters back (a replica restarts the epoch
it was in from its first mini-batch), and counts its time from the checkpoint's, so ``epochs``,
``max_steps`` and ``time_limit`` keep meaning the whole run.

Replica counters are polled, not frozen with the shards: a periodic checkpoint's counters are those of the
driver's last poll before it (a ``poll_every`` behind at most); the final checkpoint's are exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError, StoreError
from distbelief.storage import Layout
from distbelief.storage.internal import normalize_url, read_attrs, read_stored_vector

__all__ = ["ResumePoint", "checkpoint_meta", "checkpoint_vector", "params_store", "resume_point"]

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
