"""Tests of storage._direct: small actor calls as a plain RPC to a handler on the actor's worker."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import numpy as np
import pytest
from distributed import Client

from distbelief.errors import ClusterError
from distbelief.storage._actor import HandedPush, HandOut, ShardActor
from distbelief.storage._direct import HANDLER, _call_method, direct_call, direct_call_to, install
from distbelief.storage._wire import unpack


class _Echo:
    DIRECT_METHODS = frozenset({"echo"})

    async def echo(self, payload: bytes) -> bytes:
        return payload[::-1]

    async def hidden(self, payload: bytes) -> bytes:
        return payload


def test_only_listed_methods_can_be_called() -> None:
    assert asyncio.run(_call_method(_Echo(), "echo", b"ab")) == b"ba"
    for method in ("hidden", "__init__", "missing"):
        with pytest.raises(AttributeError, match="cannot be called directly"):
            asyncio.run(_call_method(_Echo(), method, b""))


def test_a_shard_answers_direct_calls_as_its_actor_calls(client: Client, tmp_path: object) -> None:
    # An actor's proxy (typed as the class by distributed): its method calls return ActorFutures.
    shard: Any = client.submit(ShardActor, 0, 0, 3, str(tmp_path), actor=True, pure=False).result()
    shard.set("x", 0, 3, np.arange(3.0)).result()
    installed = client.run(lambda dask_worker: HANDLER in dask_worker.handlers, workers=[shard._address])
    assert installed == {shard._address: True}  # the shard's constructor installed the handler

    async def call(method: str, *args: object) -> object:
        return unpack(await direct_call(client.rpc, shard, "packed", pickle.dumps((method, args, {}))))

    got = client.sync(call, "get", "x")
    assert np.array_equal(got, shard.get("x").result())  # the actor call's answer (oracle)
    # The method's own errors come back as the actor call raises them.
    with pytest.raises(Exception) as via_actor:
        shard.get("missing").result()
    with pytest.raises(type(via_actor.value)) as direct:
        client.sync(call, "get", "missing")
    assert str(direct.value) == str(via_actor.value)

    async def raw(method: str) -> object:
        return await direct_call(client.rpc, shard, method, b"")

    with pytest.raises(AttributeError, match="cannot be called directly"):
        client.sync(raw, "get")


class _HandOutTarget:
    """A worker actor the shard hands work to: it keeps what it was handed and answers with two gradients
    (portions 0 and 1) computed from the parameters, or fails when the payload says so."""

    DIRECT_METHODS = frozenset({"take"})

    def __init__(self) -> None:
        install()
        self.handed: list[tuple[bytes, list[np.ndarray], list[object]]] = []

    async def take(self, request: bytes) -> bytes:
        payload, slices, results = pickle.loads(request)
        self.handed.append((payload, slices, results))
        if payload == b"fail":
            raise ValueError("the work itself failed")
        (x,) = slices
        epoch = int(payload.decode())
        pushes = [HandedPush("acc", 2.0 * x, [0], epoch, False), HandedPush("acc", x + 1, [1], epoch, False)]
        return pickle.dumps((payload[::-1], pushes))

    async def log(self) -> list[tuple[bytes, list[np.ndarray], list[object]]]:
        return self.handed


def _hand_out(
    client: Client, shard: object, epoch: int, ops: list[tuple[Any, ...]], target: Any, payload: bytes
) -> Any:
    message = pickle.dumps(HandOut(epoch, ops, ["x"], target.key, target._address, "take", payload))

    async def call() -> object:
        return pickle.loads(await direct_call(client.rpc, shard, "hand_out", message))

    return client.sync(call)


@pytest.mark.parametrize("beside", [True, False], ids=["target-beside-the-shard", "target-on-another-worker"])
def test_a_shard_hands_out_work_with_the_parameters_and_accumulates_the_gradient_that_comes_back(
    client: Client, tmp_path: object, beside: bool
) -> None:
    a, b = sorted(client.scheduler_info()["workers"])
    x = np.array([1.0, -2.0, 0.5, 4.0])
    shard: Any = client.submit(
        ShardActor, 0, 0, 4, str(tmp_path), vectors={"x": x}, actor=True, workers=[a], pure=False
    ).result()
    target: Any = client.submit(_HandOutTarget, actor=True, workers=[a if beside else b], pure=False).result()
    # The evaluation's prep: open the accumulator for 2 portions; the push completing them runs finalize.
    prep = [("reset_acc", "acc", 1, 2, [("settle", "acc"), ("dot", "acc", "acc")]), ("dot", "x", "x")]
    answer, finalized = _hand_out(client, shard, 1, prep, target, b"1")
    assert answer == b"1"[::-1]  # the target's own answer, passed back as it is
    expected = 2.0 * x + (x + 1.0)  # numpy oracle of the two gradients summed
    np.testing.assert_array_equal(shard.get("acc").result(), expected)
    assert finalized == [2, float(expected @ expected)]  # settle: the portions held; the dot
    ((payload, slices, results),) = target.log().result()
    np.testing.assert_array_equal(slices[0], x)  # handed the parameters...
    assert payload == b"1" and results[1] == float(x @ x)  # ...and the prep ops' results
    # A second call of the same epoch: the prep ops do not run again (the accumulator is not reset), and the
    # pushes of portions the shard holds already are not counted twice.
    answer, finalized = _hand_out(client, shard, 1, prep, target, b"1")
    assert finalized is None
    np.testing.assert_array_equal(shard.get("acc").result(), expected)


def test_a_hand_out_reports_the_targets_failure_and_a_lost_target(client: Client, tmp_path: object) -> None:
    a, b = sorted(client.scheduler_info()["workers"])
    shard: Any = client.submit(
        ShardActor, 0, 0, 2, str(tmp_path), vectors={"x": np.ones(2)}, actor=True, workers=[a], pure=False
    ).result()
    target: Any = client.submit(_HandOutTarget, actor=True, workers=[b], pure=False).result()
    prep: list[tuple[Any, ...]] = [("reset_acc", "acc", 1, 2, [])]
    with pytest.raises(ValueError, match="the work itself failed"):
        _hand_out(client, shard, 1, prep, target, b"fail")
    assert shard.get("acc").result().tolist() == [0.0, 0.0]  # nothing accumulated

    class Gone:
        key, _address = "no-such-actor", b

    with pytest.raises(KeyError, match="no actor 'no-such-actor'"):
        _hand_out(client, shard, 1, prep, Gone(), b"1")
    assert shard.get("acc").result().tolist() == [0.0, 0.0]
    # (A target whose worker died fails the call with OSError: tests/sandblaster's replica-loss tests.)


def test_a_worker_without_the_handler_is_a_clear_error() -> None:
    class Pool:  # Dask answers None for an op the worker has no handler for
        def __call__(self, address: str) -> Pool:
            return self

        async def distbelief_actor_call(self, **message: object) -> None:
            return None

    with pytest.raises(ClusterError, match="takes no direct calls"):
        asyncio.run(direct_call_to(Pool(), "tcp://w", "key", "echo", b""))
