"""What reproducible Sandblaster gradients cost (issue 18, item 6): binned exact sums against float sums.

Two measurements:

* ``--micro``: the accumulate kernels alone, per element: depositing one portion's gradient into a binned
  sum (``storage._exactsum.deposit``), merging two binned sums (a shard taking a replica's push), and
  rounding one, against the ``daxpy`` they replace; at 500, 1e5 and 1e6 elements.
* end to end (default): Sandblaster L-BFGS on logistic regression 200,000 x 500 (seeded), seconds per
  evaluation (gradient phase, from the run's history) with the code in each of the given trees, one fresh
  2-worker LocalCluster per run, interleaved (before, after, before, ...), each run after a warm-up run
  that puts the rows in the workers' memory; medians over rounds.

Run: ``python benchmarks/reproducible_cost.py --trees /tmp/before . [--rounds 3] [--out PATH]`` where each
tree is a checkout of the project (``git archive b920ce2 | tar -x -C /tmp/before``), and
``python benchmarks/reproducible_cost.py --micro``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS, COLS = 200_000, 500


def micro() -> dict[str, Any]:
    """Per-element nanoseconds of the binned kernels and of daxpy (median of 15)."""
    from scipy.linalg import blas

    from distbelief.storage import _exactsum

    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for n in (500, 100_000, 1_000_000):
        g = rng.standard_normal(n)
        acc, state, other = np.zeros(n), _exactsum.zeros(n), _exactsum.deposit(_exactsum.zeros(n), g)

        def best(fn: Any, n: int = n) -> float:
            times = []
            for _ in range(15):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times) / n * 1e9

        out[str(n)] = {
            "daxpy_ns": best(lambda: blas.daxpy(g, acc, a=1.0)),  # noqa: B023
            "deposit_ns": best(lambda: _exactsum.deposit(state, g)),  # noqa: B023
            "merge_ns": best(lambda: _exactsum.merge(state, other)),  # noqa: B023
            "value_ns": best(lambda: _exactsum.value(state)),  # noqa: B023
        }
    return out


def one_run(data: str, store: str, repeats: int, maxiter: int) -> dict[str, Any]:
    """Warm-up run, then ``repeats`` timed ones, on a fresh LocalCluster; seconds per evaluation."""
    from distributed import Client, LocalCluster

    from distbelief import models, sandblaster
    from distbelief.storage import Dataset

    ds = Dataset.open(data)
    model = models.Logistic(COLS)
    per_eval, objectives = [], []
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        for k in range(repeats + 1):
            res = sandblaster.minimize(
                model, ds, x0=np.zeros(model.n_params), l2=1e-4, client=client, maxiter=maxiter,
                store=f"{store}/run{k}",
            )  # fmt: skip
            if k:
                per_eval.append(float(res.history.time_gradient.sum()) / res.nfev)
                objectives.append(float(res.fun))
    return {"per_eval_s": per_eval, "objectives": objectives, "nfev": int(res.nfev)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--trees", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--maxiter", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one-run", nargs=2, metavar=("DATA", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(*args.one_run, args.repeats, args.maxiter)))
        return {}
    if args.micro:
        result: dict[str, Any] = {"micro": micro()}
    else:
        from distbelief.storage import Dataset

        tmp = tempfile.mkdtemp(prefix="repro-cost-")
        rng = np.random.default_rng(0)
        X = rng.standard_normal((ROWS, COLS))
        y = (X @ rng.standard_normal(COLS) + rng.standard_normal(ROWS) > 0).astype(float)
        Dataset.from_arrays(X, y, path=f"{tmp}/data", overwrite=True)
        del X, y
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in args.trees}
        for r in range(args.rounds):
            for tree in args.trees:
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                cmd = [sys.executable, __file__, "--one-run", f"{tmp}/data", f"{tmp}/{Path(tree).name}{r}"]
                cmd += ["--repeats", str(args.repeats), "--maxiter", str(args.maxiter)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(tree, runs[tree][-1], flush=True)
        result = {
            "problem": f"logistic {ROWS} x {COLS}, l2=1e-4, maxiter={args.maxiter}, 2 workers",
            "load_average": os.getloadavg(),
            "median_per_eval_s": {
                t: statistics.median(x for run in rs for x in run["per_eval_s"]) for t, rs in runs.items()
            },
            "runs": runs,
        }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
