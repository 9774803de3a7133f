"""Proposed with the one-call-per-worker change: more shards than workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Client, LocalCluster

from distbelief.errors import ShardLostError
from distbelief.storage import ParameterServer, worker_addresses


def test_more_shards_than_workers_cost_one_call_per_worker(client: Client, tmp_path: Path) -> None:
    n = 10_000
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    ps = ParameterServer.create(client, n, shards=5, store=str(tmp_path / "ps"))
    try:
        ps.scatter("a", a)
        ps.scatter("b", b)
        ps.stats.reset()
        assert ps.dots([("a", "b"), ("a", "a")]) == pytest.approx([a @ b, a @ a], rel=1e-12)
        ps.lincomb("c", [2.0, -1.0], ["a", "b"])
        assert ps.stats.round_trips == 2
        assert ps.stats.shard_calls == 10  # shards reached, as before
        assert ps.stats.by_method == {"run_with": 2}  # but one message per worker
        np.testing.assert_allclose(ps.gather("c"), 2 * a - b, rtol=1e-14)
    finally:
        ps.close()


def test_a_lost_worker_with_two_shards_loses_both_and_both_come_back(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    # The session's cluster: its nanny restarts the killed worker, and the client fixture waits for it.
    workers = worker_addresses(client)
    n = 1000
    x = np.arange(n, dtype=float)
    ps = ParameterServer.create(client, n, shards=4, store=str(tmp_path / "ps"), workers=workers)
    try:
        ps.scatter("x", x)
        ps.checkpoint()
        victim = next(w for w in cluster.workers.values() if w.worker_address == workers[1])
        os.kill(victim.process.pid, signal.SIGKILL)  # holds shards 1 and 3
        deadline = time.monotonic() + 30
        with pytest.raises(ShardLostError) as info:
            while time.monotonic() < deadline:
                ps.dot("x", "x")
                time.sleep(0.05)
        assert info.value.shard == 1 and "3 [" in str(info.value)
        assert ps.dot("x", "x") == pytest.approx(x @ x)  # no second ShardLostError for shard 3
    finally:
        ps.close()
