"""The messages between Sandblaster's portion scheduler and its replicas, typed (paper, section 4.2).

The coordinator's scheduler sends a replica a :class:`WorkCall` (compute these portions at these
parameters, push their gradient to the shards); the replica answers with a :class:`WorkReport` (each
portion's loss, once every shard holds its gradient). Each travels as *one* pickled frame
(:func:`encode`): Dask serializes every argument of an actor call on its own, which for messages this
small costs more than the message (see :mod:`storage._wire`). A frozen dataclass with slots pickles as
its class reference and a tuple of its fields, a few dozen bytes more than a bare tuple.

Examples
--------
>>> call = WorkCall(eval_id=3, x_name="x", acc_name="acc", portions=(0, 1))
>>> decode(encode(call), WorkCall) == call
True
>>> decode(encode(WorkReport()), WorkReport).results
()
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, TypeVar

from distbelief.errors import ProtocolError

__all__ = ["PortionResult", "WorkCall", "WorkReport", "decode", "encode"]

#: One computed portion: ``(portion, sum of its rows' losses, number of rows)``.
PortionResult = tuple[int, float, int]

_M = TypeVar("_M", "WorkCall", "WorkReport")


@dataclass(frozen=True, slots=True)
class WorkCall:
    """Compute ``portions`` at the parameters ``x_name`` of evaluation ``eval_id``; push into ``acc_name``.

    Parameters
    ----------
    eval_id : int
        The evaluation (the shards' accumulator epoch); a call of an evaluation that is over does nothing.
    x_name, acc_name : str
        The parameter vector to fetch and the gradient accumulator to push into.
    portions : tuple of int
        The portions to compute.
    solo : bool
        Push each portion's gradient alone (backup copies, recomputations) rather than summed.
    prep : tuple of shard ops
        The coordinator's ops for this evaluation, run once on each shard, fused into the first fetch.
    push_every : int or None
        Push the summed gradient every this many portions (None: once, for all of them).

    Examples
    --------
    >>> WorkCall(1, "x", "acc", (4,), solo=True).solo
    True
    """

    eval_id: int
    x_name: str
    acc_name: str
    portions: tuple[int, ...]
    solo: bool = False
    prep: tuple[Any, ...] = ()
    push_every: int | None = None

    def __reduce__(self) -> tuple[type[WorkCall], tuple[Any, ...]]:
        # The fields as one tuple: pickled 3x faster than through dataclasses' generic slots state.
        return WorkCall, _call_fields(self)


@dataclass(frozen=True, slots=True)
class WorkReport:
    """What a replica did for one :class:`WorkCall`; sent once every shard holds the call's gradient.

    Parameters
    ----------
    results : tuple of (int, float, int)
        ``(portion, loss, rows)`` of each computed portion (none if the evaluation was already over).
    prep : tuple
        The ``prep`` ops' reduced results, if this call's fetch ran them.
    final : mapping of int to list
        Per shard, the finalize ops' results if one of this call's pushes completed that shard's batch.
    fetched : bool
        Whether this call fetched the parameters (the first call of the evaluation on this replica).
    fetch_s, compute_s, queued_s, read_s, push_s : float
        Seconds spent fetching, computing (reads included), queued behind other calls, reading portions
        not in memory yet, and pushing.
    reads : tuple of int
        The portions read from the store (not in memory before).

    Examples
    --------
    >>> WorkReport(results=((0, 0.7, 128),), compute_s=0.01).results[0][2]
    128
    """

    results: tuple[PortionResult, ...] = ()
    prep: tuple[Any, ...] = ()
    final: Mapping[int, list[Any]] = field(default_factory=dict)
    fetched: bool = False
    fetch_s: float = 0.0
    compute_s: float = 0.0
    queued_s: float = 0.0
    read_s: float = 0.0
    reads: tuple[int, ...] = ()
    push_s: float = 0.0

    def __reduce__(self) -> tuple[type[WorkReport], tuple[Any, ...]]:
        return WorkReport, _report_fields(self)


_call_fields = attrgetter(*(f.name for f in fields(WorkCall)))
_report_fields = attrgetter(*(f.name for f in fields(WorkReport)))


def encode(message: WorkCall | WorkReport) -> bytes:
    """``message`` as one pickled frame (see the module docstring)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes, kind: type[_M]) -> _M:
    """The message of type ``kind`` that ``frame`` holds; raises ProtocolError on any other content."""
    message = pickle.loads(frame)
    if not isinstance(message, kind):
        raise ProtocolError(f"expected a {kind.__name__}, got a {type(message).__name__}")
    return message
