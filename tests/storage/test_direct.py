"""Tests of storage._direct: small actor calls as a plain RPC to a handler on the actor's worker."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
from distributed import Client

from distbelief.storage._actor import ShardActor
from distbelief.storage._direct import HANDLER, _call_method, direct_call
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
    shard = client.submit(ShardActor, 0, 0, 3, str(tmp_path), actor=True, pure=False).result()
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
