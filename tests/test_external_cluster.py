"""Runs on a cluster the user started: ``dask scheduler`` and two ``dask worker`` processes (issue 25).

The scheduler and the workers are separate OS processes started by the commands, on 127.0.0.1 with their own
ports and local directories, in another working directory than the tests'. Every front door runs against
them with a ``Client`` that is not the default one (while the default client is another cluster's: an actor
proxy that bound to the default client would talk to the wrong cluster) or with the scheduler's address,
and gets the embedded cluster's answers. The last tests kill a worker mid-run and add a worker without
(this version of) distbelief.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse
from distributed import Client

import distbelief
from distbelief import downpour, models, sandblaster
from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.sklearn import LogisticRegression
from distbelief.storage import Dataset, _cluster, worker_addresses

#: Where this distbelief is imported from: the workers get it on their path (an installed package would do).
ROOT = str(Path(distbelief.__file__).resolve().parent.parent)
START_TIMEOUT = 60.0

RNG = np.random.default_rng(7)
X = RNG.standard_normal((1200, 12))
Y = (X @ RNG.standard_normal(12) + 0.5 * RNG.standard_normal(1200) > 0).astype(float)


def _env(extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, ROOT) if p)
    return env


def _start_worker(scheduler_file: Path, tmp: Path, name: str, extra_path: str | None = None) -> Any:
    args = f"--scheduler-file {scheduler_file} --host 127.0.0.1 --nthreads 1 --local-directory {tmp / name} "
    args += f"--name {name} --no-dashboard --memory-limit 2GiB --death-timeout 60"
    return _spawn("distributed.cli.dask_worker", args, tmp, extra_path)


def _spawn(module: str, args: str, cwd: Path, extra_path: str | None = None) -> Any:
    """``python -m module args`` in ``cwd`` (not the tests' working directory), its output dropped."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args.split()], cwd=cwd, env=_env(extra_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait(client: Client, n: int) -> list[str]:
    client.wait_for_workers(n, timeout=START_TIMEOUT)
    return worker_addresses(client)


@pytest.fixture(scope="module")
def external(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, list[Any]]]:
    """The scheduler's address, the cluster's directory, and the processes (scheduler first)."""
    tmp = tmp_path_factory.mktemp("external")
    scheduler_file = tmp / "scheduler.json"
    args = f"--host 127.0.0.1 --port 0 --no-dashboard --scheduler-file {scheduler_file}"
    procs: list[Any] = [_spawn("distributed.cli.dask_scheduler", args, tmp)]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not scheduler_file.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.fail("the dask scheduler did not start")
            time.sleep(0.05)
        time.sleep(0.05)  # the file is written whole, but give the writer its close
        address = json.loads(scheduler_file.read_text())["address"]
        procs += [_start_worker(scheduler_file, tmp, f"w{i}") for i in range(2)]
        with Client(address, set_as_default=False) as c:
            _wait(c, 2)
        yield address, tmp, procs
    finally:
        # The workers first, while their scheduler still answers: a worker whose scheduler went first spent
        # ~7 s trying to reach it before it exited (the module's teardown took 8 s, 1.4 s in this order).
        _stop(procs[1:])
        _stop(procs[:1])


def _stop(procs: list[Any]) -> None:
    """Interrupts ``procs`` together (as Ctrl-C would), then waits for each; one that hangs is killed."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def embedded() -> Iterator[Client]:
    """The embedded cluster's client, and a *default* client of that same cluster: an actor proxy of a run
    on the external cluster that bound to the default client would call the wrong cluster."""
    shared = _cluster.shared_embedded_client()
    with Client(shared.scheduler_info()["address"], set_as_default=True):
        yield shared


@pytest.fixture(scope="module")
def other(external: tuple[str, Path, list[Any]], embedded: Client) -> Iterator[Client]:
    """A client of the external cluster that is not the default client, made in another thread."""
    made: list[Client] = []
    thread = threading.Thread(target=lambda: made.append(Client(external[0], set_as_default=False)))
    thread.start()
    thread.join()
    try:
        yield made[0]
    finally:
        made[0].close()


def test_lbfgs_with_a_client_and_with_an_address(external: Any, other: Client, embedded: Client) -> None:
    kw: dict[str, Any] = {"l2": 1e-2, "maxiter": 50}
    ref = sandblaster.minimize(models.Logistic(12), (X, Y), client=None, **kw)  # the default: embedded
    by_client = sandblaster.minimize(models.Logistic(12), (X, Y), client=other, **kw)
    by_address = sandblaster.minimize(models.Logistic(12), (X, Y), client=external[0], **kw)
    for res in (by_client, by_address):
        assert res.success, res.message
        np.testing.assert_allclose(res.fun, ref.fun, rtol=1e-10)
        np.testing.assert_allclose(res.x, ref.x, rtol=1e-6, atol=1e-8)


def test_owlqn_on_sparse_rows(external: Any, embedded: Client) -> None:
    Xs = scipy.sparse.csr_array(np.where(np.abs(X) > 1.0, X, 0.0))
    kw: dict[str, Any] = {"method": "owlqn", "l1": 2.0, "maxiter": 60}
    ref = sandblaster.minimize(models.Logistic(12), (Xs, Y), client=embedded, **kw)
    res = sandblaster.minimize(models.Logistic(12), (Xs, Y), client=external[0], **kw)
    assert res.success and ref.success, (res.message, ref.message)
    np.testing.assert_allclose(res.fun, ref.fun, rtol=1e-9)
    np.testing.assert_allclose(res.x, ref.x, atol=1e-6)
    assert np.array_equal(res.x == 0, ref.x == 0), "the same weights are exactly zero"


def test_downpour(other: Client, embedded: Client) -> None:
    # One replica that never runs ahead of the shards: plain sequential SGD, the same on any cluster.
    kw: dict[str, Any] = {
        "replicas": 1,
        "shards": 2,
        "lr": 0.1,
        "max_steps": 150,
        "max_staleness": 0,
        "seed": 1,
    }
    ref = downpour.train(models.Logistic(12), (X, Y), client=embedded, **kw)
    res = downpour.train(models.Logistic(12), (X, Y), client=other, **kw)
    assert res.success, res.message
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-9, atol=1e-12)


def test_a_partitioned_run(external: Any, embedded: Client) -> None:
    model = models.MLP([12, 6, 2], activation="tanh")
    kw: dict[str, Any] = {"l2": 1e-2, "maxiter": 6, "replicas": 2, "portions": 4, "partitions": 2}
    ref = sandblaster.minimize(model, (X, Y), client=embedded, **kw)
    res = sandblaster.minimize(model, (X, Y), client=external[0], **kw)
    assert res.nit == ref.nit == 6 and res.stats["partitions"] == 2
    np.testing.assert_allclose(res.fun, ref.fun, rtol=1e-10)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-8, atol=1e-10)


def test_an_estimator_and_a_dataset_written_on_the_workers(
    external: Any, other: Client, embedded: Client, tmp_path: Path
) -> None:
    import dask.array as da

    ref = LogisticRegression(C=1.0).fit(X, Y)  # the default client: the embedded cluster
    ours = LogisticRegression(C=1.0, client=other).fit(X, Y)
    np.testing.assert_allclose(ours.coef_, ref.coef_, rtol=1e-5, atol=1e-7)
    # Rows written by the external workers, named by the scheduler's address.
    ds = Dataset.from_dask(
        da.from_array(X, chunks=(300, 12)),
        da.from_array(Y, chunks=300),
        path=tmp_path / "d",
        client=external[0],
    )
    assert ds.n_rows == len(X) and ds.label_kind == "binary"
    by_address = LogisticRegression(C=1.0, client=external[0]).fit(ds)
    np.testing.assert_allclose(by_address.coef_, ref.coef_, rtol=1e-5, atol=1e-7)


def test_bad_addresses_are_refused_clearly() -> None:
    with pytest.raises(InvalidOptionError, match="not a Dask scheduler address"):
        sandblaster.minimize(models.Logistic(12), (X, Y), client="127.0.0.1")
    with pytest.raises(InvalidOptionError, match="not a Dask scheduler address"):
        sandblaster.minimize(models.Logistic(12), (X, Y), client="nosuch://1.2.3.4:5")
    with pytest.raises(InvalidOptionError, match=r"distributed\.Client; got int"):
        downpour.train(models.Logistic(12), (X, Y), max_steps=1, client=8786)  # type: ignore[arg-type]


def test_a_worker_killed_mid_run(external: Any, other: Client, embedded: Client) -> None:
    w0, w1 = _wait(other, 2)
    pid = other.run(os.getpid, workers=[w1])[w1]
    killed: list[int] = []

    def kill_replica_1(record: sandblaster.IterationRecord) -> None:
        if record.iteration == 2 and not killed:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)  # the worker process; its nanny starts another one
            # The run goes on once the scheduler has seen the loss: the next evaluation then meets it
            # (without the wait, a small run could end before any call reached the dead worker).
            deadline = time.monotonic() + START_TIMEOUT
            while w1 in worker_addresses(other) and time.monotonic() < deadline:
                time.sleep(0.02)

    kw: dict[str, Any] = {"l2": 1e-2, "maxiter": 50, "portions": 8}
    ref = sandblaster.minimize(models.Logistic(12), (X, Y), client=embedded, **kw)
    res = sandblaster.minimize(
        models.Logistic(12), (X, Y), client=other, shard_workers=[w0], replica_workers=[w0, w1],
        callback=kill_replica_1, **kw,
    )  # fmt: skip
    assert killed and res.success, res.message
    assert res.stats["lost_replicas"] == [1]
    np.testing.assert_allclose(res.fun, ref.fun, rtol=1e-8)
    _wait(other, 2)


def test_a_worker_with_another_distbelief_is_named(external: Any, other: Client, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "distbelief").mkdir(parents=True)
    (fake / "distbelief" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    address, tmp, procs = external
    procs.append(_start_worker(tmp / "scheduler.json", tmp, "stale", extra_path=str(fake)))
    _wait(other, 3)
    _cluster._checked.clear()  # checked once per cluster: this cluster changed under the check
    with pytest.raises(
        ClusterError, match=r"another version of distbelief.*has 0\.0\.1.*install distbelief=="
    ):
        sandblaster.minimize(models.Logistic(12), (X, Y), client=address, maxiter=2)


def test_the_embedded_clusters_dashboard_answers(embedded: Client) -> None:
    import urllib.request

    link = embedded.dashboard_link
    assert link.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(link, timeout=30) as page:
        assert page.status == 200
