"""The steps a ``kill -9`` of the service costs a running Downpour job (issue 27 item 2), measured end to end.

Downpour paces its shard checkpoints so that a kill loses about 5% of a run's steps
(``downpour._resume.checkpoint_interval``: one once 5% of the time trained has passed since the last). This
script measures it as an operator would meet it: ``distbelief serve`` runs as a process of its own against
a Dask cluster of its own (the script's LocalCluster, 2 worker processes, as docker-compose.yml runs the API
apart from the scheduler and workers), with a token, on 127.0.0.1. A Downpour job on the digits (an MLP, so
that a step takes a while) runs once whole: the reference, its steps ``T``. Then, for each kill point
``f``, the same job is submitted and the service is killed with SIGKILL once the job's replicas have done
``f * T`` steps (their own counters, read on the workers as the metrics page reads them: the job's record
shows its steps only as its history rows are evaluated, seconds late). The service is started again on the
same store, and the job followed to its end. Its record says from which checkpoint step it resumed
(``resumed_from``): the steps done when killed, less that, are the steps lost, ``lost_share`` of ``T``
(a resumed run stops at its ``epochs`` exactly, so ``T`` is the steps of every run).

The job's options are the service's defaults but for ``epochs`` (so ``checkpoint_every_s`` is 5 s). The
box may be shared: the JSON says the load average before and after. The figures are steps, but the
checkpoints are paced by time, so a loaded box moves them somewhat.

Run: ``python benchmarks/api_kill.py`` (three kill points, a few minutes); ``--quick`` is a smoke run (a
short job, one kill). Writes ``benchmarks/results/api_kill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/api_kill.py`: this checkout's distbelief, here and in the workers it spawns.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
TOKEN = "kill-token-0123456789abcdef"
FINAL = ("succeeded", "failed", "cancelled")
#: What "about 5%" allows: the issue's figure.
TARGET_LOST_SHARE = 0.05
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_body(epochs: int, lr: float | None = None) -> dict[str, Any]:
    """The Downpour job: an MLP on the digits, 2 replicas, the service's defaults but ``epochs`` (and ``lr``
    when given).

    Examples
    --------
    >>> job_body(3)["options"], job_body(3, lr=0.05)["options"]["lr"]
    ({'epochs': 3, 'replicas': 2}, 0.05)
    """
    options: dict[str, Any] = {"epochs": epochs, "replicas": 2}
    if lr is not None:
        options["lr"] = lr
    return {
        "name": "kill -9 measurement",
        "algorithm": "downpour-sgd",
        "dataset": "digits",
        "model": {"kind": "mlp", "layer_sizes": [64, 256, 256, 10]},
        "options": options,
    }


def replica_steps(dask_worker: Any) -> int:
    """The steps of every Downpour replica on a worker (its actors' ``monitor()`` counters, as the metrics
    page reads them; run with ``Client.run``)."""
    steps = 0
    for actor in list(dask_worker.state.actors.values()):
        monitor = getattr(actor, "monitor", None)
        if monitor is not None:
            with contextlib.suppress(Exception):  # an actor half-built or closing
                steps += sum(v for name, _, v in monitor() if name == "distbelief_replica_steps_total")
    return int(steps)


def lost(record: dict[str, Any], steps_at_kill: int, total: int) -> dict[str, Any]:
    """The steps a kill lost, from the job's final record, the steps done when killed and the run's steps.

    Examples
    --------
    >>> lost({"resumed_from": 900, "restarts": 1}, 950, 1000)["lost_share"]
    0.05
    """
    resumed = int(record.get("resumed_from") or 0)
    return {
        "steps_at_kill": steps_at_kill,
        "resumed_from": resumed,
        "restarts": record.get("restarts"),
        "lost_steps": steps_at_kill - resumed,
        "lost_share": round((steps_at_kill - resumed) / total, 4),
    }


class Service:
    """``distbelief serve`` in a process of its own on 127.0.0.1, against ``scheduler``, on ``store``."""

    def __init__(self, store: Path, scheduler: str) -> None:
        self.store = store
        self.scheduler = scheduler
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
        env["DISTBELIEF_API_TOKEN"] = TOKEN
        cmd = [sys.executable, "-m", "distbelief.api.cli", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--store", str(self.store), "--scheduler", self.scheduler]
        cmd += ["--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"distbelief serve exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/api/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"distbelief serve did not answer in {START_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no clean-up, no last checkpoint."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)


def _wait_final(http: httpx.Client, job_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        record: dict[str, Any] = http.get(f"/api/jobs/{job_id}").json()
        if record["status"] in FINAL:
            return record
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} still {record['status']} after {timeout:g} s")
        time.sleep(0.2)


def _upload_digits(http: httpx.Client) -> None:
    from distbelief.storage import load_digits

    X, y = load_digits()
    buf = io.BytesIO()
    np.savez(buf, X=X, y=y)
    http.post(
        "/api/datasets", data={"name": "digits"}, files={"file": ("d.npz", buf.getvalue())}
    ).raise_for_status()


def measure(
    dask: Any, epochs: int, fractions: list[float], timeout: float, lr: float | None = None
) -> dict[str, Any]:
    """The reference run and one killed run a fraction, on the cluster of the Dask client ``dask``."""
    with tempfile.TemporaryDirectory(prefix="api-kill-") as tmp:
        service = Service(Path(tmp) / "store", dask.scheduler.address)
        try:
            service.start()
            with service.http() as http:
                _upload_digits(http)
                started = time.monotonic()
                job_id = http.post("/api/jobs", json=job_body(epochs, lr)).json()["id"]
                reference = _wait_final(http, job_id, timeout)
                wall = time.monotonic() - started
            if reference["status"] != "succeeded":
                raise RuntimeError(f"the reference job {reference['status']}: {reference['message']}")
            total = int(reference["result"]["steps"])
            kills = []
            for fraction in fractions:
                with service.http() as http:
                    job_id = http.post("/api/jobs", json=job_body(epochs, lr)).json()["id"]
                    deadline = time.monotonic() + timeout
                    while (done := sum(dask.run(replica_steps).values())) < fraction * total:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"the job did {done} of {total} steps in {timeout:g} s")
                        time.sleep(0.05)
                service.kill()
                record = json.loads((Path(tmp) / "store" / "jobs" / job_id / "job.json").read_text())
                if record["status"] != "running":
                    raise RuntimeError(f"the job was {record['status']} when killed: kill it earlier")
                service.start()
                with service.http() as http:
                    final = _wait_final(http, job_id, timeout)
                result = final.get("result") or {}
                kills.append(
                    {
                        "kill_at": fraction,
                        **lost(final, done, total),
                        "status": final["status"],
                        "steps": result.get("steps"),
                        "stop_reason": result.get("stop_reason"),
                    }
                )
        finally:
            service.stop()
    worst = max(k["lost_share"] for k in kills)
    return {
        "job": job_body(epochs, lr),
        "reference": {
            "steps": total,
            "wall_s": round(wall, 2),
            "status": reference["status"],
            "checkpoints": reference["result"]["stats"]["checkpoints"],
        },
        "kills": kills,
        "worst_lost_share": worst,
        "target": {"lost_share_at_most": TARGET_LOST_SHARE, "met": worst <= TARGET_LOST_SHARE},
    }


@contextlib.contextmanager
def dask_client(scheduler: str | None) -> Iterator[Any]:
    """A Dask client of ``scheduler``, or of a LocalCluster of 2 worker processes started here."""
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler is None:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=None,
                    host="127.0.0.1",
                )
            )
            scheduler = str(cluster.scheduler_address)
        yield stack.enter_context(Client(scheduler))


def main(argv: list[str] | None = None, scheduler: str | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=200, help="the job's epochs (default 200)")
    parser.add_argument(
        "--kill-at", default="0.3,0.6,0.9", help="kill points, as fractions of the run's steps (0.3,0.6,0.9)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a job (600)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 20 epochs at lr 0.05, one kill at 0.5"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "api_kill.json"))
    args = parser.parse_args(argv)
    epochs = 20 if args.quick else args.epochs
    fractions = [0.5] if args.quick else [float(f) for f in args.kill_at.split(",")]
    before = os.getloadavg()
    with dask_client(scheduler) as dask:
        # The smoke run at a smaller rate than the service's default (0.2): a quick run of the default
        # diverged once in CI, in its first epochs (the objective from 2.4 to 50); the full runs have not.
        result = measure(dask, epochs, fractions, args.timeout, lr=0.05 if args.quick else None)
    result["load_average_before"], result["load_average_after"] = before, os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k in result["kills"]:
        print(
            f"killed at {k['kill_at']:.0%}: lost {k['lost_steps']} of {result['reference']['steps']} steps "
            f"({k['lost_share']:.1%}); {k['status']} after {k['restarts']} restart(s), {k['steps']} steps "
            f"({k['stop_reason']})"
        )
    print(f"-> {args.out}")
    return result


if __name__ == "__main__":
    main()
