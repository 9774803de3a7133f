"""docker-compose.yml without Docker: start exactly the commands it runs (a Dask scheduler, two workers, the
API) as separate processes on 127.0.0.1, and run jobs through them end to end, killing the API mid-job once.

Only addresses change: every ``0.0.0.0`` becomes ``127.0.0.1``, the service name ``scheduler`` becomes
127.0.0.1, fixed ports become free ones, and the volume path ``/data/store`` a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from distributed import Client as DaskClient

from distbelief import models, sandblaster
from distbelief.api import ApiError, Client
from distbelief.downpour._resume import checkpoint_vector, resume_point
from distbelief.storage import Dataset, load_digits
from tests.api.conftest import LOGISTIC, scipy_logistic, tiny_xy

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOKEN = "compose-token-0123456789abcdef"
SOFTMAX = {"kind": "softmax", "n_features": 64, "n_classes": 10}
LBFGS: dict[str, Any] = {"gtol": 0.0, "ftol": 0.0, "maxiter": 120, "checkpoint_every": 5, "l2": 1e-3}
DOWNPOUR = {"epochs": 300, "lr": 0.3, "checkpoint_every_s": 0.2, "replicas": 2}


class _NoPoint:
    step = -1


NO_POINT = _NoPoint()


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable forms: ``${VAR:?message}`` (required), ``${VAR:-default}``, ``${VAR}``."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        given = env.get(name) or ""
        if op == ":?" and not given:
            raise KeyError(f"required variable {name} is missing: {arg}")
        return given or (arg if op == ":-" else "")

    return re.sub(r"\$\{(\w+)(?:(:\?|:-)([^}]*))?\}", one, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args!r} exited with {proc.returncode}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Deployment:
    """The compose services as local processes."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {"8786": _free_port(), "8787": _free_port(), "8000": _free_port()}
        self.store = tmp / "store"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "DISTBELIEF_API_TOKEN": TOKEN}
        for var in ("DISTBELIEF_DASK_DASHBOARD_URL", "DISTBELIEF_MAX_CONCURRENT_JOBS", "DISTBELIEF_PORT"):
            self.env.pop(var, None)
        # The services run this checkout's code (its distbelief/ links), not whichever copy is installed.
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

    def localize(self, text: str) -> str:
        text = text.replace("0.0.0.0", "127.0.0.1").replace("/data/store", str(self.store))
        text = text.replace("scheduler:8786", f"127.0.0.1:{self.ports['8786']}")
        for fixed, port in self.ports.items():
            text = text.replace(f"127.0.0.1:{fixed}", f"127.0.0.1:{port}")
        if text == ":8787":
            return f"127.0.0.1:{self.ports['8787']}"
        return str(self.ports[text]) if text in self.ports else text

    def command(self, service: str) -> list[str]:
        argv = [self.localize(a) for a in _compose()["services"][service]["command"]]
        exe = BIN / argv[0]
        assert exe.exists(), f"{argv[0]} is not installed next to {sys.executable}"
        return [str(exe), *argv[1:]]

    def healthcheck(self, service: str) -> subprocess.CompletedProcess[str]:
        """Run the service's healthcheck (``CMD`` form) here, as Docker runs it in the container."""
        test = _compose()["services"][service]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = [self.localize(a) for a in test[1:]]
        exe = BIN / argv[0]
        return subprocess.run(
            [str(exe), *argv[1:]], env=self.environment(service), capture_output=True, text=True, timeout=60
        )

    def environment(self, service: str) -> dict[str, str]:
        env = dict(self.env)
        for key, value in (_compose()["services"][service].get("environment") or {}).items():
            env[key] = self.localize(interpolate(str(value), self.env))
        return env

    def start(self, service: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{service}.log", "ab")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(
            self.command(service),
            env=self.environment(service),
            cwd=self.tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the worker's nanny and child go with it
        )
        self.procs[service] = proc
        return proc

    def stop(self, service: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(service)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['8000']}"

    def wait_api(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.procs["api"].poll() is None, "the API exited:\n" + self.logs()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/api/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("the API did not become healthy:\n" + self.logs())


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    try:
        scheduler = d.start("scheduler")
        _wait_port(d.ports["8786"], scheduler)
        d.start("worker-1")
        d.start("worker-2")
        d.start("api")
        d.wait_api()
        # The API is healthy before both workers have registered: the test reads the cluster's workers.
        with DaskClient(f"tcp://127.0.0.1:{d.ports['8786']}", set_as_default=False) as dask_client:
            dask_client.wait_for_workers(2, timeout=90)
        yield d
    finally:
        for service in ("api", "worker-2", "worker-1", "scheduler"):
            if service in d.procs:
                d.stop(service)


def test_compose_file_requires_the_token_and_checks_health() -> None:
    compose = _compose()
    assert set(compose["services"]) == {"scheduler", "worker-1", "worker-2", "api"}
    api = compose["services"]["api"]
    assert "${DISTBELIEF_API_TOKEN:?" in api["environment"]["DISTBELIEF_API_TOKEN"]
    with pytest.raises(KeyError, match="DISTBELIEF_API_TOKEN"):
        interpolate(api["environment"]["DISTBELIEF_API_TOKEN"], {})
    assert any("/api/health" in part for part in api["healthcheck"]["test"])
    # The image is built once: one service builds and tags it, the others run that tag and never pull it.
    builders = [name for name, service in compose["services"].items() if "build" in service]
    assert builders == ["scheduler"] and compose["services"]["scheduler"]["build"] == "."
    for name, service in compose["services"].items():
        assert service["image"] == "distbelief:latest", name
        if name not in builders:
            assert service["pull_policy"] == "never", name
    for name in ("worker-1", "worker-2", "api"):
        assert "store:/data" in compose["services"][name]["volumes"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install ." in dockerfile and "/api/health" in dockerfile


def test_every_service_checks_its_own_health() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "python", (name, test)
    # Each checks its own process: the scheduler its liveness route, a worker its registration under its
    # own name (never the API's /api/health, which the Dockerfile's HEALTHCHECK would give every service).
    assert "127.0.0.1:8787/health" in services["scheduler"]["healthcheck"]["test"][-1]
    for name in ("worker-1", "worker-2"):
        check = services[name]["healthcheck"]["test"][-1]
        assert "/api/health" not in check and f"'{name}'" in check and "scheduler:8786" in check
        assert f"--name', '{name}'" in repr(services[name]["command"])
    assert "127.0.0.1:8000/api/health" in services["api"]["healthcheck"]["test"][-1]
    # The API starts once both workers are healthy, the workers once the scheduler is.
    assert {w: c["condition"] for w, c in services["api"]["depends_on"].items()} == {
        "worker-1": "service_healthy",
        "worker-2": "service_healthy",
    }
    for name in ("worker-1", "worker-2"):
        assert services[name]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_the_compose_commands_run_a_job_end_to_end_and_survive_an_api_crash(deployment: Deployment) -> None:
    d = deployment
    with Client(d.url, TOKEN) as api:
        cluster = api.cluster()
        assert not cluster["embedded"] and sorted(w["name"] for w in cluster["workers"]) == [
            "worker-1",
            "worker-2",
        ]
        assert all(w["address"].startswith("tcp://127.0.0.1:") for w in cluster["workers"])
        with pytest.raises(ApiError) as denied, Client(d.url) as anonymous:
            anonymous.jobs()
        assert denied.value.status_code == 401

        X, y = tiny_xy()
        api.upload_dataset("tiny", X, y)
        options = {"l2": 0.05, "gtol": 1e-9}
        job = api.submit(
            {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC, "options": options}
        )
        assert api.wait(job["id"], timeout=120, progress=False)["status"] == "succeeded"
        w, ref = api.params(job["id"]), scipy_logistic(X, y, 0.05)
        np.testing.assert_allclose(w, ref.x, rtol=1e-5, atol=1e-7)
        assert models.objective(models.Logistic(4), w, X, y, l2=0.05)[0] == pytest.approx(ref.fun, rel=1e-10)

        X, y = load_digits()
        api.upload_dataset("digits", X, y)
        long = api.submit(
            {
                "algorithm": "sandblaster-lbfgs",
                "dataset": "digits",
                "model": SOFTMAX,
                # 120 iterations (it converges at 162): ~100 are left after checkpoint 10,
                # so the job is still running when the API is killed, even on a loaded machine.
                "options": LBFGS,
            }
        )
        # Killed once the store records a checkpoint past the first: the store is all the next API gets.
        record_file = d.store / "jobs" / long["id"] / "job.json"
        deadline = time.monotonic() + 120
        while (
            not record_file.exists()
            or (json.loads(record_file.read_text())["checkpoint_iteration"] or 0) < 10
        ):
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.02)
    d.stop("api", signal.SIGKILL)
    d.start("api")
    d.wait_api()
    softmax = models.Softmax(64, 10)
    with Client(d.url, TOKEN) as api:
        assert api.job(job["id"])["status"] == "succeeded"
        record = api.wait(long["id"], timeout=120, progress=False)
        assert record["status"] == "succeeded", record["message"] + d.logs()
        assert record["resumed_from"] >= 10 and record["restarts"] == 1 and record["result"]["nit"] == 120
        assert list(api.metrics(long["id"]).iteration.values) == list(range(121))
        w_long = api.params(long["id"])
        # The resumed Sandblaster job's parameters are the uninterrupted run's: bit for bit when two
        # uninterrupted runs on this cluster agree bit for bit (Sandblaster runs reproducible), else to 1e-9.
        digits = Dataset.in_store(d.store / "datasets", "digits")
        opts = {k: v for k, v in LBFGS.items() if k != "checkpoint_every"}
        with DaskClient(f"tcp://127.0.0.1:{d.ports['8786']}", direct_to_workers=True) as dask_client:
            refs = [
                sandblaster.minimize(
                    softmax, digits, client=dask_client, store=str(d.store / f"ref{i}"), **opts
                )
                for i in range(2)
            ]
        if np.array_equal(refs[0].x, refs[1].x):
            np.testing.assert_array_equal(w_long, refs[0].x)
        else:
            np.testing.assert_allclose(w_long, refs[0].x, rtol=1e-9, atol=1e-12)
        # A Downpour job (~56 steps an epoch: 300 epochs run well past the checkpoint awaited), killed once
        # its shards have a checkpoint past step 3000.
        down = api.submit(
            {"algorithm": "downpour-sgd", "dataset": "digits", "model": SOFTMAX, "options": DOWNPOUR}
        )
        down_run = d.store / "jobs" / down["id"] / "run"
        deadline = time.monotonic() + 120
        while (resume_point(down_run) or NO_POINT).step < 3000:
            assert time.monotonic() < deadline, api.job(down["id"])
            time.sleep(0.02)
        assert api.job(down["id"])["status"] == "running"
    d.stop("api", signal.SIGKILL)
    # What the Downpour job left: its last shard checkpoint, far from the start.
    point = resume_point(down_run)
    assert point is not None and 3000 <= point.step < DOWNPOUR["epochs"] * 56
    x_ckpt = checkpoint_vector(down_run)
    f0 = models.objective(softmax, softmax.init_params(0), X, y)[0]
    f_ckpt = models.objective(softmax, x_ckpt, X, y)[0]
    assert f_ckpt < 0.5 * f0
    d.start("api")
    d.wait_api()
    with Client(d.url, TOKEN) as api:
        # The Downpour job went on from its checkpoint (not from x0) and reached its target.
        resumed = api.wait(down["id"], timeout=180, progress=False)
        assert resumed["status"] == "succeeded", resumed["message"] + d.logs()
        assert resumed["resumed_from"] == point.step and resumed["restarts"] == 1
        assert resumed["result"]["stop_reason"] == "epochs" and resumed["result"]["steps"] > point.step
        h = api.metrics(down["id"])
        first = int(np.searchsorted(h.time.values, point.time))
        assert h.time.values[first] == pytest.approx(point.time) and h.step.values[first] == point.step
        assert float(h.objective.values[first]) == pytest.approx(f_ckpt, rel=1e-12)
        assert np.all(h.objective.values[first:] < 0.5 * f0)
        assert models.objective(softmax, api.params(down["id"]), X, y)[0] < 0.1 * f0
    # Every service's healthcheck passes on the running deployment; a stopped worker's fails, the other's not.
    for service in ("scheduler", "worker-1", "worker-2", "api"):
        check = d.healthcheck(service)
        assert check.returncode == 0, (service, check.stderr[-2000:])
    d.stop("worker-2")
    assert d.healthcheck("worker-2").returncode != 0
    assert d.healthcheck("worker-1").returncode == 0
