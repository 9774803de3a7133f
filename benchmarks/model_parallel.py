"""Model parallelism (paper, section 3, Figure 3): time per mini-batch against partitions per replica.

For a small and a large locally connected model, 1-D and 2-D (image patches, split into bands of map rows),
and an MLP (for its all-gather traffic), one Downpour replica is split into 1, 2 and 4 partition actors
(``downpour.train(partitions=K)``; K = 1 runs the partitioned code path with a single partition, so the
comparison is like for like). Reported per configuration: milliseconds per mini-batch (median of the
repeats), messages and bytes exchanged between partitions per step, and where the time of a partition went
(compute, waiting for peers, fetch, push); beside every K, ``in_process_ms``: the single-process numpy
reference (the whole model's ``loss_and_grad`` on one mini-batch in this process, no actors), and their
ratio ``vs_in_process``.

The replicas fetch and push every ``--n-sync`` steps (``n_fetch = n_push``, default 10; recorded in the
JSON): the paper's Figure 3 measures a replica's speed per mini-batch with the parameter server out of the
way, and with ``n_sync = 1`` every step moves the whole parameter slice to and from the shards twice (45 MB
for ``large_lc2d``), which is the parameter server's cost, not the partitions'. ``--n-sync 1`` measures it.

Then the memory case: on a cluster whose workers have a small ``memory_limit``, an MLP whose parameters do
not fit one worker is refused with ``partitions=1`` (InvalidOptionError saying how many partitions would
fit) and trains with enough partitions.

The speedup is bounded by the machine: this project's box has 2 cores shared by every worker (and, while
the benchmark runs, by whoever else is using it; the load average is recorded in the JSON).

Usage::

    python benchmarks/model_parallel.py            # full run, JSON + PNG in benchmarks/results/
    python benchmarks/model_parallel.py --quick    # a smoke run (small models, one repeat)
    python benchmarks/model_parallel.py --models small_lc2d large_lc2d   # only these rows, merged
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distbelief import models
from distbelief.downpour._partition import memory_needed
from distbelief.downpour._partitioned import check_partitioned_options
from distbelief.downpour._train import fit
from distbelief.errors import InvalidOptionError
from distbelief.storage import Dataset

RESULTS = Path(__file__).parent / "results"


def train_partitioned(model: Any, data: Any, *, partitions: int, **options: Any) -> Any:
    """``downpour.train(model, data, partitions=K, **options)`` with K = 1 too: one partition actor per
    replica, the partitioned code path (``downpour.train`` takes it only from K = 2; this compares K = 1
    with K > 1)."""
    opts = check_partitioned_options(partitions, {**options, "partitions": partitions})
    run = {k: options.get(k) for k in ("eval_data", "client", "store", "callback", "x0")}
    return fit(model, data, opts, partitions=partitions, **run)


def _data(n_features: int, n_classes: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, n_features))
    teacher = rng.normal(size=(n_features, n_classes))
    return X, np.argmax(X @ teacher, axis=1).astype(np.float64)


def _models(quick: bool) -> dict[str, Any]:
    # The 2-D rows are the paper's image models in miniature: digits-sized 8 x 8 images, and 28 x 28 ones
    # (MNIST-sized), split into bands of map rows.
    if quick:
        return {
            "small_lc": models.LocallyConnected(256, 10, fields=[9, 5]),
            "large_lc": models.LocallyConnected(4096, 10, fields=[32, 16], strides=[2, 1]),
            "small_lc2d": models.LocallyConnected2D((8, 8), 10, patches=[3, 3], filters=[4, 4]),
            "large_lc2d": models.LocallyConnected2D(
                (28, 28), 10, patches=[5, 3], strides=[1, 1], filters=[8, 4]
            ),
            "mlp": models.MLP([256, 128, 128, 10]),
        }
    return {
        "small_lc": models.LocallyConnected(1024, 10, fields=[16, 8]),
        "large_lc": models.LocallyConnected(32768, 10, fields=[128, 64], strides=[2, 1]),
        "small_lc2d": models.LocallyConnected2D((8, 8), 10, patches=[3, 3], filters=[16, 8]),
        "large_lc2d": models.LocallyConnected2D((28, 28), 10, patches=[5, 5], filters=[32, 16]),
        "mlp": models.MLP([1024, 512, 512, 10]),
    }


def _time_per_batch(
    client: Client,
    model: Any,
    K: int,
    X: np.ndarray,
    y: np.ndarray,
    steps: int,
    repeats: int,
    batch: int,
    n_sync: int = 1,
) -> dict[str, Any]:
    times: list[float] = []
    res: Any = None
    with tempfile.TemporaryDirectory(prefix="mp-bench-") as store:
        data_path = os.path.join(store, "data")
        ds = Dataset.from_arrays(X, y, path=data_path, label_kind="classes", n_classes=model.n_classes)
        for r in range(repeats):
            res = train_partitioned(
                model, ds, partitions=K, max_steps=steps, batch_size=batch, rule="adagrad", lr=0.05,
                client=client, store=os.path.join(store, f"run{r}"), seed=r, n_fetch=n_sync, n_push=n_sync,
            )  # fmt: skip
            times.append(res.wall_time / res.steps)
    seconds: dict[str, float] = {}
    for st in res.stats["per_partition"]:
        for key, value in st["seconds"].items():
            seconds[key] = seconds.get(key, 0.0) + value / (res.steps * K)
    return {
        "partitions": K,
        "n_params": model.n_params,
        "n_fetch": n_sync,
        "n_push": n_sync,
        "ms_per_batch": 1000 * statistics.median(times),
        "ms_per_batch_all": [1000 * t for t in times],
        "messages_per_step": res.stats["messages_per_step"],
        "bytes_per_step": res.stats["bytes_per_step"],
        "messages_by_kind": res.stats["messages_by_kind"],
        "ms_per_step_per_partition": {k: 1000 * v for k, v in seconds.items()},
        "param_bytes_per_partition": [st["param_bytes"] for st in res.stats["per_partition"]],
    }


def _in_process_ms(model: Any, X: np.ndarray, y: np.ndarray, batch: int, repeats: int = 5) -> float:
    """The single-process numpy reference: the whole model's ``loss_and_grad`` on one mini-batch (median)."""
    w = model.init_params(0)
    times = []
    for r in range(repeats):
        rows = slice(r * batch, (r + 1) * batch)
        t0 = time.perf_counter()
        model.loss_and_grad(w, X[rows], y[rows])
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _memory_case(quick: bool) -> dict[str, Any]:
    """An MLP that does not fit one worker's memory_limit: refused unpartitioned, trained partitioned."""
    limit = 600 * 2**20
    # ~1.25 x what one worker may hold: partitions=1 is refused; 4 partitions need a third of a worker each.
    hidden = 1600 if quick else 3000
    n_in = int(1.25 * limit / (8 * 4) / hidden) - hidden
    model = models.MLP([n_in, hidden, hidden, 10])
    X, y = _data(n_in, 10, 64, seed=1)
    out: dict[str, Any] = {
        "memory_limit": limit,
        "n_params": model.n_params,
        "param_mib": model.n_params / 2**17,
    }
    with LocalCluster(
        n_workers=4, threads_per_worker=1, memory_limit=limit, dashboard_address=None, host="127.0.0.1"
    ) as cluster, Client(cluster) as client:  # fmt: skip
        for K in (1, 4):
            plan = models.partition_plan(model, K)
            row: dict[str, Any] = {"partitions": K, "need_mib_per_partition": memory_needed(plan) / 2**20}
            t0 = time.perf_counter()
            try:
                res = train_partitioned(
                    model,
                    (X, y),
                    partitions=K,
                    max_steps=2,
                    batch_size=16,
                    rule="sgd",
                    lr=0.01,
                    client=client,
                )
                row.update(trained=True, steps=res.steps, seconds=time.perf_counter() - t0)
            except InvalidOptionError as exc:
                row.update(trained=False, refused=str(exc))
            out[f"partitions_{K}"] = row
            print(f"  memory case, partitions={K}: {row}", flush=True)
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results["timings"].items():
        ks = [r["partitions"] for r in rows]
        ax1.plot(ks, [r["ms_per_batch"] for r in rows], marker="o", label=name)
        ax2.plot(ks, [max(r["bytes_per_step"], 1) for r in rows], marker="o", label=name)
    ax1.set(
        xlabel="partitions per replica",
        ylabel="ms per mini-batch",
        title="time per mini-batch",
        xticks=[1, 2, 4],
        yscale="log",
    )
    ax2.set(xlabel="partitions per replica", ylabel="bytes between partitions per step", yscale="log",
            title="traffic per step", xticks=[1, 2, 4])  # fmt: skip
    ax1.legend()
    fig.suptitle(
        f"model parallelism on {os.cpu_count()} cores (load average {results['load_average'][0]:.1f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None, *, cluster: LocalCluster | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, one repeat (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="mini-batches per run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--n-sync",
        type=int,
        default=10,
        help="fetch and push every N steps (n_fetch = n_push = N; the paper's Figure 3 keeps the parameter "
        "server out of a replica's time per mini-batch); 1 moves the whole slice twice a step",
    )
    parser.add_argument("--skip-memory", action="store_true", help="skip the memory_limit case")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the JSON and PNG")
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="run only these rows and merge them into the JSON already there (each row keeps the load "
        "average it was measured at)",
    )
    args = parser.parse_args(argv)
    if args.n_sync < 1:
        parser.error(f"--n-sync must be a positive integer, got {args.n_sync}")
    steps = args.steps or (10 if args.quick else 40)
    repeats = args.repeats or (1 if args.quick else 3)
    # The quick run's data set is small: a run's history evaluates the objective on the training rows (at
    # its start and end, in the driver): on 1024 rows those cost the 15 quick runs 2.5x their time.
    n_rows = 256 if args.quick else 1024
    results: dict[str, Any] = {
        "quick": args.quick,
        "steps": steps,
        "repeats": repeats,
        "rows": n_rows,
        "batch_size": args.batch_size,
        "n_sync": args.n_sync,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "timings": {},
    }
    own = cluster is None
    if own:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, host="127.0.0.1")
    try:
        with Client(cluster, direct_to_workers=True) as client:
            chosen = _models(args.quick)
            unknown = set(args.models or ()) - set(chosen)
            if unknown:
                parser.error(f"unknown rows {sorted(unknown)}; choose from {sorted(chosen)}")
            for name, model in chosen.items():
                if args.models and name not in args.models:
                    continue
                X, y = _data(model.n_features, model.n_classes, n_rows)
                reference = _in_process_ms(model, X, y, args.batch_size)
                results.setdefault("in_process_ms", {})[name] = reference
                results.setdefault("load_average_by_row", {})[name] = os.getloadavg()
                rows = []
                for K in (1, 2, 4):
                    row = _time_per_batch(
                        client, model, K, X, y, steps, repeats, args.batch_size, n_sync=args.n_sync
                    )
                    row["in_process_ms"] = reference
                    row["vs_in_process"] = row["ms_per_batch"] / reference
                    rows.append(row)
                    ms, msgs, kib = (
                        row["ms_per_batch"],
                        row["messages_per_step"],
                        row["bytes_per_step"] / 1024,
                    )
                    print(
                        f"{name:10s} n_params={model.n_params:>9,d} K={K} n_sync={args.n_sync}: {ms:8.2f} "
                        f"ms/batch (in-process {reference:7.2f} ms, x{ms / reference:.2f}), {msgs:5.1f} "
                        f"messages, {kib:9.1f} KiB/step",
                        flush=True,
                    )
                results["timings"][name] = rows
    finally:
        if own:
            cluster.close()
    if not args.skip_memory:
        results["memory"] = _memory_case(args.quick)
    results["load_average_end"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "model_parallel_quick" if args.quick else "model_parallel"
    if args.models and (out / f"{stem}.json").exists():
        # Merge: the other rows (and the memory case) stay as they were measured.
        earlier = json.loads((out / f"{stem}.json").read_text())
        for key in ("timings", "in_process_ms", "load_average_by_row"):
            earlier.setdefault(key, {}).update(results.get(key, {}))
        if "memory" in results:
            earlier["memory"] = results["memory"]
        earlier.setdefault("merged_runs", []).append(
            {
                "rows": args.models,
                "load_average": results["load_average"],
                "steps": steps,
                "repeats": repeats,
                "n_sync": args.n_sync,
            }
        )
        results = earlier
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    _plot(results, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
