"""The parameter server's capacity, by simulation with many light replicas (issue 30, item 4).

Usage::

    python benchmarks/ps_capacity.py [--quick] [--repeats 3] [--time-limit 4] [--out DIR]

The paper ran Downpour with up to 200 replicas; this box has 2 cores. So the replicas here are light: their
model's mini-batch step is a calibrated ``time.sleep`` (it releases the GIL and costs no CPU) and its gradient
a fixed vector, and every replica runs on one worker while every shard runs on the other. What loads the
shards' worker is then exactly what a real run's shards do: receive pushes, apply Adagrad, answer fetches.

Measured, for 1-64 replicas and 1-4 shards at n_fetch = n_push = 1 (every step a fetch and a push, the
heaviest load) on a 400k-parameter model (the MLP of issue 30: 3.2 MB a message) and a 20k-parameter one:

* steps/s over the steady part of the run, pushes/s and bytes/s the shards absorbed;
* the CPU seconds the shards' worker spent per message and per byte (its process time over the run);
* staleness (mean, in shard versions) as replicas grow.

From these, a model predicts a cluster's steps/s::

    steps/s = min(R / (t_step + t_comm),                      # replicas, each at its own pace
                  n / (c_msg + c_byte * 8P/S),                 # shard CPU: every push reaches every shard
                  n * bandwidth / (8P/S))                      # each shard machine's network link

with R replicas, S shards, P parameters, n = n_fetch = n_push, t_step the model's step and t_comm the
replica's own cost per step of moving ``2 * 8P / n`` bytes (measured here at R = 1); ``c_msg`` and
``c_byte`` are fitted to the shard worker's CPU per push-and-fetch pair. The JSON holds every measured row,
the fit, the prediction for each measured configuration beside the measurement (the check the issue asks
for), and the table for 20-200 replicas on 10 shards over a 10 Gbit/s network that ``docs/operations.md``
shows, with the resource that saturates first named in each row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's distbelief, here and in the workers it spawns
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))

#: The MLP of issue 30 (benchmarks/downpour_steps.py): its parameters, and one mini-batch step's time in one
#: process on this machine (loss_and_grad, one BLAS thread, 128 rows; see storage/_malloc.py).
MLP_PARAMS = 399_370
MLP_STEP_S = 0.0067
#: A shard machine's network link in the prediction (10 Gbit/s, one direction), bytes per second.
LINK_BYTES_PER_S = 10e9 / 8
#: The predicted cluster: shards, and replica counts.
PREDICT_SHARDS = 10
PREDICT_REPLICAS = (20, 50, 100, 200)


class SleepModel:
    """A model whose mini-batch step is a sleep of ``step_s`` and whose gradient is a fixed tiny vector.

    Parameters
    ----------
    n_params : int
        Parameters (the bytes each fetch and push moves: 8 per parameter).
    step_s : float
        Seconds one ``loss_and_grad`` call sleeps.

    Examples
    --------
    >>> m = SleepModel(4, 0.0)
    >>> loss, g = m.loss_and_grad(m.init_params(0), np.zeros((2, 1)), np.zeros(2)); loss, g.shape
    (2.0, (4,))
    """

    def __init__(self, n_params: int, step_s: float) -> None:
        self.n_params = int(n_params)
        self.step_s = float(step_s)
        # Tiny and fixed: Adagrad moves the parameters by ~lr per step whatever its size; nothing diverges.
        self._grad = np.full(self.n_params, 1e-3)

    def init_params(self, seed: int = 0) -> np.ndarray:
        return np.zeros(self.n_params)

    def loss_and_grad(self, w: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        rows = int(X.shape[0])
        if self.step_s > 0:
            time.sleep(self.step_s)
        return float(rows), self._grad * rows  # a sum over the rows, as every model's


def _cpu_seconds() -> float:
    return time.process_time()


def one_run(
    client: Any, model: SleepModel, X: np.ndarray, y: np.ndarray, *, replicas: int, shards: int, limit: float
) -> dict[str, Any]:
    """One ``downpour.train`` with the shards on the first worker and the replicas on the second."""
    from distbelief import downpour

    workers = sorted(client.scheduler_info()["workers"])
    shard_worker, replica_worker = workers[0], workers[-1]
    cpu0 = client.run(_cpu_seconds)
    res = downpour.train(
        model, (X, y), replicas=replicas, shards=shards, rule="adagrad", lr=0.01, batch_size=8, n_fetch=1,
        n_push=1, time_limit=limit, client=client, shard_workers=[shard_worker],
        replica_workers=[replica_worker], fuse=True, eval_every=limit, checkpoint_every_s=0.0,
    )  # fmt: skip
    cpu1 = client.run(_cpu_seconds)
    h = res.history
    t, steps = h.time.values, h.step.values
    # The steady part: from a quarter of the run on (the replicas start one after another).
    lo = int(np.searchsorted(t, 0.25 * t[-1]))
    span = float(t[-1] - t[lo]) if len(t) > 1 else 0.0
    steady = float(steps[-1] - steps[lo]) / span if span > 0 else float(res.steps) / max(res.wall_time, 1e-9)
    wall = float(res.wall_time)
    pushes, fetches = int(res.stats["pushes"]), int(res.stats["fetches"])
    moved = float(res.stats["bytes_fetched"] + res.stats["bytes_pushed"])
    return {
        "replicas": replicas,
        "shards": shards,
        "n_params": model.n_params,
        "steps": int(res.steps),
        "steps_per_s": steady,
        "pushes_per_s": pushes / wall,
        "fetches_per_s": fetches / wall,
        "bytes_per_s": moved / wall,
        "staleness_mean": float(res.stats["staleness_mean"]),
        "shard_cpu_s": cpu1[shard_worker] - cpu0[shard_worker],
        "replica_cpu_s": cpu1[replica_worker] - cpu0[replica_worker],
        "wall_s": wall,
        "stop_reason": res.stop_reason,
    }


def one_process_steps_per_s(model: SleepModel, X: np.ndarray, y: np.ndarray, seconds: float) -> float:
    """The single-process reference: ``downpour.sequential_sgd`` on the same model (no Dask, no shards)."""
    from distbelief.downpour import sequential_sgd

    rng = np.random.default_rng(0)
    batches = (rng.integers(0, len(X) - 8) + np.arange(8) for _ in range(10**9))
    t0 = time.perf_counter()
    res = sequential_sgd(
        model, X, y, model.init_params(0), batches, rule="adagrad", lr=0.01, time_limit=seconds
    )
    return len(res.losses) / (time.perf_counter() - t0)


def fit_shard_cost(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``c_msg`` and ``c_byte``: the shard worker's CPU seconds per push-and-fetch pair, as a line in the
    bytes one shard's slice of a message holds (least squares over the rows; at least two message sizes).

    Examples
    --------
    >>> rows = [{"shard_cpu_s": 1e-3 * 100 + 1e-9 * 8e5 * 100, "pushes_per_s": 100 / 2, "wall_s": 2.0,
    ...          "shards": 1, "n_params": 100_000},
    ...         {"shard_cpu_s": 1e-3 * 200 + 1e-9 * 8e4 * 200, "pushes_per_s": 200 / 2, "wall_s": 2.0,
    ...          "shards": 1, "n_params": 10_000}]
    >>> {k: round(v, 12) for k, v in fit_shard_cost(rows).items()}
    {'c_msg': 0.001, 'c_byte': 1e-09}
    """
    # Pushes are counted per shard that applied one (a replica's push to S shards counts S).
    pairs = np.array([r["pushes_per_s"] * r["wall_s"] for r in rows])
    slice_bytes = np.array([8.0 * r["n_params"] / r["shards"] for r in rows])
    cpu = np.array([r["shard_cpu_s"] for r in rows])
    A = np.column_stack([pairs, pairs * slice_bytes])
    (c_msg, c_byte), *_ = np.linalg.lstsq(A, cpu, rcond=None)
    return {"c_msg": float(max(c_msg, 0.0)), "c_byte": float(max(c_byte, 0.0))}


def predict(
    *,
    replicas: int,
    shards: int,
    n_params: int,
    step_s: float,
    comm_s: float,
    n: int,
    cost: dict[str, float],
    link_bytes_per_s: float = LINK_BYTES_PER_S,
) -> dict[str, Any]:
    """Predicted steps/s of ``replicas`` replicas on ``shards`` shards, each on its own machine, and the
    resource that bounds it (see the module docstring).

    Examples
    --------
    >>> p = predict(replicas=10, shards=1, n_params=1000, step_s=0.01, comm_s=0.0, n=1,
    ...             cost={"c_msg": 0.001, "c_byte": 0.0})
    >>> round(p["steps_per_s"]), p["bound"]
    (1000, 'replicas')
    """
    slice_bytes = 8.0 * n_params / shards
    limits = {
        "replicas": replicas / (step_s + comm_s),
        # Every step's push (and fetch) reaches every shard, as a slice: more shards make the slices
        # smaller, not the messages fewer.
        "shard CPU": n / max(cost["c_msg"] + cost["c_byte"] * slice_bytes, 1e-300),
        "shard network": n * link_bytes_per_s / slice_bytes,
    }
    bound = min(limits, key=lambda k: limits[k])
    return {"steps_per_s": limits[bound], "bound": bound, "limits": limits}


def main(argv: list[str] | None = None, *, client: Any = None) -> dict[str, Any]:
    """The benchmark; on ``client``'s cluster (two workers) when given (the suite's smoke run: a cluster of
    its own cost a start and a close), else on a 2-worker ``LocalCluster`` of its own."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a small grid, 0.6 s runs, one round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    from distributed import Client, LocalCluster

    if args.quick:
        args.repeats, args.time_limit = 1, 0.6
        grid = [(1, 1, 2_000), (4, 1, 2_000), (4, 2, 2_000), (4, 1, 200)]
        step_s = 0.002
    else:
        grid = [(r, s, MLP_PARAMS) for r in (1, 2, 4, 8, 16, 32, 64) for s in (1, 2, 4)]
        grid += [(r, 1, 20_000) for r in (8, 64)]
        step_s = MLP_STEP_S
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4096, 1))
    y = np.zeros(len(X))
    rounds: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        if client is None:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0", host="127.0.0.1"
                )
            )
            client = stack.enter_context(Client(cluster))
        one_run(client, SleepModel(grid[0][2], step_s), X, y, replicas=1, shards=1, limit=1.0)  # warm
        reference: list[float] = []
        for _ in range(args.repeats):
            reference.append(one_process_steps_per_s(SleepModel(grid[0][2], step_s), X, y, args.time_limit))
            for replicas, shards, n_params in grid:
                run = one_run(
                    client, SleepModel(n_params, step_s), X, y, replicas=replicas, shards=shards,
                    limit=args.time_limit,
                )  # fmt: skip
                rounds.setdefault((replicas, shards, n_params), []).append(run)
    rows = []
    for (replicas, shards, n_params), got in rounds.items():
        row: dict[str, Any] = {"replicas": replicas, "shards": shards, "n_params": n_params, "rounds": got}
        for key in ("steps_per_s", "pushes_per_s", "bytes_per_s", "staleness_mean", "shard_cpu_s", "wall_s"):
            row[key] = statistics.median(float(g[key]) for g in got)
        row["fetches_per_s"] = statistics.median(float(g["fetches_per_s"]) for g in got)
        row["replica_cpu_s"] = statistics.median(float(g["replica_cpu_s"]) for g in got)
        rows.append(row)
    cost = fit_shard_cost(rows)
    # A replica's own time per step beyond its model's: from the one-replica rows (no queueing at the shards).
    singles = [r for r in rows if r["replicas"] == 1]
    comm_s = statistics.median(max(0.0, 1.0 / r["steps_per_s"] - step_s) for r in singles) if singles else 0.0
    # This box's shards share one worker process: its capacity is one shard's, whatever S (the check uses S=1
    # for the CPU bound and no network bound: loopback).
    for r in rows:
        p = predict(
            replicas=r["replicas"], shards=1, n_params=r["n_params"], step_s=step_s, comm_s=comm_s, n=1,
            cost={"c_msg": cost["c_msg"] * r["shards"], "c_byte": cost["c_byte"]}, link_bytes_per_s=np.inf,
        )  # fmt: skip
        r["predicted_steps_per_s"] = p["steps_per_s"]
        r["predicted_bound"] = p["bound"]
        r["predicted_over_measured"] = p["steps_per_s"] / r["steps_per_s"] if r["steps_per_s"] else np.nan
    staleness = [(r["replicas"], r["staleness_mean"]) for r in rows if r["n_params"] == grid[0][2]]
    table = []
    for n in (1, 10):
        for replicas in PREDICT_REPLICAS:
            p = predict(
                replicas=replicas, shards=PREDICT_SHARDS, n_params=MLP_PARAMS, step_s=MLP_STEP_S,
                comm_s=comm_s / n, n=n, cost=cost,
            )  # fmt: skip
            table.append({"replicas": replicas, "shards": PREDICT_SHARDS, "n": n, **p})
    result = {
        "problem": {"step_s": step_s, "batch": 8, "rule": "adagrad", "n_fetch": 1, "n_push": 1},
        "time_limit": args.time_limit,
        "repeats": args.repeats,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "one_process_steps_per_s": statistics.median(reference),
        "rows": rows,
        "fit": {**cost, "comm_s": comm_s},
        "staleness_by_replicas": staleness,
        "prediction": table,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "ps_capacity_quick.json" if args.quick else "ps_capacity.json"
    (args.out / name).write_text(json.dumps(result, indent=1, default=float))
    print(f"one process (sequential_sgd, no Dask): {result['one_process_steps_per_s']:.1f} steps/s")
    print(f"{'R':>3} {'S':>2} {'P':>7} {'steps/s':>8} {'pred':>8} {'MB/s':>7} {'stale':>6} {'shard cpu':>9}")
    for r in rows:
        print(
            f"{r['replicas']:>3} {r['shards']:>2} {r['n_params']:>7} {r['steps_per_s']:8.1f} "
            f"{r['predicted_steps_per_s']:8.1f} {r['bytes_per_s'] / 1e6:7.1f} {r['staleness_mean']:6.1f} "
            f"{r['shard_cpu_s']:9.2f}"
        )
    c_msg_ms, c_byte_ns = cost["c_msg"] * 1e3, cost["c_byte"] * 1e9
    print(f"fit: c_msg {c_msg_ms:.3f} ms, c_byte {c_byte_ns:.3f} ns/B, comm {comm_s * 1e3:.2f} ms")
    for t in table:
        where = f"R={t['replicas']:>3} S={t['shards']} n={t['n']:>2}"
        print(f"predicted {where}: {t['steps_per_s']:9.0f} steps/s ({t['bound']})")
    return result


if __name__ == "__main__":
    main()
