"""Sandblaster L-BFGS against its peers, side by side in one run (issue 3's benchmark).

Peers, each run for real in this process on this machine:

* ``scipy``: ``scipy.optimize.minimize(method="L-BFGS-B")`` in one process with the textbook numpy loss and
  gradient (``X @ w``, then ``X.T @ r``: the plain single-process reference), run with SciPy's bundled
  OpenBLAS pool as installed and limited to one thread with threadpoolctl (its idle threads spin against
  numpy's on 2 cores); the faster counts. A third row runs SciPy on our models' fused single-pass kernel
  (one read of ``X`` per evaluation), the strongest single process we know, with a ratio of its own.
* ``dask-glm``: ``dask_glm.algorithms.lbfgs`` on the same LocalCluster, data persisted in the workers' memory,
  the same objective (``normalize=False``, ``lamduh = N * l2``; its tolerance is on the summed objective).
* ``spark``: Spark MLlib's ``LogisticRegression`` (pyspark, ``local[2]``: two cores, as the cluster has), when
  pyspark is installed (the ``bench`` extra; Java 17). No intercept, no standardization,
  ``elasticNetParam = 0`` and ``regParam = l2``: Spark then minimizes
  ``(1/N) sum loss_i + regParam/2 ||w||^2``,
  our ``F`` of the same model without intercept (``models.Logistic(d, fit_intercept=False)``). Spark cannot
  solve our with-intercept ``F`` (an unpenalized intercept is a different objective, and a column of ones
  without intercept gets a zero coefficient: MLlib zeroes constant columns), so its row is compared with
  SciPy's L-BFGS-B on that same no-intercept ``F``, run beside it. Spark's L-BFGS keeps m = 10 corrections
  (fixed in MLlib). Reported: the fit on a cached DataFrame (``count()`` run before the clock starts), its
  iterations, and ``F`` at its coefficients evaluated by our numpy code. Without pyspark the JSON says why
  it was skipped.
* ``sandblaster``: ours, on the same LocalCluster. Reported warm (the median of repeated runs, the rows
  already in the workers' memory from an earlier run, as dask-glm's persisted arrays and scipy's ``X`` are)
  and cold (the first run on the freshly written dataset, every row read from zarr inside the timed run).

Problems: logistic regression on the digits (digit 0 against the rest), on a seeded synthetic 200,000 x 500
dense set, and on a correlated-features variant of it that needs more iterations. Every optimizer stops on
L-BFGS-B's rules (``gtol``, relative decrease ``ftol``), with history 10. Reported: wall time (median of
5 repeats, interleaved: a round runs every scipy variant, then ours, each after a pause of SETTLE_S; and
the median of the rounds' own ratios), the final objective (evaluated by the same numpy code for every
peer), iterations, ratios; for ours a breakdown per iteration (gradient portions, shard ops, coordinator
logic, round trips), round trips per iteration for m = 5, 10, 20, and batch times with a 10x straggler,
backups on and off. Per evaluation, ours is compared with the kernel floor (``kernel_floor``: the gradient
kernel on every worker at once, rows in memory, no messages), measured right after each of our runs; the
median of the rounds' ratios has a target (``FLOOR_RATIO_TARGET``) on the synthetic problems.

Run: ``python benchmarks/sandblaster_vs_peers.py [--quick] [--out PATH]`` (default
``benchmarks/results/sandblaster_vs_peers.json`` and a PNG beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import scipy
import scipy.optimize
from distributed import Client
from scipy.special import expit
from threadpoolctl import ThreadpoolController

from distbelief import models, sandblaster
from distbelief.storage import Dataset, embedded_client, load_digits, worker_addresses

RESULTS = Path(__file__).parent / "results"
#: Seconds of quiet before every timed run, whichever peer's: on 2 cores a run's leftovers take CPU from
#: the next one. Right after SciPy returns, OpenBLAS's threads spin for ~0.2 s (measured: 0.52 cores busy
#: through an idle sleep), and the run that followed it took 0.458 s against 0.433 s after a pause.
SETTLE_S = 0.5


def settle(quick: bool = False) -> None:
    """Let the previous run's threads go idle before the next timed run starts (a ``--quick`` smoke run
    times nothing that counts: no pause)."""
    if not quick:
        time.sleep(SETTLE_S)


#: Every peer's final objective must be within this relative gap of the best any peer reached.
OBJECTIVE_GAP_TARGET = 1e-5
#: Ours must take at most this multiple of the single-process reference's time on the synthetic problems
#: (the large ones, where distributing pays; digits is too small for that and has no time target).
TIME_RATIO_TARGET = 1.0
#: Issue 17, item 4: on the synthetic problems an evaluation of ours may cost at most this multiple of the
#: kernel floor (the gradient kernel on every worker at once, no messages: ``kernel_floor``), per round.
FLOOR_RATIO_TARGET = 1.25
#: Seconds ahead of the ``client.run`` call that the floor's workers start their passes together: enough
#: for the call to reach every worker (``kernel_floor`` doubles it when one arrived late).
FLOOR_START_MARGIN_S = 0.1
#: Spark's L-BFGS relative-change tolerance (its default 1e-6 stops short of L-BFGS-B's optimum).
SPARK_TOL = 1e-9


def make_problem(name: str, quick: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """``(X, y, l2)`` of a benchmark problem (seeded)."""
    if name == "digits":
        X, y = load_digits()
        return X, (y == 0).astype(float), 1e-3
    rows = 4_000 if quick else 200_000
    d = 100 if quick else 500
    rng = np.random.default_rng(12345)
    X = rng.standard_normal((rows, d))
    if name == "synthetic-correlated":
        # AR(1) correlation between neighbouring features: an ill-conditioned Hessian, more iterations.
        rho = 0.9
        for j in range(1, d):
            X[:, j] = rho * X[:, j - 1] + np.sqrt(1 - rho * rho) * X[:, j]
    w_true = rng.standard_normal(d) / np.sqrt(d) * 3
    p = 1 / (1 + np.exp(-(X @ w_true)))
    y = (rng.random(rows) < p).astype(float)
    return np.ascontiguousarray(X), y, 1e-4


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def numpy_logistic(w: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> tuple[float, np.ndarray]:
    """The textbook numpy objective and gradient (two passes over ``X``), as a scipy user writes them."""
    n = X.shape[0]
    z = X @ w[:-1] + w[-1]
    r = expit(z) - y
    grad = np.empty_like(w)
    grad[:-1] = X.T @ r
    grad[-1] = r.sum()
    loss = float(np.logaddexp(0.0, z).sum() - y @ z)
    return loss / n + 0.5 * l2 * float(w @ w), grad / n + l2 * w


def run_scipy(
    model: Any, X: np.ndarray, y: np.ndarray, l2: float, m: int, limit: bool, kernel: str
) -> dict[str, Any]:
    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        if kernel == "numpy":
            return numpy_logistic(w, X, y, l2)
        return models.objective(model, w, X, y, l2=l2)

    x0 = np.zeros(model.n_params)
    # SciPy's own OpenBLAS (scipy.libs) to one thread; numpy's pool (numpy.libs) stays as installed.
    scipy_pools = [p for p in ThreadpoolController().lib_controllers if "scipy.libs" in p.filepath]
    before = [p.num_threads for p in scipy_pools]
    try:
        if limit:
            for pool in scipy_pools:
                pool.set_num_threads(1)
        wall, res = timed(
            lambda: scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", options={"maxcor": m})
        )
    finally:
        for pool, n in zip(scipy_pools, before, strict=True):
            pool.set_num_threads(n)
    return {"wall_s": wall, "fun": float(res.fun), "nit": int(res.nit), "nfev": int(res.nfev), "x": res.x}


def run_dask_glm(
    client: Client, X: np.ndarray, y: np.ndarray, l2: float, gtol: float, max_iter: int = 1000
) -> dict[str, Any]:
    import dask.array as da
    from dask_glm.algorithms import lbfgs
    from dask_glm.families import Logistic
    from dask_glm.regularizers import L2

    n = X.shape[0]
    chunk = max(1, n // (2 * len(worker_addresses(client))))
    Xi = da.from_array(np.hstack([X, np.ones((n, 1))]), chunks=(chunk, X.shape[1] + 1))
    yd = da.from_array(y, chunks=chunk)
    Xi, yd = client.persist([Xi, yd])
    from distributed import wait

    wait([Xi, yd])
    # dask-glm minimizes N * F (a sum, and lamduh/2 ||b||^2): the same minimizer with lamduh = N * l2, and
    # its gradient tolerance is N times ours.
    wall, beta = timed(
        lambda: lbfgs(
            Xi,
            yd,
            regularizer=L2(),
            lamduh=n * l2,
            family=Logistic,
            max_iter=max_iter,
            tol=n * gtol,
            normalize=False,
        )
    )
    beta = np.asarray(beta)
    # Our parameter layout puts the intercept last, as the column of ones above does.
    return {"wall_s": wall, "x": beta}


def spark_session() -> tuple[Any, str | None]:
    """A ``local[2]`` SparkSession, or ``(None, reason)`` when pyspark (or Java) is missing."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        return None, f"pyspark is not installed ({exc}); pip install 'distbelief[bench]' (needs Java 17)"
    try:
        session = (
            SparkSession.builder.master("local[2]")
            .appName("distbelief-bench")
            .config("spark.driver.memory", "4g")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
    except Exception as exc:  # a missing or broken Java shows up here
        return None, f"Spark could not start ({type(exc).__name__}: {exc}); install openjdk-17-jre-headless"
    session.sparkContext.setLogLevel("ERROR")
    return session, None


def run_spark(
    spark: Any, X: np.ndarray, y: np.ndarray, l2: float, repeats: int, max_iter: int = 1000
) -> dict[str, Any]:
    """Spark MLlib ``LogisticRegression`` without intercept (see the module docstring): fit time on a
    cached DataFrame (median of ``repeats``), iterations, and the coefficients; beside it SciPy's L-BFGS-B
    on the same objective (``F`` of the model without intercept), and both objectives."""
    import pandas as pd
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.feature import VectorAssembler

    d = X.shape[1]
    columns = [f"f{j}" for j in range(d)]
    frame = pd.DataFrame(X, columns=columns)
    frame["label"] = y
    raw = spark.createDataFrame(frame)
    df = VectorAssembler(inputCols=columns, outputCol="features").transform(raw).select("features", "label")
    df = df.repartition(2).cache()
    df.count()
    estimator = LogisticRegression(
        maxIter=max_iter,
        regParam=l2,
        elasticNetParam=0.0,
        fitIntercept=False,
        standardization=False,
        tol=SPARK_TOL,
        family="binomial",
    )
    walls, fitted = [], None
    for _ in range(repeats):
        settle()
        wall, fitted = timed(lambda: estimator.fit(df))
        walls.append(wall)
    assert fitted is not None
    df.unpersist()
    model = models.Logistic(d, fit_intercept=False)

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        return models.objective(model, w, X, y, l2=l2)

    x = np.asarray(fitted.coefficients.toArray(), dtype=np.float64)
    ref = scipy.optimize.minimize(fun, np.zeros(d), jac=True, method="L-BFGS-B", options={"maxcor": 10})
    f_spark, f_ref = fun(x)[0], float(ref.fun)
    return {
        "wall_s_median": float(statistics.median(walls)),
        "nit": int(fitted.summary.totalIterations),
        "objective": "F without intercept (Spark cannot fit our regularized intercept)",
        "fun": f_spark,
        "scipy_fun_same_objective": f_ref,
        "scipy_nit_same_objective": int(ref.nit),
        "relative_objective_gap_to_best": max(0.0, (f_spark - f_ref) / max(abs(f_ref), 1e-300)),
        "repeats": repeats,
        "settings": {
            "master": "local[2]",
            "regParam": l2,
            "elasticNetParam": 0.0,
            "fitIntercept": False,
            "standardization": False,
            "tol": SPARK_TOL,
            "maxIter": max_iter,
            "m": 10,
        },
    }


def mark_targets(out: dict[str, Any], name: str) -> None:
    """Give every peer row of a problem its ``target`` and whether it was ``met`` (in place)."""
    peers = {"scipy": out["scipy"][out["scipy"]["reported"]], "sandblaster": out["sandblaster"]}
    peers["dask_glm"] = out["dask_glm"]
    spark = out.get("spark", {})
    if "fun" in spark:
        # Its own objective (no intercept): measured against SciPy on that objective (run_spark).
        spark["target"] = {"relative_objective_gap_to_best": OBJECTIVE_GAP_TARGET}
        spark["met"] = bool(spark["relative_objective_gap_to_best"] <= OBJECTIVE_GAP_TARGET)
    best = min(p["fun"] for p in peers.values())
    for label, p in peers.items():
        gap = (p["fun"] - best) / max(abs(best), 1e-300)
        p["relative_objective_gap_to_best"] = gap
        p["target"] = {"relative_objective_gap_to_best": OBJECTIVE_GAP_TARGET}
        p["met"] = bool(gap <= OBJECTIVE_GAP_TARGET)
        if label == "sandblaster" and name != "digits":
            ratio = out["ratios"]["sandblaster_over_scipy"]
            p["target"]["sandblaster_over_scipy"] = TIME_RATIO_TARGET
            p["target"]["per_evaluation_over_floor"] = FLOOR_RATIO_TARGET
            p["per_evaluation_over_floor"] = out["per_evaluation_over_floor"]
            p["met"] = (
                p["met"]
                and bool(ratio <= TIME_RATIO_TARGET)
                and bool(out["per_evaluation_over_floor"] <= FLOOR_RATIO_TARGET)
            )


def format_table(results: dict[str, Any]) -> str:
    """One line per problem and peer: wall time, objective, gap, iterations, and MISSED where a target was."""
    head = f"{'problem':<21} {'peer':<12} {'wall s':>9} {'F(w)':>14} {'gap to best':>11} {'nit':>5}  target"
    lines = [head, "-" * len(head)]
    for name, out in results["problems"].items():
        scipy_row = out["scipy"][out["scipy"]["reported"]]
        rows = [("scipy", scipy_row), ("sandblaster", out["sandblaster"]), ("dask-glm", out["dask_glm"])]
        # Spark's F is the model's without intercept (run_spark): its gap is to SciPy on that F.
        rows.append(("spark, no b", out["spark"]))
        for peer, r in rows:
            if "fun" not in r:
                lines.append(f"{name:<21} {peer:<12} skipped: {r.get('skipped', '')}")
                continue
            nit = str(r.get("nit", "-"))
            verdict = "met" if r["met"] else f"MISSED {r['target']}"
            if "per_evaluation_over_floor" in r:
                verdict += f" (an evaluation {r['per_evaluation_over_floor']:.2f}x the kernel floor)"
            lines.append(
                f"{name:<21} {peer:<12} {r['wall_s_median']:9.3f} {r['fun']:14.8f} "
                f"{r['relative_objective_gap_to_best']:11.2e} {nit:>5}  {verdict}"
            )
    return "\n".join(lines)


def run_ours(
    client: Client, model: Any, ds: Dataset, l2: float, m: int, store: str, **kwargs: Any
) -> dict[str, Any]:
    wall, res = timed(
        lambda: sandblaster.minimize(
            model, ds, x0=np.zeros(model.n_params), l2=l2, history=m, client=client, store=store, **kwargs
        )
    )
    h = res.history
    its = max(1, res.nit)
    return {
        "wall_s": wall,
        "optimize_s": float(h.wall_time.values[-1]),
        "fun": float(res.fun),
        "nit": int(res.nit),
        "nfev": int(res.nfev),
        "x": res.x,
        "per_iteration": {
            "gradient_portions_ms": 1e3 * float(h.time_gradient.values[1:].sum()) / its,
            "shard_ops_ms": 1e3 * float(h.time_shard_ops.values[1:].sum()) / its,
            "coordinator_ms": 1e3 * float(h.time_coordinator.values[1:].sum()) / its,
            "round_trips_median": float(np.median(h.round_trips.values[1:])) if res.nit else 0.0,
            "replica_fetches_per_evaluation": float(h.fetches.values[1:].sum()) / max(1, res.nfev - 1),
        },
        "stats": {k: v for k, v in res.stats.items() if k != "wall_s"},
        "backups_won": int(h.backups_won.sum()),
        "portions_read": int(h.portions_read.sum()),
        "batch_ms": 1e3 * float(h.time_gradient.values[1:].sum()) / max(1, res.nfev - 1),
    }


def _floor_rows(ds: Dataset, workers: list[str], portions: int, address: str) -> list[tuple[int, int]]:
    """The row ranges a worker's floor computes: its share of the rows, cut in the run's ``portions``."""
    k, share = workers.index(address), ds.n_rows // len(workers) + 1
    lo, hi = k * share, min(ds.n_rows, (k + 1) * share)
    step = -(-ds.n_rows // portions)
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


def _read_kernel_rows(ds: Dataset, workers: list[str], portions: int, dask_worker: Any) -> int:
    """On a worker, phase 1 of the floor: read its rows into the worker's row cache (their number)."""
    from distbelief.storage import default_row_cache

    cache = default_row_cache()
    return sum(
        cache.rows(ds, a, b)[1].shape[0] for a, b in _floor_rows(ds, workers, portions, dask_worker.address)
    )


def _kernel_pass_ms(
    ds: Dataset,
    model: Any,
    workers: list[str],
    portions: int,
    start_at: float,
    only: int | None,
    dask_worker: Any,
    repeats: int = 7,
) -> dict[str, float] | None:
    """On a worker, phase 2 of the floor: wait for the wall-clock instant ``start_at``, then time
    ``repeats`` gradient passes over its rows (already in memory: phase 1) and nothing else: no message,
    fetch, push or coordinator. ``only``: time on that worker's index alone (the others return ``None``).

    Returns the median pass in ms, how late the worker arrived at ``start_at`` (ms; > 0: it came after
    that instant, so the start was not common; < 0: it waited) and the wall-clock instants its passes
    began and ended (to check they overlapped).
    """
    from distbelief.storage import default_row_cache

    k = workers.index(dask_worker.address)
    if only is not None and only != k:
        return None
    cache = default_row_cache()
    # Looked up before the wait: hits, since phase 1 read them (a miss is read here, still untimed).
    arrays = [cache.rows(ds, a, b) for a, b in _floor_rows(ds, workers, portions, dask_worker.address)]
    w = np.zeros(model.n_params)
    arrived = time.time()
    while (left := start_at - time.time()) > 0:
        time.sleep(min(left, 0.0005))
    begin = time.time()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for X, y in arrays:
            model.loss_and_grad(w, X, y)
        times.append(time.perf_counter() - start)
    return {
        "ms": 1e3 * float(np.median(times)),
        "late_ms": 1e3 * (arrived - start_at),
        "begin": begin,
        "end": time.time(),
    }


def kernel_floor(client: Client, ds: Dataset, model: Any, portions: int) -> dict[str, float]:
    """The floor under one evaluation of ours: the gradient kernel on every worker at once, over the rows a
    worker holds in the run's ``portions``, from memory, with no message, fetch, push or coordinator.

    Two phases, because the one-call measurement this replaces (each worker read its rows and timed its
    passes in one ``client.run``) was in effect one worker computing alone: the floor's row ranges are not
    the run's portions, so most were read from zarr on the first pass, the two workers' reads took
    different times, and their timed passes hardly overlapped. Measured on 200k x 500 (2 workers, quiet
    2-core box): that floor read 16.6-17.0 ms; each worker alone 16.1-18.8 ms; the same kernel with rows
    read first and both workers starting at one instant 22.9-23.7 ms on both. So phase 1 (one
    ``client.run``) reads every worker's rows into memory and returns when all are read; phase 2 (another)
    gives every worker a common start instant, ``FLOOR_START_MARGIN_S`` ahead (doubled and tried again
    when a worker reached it late), and each times its passes from it. The evaluation waits for the
    slowest worker: the floor is the largest worker median. Also measured, for context: each worker timed
    alone, one after the other (``one_worker_alone_ms``: the largest). The machine's speed drifts (a synced
    floor read ~17 or ~24 ms in different minutes), so the benchmark measures it right after each of our
    runs and compares the two per round. (The common instant is ``time.time()`` on each worker: one clock
    on one machine; on several machines their clocks' skew adds to ``late_ms``.)

    Returns ``at_once_ms``, ``one_worker_alone_ms``, ``late_ms`` (the last worker's arrival after the
    start instant; < 0 when all waited for it) and ``overlap`` (the time all workers' passes ran together over
    the longest worker's: 1.0 is fully at once).
    """
    workers = worker_addresses(client)
    client.run(_read_kernel_rows, ds, workers, portions)
    margin = FLOOR_START_MARGIN_S
    for _ in range(4):
        runs = [
            r
            for r in client.run(
                _kernel_pass_ms, ds, model, workers, portions, time.time() + margin, None
            ).values()
            if r
        ]
        if max(r["late_ms"] for r in runs) <= 0:
            break
        margin *= 2
    together = min(r["end"] for r in runs) - max(r["begin"] for r in runs)
    alone = []
    for k in range(len(workers)):
        (r,) = [r for r in client.run(_kernel_pass_ms, ds, model, workers, portions, 0.0, k).values() if r]
        alone.append(r["ms"])
    return {
        "at_once_ms": max(r["ms"] for r in runs),
        "one_worker_alone_ms": max(alone),
        "late_ms": max(r["late_ms"] for r in runs),
        "overlap": max(0.0, together) / max(1e-9, max(r["end"] - r["begin"] for r in runs)),
    }


def warm_up_workers(client: Client, tmp: str, quick: bool = False) -> None:
    """Short runs on unrelated data, so no timed run pays the workers' first imports: one small, and one
    big enough (> 8 MiB of rows per replica) to load the models' compiled kernel (numba) on every worker,
    as scipy's process has it loaded after its own warm-up call below. (``--quick``: the small one only;
    its problems are too small for the compiled kernel.)"""
    rng = np.random.default_rng(0)
    for rows, d in ((2000, 10),) if quick else ((2000, 10), (12_000, 200)):
        X = rng.standard_normal((rows, d))
        ds = Dataset.from_arrays(X, (X[:, 0] > 0).astype(float), path=f"{tmp}/warm-up-{d}", overwrite=True)
        run_ours(client, models.Logistic(d), ds, 1e-3, 10, f"{tmp}/warm-up-run-{d}", maxiter=3, portions=2)
    models.objective(models.Logistic(d), np.zeros(d + 1), X, (X[:, 0] > 0).astype(float))


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def bench_problem(
    name: str,
    client: Client,
    tmp: str,
    quick: bool,
    repeats: int,
    m: int = 10,
    gtol: float = 1e-5,
    spark: Any = None,
    spark_skipped: str | None = None,
) -> dict[str, Any]:
    X, y, l2 = make_problem(name, quick)
    model = models.Logistic(X.shape[1])

    def objective(w: np.ndarray) -> float:
        return float(models.objective(model, w, X, y, l2=l2)[0])

    t_write, ds = timed(lambda: Dataset.from_arrays(X, y, path=f"{tmp}/{name}", overwrite=True))
    out: dict[str, Any] = {"rows": X.shape[0], "features": X.shape[1], "l2": l2, "dataset_write_s": t_write}
    # The textbook numpy gradient (the issue's reference), with SciPy's BLAS pool as installed and limited
    # to one thread; and SciPy calling our models' fused single-pass kernel (a stronger single process).
    variants = {
        "as_installed": (False, "numpy"),
        "scipy_blas_1_thread": (True, "numpy"),
        "fused_model_kernel": (True, "models"),
    }
    # Cold: the first run on the freshly written dataset, its replicas reading every row from zarr.
    settle(quick)
    cold = run_ours(client, model, ds, l2, m, f"{tmp}/cold")
    out["sandblaster_cold"] = {
        "wall_s": cold["wall_s"],
        "optimize_s": cold["optimize_s"],
        "portions_read": cold["portions_read"],
    }
    # Warm: the rows are in the workers' memory from the cold run, as dask-glm's persisted arrays are and
    # as scipy's X is in its process: the three peers start from data in memory. The repetitions are
    # interleaved (every scipy variant, then ours, round after round): this shared VM's speed drifts by
    # a third within minutes (the one-thread kernel took 35 ms, then 46 ms), and blocks of runs would
    # give that drift to one peer.
    scipy_runs: dict[str, list[dict[str, Any]]] = {label: [] for label in variants}
    ours: list[dict[str, Any]] = []
    # The floor is measured right before and right after each of our runs (kernel_floor), and each round's
    # evaluation is compared with the mean of the two: this box's speed flips between a ~17 ms and a ~24 ms
    # floor within seconds (measured on 200,000 x 500, five rounds of one run: 16.7, 26.9, 28.2, 18.1 and
    # 24.5 ms after the runs), so one floor on one side of a run can belong to another phase than the run.
    portions = cold["stats"]["portions"]
    floors_before: list[dict[str, float]] = []
    floors: list[dict[str, float]] = []
    for k in range(repeats):
        for label, (limit, kernel) in variants.items():
            settle(quick)
            scipy_runs[label].append(run_scipy(model, X, y, l2, m, limit, kernel))
        settle(quick)
        floors_before.append(kernel_floor(client, ds, model, portions))
        settle(quick)
        ours.append(run_ours(client, model, ds, l2, m, f"{tmp}/run{k}"))
        settle(quick)
        floors.append(kernel_floor(client, ds, model, portions))
    # The reported reference is the fastest numpy-gradient variant; the fused-kernel row gets its own ratio.
    best = min(("as_installed", "scipy_blas_1_thread"), key=lambda k: median_of(scipy_runs[k], "wall_s"))
    ref = scipy_runs[best][0]
    out["scipy"] = {
        label: {"wall_s_median": median_of(r, "wall_s"), "fun": r[0]["fun"], "nit": r[0]["nit"]}
        for label, r in scipy_runs.items()
    }
    out["scipy"]["reported"] = best
    out["sandblaster"] = {
        "wall_s_median": median_of(ours, "wall_s"),
        "optimize_s_median": median_of(ours, "optimize_s"),
        "fun": ours[0]["fun"],
        "nit": ours[0]["nit"],
        "nfev": ours[0]["nfev"],
        "relative_objective_gap_to_scipy": abs(ours[0]["fun"] - ref["fun"]) / abs(ref["fun"]),
        "per_iteration": ours[0]["per_iteration"],
        "stats": ours[0]["stats"],
    }
    per_eval = [1e3 * o["optimize_s"] / max(1, o["nfev"]) for o in ours]
    bracket = list(zip(floors_before, floors, strict=True))
    floor_ms = [0.5 * (b["at_once_ms"] + f["at_once_ms"]) for b, f in bracket]
    out["per_evaluation_ms"] = {
        "scipy": 1e3 * out["scipy"][best]["wall_s_median"] / ref["nfev"],
        "sandblaster": float(statistics.median(per_eval)),
        "gradient_kernel_only_all_workers_at_once": float(statistics.median(floor_ms)),
        # For context only (the target uses the floor at once): each worker timed alone, the slowest.
        "gradient_kernel_only_one_worker_alone": float(
            statistics.median(f["one_worker_alone_ms"] for f in [*floors_before, *floors])
        ),
    }
    out["per_evaluation_over_floor"] = float(
        statistics.median(e / f for e, f in zip(per_eval, floor_ms, strict=True))
    )
    out["per_evaluation_rounds"] = {
        "sandblaster_ms": per_eval,
        "floor_all_workers_at_once_ms": floor_ms,
        "floor_before_ms": [b["at_once_ms"] for b in floors_before],
        "floor_after_ms": [f["at_once_ms"] for f in floors],
        "floor_one_worker_alone_ms": [f["one_worker_alone_ms"] for f in floors],
        "over_floor": [e / f for e, f in zip(per_eval, floor_ms, strict=True)],
        # How late the last worker reached the common start (<= 0: all waited for it), and the part of the
        # longest worker's passes during which every worker was computing (1.0: fully at once).
        "floor_start_late_ms": [max(b["late_ms"], f["late_ms"]) for b, f in bracket],
        "floor_overlap": [min(b["overlap"], f["overlap"]) for b, f in bracket],
    }
    glm_repeats = 1 if name != "digits" else min(repeats, 3)
    glm = []
    for _ in range(glm_repeats):
        settle(quick)
        # Quick: a smoke run, capped at 10 iterations (each dask-glm iteration is a graph of its own: 30 took
        # ~10 s of the suite's 2-core box over the three problems; the correlated problem needs ~80 anyway).
        glm.append(run_dask_glm(client, X, y, l2, gtol, max_iter=10 if quick else 1000))
    out["dask_glm"] = {
        "wall_s_median": median_of(glm, "wall_s"),
        "fun": objective(glm[0]["x"]),
        "repeats": glm_repeats,
    }
    if spark is not None and quick and name != "synthetic":
        # Quick: Spark on one problem (~0.1-0.7 s a Spark iteration here): it is a smoke run.
        out["spark"] = {"skipped": "--quick runs Spark on the synthetic problem only"}
    elif spark is not None:
        # Quick: a smoke run (~0.1-0.7 s a Spark iteration here; digits' raw pixels take hundreds).
        out["spark"] = run_spark(spark, X, y, l2, glm_repeats, max_iter=30 if quick else 1000)
    else:
        out["spark"] = {"skipped": spark_skipped}
    scipy_s = out["scipy"][best]["wall_s_median"]
    ours_s = out["sandblaster"]["wall_s_median"]
    out["ratios"] = {
        "sandblaster_over_scipy": ours_s / scipy_s,
        # The median of each round's own ratio: both runs of a round saw the machine at the same speed.
        "sandblaster_over_scipy_paired_median": float(
            np.median([o["wall_s"] / s["wall_s"] for o, s in zip(ours, scipy_runs[best], strict=True)])
        ),
        "sandblaster_optimize_over_scipy": out["sandblaster"]["optimize_s_median"] / scipy_s,
        "dask_glm_over_sandblaster": out["dask_glm"]["wall_s_median"] / ours_s,
        "sandblaster_cold_over_scipy": cold["wall_s"] / scipy_s,
        "sandblaster_over_scipy_fused_kernel": ours_s / out["scipy"]["fused_model_kernel"]["wall_s_median"],
        "dask_glm_over_sandblaster_cold": out["dask_glm"]["wall_s_median"] / cold["wall_s"],
    }
    if "wall_s_median" in out["spark"]:
        out["ratios"]["spark_over_sandblaster"] = out["spark"]["wall_s_median"] / ours_s
        out["ratios"]["spark_over_scipy"] = out["spark"]["wall_s_median"] / scipy_s
    mark_targets(out, name)
    return out


def round_trips_by_history(client: Client, tmp: str, quick: bool = False) -> dict[str, Any]:
    X, y = load_digits()
    model = models.Softmax(64, 10)
    ds = Dataset.from_arrays(X, y.astype(float), path=f"{tmp}/softmax", overwrite=True)
    out = {}
    for m in (5, 10, 20):
        res = run_ours(client, model, ds, 1e-3, m, f"{tmp}/rt{m}", maxiter=6 if quick else 40)
        out[str(m)] = {
            "round_trips_per_iteration_median": res["per_iteration"]["round_trips_median"],
            "max_scalars_received_per_call": res["stats"]["max_values_received"],
            "n_params": model.n_params,
        }
    return out


def straggler(client: Client, tmp: str, quick: bool) -> dict[str, Any]:
    X, y, l2 = make_problem("synthetic", quick)
    X, y = X[:60_000], y[:60_000]
    maxiter = 2 if quick else 8
    model = models.Logistic(X.shape[1])
    ds = Dataset.from_arrays(X, y, path=f"{tmp}/straggler", overwrite=True)
    out = {}
    cases = {
        "no_straggler": {},
        "straggler_10x_backups_on": {"slowdown": {0: 10.0}, "backups": True},
        "straggler_10x_backups_off": {"slowdown": {0: 10.0}, "backups": False},
    }
    for label, kwargs in cases.items():
        res = run_ours(client, model, ds, l2, 10, f"{tmp}/s-{label}", maxiter=maxiter, portions=16, **kwargs)
        out[label] = {
            "batch_ms": res["batch_ms"],
            "portions_per_replica": res["stats"]["portions_per_replica"],
            "backups_won": res["backups_won"],
        }
    base = out["no_straggler"]["batch_ms"]
    for v in out.values():
        v["slowdown_vs_no_straggler"] = v["batch_ms"] / base
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(results["problems"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    peers = [
        ("scipy (1 process)", "scipy"),
        ("dask-glm", "dask_glm"),
        ("sandblaster (warm)", "sandblaster"),
        ("sandblaster (cold: reads zarr)", "sandblaster_cold"),
    ]
    for k, (peer, key) in enumerate(peers):
        vals = []
        for p in problems:
            entry = results["problems"][p][key]
            if key == "scipy":
                vals.append(entry[entry["reported"]]["wall_s_median"])
            else:
                vals.append(entry["wall_s"] if key == "sandblaster_cold" else entry["wall_s_median"])
        ax.bar(np.arange(len(problems)) + (k - 1.5) * width, vals, width, label=peer)
    ax.set_xticks(np.arange(len(problems)), problems)
    ax.set_yscale("log")
    ax.set_ylabel("wall time to convergence [s] (log)")
    ax.set_title("L-BFGS, logistic regression, 2-core machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None, *, client: Client | None = None) -> dict[str, Any]:
    """Run the benchmark (``argv`` as on the command line); ``client``: run on its cluster instead of
    starting one (the test suite's smoke run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small problems and one repeat (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sandblaster_vs_peers.json")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-spark", action="store_true", help="leave Spark MLlib out (it is slow to start)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    problems = ["digits", "synthetic", "synthetic-correlated"]
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
        },
        "quick": args.quick,
        "repeats": repeats,
        "problems": {},
    }
    spark, skipped = (None, "--no-spark was given") if args.no_spark else spark_session()
    results["spark"] = {"skipped": skipped} if spark is None else {"version": spark.version}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-sandblaster-") as tmp,
            embedded_client(client) as client,
        ):
            warm_up_workers(client, tmp, args.quick)
            for name in problems:
                print(f"== {name}", flush=True)
                results["problems"][name] = bench_problem(
                    name, client, tmp, args.quick, repeats, spark=spark, spark_skipped=skipped
                )
                r = results["problems"][name]
                print(json.dumps({k: r[k] for k in ("ratios",)}, indent=1), flush=True)
            results["round_trips_by_history"] = round_trips_by_history(client, tmp, args.quick)
            results["straggler"] = straggler(client, tmp, args.quick)
    finally:
        if spark is not None:
            spark.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=float))
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps(results, indent=1, default=float))
    print(format_table(results))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
