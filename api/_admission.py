"""Admission control: a job that would need more memory or time than the cluster and the settings allow is
refused when it is submitted (422, with the figures), not accepted to fail an hour later.

The estimate is deliberately simple and errs on the generous side; it counts what a run holds at once:

- every parameter-server shard keeps ``vectors`` float64 vectors of its slice (x, g, d, the L-BFGS history
  s_i and y_i, the trial point, Adagrad accumulators, ...), so a shard needs
  ``ceil(n_params / shards) * vectors * 8`` bytes (with ``history_dtype="float32"`` the history's vectors
  count half; ``"auto"`` counts them as float64, the most it can take);
- every model replica keeps the full parameter vector, its gradient and the gradient it accumulates
  (``3 * n_params * 8`` bytes), plus one portion (Sandblaster) or batch (Downpour) of rows and the
  activations of those rows through every layer;
- with ``partitions=K`` (model parallelism) no process holds a replica: the worker of the largest partition
  keeps its shard's vectors of the partition's slice (the plan's, by arithmetic), the partition's copy and
  gradient, its share of the activations and what it receives; that is checked against the smallest
  worker's ``memory_limit``;
- one pass over the training data costs about ``6 * n_rows * n_params`` floating-point operations (forward,
  backward and the update; a linear model costs less, so this is an upper bound).

Examples
--------
>>> cost = estimate_cost({"kind": "logistic", "n_features": 3}, "sandblaster-lbfgs", {}, n_rows=100,
...                      portion_rows=100, n_workers=2)
>>> cost.n_params, cost.shards
(4, 1)
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from distributed import Client

from distbelief import models
from distbelief.api.settings import Settings
from distbelief.errors import InvalidOptionError
from distbelief.storage import scheduler_identity

__all__ = ["JobCost", "WorkerMemory", "admit", "estimate_cost"]

#: Below this many parameters a job runs on one shard (sandblaster/_minimize.py and downpour/_train.py).
_SHARD_MIN_PARAMS = 1 << 17
_BYTES = 8  # float64


@dataclass(frozen=True)
class JobCost:
    """What a job would hold and do at once (see the module docstring for how it is counted)."""

    n_params: int
    n_layers: int
    widest_layer: int
    shards: int
    replicas: int
    vectors_per_shard: int
    bytes_per_shard: int
    bytes_per_replica: int
    flops_per_pass: int
    partitions: int = 1
    bytes_per_partition: int | None = None

    def figures(self) -> str:
        """The figures, as a message shows them."""
        per_replica = (
            f"{_size(self.bytes_per_replica)} per replica"
            if self.bytes_per_partition is None
            else f"{_size(self.bytes_per_partition)} per partition ({self.partitions} per replica)"
        )
        return (
            f"{self.n_params:,} parameters, {_size(self.bytes_per_shard)} per shard ({self.shards} shard(s) "
            f"x {self.vectors_per_shard} vectors), {per_replica} ({self.replicas} replica(s)), "
            f"~{_g(self.flops_per_pass)} floating-point operations per pass over the data"
        )


def _g(x: float) -> str:
    """``x`` in two significant digits, an integer too large for a float included (``1e+400``).

    Examples
    --------
    >>> _g(12345), _g(10**400)
    ('1.2e+04', '1e+400')
    """
    try:
        return f"{x:.2g}"
    except OverflowError:
        digits = str(int(x))
        return f"{digits[0]}e+{len(digits) - 1}"


def _size(n: float) -> str:
    if n >= 1024**6:
        return f"{_g(n)} bytes"  # (beyond a float's range, n / 1024 would overflow)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_LOCAL = ("locally_connected", "locally_connected_2d")


def _layers(spec: Mapping[str, Any]) -> list[int]:
    kind = spec.get("kind")
    if kind == "mlp":
        return [int(s) for s in spec["layer_sizes"]]
    if kind in _LOCAL:
        # Building a locally connected model is arithmetic on its shapes (no parameter is allocated).
        model = models.from_spec(spec)
        if isinstance(model, models.LocallyConnected):
            return [*model.widths, model.n_classes]
        assert isinstance(model, models.LocallyConnected2D)
        return [h * w * c for h, w, c in model.shapes] + [model.n_classes]
    outputs = int(spec.get("n_classes", 1)) if kind == "softmax" else 1
    return [int(spec["n_features"]), outputs]


def _n_params(spec: Mapping[str, Any]) -> int:
    sizes = _layers(spec)
    if spec.get("kind") == "mlp":
        return sum((a + 1) * b for a, b in itertools.pairwise(sizes))
    if spec.get("kind") in _LOCAL:
        return int(models.from_spec(spec).n_params)
    return (sizes[0] + int(bool(spec.get("fit_intercept", True)))) * sizes[1]


def _widest_partition(spec: Mapping[str, Any], partitions: int) -> int:
    """Parameters of the largest of ``partitions`` partitions (arithmetic on the plan: nothing is built)."""
    plan = models.partition_plan(models.from_spec(spec), partitions)
    return max(b - a for a, b in itertools.pairwise(plan.bounds))


def _vectors(algorithm: str, options: Mapping[str, Any]) -> int:
    # A float32 history vector is half a float64 one.
    history = int(options.get("history", 10)) * (1 if options.get("history_dtype") == "float32" else 2)
    if algorithm == "sandblaster-lbfgs":
        return history + 6
    if algorithm == "sandblaster-owlqn":
        # L-BFGS's, and the pseudo-gradient's two buffers and the orthant.
        return history + 9
    if algorithm == "sandblaster-cg":
        return 7
    # sandblaster-gd: x, g, d, the trial point and its gradient; downpour-sgd: x, the Adagrad accumulator,
    # pending pushes and a checkpoint copy (with room to spare).
    return 5


def estimate_cost(
    spec: Mapping[str, Any],
    algorithm: str,
    options: Mapping[str, Any],
    *,
    n_rows: int,
    portion_rows: int,
    n_workers: int,
) -> JobCost:
    """Count what a job would hold and do, from its model spec, options and data, building nothing."""
    sizes = _layers(spec)
    n = _n_params(spec)
    workers = max(1, n_workers)
    partitions = int(options.get("partitions") or 1)
    shards = min(int(options.get("shards") or (workers if n >= _SHARD_MIN_PARAMS else 1)), max(1, n))
    if partitions > 1:
        shards = partitions  # one shard per partition, holding that partition's parameters (Figure 2)
    replicas = int(options.get("replicas") or workers)
    vectors = _vectors(algorithm, options)
    if algorithm == "downpour-sgd":
        rows = int(options.get("batch_size", 32))
    else:
        portions = options.get("portions")
        rows = -(-n_rows // int(portions)) if portions else portion_rows  # integer ceil: never a float
    rows = max(1, min(rows, n_rows))
    # The rows of X, and the activations and deltas of those rows through every layer.
    activations = rows * (sizes[0] + 2 * sum(sizes[1:]))
    partition_bytes: int | None = None
    # Integers throughout: a width of 400 digits must reach the limits' checks, not overflow a float.
    shard_params = -(-n // shards)
    if partitions > 1:
        # Partition k and its shard share a worker (Figure 2), which holds what the module docstring lists;
        # what it receives is up to a whole layer (the MLP's all-gather).
        shard_params = _widest_partition(spec, partitions)
        own = rows * sizes[0] + 2 * rows * sum(sizes[1:]) // partitions + rows * max(sizes)
        partition_bytes = ((vectors + 2) * shard_params + own) * _BYTES
    return JobCost(
        n_params=n,
        n_layers=len(sizes),
        widest_layer=max(sizes),
        shards=shards,
        replicas=replicas,
        vectors_per_shard=vectors,
        bytes_per_shard=shard_params * vectors * _BYTES,
        bytes_per_replica=(3 * n + activations) * _BYTES,
        flops_per_pass=6 * n_rows * n,
        partitions=partitions,
        bytes_per_partition=partition_bytes,
    )


class WorkerMemory:
    """The smallest ``memory_limit`` of the cluster's workers and their count, asked of the scheduler at most
    every ``ttl`` seconds (a submission must not wait on the scheduler each time).

    Examples
    --------
    >>> WorkerMemory(client).get()   # doctest: +SKIP
    (4294967296, 2)
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Client, WorkerMemory]] = weakref.WeakKeyDictionary()
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def of(cls, client: Client) -> WorkerMemory:
        """The one instance of a client (so its cache is shared by every request)."""
        with cls._shared_lock:
            return cls._shared.setdefault(client, cls(client))

    def __init__(self, client: Client, ttl: float = 5.0) -> None:
        self.client = client
        self.ttl = ttl
        self._lock = threading.Lock()
        self._value: tuple[int | None, int] = (None, 1)
        self._at = -math.inf

    def get(self) -> tuple[int | None, int]:
        """``(smallest memory_limit in bytes or None if unknown, number of workers)``."""
        with self._lock:
            if time.monotonic() - self._at < self.ttl:
                return self._value
            try:
                workers = scheduler_identity(self.client).get("workers", {}) or {}
            except Exception:
                return self._value  # the scheduler is away: keep what was known
            limits = [int(w.get("memory_limit") or 0) for w in workers.values()]
            known = [m for m in limits if m > 0]
            self._value = (min(known) if known else None, max(1, len(workers)))
            self._at = time.monotonic()
            return self._value


def admit(
    spec: Mapping[str, Any],
    algorithm: str,
    options: Mapping[str, Any],
    *,
    n_rows: int,
    portion_rows: int,
    settings: Settings,
    memory: WorkerMemory | None,
) -> JobCost:
    """Refuse a job that is too big for the settings or the cluster; return its estimated cost.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        The model has too many layers, too wide a layer or too many parameters for the settings
        (``DISTBELIEF_MAX_*``), a shard or a replica would need more memory than
        ``DISTBELIEF_JOB_MEMORY_FRACTION`` of the smallest worker's, or one pass over the data more work
        than ``DISTBELIEF_MAX_PASS_FLOPS``. The message gives the figures.
    """
    limit, n_workers = memory.get() if memory is not None else (None, 1)
    cost = estimate_cost(
        spec, algorithm, options, n_rows=n_rows, portion_rows=portion_rows, n_workers=n_workers
    )
    fix = "use a smaller model (fewer or narrower layers) or a smaller dataset, or ask the operator"
    problems = []
    if cost.n_layers > settings.max_layers:
        problems.append(f"{cost.n_layers} layers is more than DISTBELIEF_MAX_LAYERS={settings.max_layers}")
    if cost.widest_layer > settings.max_layer_width:
        problems.append(
            f"a layer of {cost.widest_layer:,} units is wider than "
            f"DISTBELIEF_MAX_LAYER_WIDTH={settings.max_layer_width:,}"
        )
    if cost.n_params > settings.max_params:
        problems.append(
            f"{cost.n_params:,} parameters is more than DISTBELIEF_MAX_PARAMS={settings.max_params:,}"
        )
    if cost.flops_per_pass > settings.max_pass_flops:
        problems.append(
            f"one pass over the data would take ~{_g(cost.flops_per_pass)} floating-point operations, more "
            f"than DISTBELIEF_MAX_PASS_FLOPS={settings.max_pass_flops:.2g}"
        )
    if limit is not None:
        # What one process holds: with partitions, the worker of the largest; else a shard, and a replica.
        if cost.bytes_per_partition is not None:
            spread = "; more partitions (option 'partitions') spread it"
            holders = [("partition", cost.bytes_per_partition, "the smallest worker's", spread)]
        else:
            partitioned = spec.get("kind") in ("mlp", *_LOCAL)
            hint = (
                "; a model with a partitioned form (mlp, locally_connected, locally_connected_2d) can be "
                "spread over workers with option 'partitions' (downpour-sgd)"
            )
            holders = [
                ("shard", cost.bytes_per_shard, "a worker's", "; more shards (option 'shards') spread it"),
                ("replica", cost.bytes_per_replica, "a worker's", hint if partitioned else ""),
            ]
        for what, need, whose, fix_it in holders:
            if need > settings.job_memory_fraction * limit:
                problems.append(
                    f"a {what} would need {_size(need)}, more than {settings.job_memory_fraction:g} of "
                    f"{whose} {_size(limit)} (DISTBELIEF_JOB_MEMORY_FRACTION){fix_it}"
                )
    if problems:
        raise InvalidOptionError(
            f"this job is too big to run here: {'; '.join(problems)}. The job: {cost.figures()}; {fix}"
        )
    return cost
