"""Partition peers exchanging a pass's messages (storage._exchange), with stand-in peers in one process."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from distbelief.errors import ClusterError
from distbelief.storage._exchange import PartitionPeer


@dataclass
class Send:
    dest: int
    tag: str
    array: np.ndarray


@dataclass
class Receive:
    src: int
    tag: str


class HungPeer:
    """A peer whose worker never answers."""

    async def deliver(self, *args: Any) -> None:
        await asyncio.sleep(3600)


def one_message(op: Any) -> Any:
    yield op
    return None, np.zeros(1)


@pytest.mark.parametrize(
    ("op", "words"),
    [(Send(1, "a0", np.ones(2)), "could not send 'a0' to partition 1"), (Receive(1, "g0"), "for 'g0' from")],
    ids=["send", "receive"],
)
def test_a_peer_that_does_not_answer_in_time_is_a_cluster_error_with_advice(op: Any, words: str) -> None:
    peer = PartitionPeer(0, 0, call_timeout=0.05)

    async def run() -> None:
        await peer.connect([peer, HungPeer()])
        await peer.run_pass(7, one_message(op))

    with pytest.raises(ClusterError, match="may have died") as info:
        asyncio.run(run())
    assert words in str(info.value) and "partition 0 of replica 0" in str(info.value)
