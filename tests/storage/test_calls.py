"""storage._calls: timed calls, dead workers confirmed with grace, and the shard-loss recovery loop.

Unit tests use fakes for what they stand in for (a server that pings, a worker that dies after a while);
the last tests kill a real worker process holding a shard and an actor.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Client, LocalCluster

from distbelief.errors import ClusterError, ShardLostError
from distbelief.storage import ParameterServer, worker_addresses
from distbelief.storage._calls import (
    ShardRecovery,
    actor_gone,
    await_call,
    confirm_dead,
    confirm_dead_async,
    gather_calls,
    start_call,
)

# ------------------------------------------------------------------------------------------- dead workers


class _DiesAfter:
    """``gone()`` of a worker the scheduler notices dead only at its ``n``-th look."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.looks = 0

    def __call__(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_a_connection_error_waits_for_the_scheduler_to_confirm_the_death() -> None:
    gone = _DiesAfter(3)
    assert confirm_dead(gone, OSError("connection reset"), grace=5.0, poll=0.01)
    assert gone.looks == 3


def test_the_calls_own_error_is_not_a_dead_worker_and_is_not_waited_on() -> None:
    gone = _DiesAfter(3)
    t0 = time.monotonic()
    assert not confirm_dead(gone, KeyError("no such vector"), grace=5.0, poll=0.01)
    assert gone.looks == 1 and time.monotonic() - t0 < 1.0


def test_a_live_worker_is_given_up_on_after_the_grace() -> None:
    t0 = time.monotonic()
    assert not confirm_dead(lambda: False, ClusterError("timeout"), grace=0.1, poll=0.01)
    assert 0.1 <= time.monotonic() - t0 < 2.0


def test_confirm_dead_async_is_the_same_on_an_event_loop() -> None:
    assert asyncio.run(confirm_dead_async(_DiesAfter(3), OSError(), grace=5.0, poll=0.01))
    assert not asyncio.run(confirm_dead_async(_DiesAfter(3), ValueError(), grace=5.0, poll=0.01))
    assert not asyncio.run(confirm_dead_async(lambda: False, OSError(), grace=0.05, poll=0.01))


def test_actor_gone_trusts_a_dead_status_and_asks_no_one_without_an_actor() -> None:
    class Future:
        def __init__(self, status: str) -> None:
            self.status = status

    never = Client.__new__(Client)  # any scheduler query would fail on this unconnected client
    assert actor_gone(never, Future("lost"))
    assert not actor_gone(never, Future("finished"))
    assert not actor_gone(never, Future("finished"), object())  # no address: only the status can tell


# ------------------------------------------------------------------------------------------- timed calls


def test_start_call_returns_the_error_of_making_the_call() -> None:
    class Lost:
        def ping(self) -> None:
            raise RuntimeError("Worker holding Actor was lost")

    assert isinstance(start_call(Lost(), "ping"), RuntimeError)
    assert start_call([3, 1], "index", 1) == 1


def test_await_call_answers_times_out_and_notices_a_dead_worker() -> None:
    async def answer(value: int, after: float) -> int:
        await asyncio.sleep(after)
        return value

    async def dead() -> bool:
        return True

    assert asyncio.run(await_call(answer(42, 0.0), timeout=1.0)) == 42
    with pytest.raises(ClusterError, match="shard 3 did not answer within"):
        asyncio.run(await_call(answer(1, 10.0), timeout=0.05, what="shard 3"))
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="shard 3 was lost with its worker"):
        asyncio.run(await_call(answer(1, 10.0), timeout=30.0, gone=dead, what="shard 3", poll=0.01))
    assert time.monotonic() - t0 < 5.0


def test_cancelling_await_call_cancels_the_call() -> None:
    started = asyncio.Event()
    cancelled = []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(10.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        waiter = asyncio.ensure_future(await_call(slow(), timeout=None))
        await started.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)

    asyncio.run(main())
    assert cancelled == [True]


# ------------------------------------------------------------------------------------------- lost shards


class _FakeServer:
    """A server whose ``ping`` reports the losses queued in ``lost`` (each restored or not)."""

    def __init__(self) -> None:
        self.lost: list[ShardLostError] = []

    def ping(self) -> None:
        if self.lost:
            raise self.lost.pop(0)


def _lost(shard: int = 0, *, restored: bool = True) -> ShardLostError:
    return ShardLostError(f"shard {shard} was lost", shard=shard, restored=restored)


def test_recovery_retries_after_every_restored_shard() -> None:
    restored: list[int] = []
    failures = [_lost(0), _lost(1)]

    def work() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    recovery = ShardRecovery(_FakeServer(), max_recoveries=3, on_restored=lambda e: restored.append(e.shard))
    assert recovery.run(work) == "done"
    assert restored == [0, 1] and recovery.recoveries == 2


def test_a_failed_call_is_explained_by_probing_the_shards() -> None:
    ps = _FakeServer()
    restored: list[int] = []
    calls = []

    def work() -> int:
        calls.append(1)
        if len(calls) == 1:
            ps.lost.append(_lost(2))  # the shard died with the call: the next ping finds it
            raise ClusterError("replica 0 could not push to the shards")
        return len(calls)

    recovery = ShardRecovery(ps, max_recoveries=3, on_restored=lambda e: restored.append(e.shard))
    assert recovery.run(work) == 2
    assert restored == [2]


def test_a_failure_without_a_lost_shard_is_raised_as_it_is() -> None:
    recovery = ShardRecovery(_FakeServer(), max_recoveries=3, on_restored=lambda e: None)
    err = ClusterError("replica 0 failed")

    def work() -> None:
        raise err

    with pytest.raises(ClusterError) as info:
        recovery.run(work)
    assert info.value is err and recovery.recoveries == 0


def test_recovery_gives_up_after_max_recoveries_and_without_a_checkpoint() -> None:
    recovery = ShardRecovery(_FakeServer(), max_recoveries=2, on_restored=lambda e: None)

    def always_lost() -> None:
        raise _lost(0)

    with pytest.raises(ShardLostError):
        recovery.run(always_lost)
    assert recovery.recoveries == 2

    unrestored = ShardRecovery(_FakeServer(), max_recoveries=5, on_restored=lambda e: None)
    with pytest.raises(ShardLostError, match="shard 1"):
        unrestored.run(lambda: (_ for _ in ()).throw(_lost(1, restored=False)))
    assert unrestored.recoveries == 0


def test_a_probe_that_finds_a_loss_handles_it() -> None:
    ps = _FakeServer()
    restored: list[int] = []
    recovery = ShardRecovery(ps, max_recoveries=1, on_restored=lambda e: restored.append(e.shard))
    assert recovery.probe() is None
    ps.lost.append(_lost(4))
    lost = recovery.probe()
    assert lost is not None and lost.shard == 4 and restored == [4]


# ------------------------------------------------------------------------------------------- a real cluster


def _kill(cluster: LocalCluster, address: str) -> None:
    nanny = next(w for w in cluster.workers.values() if w.worker_address == address)
    assert nanny.process is not None and nanny.process.pid is not None
    os.kill(nanny.process.pid, signal.SIGKILL)


class Echo:
    """A tiny actor."""

    def echo(self, value: int) -> int:
        return value

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_killed_shard_is_restored_from_its_checkpoint_and_the_work_retried(
    cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    # The session's cluster: its nanny restarts the killed worker, and the client fixture waits for it.
    a, b = worker_addresses(client)
    ps = ParameterServer.create(client, 100, shards=2, store=str(tmp_path / "ps"), workers=[a, b], timeout=30)
    try:
        saved = np.arange(100.0)
        ps.scatter("x", saved)
        ps.checkpoint()
        ps.scatter("x", -saved)  # work since the checkpoint, lost with the shard
        restored: list[int] = []

        def roll_back(lost: ShardLostError) -> None:
            restored.append(lost.shard)
            ps.rollback()

        recovery = ShardRecovery(ps, max_recoveries=1, on_restored=roll_back)
        _kill(cluster, b)
        x = recovery.run(lambda: ps.gather("x"))
        assert restored == [1] and recovery.recoveries == 1
        np.testing.assert_array_equal(x, saved)  # every shard back at the checkpoint
        assert b not in ps.workers()
    finally:
        ps.close()


def test_a_call_to_a_killed_worker_fails_without_waiting_for_the_time_limit(
    cluster: LocalCluster, client: Client
) -> None:
    a, b = worker_addresses(client)
    futures = [client.submit(Echo, actor=True, workers=[w], pure=False) for w in (a, b)]
    actors = [f.result() for f in futures]
    try:
        out = gather_calls(client, [start_call(x, "echo", k) for k, x in enumerate(actors)], timeout=30.0)
        assert out == [(True, 0), (True, 1)]
        late = gather_calls(client, [start_call(actors[0], "sleep", 2.0)], timeout=0.2)
        assert not late[0][0] and "did not answer within" in str(late[0][1])
        assert not actor_gone(client, futures[1], actors[1])
        calls = [start_call(actors[1], "sleep", 20.0)]
        _kill(cluster, b)
        t0 = time.monotonic()
        out = gather_calls(
            client, calls, timeout=25.0, gone=lambda k: actor_gone(client, futures[1], actors[1])
        )
        assert not out[0][0] and time.monotonic() - t0 < 15.0
        assert confirm_dead(lambda: actor_gone(client, futures[1], actors[1]), out[0][1])
    finally:
        for f in futures:
            f.release()
