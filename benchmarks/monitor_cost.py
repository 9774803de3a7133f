"""What the metrics page (storage._monitor, issue 25 item 4) costs a Sandblaster L-BFGS run.

The page adds work in two places: counters the shards and replicas update as they work (one dict update per
shard op, three integer additions per replica work call), and the page itself, computed only when someone
reads it. Measured here, on the embedded cluster (worker processes on 127.0.0.1):

- ``counted``: how many shard ops and replica work calls one L-BFGS iteration makes (the workers keep every
  shard and replica of the run alive to count them afterwards);
- ``micro``: the time of the added counter update (``timeit`` in this process), hence the added time per
  iteration, against the measured time of an iteration (``estimated_fraction``);
- ``ab``: the same run, interleaved, with the op counter removed on the workers (``off``: the shard's
  ``_count`` as it was before the page), as shipped (``on``), and as shipped with the page read every
  ``--scrape-every`` seconds (``on+scrape``); median seconds per iteration of each, and ``on`` / ``off``
  - 1. On a shared machine the spread between rounds is larger than the effect: this is the check that
  nothing larger than the estimate shows up, the estimate is the figure;
- ``scrape``: the median time of one read of the page on the scheduler's port during a run (every worker
  answers one message).

Run ``python benchmarks/monitor_cost.py [--quick] [--out PATH]`` (a full run takes about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import timeit
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the checkout's root on the path, as for the other scripts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distbelief import models, sandblaster
from distbelief.storage import _cluster, _monitor

RESULTS = Path(__file__).resolve().parent / "results" / "monitor_cost.json"


# -- on the workers -----------------------------------------------------------------------------------------
def _set_counting(on: bool) -> None:
    """The shard's op counter as shipped (``on``) or removed (the ``_count`` from before the page)."""
    from distbelief.storage._shard import Shard

    original = Shard.__dict__.get("_shipped_count") or Shard._count
    Shard._shipped_count = original  # type: ignore[attr-defined]

    def _count_without_ops(self: Shard, kind: str, t0: float) -> None:
        self.op_seconds[kind] = self.op_seconds.get(kind, 0.0) + time.perf_counter() - t0

    Shard._count = original if on else _count_without_ops  # type: ignore[method-assign]


def _track(on: bool) -> None:
    """Keep every shard and replica built from now on (``on``), to count their work after the run."""
    import gc

    from distbelief.sandblaster._replica import Replica
    from distbelief.storage._shard import Shard

    # Kept on the class: this function travels by value when the script runs as __main__ (its globals with
    # it), the class is the workers' own.
    kept: list[Any] = Shard.__dict__.get("_bench_kept") or []
    Shard._bench_kept = kept  # type: ignore[attr-defined]
    kept.clear()
    for cls in (Shard, Replica):
        init = cls.__dict__.get("_untracked_init") or cls.__init__
        cls._untracked_init = init  # type: ignore[attr-defined]

        def tracked(self: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            kept.append(self)

        cls.__init__ = tracked if on else init  # type: ignore[method-assign]
    gc.collect()


def _counted() -> dict[str, int]:
    from distbelief.storage._shard import Shard

    kept: list[Any] = Shard.__dict__.get("_bench_kept") or []
    ops = sum(sum(getattr(o, "op_counts", {}).values()) for o in kept)
    calls = sum(getattr(o, "work_calls", 0) for o in kept)
    return {"shard_ops": ops, "work_calls": calls}


# -- in the driver ------------------------------------------------------------------------------------------
def _problem(rows: int) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((rows, 20))
    y = (X @ rng.standard_normal(20) + rng.standard_normal(rows) > 0).astype(int)
    return models.MLP([20, 32, 2], activation="tanh"), (X, y)


def _fit(client: Any, iterations: int, rows: int) -> tuple[float, int]:
    model, data = _problem(rows)
    t0 = time.perf_counter()
    res = sandblaster.minimize(model, data, client=client, l2=1e-4, maxiter=iterations, gtol=0.0, ftol=0.0)
    return time.perf_counter() - t0, int(res.nit)


def _scraping(url: str, every: float, stop: threading.Event, times: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as page:
            page.read()
        times.append(time.perf_counter() - t0)
        stop.wait(every)


def main(argv: Sequence[str] | None = None, client: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few short runs (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the three variants")
    parser.add_argument("--scrape-every", type=float, default=0.1, help="seconds between page reads")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    iterations, rows = (40, 2000) if args.quick else (300, 5000)
    client = client or _cluster.shared_embedded_client()
    _cluster.check_workers(client)
    _monitor.install_cluster(client)
    started = time.time()
    _fit(client, 5, rows)  # warm: imports and compiled kernels on the workers

    # What an iteration does.
    client.run(_set_counting, True)
    client.run(_track, True)
    wall, nit = _fit(client, iterations, rows)
    counts = client.run(_counted)
    client.run(_track, False)
    ops = sum(c["shard_ops"] for c in counts.values())
    calls = sum(c["work_calls"] for c in counts.values())
    counted = {"iterations": nit, "shard_ops": ops, "work_calls": calls, "ops_per_iteration": ops / nit}
    counted["work_calls_per_iteration"] = calls / nit

    # The added updates, timed alone.
    d: dict[str, int] = {"lincomb": 0}
    n = 200_000
    op_update = min(
        timeit.repeat(lambda: d.__setitem__("lincomb", d.get("lincomb", 0) + 1), number=n, repeat=5)
    )
    empty = min(timeit.repeat(lambda: None, number=n, repeat=5))
    op_s = max(0.0, (op_update - empty) / n)
    work_s = 3 * op_s  # three integer additions on attributes: bounded by three dict updates
    added = counted["ops_per_iteration"] * op_s + counted["work_calls_per_iteration"] * work_s

    # Interleaved A/B(/C).
    url = client.dashboard_link.rsplit("/", 1)[0] + _monitor.PATH
    per_iter: dict[str, list[float]] = {"off": [], "on": [], "on+scrape": []}
    scrapes: list[float] = []
    for _ in range(rounds):
        for variant in per_iter:
            client.run(_set_counting, variant != "off")
            stop = threading.Event()
            scraper = None
            if variant == "on+scrape":
                scraper = threading.Thread(target=_scraping, args=(url, args.scrape_every, stop, scrapes))
                scraper.start()
            try:
                wall, nit = _fit(client, iterations, rows)
            finally:
                stop.set()
                if scraper is not None:
                    scraper.join(timeout=60)
            per_iter[variant].append(wall / max(1, nit))
    client.run(_set_counting, True)
    med = {k: statistics.median(v) for k, v in per_iter.items()}
    result: dict[str, Any] = {
        "benchmark": "monitor_cost",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["monitor_cost.py", *(argv if argv is not None else sys.argv[1:])]),
        "duration_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "shared": True},
        "config": {
            "rounds": rounds,
            "iterations": iterations,
            "rows": rows,
            "scrape_every_s": args.scrape_every,
        },
        "counted": counted,
        "micro": {
            "op_counter_update_ns": op_s * 1e9,
            "added_per_iteration_us": added * 1e6,
            "iteration_ms": med["on"] * 1e3,
            "estimated_fraction": added / med["on"],
        },
        "ab": {
            "seconds_per_iteration": per_iter,
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "on_over_off_minus_1": med["on"] / med["off"] - 1,
            "scrape_over_off_minus_1": med["on+scrape"] / med["off"] - 1,
            "spread_off": (max(per_iter["off"]) - min(per_iter["off"])) / med["off"],
        },
        "scrape": {"reads": len(scrapes), "median_ms": 1e3 * statistics.median(scrapes) if scrapes else None},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    micro, ab = result["micro"], result["ab"]
    print(
        f"{counted['ops_per_iteration']:.1f} shard ops and {counted['work_calls_per_iteration']:.2f} "
        f"work calls an iteration; counter update {micro['op_counter_update_ns']:.0f} ns -> "
        f"{micro['added_per_iteration_us']:.2f} us of a {micro['iteration_ms']:.2f} ms iteration "
        f"({100 * micro['estimated_fraction']:.3f}%); A/B medians (ms/iteration) {ab['median_ms']} "
        f"(spread of 'off' {100 * ab['spread_off']:.0f}%); a page read {result['scrape']['median_ms']} ms"
    )
    return result


if __name__ == "__main__":
    main()
