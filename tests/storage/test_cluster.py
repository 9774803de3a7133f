"""Tests of storage._cluster: which cluster a call runs on, the workers' check, the actors' binding.

The runs against a cluster started with ``dask scheduler`` / ``dask worker`` are in
tests/test_external_cluster.py.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from distributed import Client, get_client

import distbelief
from distbelief.errors import ClusterError, InvalidOptionError
from distbelief.storage import _cluster


def _fake(answers: dict[str, Any], sid: str = "scheduler-1") -> Any:
    calls: list[Any] = []

    def run(fn: Any, *args: Any, on_error: str = "raise") -> dict[str, Any]:
        calls.append((fn, args, on_error))
        return answers

    return SimpleNamespace(run=run, scheduler_info=lambda: {"id": sid}, scheduler=None, calls=calls)


@pytest.fixture
def unchecked() -> Iterator[None]:
    saved = set(_cluster._checked)
    _cluster._checked.clear()
    yield
    _cluster._checked.clear()
    _cluster._checked.update(saved)


def test_workers_are_checked_once_per_scheduler(unchecked: None) -> None:
    fake = _fake({"tcp://127.0.0.1:1": distbelief.__version__, "tcp://127.0.0.1:2": distbelief.__version__})
    _cluster.check_workers(fake)
    _cluster.check_workers(fake)
    assert len(fake.calls) == 1
    # The probe needs nothing but builtins on the worker: it unpickles whatever the worker has installed.
    fn, args, on_error = fake.calls[0]
    assert fn is eval and on_error == "return"
    assert eval(*args) == distbelief.__version__


def test_a_worker_without_distbelief_is_named(unchecked: None) -> None:
    fake = _fake({"tcp://127.0.0.1:1": distbelief.__version__, "tcp://127.0.0.1:2": ModuleNotFoundError("x")})
    with pytest.raises(
        ClusterError, match=r"1 Dask worker\(s\) cannot import distbelief .*tcp://127.0.0.1:2; install"
    ):
        _cluster.check_workers(fake)
    with pytest.raises(ClusterError):  # not cached: a failed check is made again (the user fixes it)
        _cluster.check_workers(fake)


def test_a_worker_with_another_version_is_named(unchecked: None) -> None:
    fake = _fake({"tcp://127.0.0.1:1": "0.0.1"})
    match = rf"tcp://127.0.0.1:1 has 0\.0\.1; install distbelief=={distbelief.__version__}"
    with pytest.raises(ClusterError, match=match):
        _cluster.check_workers(fake)


@pytest.mark.parametrize(
    "address",
    ["", " tcp://127.0.0.1:8786", "127.0.0.1", "tcp://127.0.0.1", "nosuch://127.0.0.1:1", "tcp://:8786"],
)
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(InvalidOptionError, match="not a Dask scheduler address"):
        _cluster.as_client(address)


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:8786", "127.0.0.1:8786", "tls://10.0.0.1:1", "tcp://[::1]:1"]
)
def test_well_formed_addresses_pass(address: str) -> None:
    assert _cluster.check_address(address) == address


def test_no_scheduler_at_an_address_is_a_cluster_error() -> None:
    import dask

    no_scheduler = r"no Dask scheduler answers at tcp://127\.0\.0\.1:9 .*; start one"
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "0.3s"}),
        pytest.raises(ClusterError, match=no_scheduler),
    ):
        _cluster.as_client("tcp://127.0.0.1:9")


def test_other_types_are_refused() -> None:
    with pytest.raises(InvalidOptionError, match="got int"):
        _cluster.resolve_client(8786)  # type: ignore[arg-type]


def test_bound_to_makes_the_client_current_only_in_the_block(client: Client) -> None:
    fake: Any = SimpleNamespace()
    with _cluster.bound_to(fake):
        assert get_client() is fake  # what an actor proxy asks for its client
    assert get_client() is not fake


def _start_method_in_child(queue: Any) -> None:
    queue.put(_cluster.can_start_processes())


def test_pool_workers_run_the_embedded_cluster_in_threads() -> None:
    assert _cluster.can_start_processes()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_start_method_in_child, args=(queue,), daemon=True)
    child.start()
    try:
        assert queue.get(timeout=60) is False  # daemonic: no children allowed
    finally:
        child.join(timeout=10)
