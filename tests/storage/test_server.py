"""The parameter server on a real multi-process LocalCluster, against numpy as the oracle."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from distributed import Client, LocalCluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distbelief.storage._server as server_module
from distbelief import models
from distbelief.errors import InvalidOptionError, ShardLostError, StoreError
from distbelief.storage import Layout, ParameterServer, partition_layout, worker_addresses
from distbelief.storage._actor import read_stored_vector

slow_settings = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@slow_settings
@given(n=st.integers(1, 3000), shards=st.integers(1, 5), seed=st.integers(0, 1000))
def test_ops_match_numpy_for_any_size_and_shard_count(
    client: Client, tmp_path: Path, n: int, shards: int, seed: int
) -> None:
    shards = min(shards, n)
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    # ``a`` travels with the shards' construction (no round trip of its own), ``b`` is scattered.
    ps = ParameterServer.create(
        client,
        n,
        shards=shards,
        store=str(tmp_path / f"ps{seed}"),
        overwrite=True,
        vectors={"a": list(a)},  # type: ignore[dict-item]  # a list is taken as an array
    )
    try:
        assert ps.stats.round_trips == 0
        ps.scatter("b", b)
        np.testing.assert_array_equal(ps.gather("a"), a)
        assert ps.dot("a", "b") == pytest.approx(a @ b, rel=1e-12, abs=1e-12)
        ps.axpy(-0.5, "a", "b")
        b = b - 0.5 * a
        np.testing.assert_allclose(ps.gather("b"), b, rtol=1e-14, atol=1e-15)
        ps.lincomb("c", [2.0, 3.0], ["a", "b"])
        np.testing.assert_allclose(ps.gather("c"), 2 * a + 3 * b, rtol=1e-13, atol=1e-14)
        c = ps.gather("c")
        assert ps.norm2("c") == pytest.approx(np.linalg.norm(c), rel=1e-12)
        assert ps.norm_inf("c") == np.max(np.abs(c))
        assert ps.dots([("a", "c"), ("b", "b")]) == pytest.approx([a @ c, b @ b], rel=1e-12, abs=1e-12)
        lo, hi = n // 3, n - n // 4
        np.testing.assert_array_equal(ps.get("c", lo, hi), ps.gather("c")[lo:hi])
        ps.set("a", lo, np.full(hi - lo, 7.0))
        a[lo:hi] = 7.0
        np.testing.assert_array_equal(ps.gather("a"), a)
        assert sorted(ps.names()) == ["a", "b", "c"]
    finally:
        ps.close()


def test_big_vectors_are_scattered_once_the_shards_exist(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past INLINE_VECTOR_BYTES a vector does not ride in the task graph: it is scattered (a round trip)."""
    monkeypatch.setattr(server_module, "INLINE_VECTOR_BYTES", 0)
    x = np.random.default_rng(3).standard_normal(1000)
    with ParameterServer.create(client, 1000, shards=3, store=str(tmp_path / "ps"), vectors={"x": x}) as ps:
        assert ps.stats.round_trips >= 1
        assert np.array_equal(ps.gather("x"), x)


def test_a_wide_range_is_gathered_shard_by_shard_with_the_same_values(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.random.default_rng(1).normal(size=1000)
    with ParameterServer.create(client, 1000, shards=3, store=str(tmp_path / "ps"), vectors={"x": x}) as ps:
        monkeypatch.setattr(server_module, "GATHER_PIECEWISE_BYTES", 100)
        before = ps.stats.round_trips
        np.testing.assert_array_equal(ps.gather("x"), x)
        np.testing.assert_array_equal(ps.get("x", 5, 990), x[5:990])
        assert ps.stats.round_trips - before == 6  # one per shard each time


def test_calls_to_wide_shards_wait_longer() -> None:
    assert server_module.scaled_timeout(None, Layout.split(1 << 27, 2)) is None
    assert server_module.scaled_timeout(60.0, Layout.split(1000, 2)) == 60.0
    # 2**26 float64 a shard = 512 MiB = 8 * TIMEOUT_SLICE_BYTES
    assert server_module.scaled_timeout(60.0, Layout.split(1 << 27, 2)) == 480.0


def test_vectors_of_the_wrong_size_are_refused_before_anything_is_stored(
    client: Client, tmp_path: Path
) -> None:
    with pytest.raises(InvalidOptionError, match="has 4 values, the server holds 5"):
        ParameterServer.create(client, 5, store=str(tmp_path / "ps"), vectors={"x": np.ones(4)})
    assert not (tmp_path / "ps").exists()
    bads: tuple[Any, ...] = (-1, "big", 1.5, True)
    for bad in bads:
        with pytest.raises(InvalidOptionError, match="memory_budget must be bytes"):
            ParameterServer.create(client, 5, store=str(tmp_path / "ps"), memory_budget=bad)
        assert not (tmp_path / "ps").exists()


def test_a_batch_costs_one_round_trip_and_returns_only_scalars(client: Client, tmp_path: Path) -> None:
    n = 10_000
    ps = ParameterServer.create(client, n, shards=3, store=str(tmp_path / "ps"))
    try:
        ps.scatter("x", np.ones(n))
        ps.stats.reset()
        batch = ps.batch()
        batch.fill("g", 2.0)
        batch.axpy(0.5, "g", "x")
        batch.lincomb("d", [-1.0], ["g"])
        i = batch.dots([("x", "x"), ("g", "d")])
        j = batch.norm_inf("d")
        out = batch.run()
        assert out[i] == pytest.approx([4.0 * n, -4.0 * n])
        assert out[j] == 2.0
        assert ps.stats.round_trips == 1
        assert ps.stats.shard_calls == 3
        assert ps.stats.max_received == 3  # two dots and one norm from a shard: scalars only
    finally:
        ps.close()


def test_checkpoint_reopen_is_bit_for_bit_and_rollback_restores(client: Client, tmp_path: Path) -> None:
    n = 100_003  # large shards: ops go through each shard's own thread
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n)
    store = str(tmp_path / "ps")
    ps = ParameterServer.create(client, n, shards=2, store=store, target_chunk=4096)
    ps.scatter("x", x)
    ps.scatter("y", -x)
    assert ps.checkpoint(meta={"iteration": 7}) == 1
    ps.scale(3.0, "x")
    ps.checkpoint(["x"])  # second checkpoint goes to the other slot
    ps.rollback()
    np.testing.assert_array_equal(ps.gather("x"), 3.0 * x)
    with pytest.raises(InvalidOptionError):
        ps.gather("y")  # not in the last checkpoint: gone after a rollback
    ps.close()
    ps2 = ParameterServer.open(client, store=store)
    try:
        np.testing.assert_array_equal(ps2.gather("x"), 3.0 * x)
        assert ps2.checkpoint_id == 2
        assert ps2.checkpoint_meta == {}
    finally:
        ps2.close()


@pytest.mark.parametrize(
    ("model", "partitions"),
    [
        (models.MLP([784, 300, 100, 10]), 4),  # 266,610 values: large shards, each on its own thread
        (models.LocallyConnected(64, 10, fields=[5, 3]), 3),  # 1182 values: shards inline on the loop
    ],
)
def test_a_partitioned_server_checkpoints_in_big_chunks_and_restores_exactly(
    client: Client, tmp_path: Path, model: models.Model, partitions: int
) -> None:
    plan = models.partition_plan(model, partitions)
    layout = partition_layout(plan.bounds)
    assert layout.padded  # its bounds are not multiples of one big chunk: the stored ranges are padded
    n = layout.n
    x = np.random.default_rng(3).standard_normal(n)
    store = str(tmp_path / "ps")
    ps = ParameterServer.create(client, n, store=store, layout=layout, vectors={"x": x, "a": x**2})
    try:
        ps.checkpoint()
        array = zarr.open_group(store, mode="r")["slot0/x"]
        assert isinstance(array, zarr.Array)
        assert array.chunks == (layout.chunk,) and array.shape == (layout.stored_size,)
        assert array.nchunks <= 2 * layout.shards  # was n for the MLP
        stored = np.asarray(array[:])
        padding = np.ones(layout.stored_size, dtype=bool)
        for o, (lo, hi) in zip(layout.offsets(), layout.ranges(), strict=True):
            np.testing.assert_array_equal(stored[o : o + hi - lo], x[lo:hi])
            padding[o : o + hi - lo] = False
        assert padding.any() and not stored[padding].any(), "the padding stays zero"
        np.testing.assert_array_equal(read_stored_vector(store, "slot0", layout, "a"), x**2)
        ps.scale(3.0, "x")
        ps.checkpoint(["x"])  # the other slot
        ps.axpy(1.0, "x", "x")
        ps.rollback()
        np.testing.assert_array_equal(ps.gather("x"), 3.0 * x)
    finally:
        ps.close()
    saved: Any = zarr.open_group(store, mode="r").attrs[server_module.ATTR]  # JSON: a dict here
    assert saved["format"] == 2
    ps2 = ParameterServer.open(client, store=store)
    try:
        assert ps2.layout == layout
        np.testing.assert_array_equal(ps2.gather("x"), 3.0 * x)
    finally:
        ps2.close()


def test_old_and_unknown_store_formats(client: Client, tmp_path: Path) -> None:
    store = str(tmp_path / "ps")
    ps = ParameterServer.create(client, 10, shards=2, store=store, vectors={"x": np.arange(10.0)})
    ps.checkpoint()
    ps.close()
    group = zarr.open_group(store, mode="r+")
    attrs: Any = group.attrs[server_module.ATTR]
    meta = dict(attrs)
    assert (
        meta["format"] == 1
    )  # a chunk-aligned layout needs no padding: stored as before, old versions read it
    ps = ParameterServer.open(client, store=store)
    np.testing.assert_array_equal(ps.gather("x"), np.arange(10.0))
    ps.close()
    group.attrs[server_module.ATTR] = {**meta, "format": 99}
    with pytest.raises(StoreError, match=r"format 99.*distbelief version that wrote it"):
        ParameterServer.open(client, store=store)
    group.attrs[server_module.ATTR] = {**meta, "layout": {"n": 10, "chunk": 4, "bounds": [0, 5, 10]}}
    with pytest.raises(StoreError, match="damaged"):
        ParameterServer.open(client, store=store)


def test_store_errors_say_what_to_do(client: Client, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"no zarr store|holds no parameter server"):
        ParameterServer.open(client, store=str(tmp_path / "missing"))
    ps = ParameterServer.create(client, 10, shards=2, store=str(tmp_path / "ps"))
    ps.close()
    with pytest.raises(StoreError, match="overwrite=True"):
        ParameterServer.create(client, 10, shards=2, store=str(tmp_path / "ps"))
    ps = ParameterServer.create(client, 10, shards=2, store=str(tmp_path / "ps"), overwrite=True)
    try:
        with pytest.raises(StoreError, match="no checkpoint"):
            ps.rollback()
        with pytest.raises(InvalidOptionError, match="expected 10 values"):
            ps.scatter("x", np.ones(9))
        with pytest.raises(InvalidOptionError, match="unknown op"):
            ps.run([("explode",)])
    finally:
        ps.close()


def test_a_lost_shard_is_named_and_rebuilt_from_the_checkpoint(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    # The session's cluster: its nanny restarts the killed worker, and the client fixture waits for it.
    workers = worker_addresses(client)
    n = 1000
    x = np.arange(n, dtype=float)
    layout = partition_layout([0, 450, n])  # padded: shard 1 is stored away from its bounds
    assert layout.padded
    ps = ParameterServer.create(client, n, layout=layout, store=str(tmp_path / "ps"), workers=workers)
    try:
        ps.scatter("x", x)
        ps.checkpoint()
        ps.scale(2.0, "x")  # after the checkpoint: shard 1's share of this is lost with its worker
        victim = next(w for w in cluster.workers.values() if w.worker_address == workers[1])
        pid = victim.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(ShardLostError) as info:
            while time.monotonic() < deadline:
                ps.dot("x", "x")
                time.sleep(0.05)
        err = info.value
        assert err.shard == 1 and err.restored
        assert "shard 1 [" in str(err) and "checkpoint #1" in str(err)
        # Shard 0 kept its doubled values; shard 1 is back at the checkpoint.
        lo = ps.layout.bounds[1]
        expected = np.concatenate([2 * x[:lo], x[lo:]])
        np.testing.assert_array_equal(ps.gather("x"), expected)
        ps.rollback()
        np.testing.assert_array_equal(ps.gather("x"), x)
    finally:
        ps.close()


def test_rollback_gives_every_shard_its_own_scalar_state(client: Client, tmp_path: Path) -> None:
    """Each shard's clock, counters and sources' sequence numbers come back as that shard checkpointed
    them, not shard 0's (a rollback that handed every shard the first state passed the tests before)."""
    ps = ParameterServer.create(client, 8, shards=2, store=str(tmp_path / "ps"), target_chunk=4)
    try:
        ps.scatter("x", np.zeros(8))
        lo, hi = ps.layout.ranges()[1]
        for seq in range(3):  # shard 1 alone takes three pushes: the shards' states differ
            ps._call([1], "push", [(np.ones(hi - lo),)], source="r", seq=seq, rule="sgd", lr=0.5)
        ps._call([0], "push", [(np.ones(lo),)], source="q", seq=9, rule="sgd", lr=0.5)
        before = ps.counters()
        assert before[0] != before[1]
        ps.checkpoint()
        ps._call([0, 1], "push", [(np.ones(lo),), (np.ones(hi - lo),)], source="s", seq=0, rule="sgd", lr=0.5)
        assert ps.counters() != before
        ps.rollback()
        assert ps.counters() == before
        # The sequence numbers too: a retried push each shard had taken is refused again, a new one taken.
        (retried,) = ps._call([1], "push", [(np.ones(hi - lo),)], source="r", seq=2, rule="sgd", lr=0.5)
        (fresh,) = ps._call([0], "push", [(np.ones(lo),)], source="r", seq=0, rule="sgd", lr=0.5)
        assert not retried[0] and fresh[0]
    finally:
        ps.close()


def test_an_interrupted_checkpoint_leaves_the_previous_one_intact(client: Client, tmp_path: Path) -> None:
    """The promise of ParameterServer.checkpoint: a checkpoint that fails half-way (one shard wrote its
    part, the other failed) leaves the last complete one as it was, and a rollback restores it exactly."""
    n = 10
    ps = ParameterServer.create(client, n, shards=2, store=str(tmp_path / "ps"), target_chunk=5)
    try:
        old = np.arange(n, dtype=float)
        ps.scatter("x", old)
        ps.checkpoint(["x"])
        ps.scale(-3.0, "x")
        ps._call([1], "run", [([("delete", "x")],)])  # shard 1 cannot write "x" now; shard 0 can
        with pytest.raises(InvalidOptionError):
            ps.checkpoint(["x"])
        assert ps.checkpoint_id == 1
        ps.rollback()
        np.testing.assert_array_equal(ps.gather("x"), old)
    finally:
        ps.close()
