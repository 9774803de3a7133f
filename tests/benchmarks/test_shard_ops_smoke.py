"""Smoke test of benchmarks/shard_ops.py: its main function on a minimal config, so the script cannot rot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from distributed import LocalCluster
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import shard_ops
from distbelief.errors import InvalidOptionError, ProtocolError
from distbelief.storage import ParameterServer

OPS = {"bare_ping", "ping", "dot", "dots", "axpy", "lincomb"}


def test_main_runs_a_minimal_config_and_writes_consistent_json(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shard_ops.json"
    # 70_000 elements on one shard is above storage._actor.INLINE_MAX_ELEMENTS: the breakdown diagnostic runs.
    argv = ["--sizes", "1000,70000", "--shards", "1,2", "--reps", "2", "--lincomb-terms", "2"]
    argv += ["--out", str(out)]
    result = shard_ops.main(argv, cluster=cluster)

    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"], default=float))
    printed = capsys.readouterr().out
    assert "aim 1" in printed and "aim 2" in printed and str(out) in printed

    sharded = [r for r in result["rows"] if r["kind"] == "sharded"]
    for mode in ("direct", "proxied"):
        for n in (1000, 70_000):
            for s in (1, 2):
                got = {r["op"] for r in sharded if (r["mode"], r["n"]) == (mode, n) and r["shards"] in (s, 1)}
                assert got == OPS, (mode, n, s)
    for r in sharded:
        assert r["median_ms"] > 0 and r["p90_ms"] >= r["median_ms"] >= r["min_ms"]
        if r["op"] != "bare_ping":
            # Every server op, whatever the number of shards, is one round trip to each shard.
            assert r["round_trips_per_op"] == 1.0
            assert r["shard_calls_per_op"] == r["shards"]
        if r["op"] in ("dot", "dots", "axpy", "lincomb"):
            assert math.isfinite(r["gb_s"]) and r["gb_s"] > 0 and r["ratio_to_blas"] > 0
            # The fastest repetition moves the bytes at least as fast as the median one.
            assert r["gb_s_best"] >= r["gb_s"] and r["ratio_to_blas_best"] > 0

    single = [r for r in result["rows"] if r["kind"] == "single"]
    for n in (1000, 70_000):
        for op, k in (("dot", 0), ("dots", 3), ("axpy", 0), ("lincomb", 2)):
            rows = [r for r in single if (r["n"], r["op"], r["k"]) == (n, op, k)]
            assert {r["blas_threads"] for r in rows} == {"as installed", 1}
            # The reference is the faster of the two scipy-BLAS rows: its ratio is exactly one.
            assert max(r["ratio_to_blas"] for r in rows if "scipy" in r["impl"]) == pytest.approx(1.0)
            assert max(r["ratio_to_blas_best"] for r in rows if "scipy" in r["impl"]) == pytest.approx(1.0)
            assert op == "dots" or any("numpy" in r["impl"] for r in rows)

    breakdown = result["diagnostics"]["breakdown"]
    variants = {(v, o) for v in ("thread", "inline") for o in ("dot", "axpy")}
    assert {(d["variant"], d["op"]) for d in breakdown} == variants
    for d in breakdown:
        # Compute timed inside the workers is part of what the caller waits for. The fastest repetition:
        # the compute is timed in calls of its own, and one preemption of either would decide a median.
        assert 0 < d["compute_in_worker_min_ms"] < d["observed_median_ms"] + d["bare_ping_ms"]
    assert {d["op"] for d in result["diagnostics"]["ping_during_op"]} == {"dots", "axpy", "scale"}
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["workers"]
    assert len(result["aims"]["summary"]) == 2


def test_a_wrong_server_result_stops_the_benchmark(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ParameterServer.dot
    monkeypatch.setattr(ParameterServer, "dot", lambda self, a, b: real(self, a, b) * (1 + 1e-6))
    config = shard_ops.Config(sizes=(1000,), shards=(1,), reps_small=1, modes=("direct",), diagnostics=False)
    with pytest.raises(ProtocolError, match="refuses"):
        shard_ops.run(config, cluster=cluster)


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidOptionError, match="shards"):
        shard_ops.Config(sizes=(3,), shards=(4,))
    with pytest.raises(InvalidOptionError, match="modes"):
        shard_ops.Config(modes=("carrier-pigeon",))
    with pytest.raises(SystemExit) as exit_info:
        shard_ops.main(["--sizes", "ten"])
    assert exit_info.value.code == 2
    with pytest.raises(InvalidOptionError, match="unknown op"):
        shard_ops.bytes_touched("gemm", 10)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 10**8), k=st.integers(1, 30))
def test_bytes_touched_counts_vectors_read_and_written(n: int, k: int) -> None:
    # Reads plus writes, in float64 vectors of n elements, as issue 2 defines bandwidth.
    assert shard_ops.bytes_touched("dot", n) == 2 * 8 * n
    assert shard_ops.bytes_touched("dots", n, k=k) == 2 * k * 8 * n
    assert shard_ops.bytes_touched("axpy", n) == 3 * 8 * n
    assert shard_ops.bytes_touched("lincomb", n, k=k) == (k + 1) * 8 * n
    assert shard_ops.bytes_touched("ping", n) == 0
