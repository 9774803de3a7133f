"""Shards, replicas and memory per worker for 1e7, 1e8 and 1e9 parameters, from figures measured here
(issue 25, item 5): the table in docs/operations.md ("Sizing") is this script's output.

The figures, and where each comes from:

- ``bytes_per_value``: 8 (the shards' vectors are float64).
- ``lbfgs_vectors_per_shard``: vectors an L-BFGS shard holds, measured: its ``ram_bytes`` / 8 / its
  parameters in ``benchmarks/results/scale.json`` (history m = 10: 26 = 2m + 6, the history ``s_i, y_i``,
  ``x``, ``g``, the direction, the trial point and its gradient, the gradient accumulator).
- ``lbfgs_checkpoint_vectors``: 2m + 2 = 22, what an L-BFGS checkpoint writes (``x``, ``g`` and the history;
  ``sandblaster/_space.py``).
- ``downpour_vectors_per_shard``: 2, ``x`` and its Adagrad accumulator (``storage/_shard.py``); the
  admission check budgets 5 (pending pushes, a checkpoint copy: ``api/_admission.py``).
- ``replica_vectors``: 3, a replica's copy of ``x``, its gradient and the accrued push (the admission
  check's ``bytes_per_replica``), plus a batch's activations, which depend on the model.
- ``shard_op_gb_s``: bytes touched per second by the shards' ops on 2 shards (``dots`` of 1e7-element
  vectors, fastest repetitions; ``benchmarks/results/shard_ops.json``); more shards on more machines are
  taken to scale linearly (an extrapolation: this machine has 2 cores).
- ``checkpoint_gb_s``: measured by this script, :meth:`ParameterServer.checkpoint` of 4 vectors on 2 shards
  into a zarr store on the local disk (a shared file system or an object store has its own bandwidth).
- ``worker_baseline_bytes``: a worker process' memory with a small shard and replica (peak RSS at 2^16
  parameters in ``scale.json``): Dask, numpy, the package.
- Budgets: a shard keeps ``storage._vectorstore.SHARD_MEMORY_FRACTION`` (0.4) of its worker's memory limit
  in RAM (colder history vectors spill to local disk beyond it); a replica may use
  ``DISTBELIEF_JOB_MEMORY_FRACTION`` (0.5) of it (the service's admission check).

The table takes workers of ``--worker-memory`` GiB (default 16), each with one shard and one replica (or
one partition of the model, where a whole replica does not fit): see :func:`table`.

Run ``python benchmarks/sizing.py [--quick] [--out PATH] [--worker-memory GIB]``; a full run takes ~30 s
(the checkpoint measurement), ``--quick`` a few seconds; ``--markdown`` prints the table only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the checkout's root on the path, as for the other scripts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distbelief.api.settings import Settings
from distbelief.storage import ParameterServer, _cluster
from distbelief.storage._vectorstore import SHARD_MEMORY_FRACTION

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS = RESULTS_DIR / "sizing.json"
SIZES = (10**7, 10**8, 10**9)
GIB = 1 << 30
HISTORY = 10


# -- figures ------------------------------------------------------------------------------------------------
def measured_lbfgs_vectors(scale: dict[str, Any]) -> float:
    """Vectors per L-BFGS shard in ``scale.json``: ``ram_bytes / 8 / parameters per shard``, median over
    its L-BFGS runs with nothing spilled (the 2^27 rows ran with a memory budget that spilled)."""
    seen = []
    for row in scale["rows"]:
        if row.get("method") != "distbelief" or row.get("status") != "ok" or row.get("spill_bytes_written"):
            continue
        per_shard = row["n_params"] / row["shards"]
        for process in row.get("processes", {}).values():
            for shard in process.get("shards", {}).values():
                if per_shard < 2**26:
                    seen.append(shard["ram_bytes"] / 8 / per_shard)
    return round(statistics.median(seen), 2)


def measured_shard_op_gb_s(shard_ops: dict[str, Any]) -> dict[str, float]:
    """``dots`` on 2 shards at the largest size, direct: GB/s of the fastest and the median repetitions."""
    rows = [
        r
        for r in shard_ops["rows"]
        if r.get("kind") == "sharded" and r.get("op") == "dots" and r.get("shards") == 2
        and r.get("mode") == "direct"
    ]  # fmt: skip
    top = max(rows, key=lambda r: r["n"])
    return {"n": top["n"], "best": top["gb_s_best"], "median": top["gb_s"]}


def measured_worker_baseline(scale: dict[str, Any]) -> int:
    """Peak RSS of a worker at the smallest size in ``scale.json``."""
    smallest = min(scale["rows"], key=lambda r: r["n_params"])
    return int(smallest["peak_rss_workers_max"])


def measure_checkpoint(client: Any, n: int, vectors: int = 4, repeats: int = 3) -> dict[str, Any]:
    """GB/s of :meth:`ParameterServer.checkpoint` of ``vectors`` vectors of ``n`` on 2 shards, local disk
    (median of ``repeats`` after a first one that creates the zarr arrays)."""
    rng = np.random.default_rng(0)
    names = [f"v{i}" for i in range(vectors)]
    # The embedded cluster's client is not the default one: the shard proxies must talk to it.
    with tempfile.TemporaryDirectory(prefix="sizing-") as tmp, _cluster.bound_to(client):
        store = str(Path(tmp) / "ps")
        with ParameterServer.create(client, n, shards=2, store=store, memory_budget=None) as ps:
            for name in names:
                ps.scatter(name, rng.standard_normal(n))
            ps.checkpoint(names)  # creates the slot's arrays: later checkpoints overwrite them in place
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ps.checkpoint(names)
                times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {
        "n": n,
        "vectors": vectors,
        "shards": 2,
        "seconds": times,
        "gb_s": 8 * n * vectors / seconds / 1e9,
    }


# -- the table ----------------------------------------------------------------------------------------------
#: Share of a worker's memory limit its shard, its replica (or model partition) and the process itself may
#: take together: the rest is for the rows the replicas read (``DISTBELIEF_ROW_CACHE_BYTES``, a quarter of
#: the limit by default) and headroom.
WORKER_SHARE = 0.6


def table(figures: dict[str, Any], worker_memory: int) -> list[dict[str, Any]]:
    """One row per size in :data:`SIZES`: shards, replicas, memory per worker and times, from ``figures``.

    Each worker holds one shard and one replica (a whole copy of the model, or one partition of it). The
    shards are as many as keep every L-BFGS vector in RAM (a shard within its budget,
    ``shard_memory_fraction`` of the worker's limit) with shard, replica and process within
    :data:`WORKER_SHARE` of it, and at least 2; where a whole replica would not fit its share
    (``job_memory_fraction``, the service's admission check), the model is split into as many partitions
    as there are shards (one per worker, the shards holding the partitions' parameters: Figure 2).

    Examples
    --------
    >>> figures = {"bytes_per_value": 8, "lbfgs_vectors_per_shard": 26, "lbfgs_checkpoint_vectors": 22,
    ...            "downpour_vectors_per_shard": 2, "replica_vectors": 3, "shard_op_gb_s": 27.0,
    ...            "checkpoint_gb_s": 0.5, "worker_baseline_bytes": 5 * 10**8,
    ...            "shard_memory_fraction": 0.4, "job_memory_fraction": 0.5}
    >>> [(r["n_params"], r["lbfgs_shards"], r["partitions"]) for r in table(figures, 16 * GIB)]
    [(10000000, 2, 1), (100000000, 4, 1), (1000000000, 31, 31)]
    """
    b = figures["bytes_per_value"]
    shard_budget = figures["shard_memory_fraction"] * worker_memory
    replica_budget = figures["job_memory_fraction"] * worker_memory
    room = WORKER_SHARE * worker_memory - figures["worker_baseline_bytes"]
    checkpoint_vectors = figures["lbfgs_checkpoint_vectors"]
    rows = []
    for n in SIZES:
        vector = b * n
        lbfgs_total = figures["lbfgs_vectors_per_shard"] * vector
        replica = figures["replica_vectors"] * vector
        whole = replica <= replica_budget and replica < room
        if whole:  # a whole replica per worker, the shards share what is left
            shards = max(2, math.ceil(lbfgs_total / shard_budget), math.ceil(lbfgs_total / (room - replica)))
            partitions = 1
        else:  # shard k and partition k on worker k
            shards = max(2, math.ceil(lbfgs_total / shard_budget), math.ceil((lbfgs_total + replica) / room))
            partitions = shards
        downpour_total = figures["downpour_vectors_per_shard"] * vector
        downpour_shards = max(2, math.ceil(downpour_total / shard_budget))
        per_worker = lbfgs_total / shards + replica / partitions + figures["worker_baseline_bytes"]
        rows.append(
            {
                "n_params": n,
                "vector_bytes": vector,
                "lbfgs_bytes_total": lbfgs_total,
                "lbfgs_shards": shards,
                "lbfgs_bytes_per_shard": lbfgs_total / shards,
                "downpour_shards": downpour_shards,
                "replica_bytes": replica,
                "partitions": partitions,
                # One per worker; with partitions, one replica spans every worker.
                "replicas": shards // partitions,
                "workers": shards,
                "worker_bytes": per_worker,
                "worker_memory": worker_memory,
                "pass_over_shard_vectors_s": lbfgs_total / (figures["shard_op_gb_s"] * 1e9 * shards / 2),
                "checkpoint_s": checkpoint_vectors * vector / (figures["checkpoint_gb_s"] * 1e9),
            }
        )
    return rows


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.2g} s" if s < 120 else f"{s / 60:.2g} min"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of docs/operations.md ("Sizing")."""
    lines = [
        "| parameters | one vector | L-BFGS vectors, all shards | workers = L-BFGS shards (Downpour shards) "
        "| replicas | replica: x, gradient, push | memory per worker | one pass over the shards' vectors "
        "| L-BFGS checkpoint |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        replica = _size(r["replica_bytes"])
        replicas = str(r["replicas"])
        if r["partitions"] > 1:
            replica += f" in {r['partitions']} partitions of {_size(r['replica_bytes'] / r['partitions'])}"
            replicas += " (model-parallel over every worker)"
        lines.append(
            f"| {r['n_params']:.0e} | {_size(r['vector_bytes'])} | {_size(r['lbfgs_bytes_total'])} "
            f"| {r['lbfgs_shards']} ({r['downpour_shards']}) | {replicas} | {replica} "
            f"| {_size(r['worker_bytes'])} of {r['worker_memory'] / GIB:g} GiB "
            f"| {_seconds(r['pass_over_shard_vectors_s'])} | {_seconds(r['checkpoint_s'])} |"
        )
    return "\n".join(lines) + "\n"


def figures_from(results: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    scale = json.loads((results / "scale.json").read_text())
    shard_ops = json.loads((results / "shard_ops.json").read_text())
    ops = measured_shard_op_gb_s(shard_ops)
    return {
        "bytes_per_value": 8,
        "history": HISTORY,
        "lbfgs_vectors_per_shard": measured_lbfgs_vectors(scale),
        "lbfgs_checkpoint_vectors": 2 * HISTORY + 2,
        "downpour_vectors_per_shard": 2,
        "replica_vectors": 3,
        "shard_op_gb_s": ops["best"],
        "shard_op_gb_s_median": ops["median"],
        "shard_op_n": ops["n"],
        "checkpoint_gb_s": checkpoint["gb_s"],
        "worker_baseline_bytes": measured_worker_baseline(scale),
        "shard_memory_fraction": SHARD_MEMORY_FRACTION,
        "job_memory_fraction": Settings.model_fields["job_memory_fraction"].default,
        "sources": {
            "lbfgs_vectors_per_shard": "benchmarks/results/scale.json (ram_bytes / 8 / parameters per shard)",
            "shard_op_gb_s": "benchmarks/results/shard_ops.json (dots, 2 shards, fastest repetitions)",
            "checkpoint_gb_s": "benchmarks/sizing.py (ParameterServer.checkpoint, 2 shards, local disk)",
            "worker_baseline_bytes": "benchmarks/results/scale.json (worker peak RSS at 2^16 parameters)",
        },
    }


def main(argv: Sequence[str] | None = None, client: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small checkpoint measurement (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker-memory", type=float, default=16.0, help="GiB of each worker's memory limit")
    parser.add_argument(
        "--markdown", action="store_true", help="print the table of the saved results, measure nothing"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        saved = json.loads(args.out.read_text())
        print(markdown(saved["rows"]), end="")
        return dict(saved)
    client = client or _cluster.shared_embedded_client()
    checkpoint = measure_checkpoint(client, 1 << 16 if args.quick else 1 << 23)
    figures = figures_from(RESULTS_DIR, checkpoint)
    rows = table(figures, int(args.worker_memory * GIB))
    result = {
        "benchmark": "sizing",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "shared": True},
        "checkpoint": checkpoint,
        "figures": figures,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows), end="")
    return result


if __name__ == "__main__":
    main()
