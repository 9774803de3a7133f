"""Wide sparse logistic regression at growing parameter counts: Sandblaster L-BFGS against SciPy's L-BFGS-B.

Usage::

    python benchmarks/scale.py [--quick] [--sizes 16,20,24,27] [--rows 2000000] [--maxiter 5]
                               [--modes sparse,dense] [--dense-max-log2 24] [--worker-memory 6GiB]
                               [--scipy-memory-gb 6] [--scipy-timeout 900] [--shard-memory auto]
                               [--repeats 3] [--history-dtype auto|float64|float32]

Issue 29's measurement (alone on the box: ``../shared/tools/quiet-run`` or an equally quiet machine)::

    python benchmarks/scale.py --sizes 16,20,24 --rows 500000 --maxiter 10 --modes sparse --spill-ops 0

and its item 3 (2^27 parameters, 2e6 rows, >= 12 iterations; the history stored as float32)::

    python benchmarks/scale.py --sizes 27 --rows 2000000 --maxiter 12 --shard-memory 1073741824 \
        --worker-memory 7GiB --push-every 16 --history-dtype float32

A click-through-shaped synthetic set (raw feature ids with power-law frequencies, ~40 nonzeros per row,
binary values, labels from a planted model) is generated in chunks straight into a ``scipy.sparse`` CSR
matrix, hashed to ``2**k`` buckets for every ``k`` of ``--sizes`` and written as a sparse dataset. Per size:

* **distbelief**: ``sandblaster.minimize`` (L-BFGS, ``history=10``) on a fresh two-worker ``LocalCluster``
  (so every worker's lifetime peak RSS belongs to this size), shards within their memory budget (history
  spilled to local files beyond it, ``storage._vectorstore``), the history stored as ``--history-dtype``
  says (``auto``: float32 only where a float64 history would not fit the budget; each row records which);
* **scipy**: ``scipy.optimize.minimize(method="L-BFGS-B", maxcor=10)`` on the same CSR matrix in one child
  process under an address-space rlimit and a timeout, so it cannot take the machine down; where it runs
  out of memory or time is recorded.

The project runs once per communication mode of ``--modes``: ``sparse`` (replicas pull and push only the
keys their rows touch, each shard's message in the smaller of the key-value and the whole-slice encoding)
and ``dense`` (whole slices). Dense runs above ``--dense-max-log2`` are not run: every dense push of a group
carries a binned gradient sum of 32 bytes a parameter (4.3 GB at 2^27) and the shard's exact deposit makes
several slice-sized temporaries; their bytes per evaluation are then computed from the sparse run's
fetch and push counts (``dense_bytes_per_eval_model``).

Every size runs ``--repeats`` rounds, ours and SciPy alternating; a row is the round with the median
seconds per iteration, with every round's figure beside it. SciPy's child process also measures the
*physical floor* (:func:`physical_floor`): the gradient kernel alone over all rows and the vector ops of
one L-BFGS iteration, in one process. The comparison (``comparison`` in the JSON, and the second table)
gives per size ours / SciPy and ours / floor against issue 29's targets (``met`` / ``MISSED`` at 2^20 and
2^24), whether the objective and iteration count match SciPy's, and where our time went per iteration
(replica compute, waits for fetches and pushes, shard ops, spill I/O; summed over processes, first
iteration included).

Recorded per size and mode: seconds per iteration, bytes moved per evaluation as the replicas counted them
(keys included), bytes the shards streamed from/to their spill files and the seconds that took, the
shards' busy seconds per op kind, peak RSS of every process (a psutil sampler thread in every worker and in
the coordinator, and each process's ``ru_maxrss``), and the final objective. ``--spill-ops`` also times
shard ops on in-RAM against spilled vectors. Writes ``scale.json`` and ``scale.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import scipy.sparse as sp

HERE = Path(__file__).resolve().parent
# This checkout's distbelief (not an installed one), here and in the workers it spawns.
sys.path.insert(0, str(HERE.parent))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
OUT = HERE / "results"
NNZ_PER_ROW = 40
HISTORY = 10
L2 = 1e-6
#: The L1 weight of the OWL-QN rows (``--owlqn``): an elastic net beside the same L2.
L1 = 1e-5
#: Issue 29: OWL-QN at most this multiple of our L-BFGS's seconds per iteration, at the same size.
OWLQN_RATIO_TARGET = 1.3
COMMUNICATION_MODES: tuple[str, ...] = ("sparse", "dense")
DENSE_SKIPPED = (
    "every dense push of a group carries a binned gradient sum of 32 bytes a parameter and the shard's exact "
    "deposit makes several slice-sized temporaries: beyond the box's memory at this size; bytes modelled"
)


# -- data ----------------------------------------------------------------------------------------------------
def ctr_chunks(
    rows: int, seed: int = 0, chunk_rows: int = 250_000
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Raw (unhashed) feature ids, ``NNZ_PER_ROW`` a row, and labels, ``chunk_rows`` rows at a time.

    Feature frequencies follow a Zipf law (``a=1.2``: a few ids in most rows, a long tail seen once), as
    click-through features do; labels come from a planted model that is a hash of the raw id.
    """
    rng = np.random.default_rng(seed)
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        raw = rng.zipf(1.2, size=(n, NNZ_PER_ROW)).astype(np.uint64)
        raw += np.arange(NNZ_PER_ROW, dtype=np.uint64) << np.uint64(40)  # one field per column
        planted = ((raw * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(44)).astype(np.float64) / 2**19 - 1.0
        margin = planted.sum(axis=1) / math.sqrt(NNZ_PER_ROW)
        y = (rng.random(n) < 1.0 / (1.0 + np.exp(-margin))).astype(np.float64)
        yield raw, y


def hashed_csr(rows: int, log2_buckets: int, seed: int = 0) -> tuple[sp.csr_array, np.ndarray]:
    """The CTR set hashed to ``2**log2_buckets`` columns, built chunk by chunk (collisions in a row add)."""
    mask = np.uint64((1 << log2_buckets) - 1)
    parts, ys = [], []
    for raw, y in ctr_chunks(rows, seed):
        # Multiplicative hashing of a mixed id: the top bits of the product (the low ones would keep the
        # field offset out of the bucket).
        mixed = (raw ^ (raw >> np.uint64(29))) * np.uint64(0xC2B2AE3D27D4EB4F)
        cols = (mixed >> np.uint64(64 - log2_buckets)) & mask
        n = raw.shape[0]
        X = sp.csr_array(
            (
                np.ones(cols.size),
                np.sort(cols, axis=1).ravel().astype(np.int64),
                np.arange(0, cols.size + 1, NNZ_PER_ROW),
            ),
            shape=(n, 1 << log2_buckets),
        )
        X.sum_duplicates()
        parts.append(X)
        ys.append(y)
    return sp.vstack(parts, format="csr"), np.concatenate(ys)


# -- memory sampling -----------------------------------------------------------------------------------------
class PeakSampler:
    """Samples this process's RSS every ``interval`` seconds in a daemon thread; keeps the peak.

    Also keeps the largest spill counters of the shards on this process (when it is a Dask worker).
    """

    def __init__(self, interval: float = 0.05, worker: Any = None) -> None:
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.worker = worker
        self.spill: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if self.worker is not None:
                for key, actor in list(self.worker.state.actors.items()):
                    core = getattr(actor, "core", None)
                    vs = getattr(core, "vectors", None)
                    if vs is not None and hasattr(vs, "bytes_read"):
                        self.spill[str(key)] = {
                            "bytes_read": vs.bytes_read,
                            "bytes_written": vs.bytes_written,
                            "seconds_read": getattr(vs, "seconds_read", 0.0),
                            "seconds_written": getattr(vs, "seconds_written", 0.0),
                            "ram_bytes": vs.ram_bytes,
                            "spilled": len(vs.spilled),
                            "budget": vs.budget,
                            "op_seconds": dict(getattr(core, "op_seconds", {})),
                        }

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return {
            "pid": self.proc.pid,
            "rss_peak_sampled": self.peak,
            # Linux carries the high-water mark over fork+exec: a spawned worker's starts at the
            # coordinator's peak when it was spawned, so rss_peak_sampled is the figure for workers.
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "shards": self.spill,
        }


def _start_sampler(dask_worker: Any) -> None:
    dask_worker.__dict__["_scale_sampler"] = PeakSampler(worker=dask_worker)


def _stop_sampler(dask_worker: Any) -> dict[str, Any]:
    return dask_worker.__dict__.pop("_scale_sampler").stop()


# -- the project's run --------------------------------------------------------------------------------------
def communication_bytes(res: Any, n_params: int) -> dict[str, float]:
    """Bytes moved between replicas and shards per evaluation, as the replicas counted them (keys
    included), and what whole-slice (dense) messages would have moved for the same fetches and pushes.

    The dense model: every fetch pulls ``x`` whole (``8 n`` bytes) and every pushed group sends a whole
    gradient slice, binned (``32 n``: :mod:`storage._exactsum`) when it sums two portions or more.
    """
    stats = res.stats
    nfev = max(1, int(res.nfev))
    fetches = float(res.history.fetches.values.sum()) if "fetches" in res.history else float("nan")
    out = {
        "pull_bytes_per_eval": float(stats.get("bytes_pulled", 0)) / nfev,
        "push_bytes_per_eval": float(stats.get("bytes_pushed", 0)) / nfev,
        "bytes_per_eval": float(stats.get("bytes_per_evaluation", float("nan"))),
        "dense_pull_bytes_per_eval_model": 8.0 * n_params * fetches / nfev,
    }
    return out


def run_distbelief(
    dataset: Any,
    n_features: int,
    maxiter: int,
    shard_memory: int | str | None,
    workers: int,
    push_every: int = 4,
    mode: str = "sparse",
    worker_memory: str | None = None,
    l1: float = 0.0,
    history_dtype: str = "auto",
) -> dict[str, Any]:
    """Sandblaster L-BFGS (or OWL-QN with ``l1 > 0``) on ``dataset`` on a fresh two-worker cluster;
    ``history_dtype`` as ``sandblaster.minimize``'s (the row says which one ran)."""
    from distributed import Client, LocalCluster

    from distbelief import sandblaster
    from distbelief.models import Logistic

    model = Logistic(n_features)
    out: dict[str, Any] = {"method": "distbelief OWL-QN" if l1 else "distbelief", "communication": mode}
    coordinator = PeakSampler()
    t0 = time.perf_counter()
    limit: dict[str, Any] = {} if worker_memory is None else {"memory_limit": worker_memory}
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
            **limit,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.run(_start_sampler)
        try:
            res = sandblaster.minimize(
                model,
                dataset,
                x0=np.zeros(model.n_params),
                l2=L2,
                **({"method": "owlqn", "l1": l1} if l1 else {}),
                history=HISTORY,
                maxiter=maxiter,
                gtol=0.0,
                ftol=0.0,
                client=client,
                shard_memory=shard_memory,
                push_every=push_every,
                communication=mode,
                history_dtype=history_dtype,
            )
        finally:
            per_worker = client.run(_stop_sampler)
        memory_limit = list(client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit).values())
    wall = time.perf_counter() - t0
    walls = np.asarray(res.history.wall_time.values, dtype=float)
    # As for scipy: the iterations after the first (which compiles the kernel on every replica).
    walls = walls[1:] if walls.size >= 4 else walls
    per_iter = float(np.median(np.diff(walls))) if walls.size > 1 else float("nan")
    out.update(
        status="ok",
        nit=int(res.nit),
        nfev=int(res.nfev),
        fun=float(res.fun),
        wall_s=wall,
        s_per_iter=per_iter,
        time_gradient=float(res.history.time_gradient.values.sum()),
        time_shard_ops=float(res.history.time_shard_ops.values.sum()),
        time_coordinator=float(res.history.time_coordinator.values.sum()),
        **{k: v for k, v in res.stats.items() if k.startswith("replica_")},
        shards=res.stats.get("shards"),
        replicas=res.stats.get("replicas"),
        history_dtype=res.stats.get("history_dtype"),
        portions=res.stats.get("portions"),
        worker_memory_limit=memory_limit,
        push_every=push_every,
        bytes_encoding=res.stats.get("communication"),
        **communication_bytes(res, model.n_params),
    )
    # Whole-slice pushes for the same groups: each replica pushes ceil(its portions / push_every) groups a
    # evaluation, binned (32 bytes a parameter) when a group sums two portions or more.
    portions, replicas = int(out["portions"] or 1), int(out["replicas"] or 1)
    per_replica = math.ceil(portions / replicas)
    groups = replicas * math.ceil(per_replica / push_every)
    out["dense_push_bytes_per_eval_model"] = (
        groups * (32 if min(push_every, per_replica) > 1 else 8) * (model.n_params)
    )
    del res
    out["processes"] = {
        "coordinator": coordinator.stop(),
        **{f"worker {a}": v for a, v in per_worker.items()},
    }
    spill = [s for p in out["processes"].values() for s in p.get("shards", {}).values()]
    out["spill_bytes_read"] = sum(s["bytes_read"] for s in spill)
    out["spill_bytes_written"] = sum(s["bytes_written"] for s in spill)
    out["spill_bytes_per_eval"] = (out["spill_bytes_read"] + out["spill_bytes_written"]) / max(1, out["nfev"])
    out["spill_seconds"] = sum(s.get("seconds_read", 0.0) + s.get("seconds_written", 0.0) for s in spill)
    ops: dict[str, float] = {}
    for s in spill:
        for kind, secs in s.get("op_seconds", {}).items():
            ops[kind] = ops.get(kind, 0.0) + secs
    out["shard_op_seconds"] = ops  # summed over shards (they run at once, on different workers)
    out["peak_rss_max"] = max(p["rss_peak_sampled"] for p in out["processes"].values())
    out["peak_rss_workers_max"] = max(
        (p["rss_peak_sampled"] for k, p in out["processes"].items() if k != "coordinator"), default=0
    )
    # The peaks summed: an upper bound on what all processes (the coordinator, which also runs the
    # scheduler, and every worker) held at once; the memory target is on this figure.
    out["peak_rss_total"] = sum(p["rss_peak_sampled"] for p in out["processes"].values())
    return out


# -- scipy in a guarded child process ------------------------------------------------------------------------
def scipy_child(path: str, maxiter: int) -> None:
    """Child entry: L-BFGS-B on the saved CSR matrix; prints one JSON line."""
    from scipy.optimize import minimize

    from distbelief.models import Logistic

    t0 = time.perf_counter()
    try:
        X = sp.load_npz(f"{path}/X.npz")
        y = np.load(f"{path}/y.npy")
        model = Logistic(X.shape[1])
        n = X.shape[0]
        times: list[float] = []

        def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
            loss, grad = model.loss_and_grad(w, X, y)
            return loss / n + 0.5 * L2 * float(w @ w), grad / n + L2 * w

        t1 = time.perf_counter()
        res = minimize(
            fun,
            np.zeros(model.n_params),
            jac=True,
            method="L-BFGS-B",
            callback=lambda w: times.append(time.perf_counter()),
            options={"maxiter": maxiter, "maxcor": HISTORY, "gtol": 0.0, "ftol": 0.0},
        )
        # Iterations after the first: the first one also compiles the model's kernel.
        ticks = times if len(times) >= 3 else [t1, *times]
        per_iter = float(np.median(np.diff(ticks))) if len(ticks) >= 2 else float("nan")
        answer = {
            "status": "ok",
            "nit": int(res.nit),
            "nfev": int(res.nfev),
            "fun": float(res.fun),
            "s_per_iter": per_iter,
            **physical_floor(X, y, model),
        }
    except MemoryError:
        answer = {"status": "out of memory (rlimit)"}
    answer["wall_s"] = time.perf_counter() - t0
    answer["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(answer))


def physical_floor(X: sp.csr_array, y: np.ndarray, model: Any, reps: int = 3) -> dict[str, float]:
    """The hardware's reference for one L-BFGS iteration at this size, in this one process (issue 29).

    * ``floor_gradient_s``: the gradient kernel alone over all rows, the faster of the two passes
      ``X @ w`` and ``X.T @ r`` through ``scipy.sparse`` and the model's own compiled pass
      (``loss_and_grad``, which is also what our replicas run on their rows);
    * ``floor_vector_ops_s``: the vector work of one L-BFGS iteration with ``m = HISTORY`` on whole numpy
      vectors: the two-loop recursion (``2m`` dot products and ``2m`` axpys), the trial point, the new
      ``s`` and ``y`` and their dot products (~``4m + 6`` passes over a vector).

    Medians of ``reps``. ``floor_s_per_iter`` in the rows combines them with the run's evaluations per
    iteration.
    """
    rng = np.random.default_rng(1)
    n = model.n_params
    w = rng.normal(size=n) * 1e-3
    Xc = sp.csr_array(X)

    def passes() -> None:
        z = Xc @ w[: Xc.shape[1]]
        r = 1.0 / (1.0 + np.exp(-z)) - y
        Xc.T @ r

    def median_s(fn: Any) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    gradient = min(median_s(passes), median_s(lambda: model.loss_and_grad(w, Xc, y)))
    s_hist = [rng.normal(size=n) for _ in range(HISTORY)]
    y_hist = [rng.normal(size=n) for _ in range(HISTORY)]
    g, x, x_new, g_new = (rng.normal(size=n) for _ in range(4))

    def lbfgs_vector_ops() -> None:
        q = g.copy()
        alphas = []
        for s_i, y_i in zip(reversed(s_hist), reversed(y_hist), strict=True):
            a = float(s_i @ q) / float(y_i @ s_i)
            alphas.append(a)
            q -= a * y_i
        q *= float(s_hist[-1] @ y_hist[-1]) / float(y_hist[-1] @ y_hist[-1])
        for (s_i, y_i), a in zip(zip(s_hist, y_hist, strict=True), reversed(alphas), strict=True):
            b = float(y_i @ q) / float(y_i @ s_i)
            q += (a - b) * s_i
        np.add(x, -0.5 * q, out=x_new)  # the trial point
        s_new, y_new = x_new - x, g_new - g
        float(s_new @ y_new), float(y_new @ y_new), float(g_new @ q)

    return {"floor_gradient_s": gradient, "floor_vector_ops_s": median_s(lbfgs_vector_ops)}


def run_scipy(
    X: sp.csr_array, y: np.ndarray, maxiter: int, memory_gb: float, timeout: float
) -> dict[str, Any]:
    """SciPy's L-BFGS-B on ``X, y`` in a child process under an address-space limit and a timeout."""
    with tempfile.TemporaryDirectory(prefix="scale-scipy-") as tmp:
        save_for_scipy(X, y, tmp)
        return run_scipy_saved(tmp, maxiter, memory_gb, timeout)


def save_for_scipy(X: sp.csr_array, y: np.ndarray, path: str) -> None:
    """Write the matrix and labels where :func:`run_scipy_saved`'s child reads them."""
    sp.save_npz(f"{path}/X.npz", X, compressed=False)
    np.save(f"{path}/y.npy", y)


def run_scipy_saved(path: str, maxiter: int, memory_gb: float, timeout: float) -> dict[str, Any]:
    """:func:`run_scipy` on a matrix already saved by :func:`save_for_scipy` (so this process need not
    hold it meanwhile)."""
    limit = int(memory_gb * 2**30)

    def guard() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [sys.executable, str(Path(__file__).resolve()), "--scipy-child", path, "--maxiter", str(maxiter)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out: dict[str, Any] = {"method": "scipy L-BFGS-B", "memory_limit": limit}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, preexec_fn=guard, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**out, "status": f"timeout after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        out.update(json.loads(lines[-1]))
    else:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        out["status"] = "MemoryError" if "MemoryError" in done.stderr else f"failed: {tail[0][:200]}"
    out.setdefault("wall_s", time.perf_counter() - t0)
    out["peak_rss_max"] = out.get("ru_maxrss")
    return out


# -- shard ops on in-RAM and spilled vectors -----------------------------------------------------------------
def spill_ops(size: int, reps: int = 3) -> list[dict[str, Any]]:
    """Seconds and GB/s of shard ops on ``size``-element vectors, all in RAM against all spilled.

    Spilled vectors are read through the page cache, which holds them when the machine has room: this
    measures the streaming code, and disk bandwidth only once the vectors exceed the cache.
    """
    from distbelief.storage._shard import Shard

    rows = []
    rng = np.random.default_rng(0)
    values = {n: rng.normal(size=size) for n in ("x", "d", "s0", "y0", "s1", "y1")}
    ops = {
        "dot": (("dot", "s0", "y0"), 2),
        "dots(4)": (("dots", [("d", "s0"), ("d", "y0"), ("d", "s1"), ("d", "y1")]), 8),
        "axpy": (("axpy", 0.5, "d", "s0"), 3),
        "lincomb(5)": (("lincomb", "d", [1.0, 0.5, -0.5, 0.25, -0.25], ["x", "s0", "y0", "s1", "y1"]), 6),
    }
    with tempfile.TemporaryDirectory(prefix="scale-spill-", dir=OUT) as tmp:
        for where, budget in (("ram", None), ("spilled", 0)):
            shard = Shard(0, 0, size, memory_budget=budget, spill_dir=tmp)
            for n, v in values.items():
                shard.set(n, 0, size, v)
            for name, (op, touched) in ops.items():
                best = math.inf
                for _ in range(reps):
                    t0 = time.perf_counter()
                    shard.run([op])
                    best = min(best, time.perf_counter() - t0)
                rows.append(
                    {
                        "op": name,
                        "where": where,
                        "size": size,
                        "s": best,
                        "GB_per_s": 8 * size * touched / best / 1e9,
                    }
                )
            shard.close()
    return rows


# -- plot and table ------------------------------------------------------------------------------------------
def _series(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rows per line of the plot: scipy, and the project per communication mode."""
    keys: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = r["method"] if r["method"] != "distbelief" else f"distbelief ({r.get('communication')})"
        keys.setdefault(label, []).append(r)
    return list(keys.items())


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m, ax_b) = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"scipy L-BFGS-B": "s--", "distbelief (sparse)": "o-", "distbelief (dense)": "^-"}
    for i, (label, group) in enumerate(_series(rows)):
        style = styles.get(label, "x-")
        pts = sorted((r for r in group if r.get("status") == "ok"), key=lambda r: r["n_params"])
        if pts:
            p = [r["n_params"] for r in pts]
            ax_t.plot(p, [r["s_per_iter"] for r in pts], style, label=label)
            ax_m.plot(p, [r["peak_rss_max"] / 2**30 for r in pts], style, label=f"{label}: largest process")
            if label.startswith("distbelief"):
                workers = [r["peak_rss_workers_max"] / 2**30 for r in pts]
                ax_m.plot(p, workers, style.replace("-", ":"), alpha=0.6, label=f"{label}: largest worker")
                ax_b.plot(p, [r["bytes_per_eval"] / 1e6 for r in pts], style, label=f"{label}: measured")
        for r in group:
            if r.get("status") != "ok":
                ax_t.axvline(r["n_params"], color="grey", lw=0.6, ls=":")
                ax_t.annotate(
                    f"{label}: {str(r.get('status'))[:22]}",
                    (r["n_params"], 0.02),
                    xycoords=("data", "axes fraction"),
                    xytext=(-12 + 8 * i, 0),  # one column of text per series, side by side
                    textcoords="offset points",
                    fontsize=6,
                    rotation=90,
                )
    model = sorted(
        (r for r in rows if r.get("communication") == "sparse" and r.get("status") == "ok"),
        key=lambda r: r["n_params"],
    )
    if model:
        dense = [
            (r["dense_pull_bytes_per_eval_model"] + r["dense_push_bytes_per_eval_model"]) / 1e6 for r in model
        ]
        ax_b.plot([r["n_params"] for r in model], dense, "k:", label="whole slices (model, same messages)")
    for ax, label in (
        (ax_t, "seconds per iteration"),
        (ax_m, "peak RSS (GiB)"),
        (ax_b, "MB moved per evaluation (replicas <-> shards)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    floors = sorted(
        (c["log2"], c["floor_s_per_iter"]) for c in compare(rows) if "floor_s_per_iter" in c
    )  # fmt: skip
    if floors:
        ax_t.plot(
            [2**k for k, _ in floors], [f for _, f in floors], "k:", label="physical floor (one process)"
        )
        ax_t.legend(fontsize=7)
    loads = sorted(
        {round(float(r["run_machine"]["load_avg_at_start"][0]), 1) for r in rows if "run_machine" in r}
    )  # fmt: skip
    said = f"load average at the runs' starts: {', '.join(map(str, loads))}" if loads else "2-core box"
    fig.suptitle(f"Sparse logistic regression, hashed CTR features, L-BFGS m=10 ({said})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median seconds per iteration (the lower middle one of an even count), with every
    round's seconds per iteration beside it; failed rounds count as slowest."""
    key = [r.get("s_per_iter", math.inf) if r.get("status") == "ok" else math.inf for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: key[i])
    chosen = dict(rounds[order[(len(order) - 1) // 2]])
    chosen["rounds_s_per_iter"] = key
    chosen["rounds"] = len(rounds)
    return chosen


#: Issue 29's targets: ours at most this fraction of SciPy's seconds per iteration, and at most this
#: multiple of the physical floor, at these sizes (log2 of the parameters).
SCIPY_RATIO_TARGET = 0.6
FLOOR_RATIO_TARGET = 2.0
TARGET_SIZES = (20, 24)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and communication mode: ours against SciPy and the physical floor of the same run, where
    our time went per iteration, and whether each target is met (``None`` where none is set)."""
    out = []
    for r in rows:
        if r.get("method") == "distbelief OWL-QN" and r.get("status") == "ok":
            ours = next(
                (
                    q
                    for q in rows
                    if q["log2"] == r["log2"] and q.get("method") == "distbelief"
                    and q.get("communication") == "sparse" and q.get("status") == "ok"
                ),
                None,
            )  # fmt: skip
            if ours is not None:
                ratio = r["s_per_iter"] / ours["s_per_iter"]
                out.append(
                    {
                        "log2": r["log2"],
                        "communication": "owlqn",
                        "s_per_iter": r["s_per_iter"],
                        "owlqn_over_lbfgs": ratio,
                        "owlqn_target_met": ratio <= OWLQN_RATIO_TARGET
                        if r["log2"] in TARGET_SIZES
                        else None,
                        "where_per_iter_s": _where(r),
                    }
                )
            continue
        if r.get("method") != "distbelief" or r.get("status") != "ok":
            continue
        ref = next((q for q in rows if q["log2"] == r["log2"] and q.get("method") == "scipy L-BFGS-B"), None)
        nit, nfev = max(1, int(r["nit"])), int(r["nfev"])
        row: dict[str, Any] = {
            "log2": r["log2"],
            "communication": r["communication"],
            "s_per_iter": r["s_per_iter"],
        }
        row["where_per_iter_s"] = _where(r)
        targeted = r["log2"] in TARGET_SIZES
        if ref is not None and ref.get("status") == "ok":
            row["scipy_s_per_iter"] = ref["s_per_iter"]
            row["ours_over_scipy"] = r["s_per_iter"] / ref["s_per_iter"]
            row["same_objective_rel"] = abs(r["fun"] - ref["fun"]) / abs(ref["fun"])
            row["same_iterations"] = int(r["nit"]) == int(ref["nit"])
            row["scipy_target_met"] = row["ours_over_scipy"] <= SCIPY_RATIO_TARGET if targeted else None
            if "floor_gradient_s" in ref:
                floor = ref["floor_gradient_s"] * nfev / nit + ref["floor_vector_ops_s"]
                row["floor_s_per_iter"] = floor
                row["ours_over_floor"] = r["s_per_iter"] / floor
                row["floor_target_met"] = row["ours_over_floor"] <= FLOOR_RATIO_TARGET if targeted else None
        out.append(row)
    return out


def _where(r: dict[str, Any]) -> dict[str, float]:
    """Where a run's time went, per iteration (summed over processes; the first iteration included)."""
    nit = max(1, int(r["nit"]))
    return {
        "replica_compute": r.get("replica_compute_s", 0.0) / nit,
        "replica_fetch_wait": r.get("replica_fetch_s", 0.0) / nit,
        "replica_push_wait": r.get("replica_push_s", 0.0) / nit,
        "shard_ops": sum(r.get("shard_op_seconds", {}).values()) / nit,
        "spill_io": r.get("spill_seconds", 0.0) / nit,
    }


def _verdict(met: bool | None) -> str:
    return "" if met is None else ("met" if met else "MISSED")


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'params':>10} {'method':>15} {'comm':>6} {'status':>12} {'s/iter':>8} {'MB/eval':>9} "
        f"{'dense MB':>9} {'peak GiB':>8} {'worker GiB':>10} {'all GiB':>8} {'objective':>12}"
    )
    lines = [head]
    for r in rows:
        mb = r.get("bytes_per_eval", float("nan")) / 1e6
        dense = (
            r.get("dense_pull_bytes_per_eval_model", math.nan)
            + r.get("dense_push_bytes_per_eval_model", math.nan)
        ) / 1e6
        peak = (r.get("peak_rss_max") or float("nan")) / 2**30
        worker = (r.get("peak_rss_workers_max") or float("nan")) / 2**30
        total = (r.get("peak_rss_total") or float("nan")) / 2**30
        lines.append(
            f"{r['n_params']:>10} {r['method']:>15} {r.get('communication', '-'):>6} "
            f"{str(r.get('status'))[:12]:>12} {r.get('s_per_iter', float('nan')):8.3f} {mb:9.1f} "
            f"{dense:9.1f} {peak:8.2f} {worker:10.2f} {total:8.2f} {r.get('fun', float('nan')):12.6g}"
        )
    comparisons = compare(rows)
    if comparisons:
        lines.append(
            f"{'log2':>4} {'comm':>6} {'ours s/it':>9} {'scipy':>8} {'floor':>8} {'/scipy':>7} {'':>6} "
            f"{'/floor':>7} {'':>6}  per iteration (s): compute, fetch wait, push wait, shard ops, spill"
        )
        for c in comparisons:
            w = c["where_per_iter_s"]
            lines.append(
                f"{c['log2']:>4} {c['communication']:>6} {c['s_per_iter']:9.3f} "
                f"{c.get('scipy_s_per_iter', math.nan):8.3f} {c.get('floor_s_per_iter', math.nan):8.3f} "
                f"{c.get('ours_over_scipy', math.nan):7.2f} {_verdict(c.get('scipy_target_met')):>6} "
                f"{c.get('ours_over_floor', math.nan):7.2f} {_verdict(c.get('floor_target_met')):>6}  "
                + ", ".join(f"{w[k]:.3f}" for k in w)
                + (
                    f"  OWL-QN / L-BFGS {c['owlqn_over_lbfgs']:.2f} {_verdict(c.get('owlqn_target_met'))}"
                    if "owlqn_over_lbfgs" in c
                    else ""
                )
            )
    return "\n".join(lines)


def merge_runs(path: Path, run: dict[str, Any]) -> dict[str, Any]:
    """Add ``run``'s rows to the results file ``path`` (its rows of the same sizes are replaced), each row
    tagged with the command and machine state of its run; rewrite the PNG beside it from every row.

    For a size run on its own (2^27 needs the whole box): the file says which run every row came from.
    """
    old: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": [], "rows": []}
    sizes = {r["log2"] for r in run["rows"]}
    tag = {"run_argv": run["argv"], "run_machine": run["machine"]}
    rows = [r for r in old.get("rows", []) if r["log2"] not in sizes]
    rows += [{**r, **tag} for r in run["rows"]]
    rows.sort(key=lambda r: (r["log2"], r["method"], str(r.get("communication"))))
    runs = [r for r in old.get("runs", []) if set(r.get("sizes", [])) - sizes]
    runs.append({"sizes": sorted(sizes), **{k: v for k, v in run.items() if k != "rows"}})
    merged = {"note": run.get("note"), "runs": runs, "rows": rows}
    path.write_text(json.dumps(merged, indent=1, default=str))
    plot(rows, path.with_suffix(".png"))
    return merged


# -- main ----------------------------------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite")
    ap.add_argument("--sizes", default=None, help="log2 parameter counts, comma separated (16,20,24,27)")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--maxiter", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    # Every pushed group holds a whole dense gradient until its push is answered: at 2^27 (1 GB a gradient)
    # push once or twice per evaluation (e.g. 64), not every 4 portions.
    ap.add_argument("--push-every", type=int, default=4)
    ap.add_argument("--shard-memory", default="auto", help="bytes per shard, 'auto' or 'none'")
    ap.add_argument("--modes", default=",".join(COMMUNICATION_MODES), help="communication modes to run")
    ap.add_argument("--dense-max-log2", type=int, default=24, help="largest size run in dense mode")
    ap.add_argument("--worker-memory", default=None, help="each worker's memory_limit (Dask's default: auto)")
    ap.add_argument("--scipy-memory-gb", type=float, default=6.0)
    ap.add_argument("--scipy-timeout", type=float, default=900.0)
    ap.add_argument("--no-scipy", action="store_true")
    ap.add_argument("--spill-ops", type=int, default=1 << 24, help="vector size for the op timings (0: skip)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge-into", help="also merge this run's rows into that results file (see merge_runs)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size (medians reported)")
    ap.add_argument("--owlqn", action="store_true", help=f"also OWL-QN (l1={L1}) on sparse communication")
    ap.add_argument(
        "--history-dtype",
        default="auto",
        choices=("auto", "float64", "float32"),
        help="how the shards store the L-BFGS history (sandblaster.minimize's history_dtype)",
    )
    ap.add_argument("--scipy-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or "10,12"
        args.rows, args.maxiter, args.spill_ops, args.repeats = 3000, 2, 1 << 12, 1
        args.scipy_timeout = min(args.scipy_timeout, 120.0)
    args.sizes = args.sizes or "16,20,24,27"
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.scipy_child:
        scipy_child(args.scipy_child, args.maxiter)
        return {}
    from distbelief.storage import Dataset

    shard_memory: int | str | None = {"auto": "auto", "none": None}.get(args.shard_memory.lower())
    if args.shard_memory.lower() not in ("auto", "none"):
        shard_memory = int(args.shard_memory)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "rows_per_set": args.rows,
        "nnz_per_row": NNZ_PER_ROW,
        "history": HISTORY,
        "maxiter": args.maxiter,
        "machine": {
            "cpus": os.cpu_count(),
            "ram_gib": psutil.virtual_memory().total / 2**30,
            "available_gib_at_start": psutil.virtual_memory().available / 2**30,
            "load_avg_at_start": os.getloadavg(),
        },
        "note": "load averages at start and end are recorded: a figure from a loaded box is not a result",
        "rows": rows,
    }
    json_path = args.out / ("scale_quick.json" if args.quick else "scale.json")
    modes = [m for m in args.modes.split(",") if m]
    for k in sizes:
        t0 = time.perf_counter()
        X, y = hashed_csr(args.rows, k)
        gen_s = time.perf_counter() - t0
        n_params = (1 << k) + 1  # hashed buckets and the intercept
        nnz = int(X.nnz)
        print(f"2^{k}: {X.shape[0]} rows, {nnz} nonzeros, generated in {gen_s:.1f} s", flush=True)
        with tempfile.TemporaryDirectory(prefix="scale-data-", dir=args.out) as tmp:
            ds = Dataset.from_arrays(X, y, path=f"{tmp}/data", overwrite=True)
            if not args.no_scipy:
                save_for_scipy(X, y, tmp)
            # The coordinator need not hold the matrix while the cluster runs (1.3 GB at 80M nonzeros).
            del X, y
            done: dict[str, dict[str, Any]] = {}
            rounds: dict[str, list[dict[str, Any]]] = {}
            # Rounds alternate ours and SciPy, so a change in the box's speed hits both alike; each row
            # reports the round with the median seconds per iteration, and every round's figure.
            # Our runs of a round: (key, communication, l1); OWL-QN on sparse communication with --owlqn.
            ours = [(m, m, 0.0) for m in modes if not (m == "dense" and k > args.dense_max_log2)]
            ours += [("owlqn", "sparse", L1)] if args.owlqn else []
            for _ in range(args.repeats):
                for key, mode, l1 in ours:
                    row: dict[str, Any] = {"log2": k, "n_params": n_params, "nnz": nnz, "generate_s": gen_s}
                    try:
                        row.update(
                            run_distbelief(
                                ds,
                                1 << k,
                                args.maxiter,
                                shard_memory,
                                args.workers,
                                args.push_every,
                                mode,
                                args.worker_memory,
                                l1=l1,
                                history_dtype=args.history_dtype,
                            )
                        )
                    except Exception as e:  # recorded, not fatal: the other sizes still run
                        method = "distbelief OWL-QN" if l1 else "distbelief"
                        row.update(method=method, communication=mode, status=f"{type(e).__name__}: {e}"[:300])
                    rounds.setdefault(key, []).append(row)
                    print(table([row]).splitlines()[1], flush=True)
                if not args.no_scipy:
                    row = {"log2": k, "n_params": n_params, "nnz": nnz}
                    row.update(run_scipy_saved(tmp, args.maxiter, args.scipy_memory_gb, args.scipy_timeout))
                    rounds.setdefault("scipy", []).append(row)
                    print(table([row]).splitlines()[1], flush=True)
            for mode in modes:
                if mode == "dense" and k > args.dense_max_log2:
                    row = {"log2": k, "n_params": n_params, "nnz": nnz, "generate_s": gen_s}
                    row.update(method="distbelief", communication=mode, status="not run", why=DENSE_SKIPPED)
                    sparse = done.get("sparse", {})
                    for key in ("dense_pull_bytes_per_eval_model", "dense_push_bytes_per_eval_model"):
                        if key in sparse:
                            row[key] = sparse[key]
                    rows.append(row)
                    continue
                done[mode] = median_round(rounds[mode])
                rows.append(done[mode])
            if "owlqn" in rounds:
                rows.append(median_round(rounds["owlqn"]))
            if "scipy" in rounds:
                rows.append(median_round(rounds["scipy"]))
            json_path.write_text(json.dumps(result, indent=1, default=str))
        json_path.write_text(json.dumps(result, indent=1, default=str))
    if args.spill_ops:
        result["spill_ops"] = spill_ops(args.spill_ops)
    result["load_avg_at_end"] = os.getloadavg()
    result["comparison"] = compare(rows)
    json_path.write_text(json.dumps(result, indent=1, default=str))
    plot(rows, json_path.with_suffix(".png"))
    print(table(rows))
    if args.merge_into:
        merged = merge_runs(Path(args.merge_into), result)
        print(f"merged into {args.merge_into}: {len(merged['rows'])} rows")
    for r in result.get("spill_ops", []):
        print(
            f"  {r['op']:>10} {r['where']:>7} {r['size']:>10} {r['s'] * 1e3:8.1f} ms "
            f"{r['GB_per_s']:6.2f} GB/s"
        )
    return result


if __name__ == "__main__":
    main()
