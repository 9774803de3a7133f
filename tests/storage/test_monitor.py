"""The shards' and replicas' counters on the Dask cluster's HTTP ports (storage._monitor, issue 25 item 4).

Runs on the embedded cluster (worker processes on 127.0.0.1): a fit runs in a thread while the test reads
``/distbelief/metrics`` over HTTP, on the scheduler's dashboard port (every worker) and on a worker's own
port, and sees the counters move. Every wait is bounded.
"""

from __future__ import annotations

import gc
import itertools
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import pytest
from distributed import Client

from distbelief import downpour, models, sandblaster
from distbelief.storage import _cluster, _monitor

RUN_TIMEOUT = 120.0
RNG = np.random.default_rng(3)
X = RNG.standard_normal((5000, 20))
Y = (X @ RNG.standard_normal(20) + RNG.standard_normal(5000) > 0).astype(int)
#: ~5 ms an L-BFGS iteration here: a run of several seconds, without converging (a small MLP, no tolerance).
ITERATIONS = 800


def _fit(client: Client) -> Any:
    model = models.MLP([20, 32, 2], activation="tanh")
    return sandblaster.minimize(model, (X, Y), client=client, l2=1e-4, maxiter=ITERATIONS, gtol=0.0, ftol=0.0)


SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def _read(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=30) as page:
        assert page.status == 200
        assert page.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = page.read().decode()
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        out.append((match.group(1), labels, float(match.group(3))))
    return out


def _total(
    samples: list[tuple[str, dict[str, str], float]],
    name: str,
    *,
    skip: AbstractSet[str] = frozenset(),
    **labels: str,
) -> float:
    """The sum of ``name``'s samples with ``labels``, leaving out the actors in ``skip``."""
    return sum(
        v
        for n, lab, v in samples
        if n == name and lab.get("actor") not in skip and all(lab.get(k) == x for k, x in labels.items())
    )


def _actors(samples: list[tuple[str, dict[str, str], float]]) -> set[str]:
    return {lab["actor"] for _, lab, _ in samples if "actor" in lab}


@pytest.fixture(scope="module")
def embedded() -> Iterator[Client]:
    yield _cluster.shared_embedded_client()


def _base(client: Client) -> str:
    link: str = client.dashboard_link
    assert link.startswith("http://127.0.0.1:")
    return link.rsplit("/", 1)[0]


def _watch(run: Callable[[], Any], url: str, name: str, **labels: str) -> list[float]:
    """Run ``run`` in a thread and read ``url`` until it ends; the totals of ``name`` seen, in order."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    seen: list[float] = []
    thread.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    while thread.is_alive() and time.monotonic() < deadline:
        seen.append(_total(_read(url), name, skip=frozenset(), **labels))  # named, so no label can fill skip
        time.sleep(0.05)
    thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not thread.is_alive(), "the run did not end in time"
    assert not errors, errors
    return seen


def _moved(seen: list[float]) -> bool:
    """Whether the counter went up at least twice while the run was seen (never down)."""
    assert all(b >= a for a, b in itertools.pairwise(seen)), seen
    return len({v for v in seen if v > 0}) >= 2


def test_the_dashboard_port_shows_shards_and_replicas_moving(embedded: Client) -> None:
    url = _base(embedded) + _monitor.PATH
    earlier = _actors(_read(url))  # an earlier test's actors may still be on their way out
    portions = _watch(
        lambda: _fit(embedded), url, "distbelief_replica_portions_total", algorithm="sandblaster"
    )
    assert _moved(portions), portions
    # After the run its actors are released (soon, not at once); the page still answers, without them. The
    # run's actor handles can sit in reference cycles until the garbage collector runs (up to ~30 s seen).
    deadline = time.monotonic() + 30
    while (_actors(after := _read(url)) - earlier) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert not _actors(after) - earlier
    assert {lab["worker"] for n, lab, _ in after if n == "distbelief_actors"} == set(
        embedded.scheduler_info()["workers"]
    )


def test_the_shard_counters(embedded: Client) -> None:
    url = _base(embedded) + _monitor.PATH
    seen: list[list[tuple[str, dict[str, str], float]]] = []
    earlier = _actors(_read(url))  # an earlier run's shards may not be released yet: not this run's

    thread = threading.Thread(target=_fit, args=(embedded,), daemon=True)
    thread.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    while thread.is_alive() and time.monotonic() < deadline:
        samples = _read(url)
        if _total(samples, "distbelief_shard_ops_total", skip=earlier) > 0:
            seen.append(samples)
        time.sleep(0.05)
    thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not thread.is_alive() and seen
    last = seen[-1]
    n_params = models.MLP([20, 32, 2], activation="tanh").n_params
    assert _total(last, "distbelief_shard_params", skip=earlier) == n_params  # every parameter once
    assert _total(last, "distbelief_shard_vectors", skip=earlier) >= 4  # x, the gradient, L-BFGS's history
    assert _total(last, "distbelief_shard_bytes", skip=earlier, where="ram") >= 4 * 8 * n_params
    assert _total(last, "distbelief_shard_ops_total", skip=earlier, kind="accumulate") > 0  # pushes taken
    assert _moved([_total(s, "distbelief_shard_ops_total", skip=earlier) for s in seen])


def test_a_workers_own_port_shows_downpour_steps(embedded: Client) -> None:
    workers = embedded.scheduler_info()["workers"]
    _address, info = sorted(workers.items())[0]
    port = info["services"]["dashboard"]
    url = f"http://127.0.0.1:{port}{_monitor.PATH}"
    train = lambda: downpour.train(  # noqa: E731
        models.Logistic(20), (X, Y.astype(float)), client=embedded, replicas=2, time_limit=3.0, lr=0.05
    )
    steps = _watch(train, url, "distbelief_replica_steps_total", algorithm="downpour")
    assert _moved(steps), steps
    assert not any(lab.get("worker") for n, lab, _ in _read(url))  # a worker's page: its own actors only


def test_a_worker_without_actors_answers_and_install_is_idempotent(embedded: Client) -> None:
    with urllib.request.urlopen(embedded.dashboard_link, timeout=30) as page:  # the Dask dashboard itself
        assert page.status == 200
    _monitor.install_cluster(embedded)  # again: nothing changes, nothing raised
    samples = _read(_base(embedded) + _monitor.PATH)
    assert [n for n, _, _ in samples].count("distbelief_actors") == len(embedded.scheduler_info()["workers"])


def test_a_partitioned_run_shows_its_partitions(embedded: Client) -> None:
    url = _base(embedded) + _monitor.PATH
    model = models.MLP([20, 32, 2], activation="tanh")
    kw: dict[str, Any] = {"l2": 1e-4, "maxiter": 150, "gtol": 0.0, "ftol": 0.0, "partitions": 2}
    seen = _watch(
        lambda: sandblaster.minimize(model, (X, Y), client=embedded, **kw),
        url,
        "distbelief_partition_messages_total",
        algorithm="sandblaster",
    )
    assert _moved(seen), seen


def _forget(dask_worker: Any) -> None:
    dask_worker.handlers.pop(_monitor.HANDLER, None)


def _forget_all(dask_scheduler: Any) -> None:
    dask_scheduler.task_metadata.pop(_monitor.METADATA_KEY, None)


def test_a_worker_that_joins_later_shows_up_with_its_first_actor(embedded: Client) -> None:
    # As a worker that joined after the cluster was checked: no handler, not known to the scheduler.
    embedded.run(_forget)
    embedded.run_on_scheduler(_forget_all)
    url = _base(embedded) + _monitor.PATH
    assert not _read(url)
    res = sandblaster.minimize(models.Logistic(20), (X, Y.astype(float)), client=embedded, maxiter=5)
    assert res.nit > 0
    # The shards' and replicas' constructors installed the handler and told the scheduler (not waited for).
    deadline = time.monotonic() + 30
    while not (workers := {lab["worker"] for _, lab, _ in _read(url)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and workers <= set(embedded.scheduler_info()["workers"])
    _monitor.install_cluster(embedded)  # every worker again, for whoever reads the page next
