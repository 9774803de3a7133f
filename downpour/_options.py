"""Every option of :func:`downpour.train`, validated once into a frozen dataclass.

Defaults follow the DistBelief paper, section 4.1, and this project's measurements: Adagrad on the shards, a
learning rate for Adagrad about an order of magnitude above the best fixed SGD rate, and ``n_fetch = n_push``
chosen from the model and the data (:func:`auto_sync`: 1, the paper's setting, for small models; more steps
between fetches and pushes where moving the parameters costs more than a step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distbelief.errors import InvalidOptionError
from distbelief.options import (
    PARTITIONS_DOC,
    REST_MAX_ACTORS,
    REST_MAX_ITER,
    check_fields,
    check_option,
    option,
    options_of,
    worker_tuple,
)
from distbelief.storage import Rule
from distbelief.storage.internal import Communication

from ._compress import Compression, check_compression
from ._core import ADAGRAD_MAX_COALESCE

__all__ = [
    "DEFAULT_LR",
    "DownpourOptions",
    "Rule",
    "auto_sync",
    "check_workers",
    "options_from",
    "worker_tuple",
]

#: ``n_fetch = n_push`` when neither is given, by what a run communicates (see :func:`auto_sync`).
SYNC_WINDOWED = 50
SYNC_LARGE = 10
#: Dense models from this many parameters (1 MiB of float64) fetch and push every SYNC_LARGE steps.
SYNC_LARGE_PARAMS = 1 << 17
_SYNC_DOC = (
    "Steps between fetches (n_fetch) and between pushes (n_push); absent: chosen from the model and the data "
    f"({SYNC_WINDOWED} for key-value windows on sparse rows, {SYNC_LARGE} for a dense model of "
    f"{SYNC_LARGE_PARAMS} parameters or more, else 1; the other one's value when only one is given)"
)


def auto_sync(n_params: int, *, windowed: bool) -> int:
    """``n_fetch = n_push`` for a run that sets neither, from measurements on this project's benchmarks.

    * Key-value windows on sparse rows (``communication`` sparse, no compression, not deterministic):
      :data:`SYNC_WINDOWED`. A window's keys, fetch and push cost about the same for 10 steps as for 50
      (the keys of 50 mini-batches overlap), so wider windows pay: on the 2^20-column click-through set
      (``benchmarks/downpour_sparse.py``, quiet box), 2 replicas ran at 1.01x one numpy process with
      n = 10, 1.15x with 20, 1.46-1.64x with 50 and 1.57-1.81x with 100, the objective after an epoch
      +0.5%, +0.5%, +0.9% and +1.6% above the process's.
    * A dense model of :data:`SYNC_LARGE_PARAMS` parameters or more: :data:`SYNC_LARGE`. On the MLP of
      ``benchmarks/downpour_steps.py`` (399,370 parameters, 3.2 MB a fetch), one replica ran at 1.08x a
      numpy process with n = 10 and 0.72x with n = 1; two replicas at 1.67x with n = 10.
    * Smaller models: 1 (the paper's setting; each step reads the freshest parameters, and a fetch of less
      than 1 MiB costs about an actor round trip).

    Examples
    --------
    >>> auto_sync(650, windowed=False), auto_sync(400_000, windowed=False), auto_sync(2**20, windowed=True)
    (1, 10, 50)
    """
    if windowed:
        return SYNC_WINDOWED
    return SYNC_LARGE if n_params >= SYNC_LARGE_PARAMS else 1


#: Learning rates used when ``lr`` is not given: good on the built-in models with standardized inputs and
#: mini-batches of a few dozen rows (the gradient is the mini-batch *mean*, so the rate does not depend on
#: the batch size).
DEFAULT_LR: dict[str, float] = {"sgd": 0.1, "adagrad": 0.2}


def check_workers(name: str, given: Sequence[str] | None, known: Sequence[str]) -> None:
    """Refuse worker addresses that are not workers of the cluster (their actors would wait for ever).

    Examples
    --------
    >>> check_workers("shard_workers", ["tcp://b:2"], ["tcp://a:1"])
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: option shard_workers: 'tcp://b:2' is not a worker of the ...
    """
    for address in given or ():
        if address not in known:
            raise InvalidOptionError(
                f"option {name}: {address!r} is not a worker of the cluster; use some of its workers "
                f"({', '.join(known)}) or None for all of them"
            )


@dataclass(frozen=True, kw_only=True)
class DownpourOptions:
    """The options of :func:`downpour.train` (see there for their meaning), checked on construction.

    ``lr`` left as ``None`` is replaced by :data:`DEFAULT_LR` for the rule. ``has_callback`` says whether
    :func:`downpour.train` was given a callback (which may then be the only way the run stops).

    Examples
    --------
    >>> DownpourOptions(rule="sgd", max_steps=100).lr
    0.1
    >>> DownpourOptions(n_fetch=0, max_steps=1)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: option n_fetch=0 is invalid: expected None (chosen from the ...
    """

    replicas: int | None = option(None, ge=1, rest=True, rest_le=REST_MAX_ACTORS)
    partitions: int | None = option(
        None, ge=1, rest=True, rest_le=REST_MAX_ACTORS, doc=PARTITIONS_DOC,
        expected="None or an int >= 1 (partition actors per model replica; 1: the whole model in one "
        "replica)",
    )  # fmt: skip
    shards: int | None = option(None, ge=1, rest=True, rest_le=REST_MAX_ACTORS)
    rule: Rule = option("adagrad", rest=True)
    lr: float | None = option(None, gt=0, rest=True, rest_le=1e3, expected="a finite number > 0")
    local_lr: float | None = option(
        None, ge=0, rest=True, rest_le=1e3,
        expected="None (the same as lr) or a finite number >= 0 (0: no local step)",
    )  # fmt: skip
    batch_size: int = option(32, ge=1, rest=True, rest_le=1_000_000)
    n_fetch: int | None = option(
        None, ge=1, rest=True, rest_le=REST_MAX_ITER, doc=_SYNC_DOC,
        expected="None (chosen from the model and the data: see auto_sync) or an int >= 1",
    )  # fmt: skip
    n_push: int | None = option(
        None, ge=1, rest=True, rest_le=REST_MAX_ITER, doc=_SYNC_DOC,
        expected="None (chosen from the model and the data: see auto_sync) or an int >= 1",
    )  # fmt: skip
    warmstart_steps: int = option(0, ge=0, rest=True, rest_le=100 * REST_MAX_ITER)
    epochs: int | None = option(None, ge=1, rest=True, rest_le=100_000)
    max_steps: int | None = option(None, ge=1, rest=True, rest_le=100 * REST_MAX_ITER)
    time_limit: float | None = option(None, gt=0, rest=True, rest_le=7 * 86400, doc="seconds")
    eval_every: float = option(1.0, gt=0, rest=True, rest_le=86400, doc="seconds between history rows")
    l2: float = option(0.0, ge=0, rest=True, rest_le=1e6)
    staleness_scale: bool | None = option(
        None, rest=True, expected="None (on for rule='sgd' with more than one replica), True or False"
    )
    max_loss_growth: float | None = option(
        10.0, gt=1, expected="None (only NaN / inf is divergence) or a finite number > 1"
    )
    max_staleness: int | None = option(
        None, ge=0, rest=True, rest_le=REST_MAX_ITER, expected="None (no bound) or an int >= 0"
    )
    checkpoint_every_s: float = option(
        5.0, ge=0, rest=True, rest_le=86400, expected="a number of seconds >= 0 (0: only the initial "
        "checkpoint)",
    )  # fmt: skip
    seed: int = option(0, ge=0, rest=True, rest_le=2**32 - 1)
    shuffle: bool = option(True, rest=True)
    poll_every: float = option(0.05, gt=0)
    call_timeout: float = option(30.0, gt=0)
    shard_workers: tuple[str, ...] | None = option(None, check=False)
    replica_workers: tuple[str, ...] | None = option(None, check=False)
    trace: bool = option(False)
    resume: bool = option(False)
    communication: Communication = option("auto")
    fuse: bool = option(
        True, rest=True,
        doc="Send each push and the next fetch as one message per shard when n_push == n_fetch (default "
        "true)",
    )  # fmt: skip
    compression: Compression | None = option(
        None,
        rest=True,
        doc='Compressed pushes (Strom 2015): {"tau": threshold}; null or absent: uncompressed. Not with '
        "partitions > 1",
    )
    max_coalesce: int | None = option(
        None, ge=0, rest=True, rest_le=REST_MAX_ITER,
        expected="None (8 for rule='adagrad', no limit for 'sgd'), 0 (no limit) or an int >= 1",
        doc="Most steps a push may sum while all of a replica's pushes are outstanding; 0: no limit; absent: "
        "8 for rule adagrad, no limit for sgd. Not with partitions > 1",
    )  # fmt: skip
    deterministic: bool = option(
        False, rest=True,
        doc="The same parameters, bit for bit, on every rerun: replicas work in rounds of n_fetch (= n_push) "
        "steps and the shards apply each round's pushes in replica order; replicas wait for each other at "
        "every round start. A job restarted with the service starts over. Not with partitions > 1 or "
        "warmstart_steps",
    )  # fmt: skip
    #: Not an option: whether :func:`downpour.train` was given a callback (then a way to stop).
    has_callback: bool = False

    def __post_init__(self) -> None:
        for name in ("shard_workers", "replica_workers"):
            object.__setattr__(self, name, worker_tuple(getattr(self, name)))
        check_fields(self)
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.rule])
        check_option(
            not (self.communication == "sparse" and self.l2),
            "communication",
            self.communication,
            "'auto' or 'dense' when l2 > 0 (the l2 term moves every parameter every step)",
        )
        if self.deterministic is True:
            # Rounds of n steps (storage/_rounds.py): a fetch and a push a round, all replicas from the start.
            check_option(
                self.n_fetch is None or self.n_push is None or self.n_fetch == self.n_push,
                "n_fetch",
                self.n_fetch,
                f"equal to n_push ({self.n_push}) with deterministic=True (rounds of n steps)",
            )
            check_option(
                self.warmstart_steps == 0,
                "warmstart_steps",
                self.warmstart_steps,
                "0 with deterministic=True (every replica takes part from the first round)",
            )
            check_option(
                not self.resume,
                "resume",
                self.resume,
                "False with deterministic=True (the shards' push order starts with the run)",
            )
        check_compression(self.compression)
        for name in ("shard_workers", "replica_workers"):
            value = getattr(self, name)
            check_option(
                value is None
                or (isinstance(value, tuple) and len(value) > 0 and all(isinstance(w, str) for w in value)),
                name,
                value,
                "None or a non-empty list of worker addresses",
            )
        if (
            self.epochs is None
            and self.max_steps is None
            and self.time_limit is None
            and not self.has_callback
        ):
            raise InvalidOptionError(
                "train() needs a way to stop: give epochs=, max_steps= or time_limit= "
                "(or a callback that raises StopIteration)"
            )

    def with_sync(self, n_params: int, *, windowed: bool) -> DownpourOptions:
        """These options with ``n_fetch`` and ``n_push`` set: a missing one takes the other's value, and
        both missing take :func:`auto_sync`'s.

        Examples
        --------
        >>> o = DownpourOptions(max_steps=1)
        >>> (o.n_fetch, o.n_push), o.with_sync(400_000, windowed=False).n_push
        ((None, None), 10)
        >>> DownpourOptions(max_steps=1, n_push=4).with_sync(650, windowed=False).n_fetch
        4
        """
        n_fetch, n_push = self.n_fetch, self.n_push
        if n_fetch is None and n_push is None:
            n_fetch = n_push = auto_sync(n_params, windowed=windowed)
        return dataclasses.replace(self, n_fetch=n_fetch or n_push, n_push=n_push or n_fetch)

    @property
    def sync(self) -> tuple[int, int]:
        """``(n_fetch, n_push)`` of options that went through :meth:`with_sync`."""
        assert self.n_fetch is not None and self.n_push is not None, "call with_sync first"
        return self.n_fetch, self.n_push

    @property
    def fuses(self) -> bool:
        """Whether a push and the next fetch travel as one message (``fuse`` and ``n_push == n_fetch``).

        Examples
        --------
        >>> DownpourOptions(max_steps=1).fuses, DownpourOptions(max_steps=1, n_fetch=2).fuses
        (True, False)
        """
        return self.fuse and self.n_push == self.n_fetch

    def scales_staleness(self, replicas: int) -> bool:
        """Whether the shards divide each push's step by ``1 + staleness`` in a run of ``replicas``.

        ``staleness_scale=None`` (the default) turns it on for a fixed rate (``rule="sgd"``) with more than
        one replica: a fixed rate tuned for one replica diverges with several (4 replicas on the digits
        MLP at lr 0.2 ended at chance accuracy in 2 of 3 runs), as each stale push adds a full step.
        Adagrad's own rates shrink with the pushes it has applied, and scaling them down again stalls it.

        The staleness a step is divided by counts the *other* replicas' updates since the fetch (a
        replica's own pushes are in its local copy; :meth:`storage.Shard.others_since`). Counting its own
        too left 2 replicas on a two-feature logistic problem 2.4-12% above the batch optimum after 10
        epochs (14-28% of the unscaled rate); counting only the others', 0.04-4.8% (26-52%).
        The replicas' local step stays at the full rate (``local_lr`` defaults to ``lr``): without it the
        4-replica digits MLP diverged in 3 of 3 runs.

        Examples
        --------
        >>> DownpourOptions(rule="sgd", max_steps=1).scales_staleness(4)
        True
        >>> DownpourOptions(rule="sgd", max_steps=1).scales_staleness(1)
        False
        >>> DownpourOptions(max_steps=1).scales_staleness(4)
        False
        """
        if self.staleness_scale is not None:
            return self.staleness_scale
        return self.rule == "sgd" and replicas > 1

    @property
    def coalesce_limit(self) -> int | None:
        """The most steps a push may sum while every push is outstanding (None: no limit).

        ``max_coalesce=None`` gives :data:`downpour._core.ADAGRAD_MAX_COALESCE` for Adagrad, whose
        accumulators a push of many summed gradients inflates for good, and no limit for SGD, where a
        summed push is exactly the steps it sums.

        Examples
        --------
        >>> DownpourOptions(max_steps=1).coalesce_limit
        8
        >>> DownpourOptions(rule="sgd", max_steps=1).coalesce_limit is None
        True
        >>> DownpourOptions(max_coalesce=0, max_steps=1).coalesce_limit is None
        True
        """
        if self.max_coalesce is None:
            return ADAGRAD_MAX_COALESCE if self.rule == "adagrad" else None
        return self.max_coalesce or None

    @property
    def step_size(self) -> float:
        """The resolved learning rate (``lr`` as a float)."""
        assert self.lr is not None
        return float(self.lr)


def options_from(given: dict[str, Any], **fixed: Any) -> DownpourOptions:
    """The :class:`DownpourOptions` of ``downpour.train``'s arguments ``given`` (its locals), with ``fixed``.

    Examples
    --------
    >>> options_from({"max_steps": 5, "callback": None, "model": None}).max_steps
    5
    """
    rest = {name: value for name, value in given.items() if name not in fixed}
    return options_of(DownpourOptions, rest, **fixed, has_callback=given.get("callback") is not None)
