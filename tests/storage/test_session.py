"""Tests of storage._session: what both front doors need before they run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from distbelief.errors import InvalidOptionError
from distbelief.storage import (
    Dataset,
    as_dataset,
    embedded_client,
    scheduler_identity,
    start_vector,
    worker_addresses,
)
from distbelief.storage._session import _direct_when_local, _on_loopback, run_store, wait_for_removals


def test_a_callers_loopback_client_talks_to_workers_directly_only_inside_the_block(client: Client) -> None:
    before = client.direct_to_workers
    client.direct_to_workers = False
    try:
        with embedded_client(client) as c:
            assert c is client and client.direct_to_workers is True
        assert client.direct_to_workers is False
    finally:
        client.direct_to_workers = before


def test_a_remote_cluster_keeps_the_callers_setting() -> None:
    remote: Any = SimpleNamespace(
        direct_to_workers=False,
        scheduler=SimpleNamespace(
            address="tcp://10.0.0.5:8786",
            identity=lambda n_workers=0: {"workers": {"tcp://10.0.0.6:40000": {}} if n_workers else {}},
        ),
        sync=lambda func, **kwargs: func(**kwargs),
    )
    with _direct_when_local(remote):
        assert remote.direct_to_workers is False


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("tcp://127.0.0.1:8786", True),
        ("tls://127.0.0.1:1", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:1", True),
        ("inproc://10.1.2.3/1/2", True),
        ("tcp://10.0.0.5:8786", False),
        ("tcp://192.168.1.2:1", False),
    ],
)
def test_loopback_addresses(address: str, local: bool) -> None:
    assert _on_loopback(address) is local


def test_start_vector_copies_and_checks() -> None:
    model: Any = SimpleNamespace(n_params=3, init_params=lambda seed: np.full(3, float(seed)))
    x0 = np.ones(3)
    x = start_vector(model, x0, 0)
    assert x is not x0 and np.array_equal(x, x0)
    assert np.array_equal(start_vector(model, None, 2), [2.0, 2.0, 2.0])
    with pytest.raises(InvalidOptionError, match="3 parameters"):
        start_vector(model, np.ones(2), 0)
    with pytest.raises(InvalidOptionError, match="NaN or inf"):
        start_vector(model, [1.0, np.nan, 0.0], 0)


def test_as_dataset_writes_arrays_once_and_passes_datasets_through(tmp_path: Path) -> None:
    X, y = np.arange(8.0).reshape(4, 2), np.zeros(4)
    ds = as_dataset((X, y), str(tmp_path))
    np.testing.assert_array_equal(ds.read_all()[0], X)
    assert as_dataset(ds, str(tmp_path / "other")) is ds
    assert isinstance(ds, Dataset)


def test_worker_addresses_never_sees_an_empty_cluster_while_the_client_refreshes(
    cluster: LocalCluster, client: Client
) -> None:
    """``Client.scheduler_info()`` races the client's periodic refresh, which caches no workers: with a 5 ms
    refresh it answered "no workers" to 219 of 3000 calls here. The helpers ask the scheduler instead."""
    expected = worker_addresses(client)
    assert len(expected) >= 2
    with (
        dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}),
        Client(cluster, set_as_default=False) as fast_refresh,
    ):
        answers = [worker_addresses(fast_refresh) for _ in range(300)]
        identities = [sorted(scheduler_identity(fast_refresh)["workers"]) for _ in range(100)]
    assert all(a == expected for a in answers)
    assert all(a == expected for a in identities)


def test_both_front_doors_refuse_a_cluster_without_workers() -> None:
    # Imported here: storage's tests otherwise need neither algorithm package.
    from distbelief import downpour, models, sandblaster
    from distbelief.errors import ClusterError

    X, y = np.random.default_rng(0).normal(size=(40, 3)), np.zeros(40)
    model = models.LeastSquares(n_features=3)
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty,
        Client(empty, set_as_default=False) as c,
    ):
        with pytest.raises(ClusterError, match="no workers"):
            sandblaster.minimize(model, (X, y), client=c, maxiter=2)
        with pytest.raises(ClusterError, match="no workers"):
            downpour.train(model, (X, y), client=c, epochs=1)


def test_run_store_keeps_a_given_store_and_deletes_only_its_own_temporary_one(tmp_path: Path) -> None:
    with run_store(tmp_path, "unused-") as root:
        assert root == str(tmp_path)
    assert tmp_path.is_dir()  # the caller's store is never deleted
    with run_store(None, "mine-") as root:
        assert Path(root).name.startswith("mine-") and Path(root).is_dir()
        (Path(root) / "x").write_text("kept until the block ends")
    wait_for_removals()  # deleted in the background
    assert not Path(root).exists()


def test_a_lazy_store_is_made_by_its_first_writer_and_deleted_only_then() -> None:
    with run_store(None, "unwritten-", lazy=True) as unused, run_store(None, "written-", lazy=True) as used:
        assert unused != used and not Path(unused).exists() and not Path(used).exists()
        assert Path(unused).name.startswith("unwritten-")
        (Path(used) / "data").mkdir(parents=True)  # as zarr makes a store's directories
    assert Path(used).parent.is_dir()  # the process's directory of stores stays until exit
    wait_for_removals()
    assert not Path(used).exists() and not Path(unused).exists()
