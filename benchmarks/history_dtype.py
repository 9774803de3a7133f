"""L-BFGS history stored as float32 against float64 history: the same iterations and objectives? (issue 29,
item 3)

``sandblaster.minimize(history_dtype="float32")`` stores the pairs ``s_i``, ``y_i`` as float32 (arithmetic
in float64; see ``sandblaster/_vlbfgs.py``). That rounds every pair once (~6e-8 relative), so the iterates
are not float64 history's bit for bit. This script measures how far the runs end apart, per problem,
running each one with both dtypes and the same everything else:

* the peer problems of ``benchmarks/sandblaster_vs_peers.py`` (logistic regression on the digits, the
  seeded 200,000 x 500 synthetic set and its correlated-features variant), L-BFGS to L-BFGS-B's stopping
  rules (``gtol=1e-5``, ``ftol`` L-BFGS-B's), ``history=10``; OWL-QN (``l1``) on the digits too;
* the scale set of ``benchmarks/scale.py`` (``hashed_csr``: click-through-shaped sparse rows, 40 nonzeros
  a row) at ``--rows`` rows and each of ``--sizes`` (log2 columns), L-BFGS and OWL-QN (the scale set's
  ``L2``/``L1``), both to the stopping rules (``maxiter`` at most ``--maxiter``) and for a fixed
  ``--fixed-iters`` iterations with the tolerances at 0 (as ``scale.py`` runs: the 2^27 target is 12 of
  them with the history full).

Each row records, per dtype, the iterations, evaluations, final objective and stop message, and
``rel_fun`` (``|F32 - F64| / |F64|``), ``same_nit`` and ``met`` (``rel_fun <= 1e-6`` and the same
iteration count: issue 29's bar). The rows run to the stopping rules on the scale set also run float64
history twice more with ``l2`` moved by ``1e-12`` relative (``float64_perturbed``, ``noise_rel_fun``,
``noise_nit``): at ``L2 = 1e-6`` that set is ill-conditioned, the gradient test fires somewhere in a slow
valley, and where it fires moves with any perturbation, a float32 rounding of the pairs or far less; these
rows say how much. The runs go through ``minimize(local=True)`` (the method and the shards' kernels in this
process, no cluster: the figures are about arithmetic, not time); ``--cluster`` runs them on a two-worker
``LocalCluster`` as well (the sharded path: the same ops on the shards; with ``--quick`` only the digits'
L-BFGS row). No timing is recorded. ``auto`` lists which dtype ``history_dtype="auto"`` picks per size
for two shards under the default memory budget (``SHARD_MEMORY_FRACTION`` of ``--worker-memory``), from
:func:`sandblaster._minimize.auto_history_dtype`, beside the history's bytes per shard in each dtype.

Run: ``python benchmarks/history_dtype.py [--quick] [--cluster] [--sizes 16,18] [--rows 50000]
[--out DIR]`` (writes ``history_dtype.json``, ``history_dtype_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's distbelief, here and in the workers it spawns
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))

from benchmarks.sandblaster_vs_peers import make_problem  # noqa: E402
from benchmarks.scale import L1, L2, hashed_csr  # noqa: E402
from distbelief import models, sandblaster  # noqa: E402
from distbelief.sandblaster._minimize import WORKING_VECTORS, auto_history_dtype  # noqa: E402
from distbelief.storage import Dataset  # noqa: E402

OUT = HERE / "results"
HISTORY = 10
#: Issue 29's bar for a float32 history: the final objective within this relative gap of float64's.
REL_FUN_TARGET = 1e-6
DTYPES = ("float64", "float32")
#: Peer problems (``sandblaster_vs_peers.make_problem``).
PEER_PROBLEMS = ("digits", "synthetic", "synthetic-correlated")
#: The digits' OWL-QN row: an L1 weight that zeroes a good part of the weights.
DIGITS_L1 = 2e-3
#: Relative change of ``l2`` of the float64 runs that measure a problem's own sensitivity (``noise``).
NOISE = 1e-12


def _run(
    model: Any, data: Any, *, dtype: str, client: Any, store: str | None, **options: Any
) -> dict[str, Any]:
    """One minimize run; its iterations, evaluations, objective, stop message and x."""
    where: dict[str, Any] = {"local": True} if client is None else {"client": client, "store": store}
    res = sandblaster.minimize(
        model, data, x0=np.zeros(model.n_params), history=HISTORY, history_dtype=dtype, **where, **options
    )
    assert res.stats["history_dtype"] == dtype
    return {
        "nit": int(res.nit),
        "nfev": int(res.nfev),
        "fun": float(res.fun),
        "success": bool(res.success),
        "message": res.message,
        "nnz": int(np.count_nonzero(res.x)),
        "x": res.x,
        "objective": np.asarray(res.history.objective.values, dtype=float),
    }


#: Iterations at which ``rel_fun_at`` compares the runs' objectives (those both runs reached).
AT = (1, 2, 5, 10, 12, 20, 30, 50, 100, 200, 300, 500)


def _drift(a: np.ndarray, b: np.ndarray) -> dict[int, float]:
    """``|F_b - F_a| / |F_a|`` at the iterations of :data:`AT` both objective histories reach."""
    return {i: float(abs(b[i] - a[i]) / max(abs(a[i]), 1e-300)) for i in AT if i < min(a.size, b.size)}


def compare(
    name: str,
    model: Any,
    data: Any,
    *,
    client: Any = None,
    tmp: str = "",
    noise: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Both dtypes on one problem, and how far apart they end. ``noise``: also float64 history with ``l2``
    moved by ``1e-12`` relative either way (:data:`NOISE`), the problem's own sensitivity to a perturbation
    far below a float32 rounding, for scale (``noise_rel_fun``, ``noise_nit``)."""

    def store(label: str) -> str | None:
        return None if client is None else f"{tmp}/{name}-{label}-{time.monotonic_ns()}"

    runs: dict[str, dict[str, Any]] = {}
    for dtype in DTYPES:
        runs[dtype] = _run(model, data, dtype=dtype, client=client, store=store(dtype), **options)
    a, b = runs["float64"], runs["float32"]
    perturbed = []
    if noise:
        for sign in (1.0, -1.0):
            moved = {**options, "l2": options["l2"] * (1.0 + sign * NOISE)}
            run = _run(model, data, dtype="float64", client=client, store=store(f"noise{sign}"), **moved)
            perturbed.append(
                {k: v for k, v in run.items() if k not in ("x", "objective")}
                | {"rel_fun_at": _drift(a["objective"], run["objective"])}
            )
    rel_fun = abs(b["fun"] - a["fun"]) / max(abs(a["fun"]), 1e-300)
    scale = max(float(np.max(np.abs(a["x"]))), 1e-300)
    row = {
        "problem": name,
        "where": "local" if client is None else "cluster",
        "n_params": int(model.n_params),
        "options": {k: v for k, v in options.items() if k != "l1_exclude"},
        **{
            dtype: {k: v for k, v in run.items() if k not in ("x", "objective")}
            for dtype, run in runs.items()
        },
        "rel_fun": rel_fun,
        # How the gap grows along the run: the same iteration of both.
        "rel_fun_at": _drift(a["objective"], b["objective"]),
        "max_rel_x": float(np.max(np.abs(b["x"] - a["x"]))) / scale,
        "same_nit": a["nit"] == b["nit"],
        "same_zeros": bool(np.array_equal(a["x"] == 0.0, b["x"] == 0.0)),
    }
    if perturbed:
        row["float64_perturbed"] = perturbed
        row["noise_rel_fun"] = max(abs(p["fun"] - a["fun"]) / max(abs(a["fun"]), 1e-300) for p in perturbed)
        row["noise_nit"] = max(abs(p["nit"] - a["nit"]) for p in perturbed)
    row["met"] = bool(rel_fun <= REL_FUN_TARGET and row["same_nit"])
    print(
        f"{row['where']:>7} {name:<34} nit {a['nit']:>4} / {b['nit']:<4} F {a['fun']:.12g} / {b['fun']:.12g} "
        f"rel {rel_fun:.1e} {'met' if row['met'] else 'MISSED'}"
        + (
            f" (float64 perturbed: rel {row['noise_rel_fun']:.1e}, nit +-{row['noise_nit']})"
            if perturbed
            else ""
        ),
        flush=True,
    )
    return row


def auto_table(sizes: Sequence[int], worker_memory: float, shards: int = 2) -> list[dict[str, Any]]:
    """What ``history_dtype="auto"`` picks at each size on ``shards`` shards under the default budget."""
    from distbelief.storage._vectorstore import SHARD_MEMORY_FRACTION

    budget = int(SHARD_MEMORY_FRACTION * worker_memory)
    rows = []
    for k in sizes:
        n = (1 << k) + 1
        per_shard = math.ceil(n / shards)
        slots = 2 * (HISTORY + 1)
        rows.append(
            {
                "log2": k,
                "shard_budget_bytes": budget,
                "history_bytes_per_shard": {
                    "float64": 8 * slots * per_shard,
                    "float32": 4 * slots * per_shard,
                },
                "all_vectors_float64_bytes": 8 * (slots + WORKING_VECTORS["lbfgs"]) * per_shard,
                "auto": auto_history_dtype("lbfgs", HISTORY, [per_shard] * shards, [budget] * shards),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None, *, client: Any = None) -> dict[str, Any]:
    """Run the comparison (``argv`` as on the command line); ``client``: also run on its cluster (the test
    suite's smoke run) as ``--cluster`` does on a cluster of its own."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small problems (a smoke run)")
    ap.add_argument("--cluster", action="store_true", help="also run on a two-worker LocalCluster")
    ap.add_argument("--sizes", default=None, help="log2 columns of the scale set, comma separated (16,18)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the scale set (50000)")
    ap.add_argument("--maxiter", type=int, default=None, help="iteration cap of the runs to convergence")
    ap.add_argument("--fixed-iters", type=int, default=12, help="iterations of the fixed-length rows")
    ap.add_argument("--worker-memory", type=float, default=7 * 2**30, help="bytes, for the auto table")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or ("10" if args.quick else "16,18")).split(",") if s]
    rows_per_set = args.rows or (2000 if args.quick else 50_000)
    maxiter = args.maxiter or (30 if args.quick else 1000)
    result: dict[str, Any] = {
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "history": HISTORY,
        "rel_fun_target": REL_FUN_TARGET,
        "note": "arithmetic only: no timing here; figures of the same code on any machine",
        "rows": [],
        "auto": auto_table([16, 20, 24, 27], args.worker_memory),
    }
    rows: list[dict[str, Any]] = result["rows"]
    problems = ["digits", "synthetic"] if args.quick else list(PEER_PROBLEMS)
    # One BLAS thread: a dot product's bits do not then depend on the machine's core count, and idle BLAS
    # threads spinning beside the cluster's workers only slow a 2-core box.
    with (
        tempfile.TemporaryDirectory(prefix="bench-history-dtype-") as tmp,
        ExitStack() as stack,
        threadpool_limits(1),
    ):
        clients: list[Any] = [None]
        if client is not None:
            clients.append(client)
        elif args.cluster:
            from distributed import Client, LocalCluster

            cluster = stack.enter_context(
                LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, host="127.0.0.1")
            )
            clients.append(stack.enter_context(Client(cluster)))
        for c in clients:
            if c is not None and args.quick:
                # A smoke run of the sharded path: the digits' L-BFGS row.
                X, y, l2 = make_problem("digits", True)
                data = Dataset.from_arrays(X, y, path=f"{tmp}/digits", overwrite=True)
                rows.append(
                    compare("peers/digits", models.Logistic(X.shape[1]), data, client=c, tmp=tmp, l2=l2)
                )
                continue
            for name in problems:
                X, y, l2 = make_problem(name, args.quick)
                model = models.Logistic(X.shape[1])
                data: Any = (X, y)
                if c is not None:
                    data = Dataset.from_arrays(X, y, path=f"{tmp}/{name}", overwrite=True)
                rows.append(compare(f"peers/{name}", model, data, client=c, tmp=tmp, l2=l2, maxiter=maxiter))
                if name == "digits":
                    rows.append(
                        compare(
                            "peers/digits owlqn", model, data, client=c, tmp=tmp, l2=l2, method="owlqn",
                            l1=DIGITS_L1, maxiter=maxiter,
                        )
                    )  # fmt: skip
                del X, y, data
            for k in sizes:
                X, y = hashed_csr(rows_per_set, k)
                model = models.Logistic(1 << k)
                data = (X, y)
                if c is not None:
                    data = Dataset.from_arrays(X, y, path=f"{tmp}/scale{k}", overwrite=True)
                label = f"scale/2^{k} x {rows_per_set}"
                for method, extra in (("lbfgs", {}), ("owlqn", {"l1": L1})):
                    common = {"client": c, "tmp": tmp, "l2": L2, "method": method, **extra}
                    rows.append(
                        compare(
                            f"{label} {method} {args.fixed_iters} iters", model, data,
                            maxiter=args.fixed_iters, gtol=0.0, ftol=0.0, **common,
                        )
                    )  # fmt: skip
                    # To L-BFGS-B's stopping rules: where the gradient test fires in a slow valley.
                    stop = f"{label} {method} to gtol"
                    rows.append(compare(stop, model, data, maxiter=maxiter, noise=True, **common))
                del X, y, data
    result["all_met"] = all(r["met"] for r in rows)
    result["missed"] = [f"{r['where']} {r['problem']}" for r in rows if not r["met"]]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("history_dtype_quick.json" if args.quick else "history_dtype.json")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"{sum(r['met'] for r in rows)} of {len(rows)} rows met the bar; wrote {path}")
    return result


if __name__ == "__main__":
    main()
