"""Load on the REST API: concurrent job submissions and status reads against a real uvicorn server.

The server listens on 127.0.0.1 only and runs its jobs on a local Dask cluster (2 workers). The load is
bounded: ``--jobs`` concurrent submissions of tiny Sandblaster jobs (logistic regression on 240 x 4 rows,
3 iterations), then ``--reads`` concurrent status reads while those jobs run, then polling until every job
has reached a final state (or ``--timeout`` seconds pass). Reports p50 / p99 / max latency of both kinds of
request and how long the queue took to drain, as JSON (``benchmarks/results/api_load.json``).

Targets (each row of the JSON's ``targets`` says what it asks and whether it was ``met``; the printed summary
names every miss): no job lost, every job final, no request refused, submissions answered within
``SUBMIT_P99_TARGET_MS`` and status reads under load within ``STATUS_READ_P99_TARGET_MS`` at the 99th
percentile (the dashboard polls them).

The machine may be shared: the JSON says the load average before and after every round, and ``--against
CHECKOUT`` runs the same load, in the same period, against a server started from another checkout of the
project (say, the main branch), alternating the two for ``--rounds`` rounds, so that two versions are
compared under the same conditions; every run says which code it ran (``code``: the checkout's commit,
whether its work tree differs from it, and whether the server found uvloop and httptools). The reference
row is SciPy's L-BFGS-B solving the same jobs one after the other in this process (no service at all), and
``status_read_idle`` the floor of one read at a time.

Run: ``python benchmarks/api_load.py`` (``--help`` for the knobs); ``--quick`` is a smoke run (5 jobs, 20
reads, one round).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import scipy.optimize

FINAL = ("succeeded", "failed", "cancelled")
#: The 99th percentile of status reads under load, in ms, that the service aims for.
STATUS_READ_P99_TARGET_MS = 100.0
#: ... and of the submissions.
SUBMIT_P99_TARGET_MS = 300.0
ROOT = Path(__file__).resolve().parents[1]
TINY_JOB = {
    "algorithm": "sandblaster-lbfgs",
    "dataset": "tiny",
    "model": {"kind": "logistic", "n_features": 4},
    "options": {"maxiter": 3},
}


def tiny_npz(n: int = 240, d: int = 4, seed: int = 0) -> bytes:
    """A small binary problem as an .npz upload."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = (X @ rng.normal(size=d) > 0).astype(float)
    buf = io.BytesIO()
    np.savez(buf, X=X, y=y)
    return buf.getvalue()


def _summary(latencies: list[float], errors: int) -> dict[str, Any]:
    ms = np.asarray(latencies) * 1e3
    return {
        "n": len(latencies) + errors,
        "errors": errors,
        "p50_ms": float(np.percentile(ms, 50)) if ms.size else None,
        "p99_ms": float(np.percentile(ms, 99)) if ms.size else None,
        "max_ms": float(ms.max()) if ms.size else None,
    }


async def _timed(
    http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
) -> tuple[float, httpx.Response]:
    start = time.perf_counter()
    response = await http.request(method, url, **kwargs)
    return time.perf_counter() - start, response


async def raw_request(
    base_url: str, method: str, path: str, token: str | None, body: dict[str, Any] | None = None
) -> tuple[float, int, bytes]:
    """One HTTP/1.1 request on a connection of its own: ``(seconds, status, body)``.

    The load is generated with plain asyncio streams, not httpx: with hundreds of requests in flight,
    httpx's own bookkeeping costs more than the server's work and the figures would measure the client.
    """
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(data)}", "Connection: close"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    if body is not None:
        head.append("Content-Type: application/json")
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length"
        )
        payload = await reader.readexactly(length)
    finally:
        writer.close()
    return time.perf_counter() - start, status, payload


async def run_load(
    base_url: str,
    token: str | None,
    *,
    n_jobs: int = 50,
    n_reads: int = 200,
    job: dict[str, Any] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Submit ``n_jobs`` jobs at once, read job statuses ``n_reads`` times at once, wait for every job.

    Returns latencies (p50/p99/max in ms, errors) of both, the job ids, their final statuses, how many jobs
    the server lost (submitted but not listed) and the seconds until every job had finished.
    """
    start = time.perf_counter()
    submitted = await asyncio.gather(
        *(
            raw_request(base_url, "POST", "/api/jobs", token, {**(job or TINY_JOB), "name": f"load-{i}"})
            for i in range(n_jobs)
        )
    )
    ok = [json.loads(body)["id"] for _, code, body in submitted if code == 201]
    submit = _summary([t for t, code, _ in submitted if code == 201], n_jobs - len(ok))
    ids = ok or ["0" * 16]
    reads = await asyncio.gather(
        *(raw_request(base_url, "GET", f"/api/jobs/{ids[i % len(ids)]}", token) for i in range(n_reads))
    )
    status = _summary([t for t, code, _ in reads if code == 200], sum(code != 200 for _, code, _ in reads))
    final: dict[str, str] = {}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as http:
        deadline = time.monotonic() + timeout
        while len(final) < len(ok) and time.monotonic() < deadline:
            listed = (await http.get("/api/jobs", params={"limit": 1000})).json()["data"]
            final = {j["id"]: j["status"] for j in listed if j["id"] in ok and j["status"] in FINAL}
            await asyncio.sleep(0.2)
        drained = time.perf_counter() - start
        listed_ids = {j["id"] for j in (await http.get("/api/jobs", params={"limit": 1000})).json()["data"]}
    counts: dict[str, int] = {}
    for s in final.values():
        counts[s] = counts.get(s, 0) + 1
    return {
        "submit": submit,
        "status_read": status,
        "job_ids": ok,
        "final_statuses": counts,
        "not_final": len(ok) - len(final),
        "lost": len(set(ok) - listed_ids),
        "all_final_s": drained if len(final) == len(ok) else None,
    }


async def unloaded_reads(base_url: str, token: str | None, job_id: str, n: int = 50) -> dict[str, Any]:
    """Status reads one at a time on an idle server: the floor under the latencies under load."""
    times = [(await raw_request(base_url, "GET", f"/api/jobs/{job_id}", token))[0] for _ in range(n)]
    return _summary(times, 0)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the run (see the module docstring) with its measured value and whether it was met."""
    p99 = result["status_read"]["p99_ms"]
    rows = [
        {"what": "jobs lost", "target": 0, "value": result["lost"]},
        {"what": "jobs not final", "target": 0, "value": result["not_final"]},
        {"what": "submissions refused", "target": 0, "value": result["submit"]["errors"]},
        {"what": "status reads refused", "target": 0, "value": result["status_read"]["errors"]},
    ]
    for row in rows:
        row["met"] = row["value"] == row["target"]
    submit_p99 = result["submit"].get("p99_ms")
    rows.append(
        {
            "what": "submit p99 under load (ms)",
            "target": f"<= {SUBMIT_P99_TARGET_MS}",
            "value": submit_p99,
            "met": submit_p99 is not None and submit_p99 <= SUBMIT_P99_TARGET_MS,
        }
    )
    rows.append(
        {
            "what": "status read p99 under load (ms)",
            "target": f"<= {STATUS_READ_P99_TARGET_MS}",
            "value": p99,
            "met": p99 is not None and p99 <= STATUS_READ_P99_TARGET_MS,
        }
    )
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scipy_reference(n_jobs: int) -> dict[str, Any]:
    """The same jobs solved one after the other in this process by SciPy's L-BFGS-B (no service)."""
    with np.load(io.BytesIO(tiny_npz())) as f:
        X, y = f["X"], f["y"]

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = X @ w
        loss = np.logaddexp(0.0, z) - y * z
        return float(loss.mean()), X.T @ (1.0 / (1.0 + np.exp(-z)) - y) / len(y)

    start = time.perf_counter()
    for _ in range(n_jobs):
        scipy.optimize.minimize(
            fun,
            np.zeros(X.shape[1]),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": TINY_JOB["options"]["maxiter"]},
        )
    return {
        "what": "scipy L-BFGS-B, the same jobs in sequence in one process",
        "all_final_s": time.perf_counter() - start,
    }


def _output(cmd: list[str], **kwargs: Any) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kwargs)
    out, _ = proc.communicate(timeout=60)
    return out.strip() if proc.returncode == 0 else ""


def code_of(checkout: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Which code a server started from ``checkout`` (with ``env``) runs: the commit, whether the work tree
    differs from it, and whether its interpreter finds uvloop and httptools (uvicorn serves with them when it
    does), so that the two sides of a comparison are known to be what they were meant to be."""
    probe = "import importlib.util as u; print(*(bool(u.find_spec(m)) for m in ('uvloop', 'httptools')))"
    found = _output([sys.executable, "-c", probe], cwd=checkout, env=env or dict(os.environ)).split()
    return {
        "commit": _output(["git", "-C", str(checkout), "rev-parse", "HEAD"]) or None,
        # Results written by earlier runs (benchmarks/results) are not a change of the code.
        "dirty": bool(
            _output(
                [
                    "git",
                    "-C",
                    str(checkout),
                    "status",
                    "--porcelain",
                    "--untracked-files=no",
                    "--",
                    ".",
                    ":!benchmarks/results",
                ]
            )
        ),
        "uvloop": found[:1] == ["True"],
        "httptools": found[1:2] == ["True"],
    }


def serve_and_load(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round: start `distbelief serve` from ``checkout``, warm it up, read one at a time, then load it."""
    # The server is `distbelief serve` in a process of its own (embedded 2-worker LocalCluster), as a user
    # runs it, so the load generator does not share its interpreter.
    token = "bench-token-0123456789abcdef"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    with tempfile.TemporaryDirectory(prefix="api-load-") as store:
        env = {
            **os.environ,
            "DISTBELIEF_API_TOKEN": token,
            "DISTBELIEF_MAX_CONCURRENT_JOBS": str(args.concurrent_jobs),
            "DISTBELIEF_N_WORKERS": "2",
        }
        cmd = [
            sys.executable,
            "-m",
            "distbelief.api.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        cmd += ["--store", store, "--log-level", "warning"]
        code = code_of(checkout, env)
        # The checkout's own distbelief comes first on sys.path: its working directory is the checkout.
        server = subprocess.Popen(cmd, env=env, cwd=checkout)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, "the server exited"
                try:
                    if httpx.get(url + "/api/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
            with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
                files = {"file": ("t.npz", tiny_npz())}
                http.post("/api/datasets", data={"name": "tiny"}, files=files).raise_for_status()
                warm = http.post("/api/jobs", json=TINY_JOB).json()["id"]  # warm-up: imports, first actors
                while http.get(f"/api/jobs/{warm}").json()["status"] not in FINAL:
                    time.sleep(0.1)
            time.sleep(0.5)  # the warm-up job's thread has finished its clean-up
            idle = asyncio.run(unloaded_reads(url, token, warm))
            before = os.getloadavg()
            result = asyncio.run(
                run_load(url, token, n_jobs=args.jobs, n_reads=args.reads, timeout=args.timeout)
            )
            after = os.getloadavg()
        finally:
            server.terminate()
            server.wait(timeout=60)
    result.pop("job_ids")
    return {
        "code": code,
        "status_read_idle": idle,
        **result,
        "load_average_before": before,
        "load_average_after": after,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the latencies; losses, refusals and jobs not final summed (any is a miss)."""

    def med(kind: str, key: str) -> float | None:
        values = [r[kind][key] for r in runs if r[kind][key] is not None]
        return float(statistics.median(values)) if values else None

    out: dict[str, Any] = {"rounds": len(runs), "code": runs[0]["code"] if runs else None}
    for kind in ("status_read_idle", "submit", "status_read"):
        out[kind] = {
            "errors": sum(r[kind]["errors"] for r in runs),
            **{f"median_{k}": med(kind, k) for k in ("p50_ms", "p99_ms", "max_ms")},
            "p99_ms": med(kind, "p99_ms"),
        }
    out["lost"] = sum(r["lost"] for r in runs)
    out["not_final"] = sum(r["not_final"] for r in runs)
    finals = [r["all_final_s"] for r in runs if r["all_final_s"] is not None]
    out["median_all_final_s"] = float(statistics.median(finals)) if finals else None
    out["median_load_average_1min"] = float(
        statistics.median([(r["load_average_before"][0] + r["load_average_after"][0]) / 2 for r in runs])
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50, help="concurrent job submissions (default 50)")
    parser.add_argument("--reads", type=int, default=200, help="concurrent status reads (default 200)")
    parser.add_argument("--concurrent-jobs", type=int, default=2, help="jobs the server runs at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every job")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each checkout once per round)")
    parser.add_argument(
        "--against", default=None, help="another checkout of the project to run the same load against"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "api_load.json"))
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 5 jobs, 20 reads, one round, 120 s timeout"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.reads, args.timeout, args.rounds = 5, 20, 120.0, 1
    checkouts = {"this": ROOT}
    if args.against:
        checkouts["against"] = Path(args.against).resolve()
        if not (checkouts["against"] / "distbelief").is_dir():
            parser.error(f"--against {args.against}: not a checkout of distbelief (no distbelief/ in it)")

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        # Alternate which goes first, so neither always meets the machine in the same state.
        order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
        for name in order:
            run = serve_and_load(checkouts[name], args)
            runs[name].append(run)
            s, q = run["submit"], run["status_read"]
            code = run["code"]
            which = f"{(code['commit'] or '?')[:10]}{'+dirty' if code['dirty'] else ''}"
            print(
                f"round {r} {name:<8} ({which}, uvloop {code['uvloop']}, httptools {code['httptools']}) "
                f"submit p50/p99 {s['p50_ms']:.0f}/{s['p99_ms']:.0f} ms, "
                f"status read p50/p99 {q['p50_ms']:.0f}/{q['p99_ms']:.0f} ms, lost {run['lost']}, "
                f"load average {run['load_average_before'][0]:.1f} -> {run['load_average_after'][0]:.1f}",
                flush=True,
            )
    summary = {name: summarize(rs) for name, rs in runs.items()}
    this = summary["this"]
    report = {
        "benchmark": "api_load",
        "what": f"{args.jobs} concurrent job submissions, then {args.reads} concurrent status reads while "
        "the jobs run, against `distbelief serve` (uvicorn, one process) on 127.0.0.1; jobs: Sandblaster "
        "L-BFGS, logistic 240x4, 3 iterations; medians over rounds",
        "server": {"max_concurrent_jobs": args.concurrent_jobs, "dask_workers": 2, "threads_per_worker": 1},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            # The machine is shared: other work running meanwhile shows here (1, 5, 15 min).
            "load_average_at_end": list(os.getloadavg()),
        },
        "checkouts": {name: str(path) for name, path in checkouts.items()},
        "reference": scipy_reference(args.jobs),
        "summary": summary,
        "runs": runs,
        "quick": args.quick,
        "targets": targets(this),
    }
    if "against" in summary:
        other = summary["against"]
        report["ratios_against"] = {
            f"{kind} {q}": (
                other[kind][q] / this[kind][q] if this[kind][q] and other[kind][q] is not None else None
            )
            for kind in ("submit", "status_read")
            for q in ("median_p50_ms", "median_p99_ms")
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("summary", "targets", "reference")}, indent=2))
    for row in report["targets"]:
        verdict = "met" if row["met"] else "MISSED"
        print(f"{row['what']:<32} {row['value']!s:>10}  target {row['target']!s:<10} {verdict}")
    ok = all(row["met"] for row in report["targets"][:4])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
