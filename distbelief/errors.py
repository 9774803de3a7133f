"""The one error hierarchy of distbelief.

Every error a user can see derives from :class:`DistbeliefError`. Errors caused by bad input also
derive from :class:`ValueError`, so code written against numpy/scipy conventions keeps working.
Each message says what happened *and* what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ClusterError",
    "ConflictError",
    "DatasetError",
    "DistbeliefError",
    "InvalidOptionError",
    "ModelSpecError",
    "ProtocolError",
    "ShardLostError",
    "StoreError",
]


class DistbeliefError(Exception):
    """Base class of every error raised by distbelief."""


class InvalidOptionError(DistbeliefError, ValueError):
    """An option or argument is out of range, unknown, or of the wrong type."""


class DatasetError(DistbeliefError, ValueError):
    """Data that cannot be used: NaN/inf values, mismatched lengths, empty, wrong labels, bad names."""


class ModelSpecError(DistbeliefError, ValueError):
    """A model specification that does not describe a buildable model."""


class StoreError(DistbeliefError):
    """The zarr store is missing, unreadable, or does not hold what was asked for."""


class ShardLostError(DistbeliefError):
    """A parameter-server shard was lost with its worker.

    The message names the shard and says whether it was restored (and from which checkpoint).
    """

    def __init__(self, message: str, *, shard: int, restored: bool) -> None:
        super().__init__(message)
        self.shard = shard
        self.restored = restored


class ClusterError(DistbeliefError):
    """The Dask cluster cannot do what was asked (no workers, a worker lost mid-call, ...)."""


class ProtocolError(DistbeliefError):
    """Two parts of the system disagreed about the protocol (a bug, or mixed versions)."""


class ConflictError(DistbeliefError):
    """The request clashes with the current state: a name taken or being written, a resource in use."""
