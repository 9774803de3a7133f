"""Shared fixtures: one real multi-process LocalCluster for the whole session, and a 3-worker cluster for
the tests that kill a worker and need two others to go on (one per module: on a heavily loaded machine a
nanny can fail to bring a killed worker back, and that must not break every later module)."""

from __future__ import annotations

from collections.abc import Iterator

import dask
import pytest
from distributed import Client, LocalCluster
from hypothesis import settings

from distbelief.storage import worker_addresses

# No per-example deadline: the examples take microseconds to milliseconds, and on a loaded 2-core machine
# a GC pause or a preemption would fail one as "unreliable timing" though the code is right.
settings.register_profile("distbelief", deadline=None)
settings.load_profile("distbelief")

# The scheduler runs in this process; its log of recent messages would keep actor handles (and so every
# test's shards) alive on the workers until the session ends.
dask.config.set({"distributed.admin.low-level-log-length": 0})


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def session_client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster, direct_to_workers=True) as client:
        yield client


@pytest.fixture
def client(session_client: Client) -> Client:
    """The session's client once both workers are up: just after the cluster starts, or after a test killed
    a worker (the nanny restarts it), the scheduler can briefly list fewer."""
    session_client.wait_for_workers(2, timeout=60)
    return session_client


@pytest.fixture(scope="module")
def _three_worker_cluster() -> Iterator[tuple[LocalCluster, Client]]:
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        ) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        yield cluster, client


@pytest.fixture
def three_workers(
    _three_worker_cluster: tuple[LocalCluster, Client],
) -> tuple[LocalCluster, Client, list[str]]:
    """The 3-worker cluster, its client and its workers' addresses, once all three are up (the nanny
    restarts a worker killed by an earlier test)."""
    cluster, client = _three_worker_cluster
    client.wait_for_workers(3, timeout=60)
    return cluster, client, worker_addresses(client)
