"""Tests of storage._wire: small actor messages as one pickled frame, big arrays left to Dask."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distbelief.storage._actor import ShardActor
from distbelief.storage._wire import SMALL_BYTES, array_bytes, pack_if_small, unpack


@given(sizes=st.lists(st.integers(0, 4000), max_size=5), nested=st.booleans())
def test_small_messages_round_trip_and_big_ones_pass_through(sizes: list[int], nested: bool) -> None:
    arrays = [np.arange(float(n)) for n in sizes]
    message = ("accumulate", ({"parts": arrays} if nested else arrays, "acc", 3), {"solo": True})
    assert array_bytes(message) == 8 * sum(sizes)
    packed = pack_if_small(message)
    assert isinstance(packed, bytes)
    out = unpack(packed)
    got = out[1][0]["parts"] if nested else out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(got, arrays, strict=True))
    big = (np.zeros(SMALL_BYTES // 8 + 1), 1)
    assert pack_if_small(big) is big and unpack(big) is big


def test_a_shard_answers_packed_calls_like_direct_ones(tmp_path: object) -> None:
    shard = ShardActor(0, 0, 4, str(tmp_path))

    async def scenario() -> None:
        await shard.set("x", 0, 4, np.arange(4.0))
        request = pickle.dumps(("get", ("x",), {}))
        assert np.array_equal(unpack(await shard.packed(request)), await shard.get("x"))
        for forbidden in ("_do", "packed"):
            with pytest.raises(AttributeError, match="no shard method"):
                await shard.packed(pickle.dumps((forbidden, (), {})))

    asyncio.run(scenario())
