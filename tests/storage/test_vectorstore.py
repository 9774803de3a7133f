"""Spilled shard vectors (storage._vectorstore) against the same ops on in-RAM vectors, numpy as oracle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from distributed import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import InvalidOptionError
from distbelief.sandblaster import SandblasterOptions
from distbelief.storage import ParameterServer, _vectorstore
from distbelief.storage._shard import Shard
from distbelief.storage._vectorstore import VectorStore

NAMES = ["x", "g", "d", "s0", "y0", "s1"]
REDUCTIONS = {"dot", "dots", "norm2", "sum"}

name = st.sampled_from(NAMES)
coef = st.floats(-3, 3, allow_nan=False)
op = st.one_of(
    st.tuples(st.just("fill"), name, coef),
    st.tuples(st.just("copy"), name, name),
    st.tuples(st.just("scale"), coef, name),
    st.tuples(st.just("axpy"), coef, name, name),
    # With a trailing dtype the destination may be stored as float32 (a float32 L-BFGS history): read and
    # spilled at half the bytes.
    st.integers(1, 3)
    .flatmap(
        lambda k: st.tuples(
            st.just("lincomb"),
            name,
            st.lists(coef, min_size=k, max_size=k),
            st.lists(name, min_size=k, max_size=k),
        )
    )
    .flatmap(lambda o: st.sampled_from([o, (*o, "float32"), (*o, "float64")])),
    st.tuples(st.just("mul"), name, name, name),
    st.tuples(st.just("dot"), name, name),
    st.tuples(st.just("dots"), st.lists(st.tuples(name, name), min_size=1, max_size=3)),
    st.tuples(st.just("norm2"), name),
    st.tuples(st.just("norm_inf"), name),
    st.tuples(st.just("sum"), name),
    st.tuples(st.just("delete"), name),
)


def outcome(shard: Shard, one: tuple[Any, ...]) -> Any:
    try:
        return shard.run([one])[0]
    except InvalidOptionError as e:
        return type(e)


@settings(max_examples=150)
@given(
    size=st.integers(1, 40),
    chunk=st.integers(1, 7),
    in_ram=st.integers(0, 6),
    ops=st.lists(op, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_ops_on_spilled_vectors_match_in_ram_bit_for_bit(
    size: int, chunk: int, in_ram: int, ops: list[tuple[Any, ...]], seed: int, tmp_path_factory: Any
) -> None:
    rng = np.random.default_rng(seed)
    ram = Shard(0, 10, 10 + size)
    spill = Shard(
        0, 10, 10 + size, memory_budget=8 * size * in_ram, spill_dir=str(tmp_path_factory.mktemp("s"))
    )
    for n in NAMES:
        values = rng.normal(size=size)
        ram.set(n, 10, 10 + size, values)
        spill.set(n, 10, 10 + size, values)
    old = _vectorstore.SPILL_CHUNK
    _vectorstore.SPILL_CHUNK = chunk  # several chunks per vector even at these sizes
    try:
        for one in ops:
            want, got = outcome(ram, one), outcome(spill, one)
            if one[0] in REDUCTIONS and isinstance(want, (float, list)):
                # Per-chunk partial sums: the same terms, added in another order.
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * size)
            else:
                assert got == want
        assert sorted(ram.vectors) == sorted(spill.vectors)
        for n in ram.vectors:
            np.testing.assert_array_equal(spill.get(n), ram.get(n))  # elementwise ops: the same bits
            assert spill.get(n).dtype == ram.get(n).dtype
    finally:
        _vectorstore.SPILL_CHUNK = old
        spill.close()


def test_history_spills_first_and_hot_vectors_evict_it(tmp_path: Path) -> None:
    vs = VectorStore(100, budget=2 * 800, spill_dir=str(tmp_path))
    vs["x"] = np.zeros(100)
    vs["s0"] = np.ones(100)
    assert vs.spilled == set()
    vs["g"] = np.full(100, 2.0)  # hot, over budget: the cold s0 goes to disk to make room
    assert vs.spilled == {"s0"} and vs.ram_bytes == 1600
    vs["y0"] = np.full(100, 3.0)  # cold, over budget: straight to disk
    vs.create("d")  # hot, but no cold vector left in RAM: spilled too
    assert vs.spilled == {"s0", "y0", "d"}
    assert float(vs["s0"].sum()) == 100.0 and float(vs["y0"].sum()) == 300.0
    assert vs.bytes_written == 2 * 800
    del vs["s0"]
    assert len(os.listdir(tmp_path)) == 2
    vs.close()
    assert os.listdir(tmp_path) == []


def test_sandblasters_history_slots_are_cold_and_make_room_for_x(tmp_path: Path) -> None:
    # A shard restored from a checkpoint reads its vectors in name order: the history before x.
    vs = VectorStore(10, budget=2 * 80, spill_dir=str(tmp_path))
    for name in ("hs0", "hy0", "xa", "ga", "hs10", "hy10"):
        vs[name] = np.zeros(10)
    assert vs.spilled == {"hs0", "hy0", "hs10", "hy10"}
    assert [vs._cold(n) for n in ("hs3", "hy10", "s0", "lbfgs.y2", "xa", "va", "xi", "d", "acc")] == [
        True, True, True, True, False, False, False, False, False,
    ]  # fmt: skip
    vs.close()


def test_spilled_vectors_never_share_a_file(tmp_path: Path) -> None:
    # Two shards of one worker process spilling to one directory, and names that sanitize alike.
    a = VectorStore(3, budget=0, spill_dir=str(tmp_path))
    b = VectorStore(3, budget=0, spill_dir=str(tmp_path))
    a["s0"], b["s0"] = np.ones(3), np.full(3, 2.0)
    a["q"], a["a b"] = np.zeros(3), np.full(3, 3.0)
    del a["q"]
    a["a_b"] = np.full(3, 4.0)
    assert [float(v["s0"][0]) for v in (a, b)] == [1.0, 2.0]
    assert (float(a["a b"][0]), float(a["a_b"][0])) == (3.0, 4.0)
    a.close()
    assert float(b["s0"][0]) == 2.0 and len(os.listdir(tmp_path)) == 1
    b.close()


def test_an_accumulator_on_disk_counts_every_portion_once(tmp_path: Path) -> None:
    shard = Shard(0, 0, 6, memory_budget=0, spill_dir=str(tmp_path))
    shard.run([("reset_acc", "ga", 1, 2, [("settle", "ga"), ("dot", "ga", "ga")])])
    assert shard.vectors.spilled == {"ga"}
    assert shard.push_portions("ga", np.ones(6), [0], epoch=1) == (True, None)
    assert shard.push_portions("ga", np.full(6, 5.0), [1], epoch=1, solo=True) == (True, [2, 216.0])
    np.testing.assert_array_equal(shard.get("ga"), np.full(6, 6.0))
    shard.close()


def test_a_bad_budget_is_refused_with_a_message() -> None:
    with pytest.raises(InvalidOptionError, match="memory budget"):
        VectorStore(3, budget=-1)
    with pytest.raises(InvalidOptionError, match="shard_memory"):
        SandblasterOptions(shard_memory=-5)
    with pytest.raises(InvalidOptionError, match="shard_memory"):
        SandblasterOptions(shard_memory="lots")


# 140,000 over two shards is above storage._actor.INLINE_MAX_ELEMENTS: ops and the rollback on the op thread.
@pytest.mark.parametrize("n", [1000, 140_000])
def test_a_server_with_no_memory_budget_spills_everything_and_still_agrees(
    client: Client, tmp_path: Path, n: int
) -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=n), rng.normal(size=n)
    with ParameterServer.create(client, n, shards=2, store=str(tmp_path / "ps"), memory_budget=0) as ps:
        ps.scatter("x", a)
        ps.scatter("s0", b)
        ps.lincomb("d", [2.0, -1.0], ["x", "s0"])
        ps.axpy(0.5, "d", "s0")
        np.testing.assert_array_equal(ps.gather("s0"), b + 0.5 * (2.0 * a - b))
        assert ps.dot("x", "s0") == pytest.approx(float(a @ (b + 0.5 * (2.0 * a - b))), rel=1e-12)
        ps.checkpoint(["x", "s0"])
        ps.scale(0.0, "x")
        ps.rollback()
        np.testing.assert_array_equal(ps.gather("x"), a)
        report = ps._call_all("memory", [()] * ps.shards)
        assert [r["spilled"] for r in report] == [["s0", "x"]] * 2  # d was not checkpointed: rolled away
        assert all(r["ram_bytes"] == 0 and r["bytes_read"] > 0 for r in report)


def test_float32_vectors_spill_to_float32_files_and_come_back_the_same(tmp_path: Path) -> None:
    vs = VectorStore(100, budget=800, spill_dir=str(tmp_path))
    vs["x"] = np.zeros(100)
    s0 = np.random.default_rng(2).normal(size=100).astype(np.float32)
    vs["s0"] = s0  # over budget: to disk, as float32
    assert vs.spilled == {"s0"} and vs.dtype_of("s0") == np.float32
    (path,) = os.listdir(tmp_path)
    assert os.path.getsize(tmp_path / path) == 4 * 100
    np.testing.assert_array_equal(vs["s0"], s0)
    vs.create("y0", np.float32)
    assert vs.dtype_of("y0") == np.float32 and vs.spilled == {"s0", "y0"}
    vs["s0"] = s0.astype(np.float64)  # another dtype: a file of its own, as float64
    assert vs.dtype_of("s0") == np.float64 and len(os.listdir(tmp_path)) == 2
    np.testing.assert_array_equal(vs["s0"], s0)
    vs.close()
    # Half the bytes in RAM: two float32 vectors fit where one float64 vector does.
    small = VectorStore(100, budget=800)
    small.create("s0", np.float32)
    small.create("y0", np.float32)
    assert small.spilled == set() and small.ram_bytes == 800
    small.close()


def test_a_lincomb_stored_as_float32_streams_its_spilled_operands(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    g, g_new = rng.normal(size=50), rng.normal(size=50)
    ram, spill = Shard(0, 0, 50), Shard(0, 0, 50, memory_budget=0, spill_dir=str(tmp_path))
    old = _vectorstore.SPILL_CHUNK
    _vectorstore.SPILL_CHUNK = 7
    try:
        for shard in (ram, spill):
            shard.set("g", 0, 50, g)
            shard.set("gb", 0, 50, g_new)
            shard.run([("lincomb", "hy0", [1.0, -1.0], ["gb", "g"], "float32")])
        assert spill.vectors.is_spilled("hy0") and spill.vectors.dtype_of("hy0") == np.float32
        np.testing.assert_array_equal(spill.get("hy0"), (g_new - g).astype(np.float32))
        np.testing.assert_array_equal(spill.get("hy0"), ram.get("hy0"))
        assert spill.run([("dots", [("hy0", "g"), ("hy0", "hy0")])])[0] == pytest.approx(
            ram.run([("dots", [("hy0", "g"), ("hy0", "hy0")])])[0], rel=1e-13
        )
    finally:
        _vectorstore.SPILL_CHUNK = old
        spill.close()


@pytest.mark.parametrize("n", [1000, 140_000])
def test_float32_vectors_are_checkpointed_as_float32_and_restored_the_same(
    client: Client, tmp_path: Path, n: int
) -> None:
    rng = np.random.default_rng(4)
    x, d = rng.normal(size=n), rng.normal(size=n)
    with ParameterServer.create(client, n, shards=2, store=str(tmp_path / "ps"), memory_budget=4 * n) as ps:
        ps.scatter("x", x)
        ps.scatter("d", d)
        ps.run(
            [
                ("lincomb", "hs0", [0.1], ["d"], "float32"),
                ("lincomb", "hy0", [1.0, -1.0], ["x", "d"], "float32"),
            ]
        )
        s0, y0 = ps.gather("hs0"), ps.gather("hy0")
        assert s0.dtype == y0.dtype == np.float32
        np.testing.assert_array_equal(s0, (0.1 * d).astype(np.float32))
        ps.checkpoint(["x", "hs0", "hy0"], dtypes={"hs0": "float32", "hy0": "float32"})
        # hy0 without dtypes: a float64 array, which holds its values exactly; restored as float32 still.
        ps.checkpoint(["x", "hs0", "hy0"], dtypes={"hs0": "float32", "hy0": "float64"})
        group = zarr.open_group(str(tmp_path / "ps"), mode="r")
        arrays = {name: group[name] for name in ("slot0/hs0", "slot0/x", "slot1/hy0", "slot1/hs0")}
        dtypes = {name: a.dtype for name, a in arrays.items() if isinstance(a, zarr.Array)}
        assert dtypes == {"slot0/hs0": np.float32, "slot0/x": np.float64, "slot1/hy0": np.float64,
                          "slot1/hs0": np.float32}  # fmt: skip
        assert ps.checkpoint_dtypes == {"hs0": "float32", "hy0": "float32"}
        ps.run([("scale", 0.0, "hs0"), ("lincomb", "hy0", [1.0], ["x"])])
        ps.rollback()
        for name, want in (("hs0", s0), ("hy0", y0), ("x", x)):
            got = ps.gather(name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        dots = ps.dots([("hs0", "hy0"), ("x", "hs0")])
        assert dots == pytest.approx([float(s0.astype(float) @ y0), float(x @ s0)], rel=1e-12)
        # A float64 vector is never written to a float32 array (it would be rounded): refused, nothing stored.
        with pytest.raises(InvalidOptionError, match="would round it"):
            ps.checkpoint(["x"], dtypes={"x": "float32"})
        with pytest.raises(InvalidOptionError, match="'float64' or 'float32'"):
            ps.checkpoint(["x"], dtypes={"x": "float16"})
        assert ps.checkpoint_id == 2
    # A new server on the store (a resumed run) restores the float32 vectors as float32.
    with ParameterServer.open(client, store=str(tmp_path / "ps")) as again:
        assert again.gather("hs0").dtype == np.float32
        np.testing.assert_array_equal(again.gather("hy0"), y0)
