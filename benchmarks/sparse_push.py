"""Sparse (key-value) against dense pull and push in Sandblaster L-BFGS, on a click-through-shaped problem.

Issue 13, item 3. A replica working on sparse portions pulls only the parameters its rows touch and pushes
only those gradient entries, as key-value pairs per shard (ps-lite's pull/push; ``communication="sparse"``),
instead of whole slices (``"dense"``). Same iterates either way (tests/sandblaster/test_sparse_push.py);
this measures what it saves.

Data: CTR-shaped synthetic rows, ``--rows`` (200,000) with ~40 nonzeros each, whose feature ids follow a
power law (Zipf exponent 1.1, as click logs' feature frequencies do) and are hashed into ``2**b`` columns
for each ``b`` in ``--bits`` (20 and 22); binary labels from a sparse true model. Logistic regression,
``l2 = 1e-4`` on the shards, L-BFGS with history 10, ``--iters`` iterations (``gtol = 0``, so every run does
the same number), one LocalCluster of 2 single-thread workers (2 shards, 2 replicas).

Reported per problem and mode: seconds per iteration (median over ``--repeats`` runs, the rows already in
the workers' memory after the first), evaluations, bytes moved per evaluation (parameters and keys pulled,
gradients and keys pushed, counted by the replicas), the keys a portion touches, and the largest difference
between the sparse and dense runs' final ``x``. A row for SciPy's L-BFGS-B in one process (the models' own
compiled CSR kernel, the same objective, the same iteration count; its BLAS pools at one thread) gives the
single-process reference. The machine is shared and loaded: read the seconds as rough.

Run: ``PYTHONPATH=. python benchmarks/sparse_push.py [--quick] [--out PATH]`` from the checkout (default
``benchmarks/results/sparse_push.json``; ``--quick``: 20,000 rows, 2**18 and 2**20 columns, 5 iterations,
1 repeat, written to ``sparse_push_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.optimize
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from distbelief import models, sandblaster
from distbelief.storage import Dataset, embedded_client
from distbelief.storage._keys import Communication, param_keys, sorted_unique

RESULTS = Path(__file__).parent / "results"
L2 = 1e-4


def ctr_rows(n_rows: int, bits: int, nnz: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    """``n_rows`` CSR rows of ~``nnz`` power-law feature ids hashed into ``2**bits`` columns, and labels.

    Examples
    --------
    >>> X, y = ctr_rows(100, 10, 8)
    >>> X.shape, bool(X.nnz <= 800)
    ((100, 1024), True)
    """
    rng = np.random.default_rng(seed)
    d = 1 << bits
    # Zipf ranks (frequent features first), then a hash: a fixed random permutation of the columns.
    ranks = rng.zipf(1.1, size=n_rows * nnz) % d
    cols = rng.permutation(d)[ranks].reshape(n_rows, nnz)
    indptr = np.arange(0, n_rows * nnz + 1, nnz)
    X = sp.csr_array((np.ones(n_rows * nnz), cols.ravel().astype(np.int32), indptr), shape=(n_rows, d))
    X.sum_duplicates()  # a feature seen twice in a row counts 2
    X.sort_indices()
    w_true = np.where(rng.random(d) < 0.05, rng.normal(scale=0.5, size=d), 0.0)
    p = 1.0 / (1.0 + np.exp(-(X @ w_true - 1.0)))
    y = (rng.random(n_rows) < p).astype(float)
    return X, y


def scipy_row(model: Any, X: Any, y: np.ndarray, iters: int) -> dict[str, Any]:
    """SciPy's L-BFGS-B in this process on the same objective, ``iters`` iterations."""
    n = X.shape[0]

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = model.loss_and_grad(w, X, y)
        return loss / n + 0.5 * L2 * float(w @ w), grad / n + L2 * w

    x0 = np.zeros(model.n_params)
    fun(x0)  # compile the kernel outside the timing
    with threadpool_limits(limits=1):
        t0 = time.perf_counter()
        res = scipy.optimize.minimize(
            fun, x0, jac=True, method="L-BFGS-B", options={"maxiter": iters, "gtol": 0.0, "ftol": 0.0}
        )
        wall = time.perf_counter() - t0
    return {"s_per_iter": wall / max(1, res.nit), "nit": int(res.nit), "nfev": int(res.nfev), "fun": res.fun}


def run_modes(
    model: Any, ds: Dataset, client: Any, store: Path, iters: int, repeats: int
) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    """Per mode: the median seconds per iteration over ``repeats`` runs (interleaved, after an untimed
    one-iteration run of each that reads the rows into the workers' memory, compiles the kernels and
    computes the portions' keys), the bytes moved, and the last run's x."""

    def run(mode: Communication, tag: str, maxiter: int) -> Any:
        return sandblaster.minimize(
            model, ds, l2=L2, client=client, store=store / f"{mode}-{tag}", communication=mode,
            maxiter=maxiter, gtol=0.0, ftol=0.0,
        )  # fmt: skip

    modes: tuple[Communication, ...] = ("sparse", "dense")
    for mode in modes:
        run(mode, "warm", 1)
    times: dict[str, list[float]] = {m: [] for m in modes}
    last: dict[str, Any] = {}
    for r in range(repeats):
        for mode in modes:
            last[mode] = run(mode, str(r), iters)
            times[mode].append(last[mode].stats["wall_s"] / max(1, last[mode].nit))
    return {m: (_row(last[m], times[m]), last[m].x) for m in modes}


def _row(res: Any, times: list[float]) -> dict[str, Any]:
    return {
        "s_per_iter": statistics.median(times),
        "s_per_iter_all": times,
        "nit": res.nit,
        "nfev": res.nfev,
        "fun": res.fun,
        "bytes_per_evaluation": res.stats["bytes_per_evaluation"],
        "bytes_pulled": res.stats["bytes_pulled"],
        "bytes_pushed": res.stats["bytes_pushed"],
        "portions": res.stats["portions"],
        "communication": res.stats["communication"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--bits", type=int, nargs="+", default=[20, 22])
    parser.add_argument("--nnz", type=int, default=40)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.bits, args.iters, args.repeats = 20_000, [18, 20], 5, 1
    out = args.out or RESULTS / ("sparse_push_quick.json" if args.quick else "sparse_push.json")
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "problems": [],
    }
    with tempfile.TemporaryDirectory(prefix="sparse-push-") as tmp, embedded_client(None) as client:
        for bits in args.bits:
            X, y = ctr_rows(args.rows, bits, args.nnz)
            model = models.Logistic(1 << bits)
            ds = Dataset.from_arrays(X, y, path=Path(tmp) / f"ctr{bits}")
            runs = run_modes(model, ds, client, Path(tmp) / f"runs{bits}", args.iters, args.repeats)
            rows: dict[str, Any] = {m: row for m, (row, _) in runs.items()}
            xs = {m: x for m, (_, x) in runs.items()}
            for mode, row in rows.items():
                print(bits, mode, json.dumps({k: v for k, v in row.items() if k != "s_per_iter_all"}))
            rows["scipy_lbfgsb"] = scipy_row(model, X, y, args.iters)
            print(bits, "scipy", rows["scipy_lbfgsb"])
            portion_rows = -(-args.rows // rows["sparse"]["portions"])
            keys_per_portion = [
                param_keys(model, X[i : i + portion_rows]).size for i in range(0, args.rows, portion_rows)
            ]
            report["problems"].append(
                {
                    "rows": args.rows,
                    "features": 1 << bits,
                    "nnz": int(X.nnz),
                    "touched_features": int(sorted_unique(X.indices).size),
                    "keys_per_portion_mean": float(np.mean(keys_per_portion)),
                    "max_abs_diff_sparse_dense_x": float(np.abs(xs["sparse"] - xs["dense"]).max()),
                    "bytes_ratio_dense_over_sparse": rows["dense"]["bytes_per_evaluation"]
                    / rows["sparse"]["bytes_per_evaluation"],
                    **rows,
                }
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
