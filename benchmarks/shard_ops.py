"""Latency and bandwidth of the parameter server's vector ops against single-process BLAS (issue 2).

What it measures, on a real ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``:

- ``dot``, ``dots`` (several pairs in one call), ``axpy`` and ``lincomb`` (k terms) of
  :class:`storage.ParameterServer` on S = 1, 2, 4 shards for n = 1e3, 1e6, 1e7, with the number of round
  trips and shard calls each op costs (read from ``ps.stats`` before and after);
- the reference for "one round trip": a bare actor call (``actor.ping().result()`` on one shard actor,
  no server machinery) and the server's own ``ps.ping()`` on S shards;
- the same on a client with ``direct_to_workers=True`` (``direct``) and ``False`` (``proxied`` through the
  scheduler);
- single-process rows in the driver process, measured in the same run: ``scipy.linalg.blas`` ``ddot`` /
  ``daxpy`` (and the shard's own lincomb kernel: ``np.multiply`` + ``daxpy``) and the plain numpy
  expressions (``a @ b``, ``y += a*x``, ``c0*v0 + c1*v1 + ...``), with the driver's BLAS pools as
  installed and limited to one thread. These rows are always reported, also where they win.

Bandwidth is *bytes touched* / median time: dot reads 2 vectors, ``dots`` with p pairs 2p, axpy reads 2
and writes 1, lincomb with k terms reads k and writes 1 (the kernel itself moves more: each ``daxpy``
re-reads and re-writes the destination). ``ratio_to_blas`` divides a sharded row's bandwidth by the best
single-process scipy-BLAS row of the same op and size (the faster of the two thread settings).
``gb_s_best`` / ``ratio_to_blas_best`` do the same with the fastest repetition instead of the median: load
from other processes only ever adds time, so on a shared machine these compare what each side can do.

Aims (issue 2): at the largest n the sharded ops reach >= 50% of single-process BLAS bandwidth; at the
smallest n an op costs no more than one actor round trip (budget ``LATENCY_BUDGET_MS``).

Diagnostics (full run only):

- ``breakdown``: for shards above ``storage._actor.INLINE_MAX_ELEMENTS`` (whose ops run on a thread of their
  own), a large dot / axpy as the caller sees it, against the same op's compute timed inside the workers
  and a bare round trip; and the same with the ops inline on the event loop (that constant raised on the
  workers while the shards are created);
- ``ping_during_op``: how long a bare ping to a worker takes while its shard runs a long op, i.e. whether the
  shard's BLAS holds the GIL and so blocks the worker's event loop.

Run ``python benchmarks/shard_ops.py [--quick] [--out PATH]``; a full run takes 2-3 minutes, ``--quick``
about 10 s. Numbers on a shared machine are noisy: every row records the 1-minute load average.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client, LocalCluster
from scipy.linalg import blas
from threadpoolctl import threadpool_info, threadpool_limits

from distbelief.errors import InvalidOptionError, ProtocolError
from distbelief.storage import ParameterServer

__all__ = ["LATENCY_BUDGET_MS", "Config", "bytes_touched", "format_table", "main", "run"]

#: "One actor round trip here" (issue 2): the latency an op on tiny vectors may cost.
LATENCY_BUDGET_MS = 2.0
#: The bandwidth an op on the largest vectors must reach, as a fraction of single-process BLAS.
BANDWIDTH_AIM = 0.5
#: Sizes from here on use ``reps_large`` repetitions.
LARGE_N = 5_000_000
#: Each single-process sample loops a kernel until it has touched about this many elements, so that a
#: 1e3-element ``ddot`` (~0.3 us) is not measured at the resolution of the timer.
_SINGLE_SAMPLE_ELEMENTS = 1_000_000
#: Scale of the axpy coefficient: the timed loop adds it hundreds of times, and y must stay well scaled.
_ALPHA = 1e-3
#: Every sharded op result is checked against numpy to this relative accuracy (of |a| |b|).
_CHECK_RTOL = 1e-9
_MODES = {"direct": True, "proxied": False}
_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "shard_ops.json"


@dataclass(frozen=True)
class Config:
    """What to measure.

    Parameters
    ----------
    sizes : tuple of int
        Vector lengths n.
    shards : tuple of int
        Shard counts S (each must be <= every n).
    reps_small, reps_large : int
        Timed repetitions for n < ``LARGE_N`` and n >= ``LARGE_N``.
    warmup : int
        Untimed calls before each measurement (connections, caches, first-touch page faults).
    modes : tuple of str
        ``"direct"`` (``Client(direct_to_workers=True)``) and/or ``"proxied"`` (through the scheduler).
    lincomb_terms : tuple of int
        Numbers of terms k of the ``lincomb`` rows (2m+1 = 11 is VL-BFGS's direction with m = 5).
    dots_pairs : int
        Number of pairs of the ``dots`` rows (one call returns that many dot products).
    diagnostics : bool
        Also run the time-breakdown (thread handoff) and ping-during-op diagnostics.
    seed : int
        Seed of the random vectors.

    Examples
    --------
    >>> Config(sizes=(1000,), shards=(1, 2), reps_small=3).reps_for(1000)
    3
    """

    sizes: tuple[int, ...] = (1_000, 1_000_000, 10_000_000)
    shards: tuple[int, ...] = (1, 2, 4)
    reps_small: int = 30
    reps_large: int = 10
    warmup: int = 3
    modes: tuple[str, ...] = ("direct", "proxied")
    lincomb_terms: tuple[int, ...] = (3, 11)
    dots_pairs: int = 3
    diagnostics: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or any(int(n) != n or n < 1 for n in self.sizes):
            raise InvalidOptionError(f"sizes must be positive integers, got {self.sizes!r}")
        if not self.shards or any(s < 1 or s > min(self.sizes) for s in self.shards):
            raise InvalidOptionError(
                f"shards must be between 1 and the smallest size {min(self.sizes)}, got {self.shards!r}"
            )
        if min(self.reps_small, self.reps_large) < 1 or self.warmup < 0:
            raise InvalidOptionError("reps must be >= 1 and warmup >= 0")
        unknown = set(self.modes) - set(_MODES)
        if not self.modes or unknown:
            raise InvalidOptionError(f"modes must be among {sorted(_MODES)}, got {self.modes!r}")
        if not self.lincomb_terms or min(self.lincomb_terms) < 1:
            raise InvalidOptionError(f"lincomb_terms must be >= 1, got {self.lincomb_terms!r}")
        if not 1 <= self.dots_pairs <= 3:
            # The pairs are taken among three vectors (a, b, v0).
            raise InvalidOptionError(f"dots_pairs must be 1, 2 or 3, got {self.dots_pairs}")

    def reps_for(self, n: int) -> int:
        """Timed repetitions for vectors of ``n`` elements."""
        return self.reps_large if n >= LARGE_N else self.reps_small

    @classmethod
    def quick(cls) -> Config:
        """A ~30 s configuration: no 1e7 vectors, fewer repetitions, no diagnostics."""
        return cls(
            sizes=(1_000, 1_000_000), reps_small=10, reps_large=5, lincomb_terms=(3,), diagnostics=False
        )


def bytes_touched(op: str, n: int, *, k: int = 0) -> int:
    """Bytes an op reads and writes by the issue's definition (float64; 0 for ``ping``).

    ``dot`` reads 2 vectors; ``dots`` with ``k`` pairs 2k; ``axpy`` reads 2 and writes 1; ``lincomb`` with
    ``k`` terms reads k and writes 1.

    Examples
    --------
    >>> bytes_touched("axpy", 1000)
    24000
    >>> bytes_touched("lincomb", 1000, k=3)
    32000
    """
    vectors = {"dot": 2, "dots": 2 * k, "axpy": 3, "lincomb": k + 1, "ping": 0}
    if op not in vectors:
        raise InvalidOptionError(f"unknown op {op!r}; known: {sorted(vectors)}")
    return 8 * n * vectors[op]


# -- timing -------------------------------------------------------------------------------------------
def _measure(fn: Callable[[], Any], *, reps: int, warmup: int, inner: int = 1) -> dict[str, float]:
    """Median / p90 / min wall time of one call of ``fn`` (ms) and the driver's CPU time per call."""
    for _ in range(warmup):
        fn()
    samples = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    cpu = (time.process_time() - cpu0) / (reps * inner)
    ms = np.asarray(samples) * 1e3
    return {
        "reps": reps,
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "min_ms": float(ms.min()),
        # The driver process also hosts the LocalCluster's scheduler (same event loop as the client).
        "driver_cpu_ms": cpu * 1e3,
        # The machine may be shared: how busy it was (1-minute load average) when this row was taken.
        "loadavg_1m": os.getloadavg()[0],
    }


def _bandwidth(row: dict[str, Any]) -> None:
    if row["bytes"]:
        row["gb_s"] = row["bytes"] / (row["median_ms"] * 1e-3) / 1e9
        row["gb_s_best"] = row["bytes"] / (row["min_ms"] * 1e-3) / 1e9


# -- single-process reference rows ---------------------------------------------------------------------
def _single_rows(n: int, config: Config, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The reference kernels in this process, with its BLAS pools as installed and at one thread."""
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    y = b.copy()
    kmax = max(config.lincomb_terms)
    terms = [a + (i + 1) / kmax * b for i in range(kmax)]
    out = np.empty(n)
    pairs = [(a, b), (a, terms[0]), (b, terms[0])][: config.dots_pairs]
    p = config.dots_pairs

    def axpy_numpy() -> None:
        nonlocal y
        y += _ALPHA * a

    def lincomb_kernel(k: int) -> Callable[[], None]:
        coeffs = [1.0 / (i + 1) for i in range(k)]

        def kernel() -> None:
            # The shard's own kernel (storage._shard.Shard._op_lincomb): multiply, then daxpy per term.
            np.multiply(terms[0], coeffs[0], out=out)
            for c, v in zip(coeffs[1:], terms[1:k], strict=True):
                blas.daxpy(v, out, a=c)

        return kernel

    def lincomb_numpy(k: int) -> Callable[[], None]:
        coeffs = [1.0 / (i + 1) for i in range(k)]

        def expression() -> None:
            # What one would write in numpy: a temporary per term.
            acc = coeffs[0] * terms[0]
            for c, v in zip(coeffs[1:], terms[1:k], strict=True):
                acc = acc + c * v

        return expression

    # (op, k, what runs, its short name in the table, the call)
    cases: list[tuple[str, int, str, str, Callable[[], Any]]] = [
        ("dot", 0, "scipy.linalg.blas.ddot", "scipy ddot", lambda: blas.ddot(a, b)),
        ("dot", 0, "numpy a @ b", "numpy a @ b", lambda: a @ b),
        (
            "dots",
            p,
            f"{p} x scipy.linalg.blas.ddot",
            f"{p} x scipy ddot",
            lambda: [blas.ddot(*uv) for uv in pairs],
        ),
        ("axpy", 0, "scipy.linalg.blas.daxpy", "scipy daxpy", lambda: blas.daxpy(a, y, a=_ALPHA)),
        ("axpy", 0, "numpy y += a*x", "numpy y += a*x", axpy_numpy),
    ]
    for k in config.lincomb_terms:
        cases.append(
            ("lincomb", k, "np.multiply + scipy.linalg.blas.daxpy", "mul + scipy daxpy", lincomb_kernel(k))
        )
        cases.append(("lincomb", k, "numpy c0*v0 + c1*v1 + ...", "numpy c0*v0 + ...", lincomb_numpy(k)))

    rows = []
    inner = max(1, _SINGLE_SAMPLE_ELEMENTS // n)
    for threads in ("as installed", 1):
        limit = None if threads == "as installed" else 1
        with threadpool_limits(limits=limit):
            for op, k, impl, label, fn in cases:
                stats = _measure(fn, reps=config.reps_for(n), warmup=config.warmup, inner=inner)
                row: dict[str, Any] = {
                    "kind": "single",
                    "op": op,
                    "k": k,
                    "impl": impl,
                    "label": label,
                    "n": n,
                    "blas_threads": threads,
                    "bytes": bytes_touched(op, n, k=k),
                    **stats,
                }
                _bandwidth(row)
                rows.append(row)
    return rows


def _blas_reference(rows: Sequence[dict[str, Any]], field: str) -> dict[tuple[str, int, int], float]:
    """Best single-process scipy-BLAS ``field`` (a bandwidth) per (op, k, n): a ratio's denominator."""
    best: dict[tuple[str, int, int], float] = {}
    for r in rows:
        if r["kind"] == "single" and "scipy" in r["impl"]:
            key = (r["op"], r["k"], r["n"])
            best[key] = max(best.get(key, 0.0), r[field])
    return best


# -- sharded rows -------------------------------------------------------------------------------------
def _check(what: str, got: float, expected: float, scale: float) -> None:
    if not abs(got - expected) <= _CHECK_RTOL * max(scale, 1e-300):
        raise ProtocolError(
            f"{what}: the parameter server returned {got!r}, numpy says {expected!r}; the benchmark refuses "
            "to time a wrong op — run tests/storage to find the bug"
        )


def _sharded_rows(
    client: Client, mode: str, n: int, shards: int, config: Config, store: Path, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """Every op on ``shards`` shards of ``n`` elements, checked against numpy, with its round trips."""
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    kmax = max(config.lincomb_terms)
    ts = [(i + 1) / kmax for i in range(kmax)]  # v_i = a + t_i b, formed on the shards
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    aa, ab = float(a @ a), float(a @ b)
    ps = ParameterServer.create(client, n, shards=shards, store=str(store), overwrite=True)
    rows: list[dict[str, Any]] = []
    try:
        actor = ps.shard_map().actors[0]
        # Two clients in one process: an actor handle binds to the *default* client, which must be ours.
        if getattr(actor, "_client", client) is not client:
            raise ProtocolError(
                "the shard actors are bound to another Dask client; close other clients in this process first"
            )
        ps.scatter("a", a)
        ps.scatter("b", b)
        ps.copy("b", "y")
        setup = ps.batch()
        for i, t in enumerate(ts):
            setup.lincomb(f"v{i}", [1.0, t], ["a", "b"])
        setup.run()
        names = ["a", "b", "v0"]
        pairs = [(names[0], names[1]), (names[0], names[2]), (names[1], names[2])][: config.dots_pairs]
        _check("dot(a, b)", ps.dot("a", "b"), ab, na * nb)
        v0 = a + ts[0] * b
        exact = {"a": a, "b": b, "v0": v0}
        got = ps.dots(pairs)
        for (u, v), g in zip(pairs, got, strict=True):
            scale = float(np.linalg.norm(exact[u]) * np.linalg.norm(exact[v]))
            _check(f"dots {u}.{v}", g, float(exact[u] @ exact[v]), scale)

        reps = config.reps_for(n)
        axpy_calls = 0

        def axpy() -> None:
            nonlocal axpy_calls
            ps.axpy(_ALPHA, "a", "y")
            axpy_calls += 1

        cases: list[tuple[str, int, Callable[[], Any]]] = [
            ("bare_ping", 0, lambda: actor.ping().result()),
            ("ping", 0, ps.ping),
            ("dot", 0, lambda: ps.dot("a", "b")),
            ("dots", config.dots_pairs, lambda: ps.dots(pairs)),
            ("axpy", 0, axpy),
        ]
        for k in config.lincomb_terms:
            cases.append(("lincomb", k, _lincomb_call(ps, k)))
        for op, k, fn in cases:
            before = (ps.stats.round_trips, ps.stats.shard_calls)
            stats = _measure(fn, reps=reps, warmup=config.warmup)
            calls = reps + config.warmup
            row: dict[str, Any] = {
                "kind": "sharded",
                "op": op,
                "k": k,
                "impl": "actor.ping().result() (1 actor)" if op == "bare_ping" else f"ParameterServer.{op}",
                "label": "actor.ping (1 actor)" if op == "bare_ping" else f"ps.{op}",
                "mode": mode,
                "n": n,
                "shards": 1 if op == "bare_ping" else shards,
                "bytes": bytes_touched("ping" if op == "bare_ping" else op, n, k=k),
                **stats,
            }
            if op != "bare_ping":
                row["round_trips_per_op"] = (ps.stats.round_trips - before[0]) / calls
                row["shard_calls_per_op"] = (ps.stats.shard_calls - before[1]) / calls
            _bandwidth(row)
            rows.append(row)

        # The timed ops left y = b + calls * alpha * a and c{k} = sum_i v_i / (i + 1): check both by a dot.
        y_dot_a = ab + axpy_calls * _ALPHA * aa
        _check("axpy (y . a)", ps.dot("y", "a"), y_dot_a, na * (nb + axpy_calls * _ALPHA * na))
        for k in config.lincomb_terms:
            coeffs = [1.0 / (i + 1) for i in range(k)]
            ca, cb = sum(coeffs), sum(c * t for c, t in zip(coeffs, ts, strict=False))
            expected = ca * aa + cb * ab
            _check(f"lincomb k={k} (c . a)", ps.dot(f"c{k}", "a"), expected, (ca + cb) * na * (na + nb))
    finally:
        ps.close()
    return rows


def _lincomb_call(ps: ParameterServer, k: int) -> Callable[[], None]:
    """``c{k} = sum_i v_i / (i + 1)`` over ``k`` terms, as one server op."""
    coeffs = [1.0 / (i + 1) for i in range(k)]
    terms = [f"v{i}" for i in range(k)]
    return lambda: ps.lincomb(f"c{k}", coeffs, terms)


# -- diagnostics ----------------------------------------------------------------------------------------
def _set_inline_max(value: int) -> int:
    """On a worker: set ``storage._actor.INLINE_MAX_ELEMENTS`` (read when a shard actor is created)."""
    import distbelief.storage._actor as actor_module

    old = actor_module.INLINE_MAX_ELEMENTS
    actor_module.INLINE_MAX_ELEMENTS = value
    return old


def _time_in_worker(keys: Sequence[str], ops: list[Any], reps: int, dask_worker: Any = None) -> list[float]:
    """On a worker: seconds per rep to run ``ops`` on each of its shards among ``keys``, one after another.

    This is the op's compute alone, as the worker does it for a server call, without messages, event loop
    or the shard's thread (``client.run`` runs it on the worker's event loop).
    """
    actors = [dask_worker.state.actors[k] for k in keys if k in dask_worker.state.actors]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for actor in actors:
            actor.core.run(ops)
        times.append(time.perf_counter() - t0)
    return times


def _breakdown_diagnostic(client: Client, config: Config, store: Path) -> list[dict[str, Any]]:
    """Where the time of a large op goes: the op as the caller sees it, its compute on the workers, and a
    bare round trip, with each shard's ops on a thread of its own (default) and inline on the event loop.
    """
    from distbelief.storage._actor import INLINE_MAX_ELEMENTS

    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(config.seed + 1)
    cases = [(n, s) for n in config.sizes for s in config.shards if n // s > INLINE_MAX_ELEMENTS]
    for n, shards in cases:
        a, b = rng.standard_normal(n), rng.standard_normal(n)
        reps = config.reps_for(n)
        # Twice each, interleaved, so that a burst of load on the shared machine hits both variants.
        for variant in ("thread", "inline", "thread", "inline"):
            old = client.run(_set_inline_max, 1 << 62 if variant == "inline" else INLINE_MAX_ELEMENTS)
            try:
                ps = ParameterServer.create(client, n, shards=shards, store=str(store), overwrite=True)
            finally:
                client.run(_set_inline_max, next(iter(old.values())))
            try:
                ps.scatter("a", a)
                ps.scatter("b", b)
                actors = ps.shard_map().actors
                keys = [actor.key for actor in actors]
                ping = _measure(_bare_ping(actors[0]), reps=reps, warmup=config.warmup)
                for op, fn in _dot_and_axpy(ps):
                    observed = _measure(fn, reps=reps, warmup=config.warmup)
                    per_worker = client.run(_time_in_worker, keys, [_DIAGNOSTIC_OPS[op]], reps)
                    # The workers run at once: an op takes as long as its slowest worker.
                    slowest = np.max(np.asarray(list(per_worker.values())), axis=0) * 1e3
                    compute = float(np.median(slowest))
                    rows.append(
                        {
                            "diagnostic": "breakdown",
                            "variant": variant,
                            "op": op,
                            "n": n,
                            "shards": shards,
                            "observed_median_ms": observed["median_ms"],
                            "observed_p90_ms": observed["p90_ms"],
                            "observed_min_ms": observed["min_ms"],
                            "compute_in_worker_ms": compute,
                            "compute_in_worker_min_ms": float(slowest.min()),
                            "bare_ping_ms": ping["median_ms"],
                            "bare_ping_min_ms": ping["min_ms"],
                            "rest_ms": observed["median_ms"] - compute,
                            # Fastest repetitions: load from other processes only ever adds time.
                            "rest_min_ms": observed["min_ms"] - float(slowest.min()),
                            "loadavg_1m": os.getloadavg()[0],
                        }
                    )
            finally:
                ps.close()
    return rows


_DIAGNOSTIC_OPS: dict[str, tuple[Any, ...]] = {"dot": ("dot", "a", "b"), "axpy": ("axpy", _ALPHA, "a", "b")}


def _bare_ping(actor: Any) -> Callable[[], Any]:
    return lambda: actor.ping().result()


def _dot_and_axpy(ps: ParameterServer) -> list[tuple[str, Callable[[], Any]]]:
    return [("dot", lambda: ps.dot("a", "b")), ("axpy", lambda: ps.axpy(_ALPHA, "a", "b"))]


def _ping_during_op_diagnostic(client: Client, config: Config, store: Path) -> list[dict[str, Any]]:
    """Bare pings to a worker while its shard runs a long op: does the op block the worker's event loop?"""
    n = max(config.sizes)
    rng = np.random.default_rng(config.seed + 2)
    ps = ParameterServer.create(client, n, shards=1, store=str(store), overwrite=True)
    rows: list[dict[str, Any]] = []
    try:
        ps.scatter("a", rng.standard_normal(n))
        ps.scatter("b", rng.standard_normal(n))
        actor = ps.shard_map().actors[0]
        idle = _measure(lambda: actor.ping().result(), reps=30, warmup=3)
        one = _measure(lambda: ps.dot("a", "b"), reps=5, warmup=1)["median_ms"]
        repeat = max(4, math.ceil(300.0 / max(one, 1e-3)))  # a ~0.3 s op made of many BLAS calls
        repeat += repeat % 2  # scaling by -1 an even number of times leaves the vector as it was
        ops = {
            "dots": [("dots", [("a", "b")] * repeat)],  # scipy ddot, one call per pair
            "axpy": [("axpy", 1e-12, "a", "b")] * repeat,  # scipy daxpy
            "scale": [("scale", -1.0, "a")] * repeat,  # scipy dscal (by 1.0 it returns at once)
        }
        for name, batch in ops.items():
            t0 = time.perf_counter()
            future = actor.run(batch)
            pings = []
            while not future.done():
                t1 = time.perf_counter()
                actor.ping().result()
                pings.append((time.perf_counter() - t1) * 1e3)
            future.result()
            total = (time.perf_counter() - t0) * 1e3
            ms = np.asarray(pings) if pings else np.asarray([math.nan])
            rows.append(
                {
                    "diagnostic": "ping_during_op",
                    "op": name,
                    "n": n,
                    "blas_calls": repeat,
                    "op_ms": total,
                    "one_call_ms": total / repeat,
                    "idle_ping_median_ms": idle["median_ms"],
                    "pings": len(pings),
                    "ping_median_ms": float(np.median(ms)),
                    "ping_p90_ms": float(np.percentile(ms, 90)),
                    "ping_max_ms": float(ms.max()),
                }
            )
    finally:
        ps.close()
    return rows


# -- machine info ---------------------------------------------------------------------------------------
def _blas_pools() -> list[dict[str, Any]]:
    return [
        {k: p.get(k) for k in ("internal_api", "prefix", "version", "num_threads", "architecture")}
        for p in threadpool_info()
        if p.get("user_api") == "blas"
    ]


def _worker_env() -> dict[str, Any]:
    from distbelief import storage

    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    # Which storage package the workers run (an A/B run of a patched tree sets PYTHONPATH).
    return {"env": env, "blas": _blas_pools(), "storage": str(Path(storage.__file__).parent)}


def _machine(client: Client | None) -> dict[str, Any]:
    import dask
    import distributed
    import scipy
    import zarr

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "versions": {
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "dask": dask.__version__,
            "distributed": distributed.__version__,
            "zarr": zarr.__version__,
        },
        "driver_blas": _blas_pools(),
        "storage": str(Path(sys.modules[ParameterServer.__module__].__file__ or "?").parent),
    }
    if client is not None:
        info["workers"] = client.run(_worker_env)
    return info


# -- report ---------------------------------------------------------------------------------------------
def _op_label(r: dict[str, Any]) -> str:
    return f"{r['op']}{r['k']}" if r["op"] in ("dots", "lincomb") else r["op"]


def format_table(result: dict[str, Any]) -> str:
    """A short fixed-width table of the rows of a :func:`run` result, grouped by n.

    Examples
    --------
    >>> print(format_table(run(Config(sizes=(1000,), shards=(1,)))))  # doctest: +SKIP
    """
    head = (
        f"{'n':>8} {'where':<13} {'what':<20} {'op':<9} {'S':>2} {'median':>8} {'p90':>8} {'min':>8} "
        f"{'GB/s':>6} {'xBLAS':>5} {'xbest':>5} {'rt/op':>5} {'calls':>5} {'cpu':>5}"
    )
    lines = [head, "-" * len(head)]
    for n in sorted({r["n"] for r in result["rows"]}):
        for r in result["rows"]:
            if r["n"] != n:
                continue
            if r["kind"] == "single":
                threads = "as inst." if r["blas_threads"] == "as installed" else str(r["blas_threads"])
                where, shards = f"1 proc, {threads}", "-"
            else:
                where, shards = r["mode"], str(r["shards"])
            gbs = f"{r['gb_s']:6.2f}" if "gb_s" in r else f"{'':>6}"
            ratio = f"{r['ratio_to_blas']:5.2f}" if "ratio_to_blas" in r else f"{'':>5}"
            best = f"{r['ratio_to_blas_best']:5.2f}" if "ratio_to_blas_best" in r else f"{'':>5}"
            rt = f"{r['round_trips_per_op']:5.2f}" if "round_trips_per_op" in r else f"{'':>5}"
            calls = f"{r['shard_calls_per_op']:5.1f}" if "shard_calls_per_op" in r else f"{'':>5}"
            cpu = f"{r['driver_cpu_ms']:5.2f}" if r["kind"] == "sharded" else f"{'':>5}"
            lines.append(
                f"{n:>8} {where:<13} {r['label']:<20} {_op_label(r):<9} {shards:>2} {r['median_ms']:8.3f} "
                f"{r['p90_ms']:8.3f} {r['min_ms']:8.3f} {gbs} {ratio} {best} {rt} {calls} {cpu}"
                + ("  MISSED: " + r["target"] if r.get("met") is False else "")
            )
        lines.append("")
    lines += [
        "1 proc = this process alone, BLAS threads as installed or 1; direct / proxied = Client(",
        "direct_to_workers=True / False); times in ms; xBLAS = GB/s over the best single-process",
        "scipy-BLAS GB/s of the op (median times; xbest: fastest repetitions, less sensitive to load from",
        "other processes); rt/op = server round trips per op; calls = shard calls per op;",
        "cpu = driver-process (client + in-process scheduler) CPU ms per op; MISSED: the row misses its",
        "aim (its JSON row has the target and met: false)",
    ]
    breakdown: dict[tuple[int, int, str, str], list[dict[str, Any]]] = {}
    for d in result.get("diagnostics", {}).get("breakdown", []):
        breakdown.setdefault((d["n"], d["shards"], d["op"], d["variant"]), []).append(d)
    if breakdown:
        lines.append("where the time of a large op goes (ms): observed = compute in the workers + the rest,")
        lines.append("on median and on fastest repetitions (mean of the interleaved runs of each variant)")
    for (size, nshards, op, variant), ds in sorted(breakdown.items()):
        obs, comp, ping, obs_min, comp_min, ping_min = (
            float(np.mean([d[k] for d in ds]))
            for k in (
                "observed_median_ms",
                "compute_in_worker_ms",
                "bare_ping_ms",
                "observed_min_ms",
                "compute_in_worker_min_ms",
                "bare_ping_min_ms",
            )
        )
        lines.append(
            f"  n={size:<9} S={nshards} {op:<5} {variant:<7} median {obs:7.2f} = {comp:7.2f} + "
            f"{obs - comp:6.2f} | best {obs_min:7.2f} = {comp_min:7.2f} + {obs_min - comp_min:5.2f}"
            f" | bare round trip {ping:.2f} / {ping_min:.2f}"
        )
    for d in result.get("diagnostics", {}).get("ping_during_op", []):
        lines.append(
            f"ping to a worker while its shard runs {d['blas_calls']} x {d['op']} on n={d['n']} "
            f"({d['one_call_ms']:.1f} ms each): median {d['ping_median_ms']:.2f} ms, max "
            f"{d['ping_max_ms']:.2f} ms (idle {d['idle_ping_median_ms']:.2f} ms)"
        )
    for line in result.get("aims", {}).get("summary", []):
        lines.append(line)
    return "\n".join(lines)


def _aims(rows: Sequence[dict[str, Any]], config: Config) -> dict[str, Any]:
    """Whether the issue's two aims hold, row by row, in the direct mode (the production setting)."""
    sharded = [r for r in rows if r["kind"] == "sharded" and r["op"] not in ("ping", "bare_ping")]
    big, small = max(config.sizes), min(config.sizes)
    bandwidth = [
        {
            "op": _op_label(r),
            "mode": r["mode"],
            "shards": r["shards"],
            "ratio": r["ratio_to_blas"],
            "ratio_best": r["ratio_to_blas_best"],
        }
        for r in sharded
        if r["n"] == big and "ratio_to_blas" in r
    ]
    pings: dict[str, list[float]] = {}
    for r in rows:
        if r["op"] == "bare_ping" and r["n"] == small:
            pings.setdefault(r["mode"], []).append(r["median_ms"])
    rtt = {mode: float(np.median(ms)) for mode, ms in pings.items()}
    # ps.ping on one shard is the bare round trip plus the server's own machinery (sync, _gather, stats).
    overhead = {
        r["mode"]: r["median_ms"] - rtt[r["mode"]]
        for r in rows
        if r["op"] == "ping" and r["n"] == small and r["shards"] == 1 and r["mode"] in rtt
    }
    latency = [
        {
            "op": _op_label(r),
            "mode": r["mode"],
            "shards": r["shards"],
            "median_ms": r["median_ms"],
            "round_trips_per_op": r["round_trips_per_op"],
            "in_bare_round_trips": r["median_ms"] / rtt[r["mode"]] if r["mode"] in rtt else None,
        }
        for r in sharded
        if r["n"] == small
    ]
    aim1 = []
    for key, what in (("ratio", "median"), ("ratio_best", "best rep")):
        miss = [b for b in bandwidth if b[key] < BANDWIDTH_AIM and b["mode"] == "direct"]
        verdict = "met by every row" if not miss else "missed by " + _misses(miss, key, "{:.2f}")
        aim1.append(f"on {what} times {verdict}")
    if big < LARGE_N:
        aim1 = [f"not evaluated (the aim is for n >= {LARGE_N:.0e}; this run's largest n is {big})"]

    lat_miss = [
        x
        for x in latency
        if x["mode"] == "direct" and (x["median_ms"] > LATENCY_BUDGET_MS or x["round_trips_per_op"] != 1)
    ]
    _mark_targets(sharded, big, small)
    summary = [
        f"aim 1 (n={big}, direct): sharded bandwidth >= {BANDWIDTH_AIM:.0%} of single-process BLAS: "
        + "; ".join(aim1),
        f"aim 2 (n={small}, direct): one round trip and <= {LATENCY_BUDGET_MS} ms per op "
        f"(bare actor round trip here {rtt.get('direct', math.nan):.2f} ms): "
        + ("met by every row" if not lat_miss else "missed by " + _misses(lat_miss, "median_ms", "{:.2f}ms")),
    ]
    return {
        "bandwidth": bandwidth,
        "latency": latency,
        "bare_round_trip_ms": rtt,
        "server_overhead_ms": overhead,
        "summary": summary,
    }


def _mark_targets(sharded: Sequence[dict[str, Any]], big: int, small: int) -> None:
    """Give every direct-mode row an aim applies to its ``target`` and whether it was ``met`` (in place).

    Aim 1 (bandwidth) applies at the largest n when that is at least ``LARGE_N``; aim 2 (latency) at the
    smallest n. A row both aims apply to (a one-size run) carries both, and is met only if both are.
    """
    for r in sharded:
        if r["mode"] != "direct":
            continue
        targets, met = [], []
        if r["n"] == big and big >= LARGE_N and "ratio_to_blas" in r:
            targets.append(f"ratio_to_blas >= {BANDWIDTH_AIM}")
            met.append(bool(r["ratio_to_blas"] >= BANDWIDTH_AIM))
        if r["n"] == small:
            targets.append(f"median_ms <= {LATENCY_BUDGET_MS} and round_trips_per_op == 1")
            met.append(bool(r["median_ms"] <= LATENCY_BUDGET_MS and r["round_trips_per_op"] == 1))
        if targets:
            r["target"] = "; ".join(targets)
            r["met"] = all(met)


def _misses(items: Sequence[dict[str, Any]], key: str, fmt: str) -> str:
    return ", ".join(f"{x['op']} S={x['shards']} ({fmt.format(x[key])})" for x in items)


# -- entry points ---------------------------------------------------------------------------------------
def run(config: Config, *, cluster: LocalCluster | str | None = None) -> dict[str, Any]:
    """Run the benchmark and return its result (machine info, rows, diagnostics, aims).

    Parameters
    ----------
    config : Config
        What to measure.
    cluster : LocalCluster or str, optional
        A cluster (or scheduler address) to run on. By default a
        ``LocalCluster(n_workers=2, threads_per_worker=1, processes=True)`` is started and stopped.

    Examples
    --------
    >>> result = run(Config(sizes=(1000,), shards=(1,), reps_small=3))   # doctest: +SKIP
    >>> result["rows"][0]["median_ms"]                                   # doctest: +SKIP
    0.0004
    """
    started = time.time()
    load_before = os.getloadavg()
    own = cluster is None
    if cluster is None:
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        )
    rows: list[dict[str, Any]] = []
    diagnostics: dict[str, list[dict[str, Any]]] = {}
    machine: dict[str, Any] = {}
    try:
        rng = np.random.default_rng(config.seed)
        with tempfile.TemporaryDirectory(prefix="shard_ops-") as tmp:
            # Size by size, the single-process rows right before the sharded ones: on a shared machine the
            # load drifts, and a ratio of two figures taken minutes apart would measure the drift.
            for n in config.sizes:
                rows.extend(_single_rows(n, config, rng))
                # Let the driver's OpenBLAS threads go back to sleep before the workers need the cores.
                time.sleep(0.2)
                for mode in config.modes:
                    # One client at a time: actor handles bind to the process's default client.
                    with Client(cluster, direct_to_workers=_MODES[mode], set_as_default=True) as client:
                        if not machine:
                            machine = _machine(client)
                        for shards in config.shards:
                            store = Path(tmp) / f"{mode}-{n}-{shards}"
                            rows.extend(_sharded_rows(client, mode, n, shards, config, store, rng))
            if config.diagnostics:
                with Client(cluster, direct_to_workers=True, set_as_default=True) as client:
                    diagnostics["breakdown"] = _breakdown_diagnostic(client, config, Path(tmp) / "breakdown")
                    diagnostics["ping_during_op"] = _ping_during_op_diagnostic(
                        client, config, Path(tmp) / "ping"
                    )
    finally:
        if own:
            assert isinstance(cluster, LocalCluster)
            cluster.close()
    for field, ratio in (("gb_s", "ratio_to_blas"), ("gb_s_best", "ratio_to_blas_best")):
        reference = _blas_reference(rows, field)
        for r in rows:
            key = (r["op"], r["k"], r["n"])
            if field in r and key in reference:
                r[ratio] = r[field] / reference[key]
    return {
        "benchmark": "shard_ops",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": asdict(config),
        "machine": {**machine, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "rows": rows,
        "diagnostics": diagnostics,
        "aims": _aims(rows, config),
    }


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 1000,1e6; got {text!r}"
        ) from None


def main(argv: Sequence[str] | None = None, *, cluster: LocalCluster | str | None = None) -> dict[str, Any]:
    """Command line: run, print the table, write the JSON; returns the result.

    Examples
    --------
    >>> main(["--quick", "--out", "/tmp/shard_ops.json"])   # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="~30 s: no 1e7 vectors, fewer reps")
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--sizes", type=_ints, help="vector lengths, e.g. 1e3,1e6,1e7")
    parser.add_argument("--shards", type=_ints, help="shard counts, e.g. 1,2,4")
    parser.add_argument("--reps", type=int, help="timed repetitions for every size")
    parser.add_argument("--modes", help="direct,proxied (default both)")
    parser.add_argument("--lincomb-terms", type=_ints, help="k of the lincomb rows, e.g. 3,11")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the breakdown / ping diagnostics")
    args = parser.parse_args(argv)
    base = Config.quick() if args.quick else Config()
    changes: dict[str, Any] = {}
    if args.sizes:
        changes["sizes"] = args.sizes
    if args.shards:
        changes["shards"] = args.shards
    if args.reps:
        changes["reps_small"] = changes["reps_large"] = args.reps
    if args.modes:
        changes["modes"] = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if args.lincomb_terms:
        changes["lincomb_terms"] = args.lincomb_terms
    if args.no_diagnostics:
        changes["diagnostics"] = False
    try:
        config = Config(**{**asdict(base), **changes})
    except InvalidOptionError as exc:
        parser.error(str(exc))
    result = run(config, cluster=cluster)
    print(format_table(result))
    load = result["machine"]
    print(
        f"load average before / after: {load['loadavg_before'][0]:.2f} / {load['loadavg_after'][0]:.2f} "
        f"on {load['cpu_count']} cores (above ~0.5 the machine was not quiet: figures are noisy); "
        f"{result['duration_s']:.0f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
