"""Every option of :func:`downpour.train`, validated once into a frozen dataclass.

Defaults follow the DistBelief paper, section 4.1: ``n_fetch = n_push = 1`` as in its experiments, Adagrad on
the shards, a learning rate for Adagrad about an order of magnitude above the best fixed SGD rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from distbelief.errors import InvalidOptionError
from distbelief.storage import RULES

from ._compress import Compression, check_compression
from ._core import ADAGRAD_MAX_COALESCE

__all__ = ["DEFAULT_LR", "DownpourOptions", "Rule", "check_workers", "worker_tuple"]

Rule = Literal["sgd", "adagrad"]

#: Learning rates used when ``lr`` is not given: good on the built-in models with standardized inputs and
#: mini-batches of a few dozen rows (the gradient is the mini-batch *mean*, so the rate does not depend on
#: the batch size).
DEFAULT_LR: dict[str, float] = {"sgd": 0.1, "adagrad": 0.2}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise InvalidOptionError(f"option {name}={value!r} is invalid: expected {expected}")


def worker_tuple(value: object) -> object:
    """A sequence of worker addresses as a tuple; anything else (a single string too) as it is, for
    :class:`DownpourOptions` to refuse (``tuple("tcp://...")`` would be its characters).

    Examples
    --------
    >>> worker_tuple(["tcp://a:1"]), worker_tuple("tcp://a:1")
    (('tcp://a:1',), 'tcp://a:1')
    """
    if value is None or isinstance(value, str | bytes):
        return value
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        return value


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
    distbelief.errors.InvalidOptionError: option n_fetch=0 is invalid: expected an int >= 1
    """

    replicas: int | None = None
    shards: int | None = None
    rule: Rule = "adagrad"
    lr: float | None = None
    local_lr: float | None = None
    batch_size: int = 32
    n_fetch: int = 1
    n_push: int = 1
    warmstart_steps: int = 0
    epochs: int | None = None
    max_steps: int | None = None
    time_limit: float | None = None
    eval_every: float = 1.0
    l2: float = 0.0
    staleness_scale: bool | None = None
    max_loss_growth: float | None = 10.0
    max_staleness: int | None = None
    checkpoint_every_s: float = 5.0
    seed: int = 0
    shuffle: bool = True
    poll_every: float = 0.05
    call_timeout: float = 30.0
    shard_workers: tuple[str, ...] | None = None
    replica_workers: tuple[str, ...] | None = None
    trace: bool = False
    resume: bool = False
    has_callback: bool = False
    communication: str = "auto"
    fuse: bool = True
    compression: Compression | None = None
    max_coalesce: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        _check(self.rule in RULES, "rule", self.rule, "'sgd' or 'adagrad'")
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.rule])
        _check(_is_number(self.lr) and float(self.lr or 0) > 0, "lr", self.lr, "a finite number > 0")
        _check(
            self.local_lr is None or (_is_number(self.local_lr) and self.local_lr >= 0),
            "local_lr",
            self.local_lr,
            "None (the same as lr) or a finite number >= 0 (0: no local step)",
        )
        for name in ("batch_size", "n_fetch", "n_push"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _check(
            self.max_coalesce is None or (_is_int(self.max_coalesce) and self.max_coalesce >= 0),
            "max_coalesce",
            self.max_coalesce,
            "None (8 for rule='adagrad', no limit for 'sgd'), 0 (no limit) or an int >= 1",
        )
        for name in ("replicas", "shards", "epochs", "max_steps"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), name, value, "None or an int >= 1")
        _check(
            _is_int(self.warmstart_steps) and self.warmstart_steps >= 0,
            "warmstart_steps",
            self.warmstart_steps,
            "an int >= 0",
        )
        _check(
            self.max_staleness is None or (_is_int(self.max_staleness) and self.max_staleness >= 0),
            "max_staleness",
            self.max_staleness,
            "None (no bound) or an int >= 0",
        )
        _check(
            self.time_limit is None or (_is_number(self.time_limit) and self.time_limit > 0),
            "time_limit",
            self.time_limit,
            "None or a number of seconds > 0",
        )
        for name in ("eval_every", "poll_every", "call_timeout"):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, name, value, "a number of seconds > 0")
        _check(
            _is_number(self.checkpoint_every_s) and self.checkpoint_every_s >= 0,
            "checkpoint_every_s",
            self.checkpoint_every_s,
            "a number of seconds >= 0 (0: only the initial checkpoint)",
        )
        _check(_is_number(self.l2) and self.l2 >= 0, "l2", self.l2, "a finite number >= 0")
        _check(_is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an int >= 0")
        _check(
            self.communication in ("auto", "dense", "sparse"),
            "communication",
            self.communication,
            "'auto', 'dense' or 'sparse'",
        )
        _check(
            not (self.communication == "sparse" and self.l2),
            "communication",
            self.communication,
            "'auto' or 'dense' when l2 > 0 (the l2 term moves every parameter every step)",
        )
        if self.deterministic is True:
            # Rounds of n steps (storage/_rounds.py): a fetch and a push a round, all replicas from the start.
            _check(
                self.n_fetch == self.n_push,
                "n_fetch",
                self.n_fetch,
                f"equal to n_push ({self.n_push}) with deterministic=True (rounds of n steps)",
            )
            _check(
                self.warmstart_steps == 0,
                "warmstart_steps",
                self.warmstart_steps,
                "0 with deterministic=True (every replica takes part from the first round)",
            )
            _check(
                not self.resume,
                "resume",
                self.resume,
                "False with deterministic=True (the shards' push order starts with the run)",
            )
        check_compression(self.compression)
        for name in ("shuffle", "trace", "resume", "fuse", "deterministic"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "True or False")
        _check(
            self.staleness_scale is None or isinstance(self.staleness_scale, bool),
            "staleness_scale",
            self.staleness_scale,
            "None (on for rule='sgd' with more than one replica), True or False",
        )
        _check(
            self.max_loss_growth is None or (_is_number(self.max_loss_growth) and self.max_loss_growth > 1),
            "max_loss_growth",
            self.max_loss_growth,
            "None (only NaN / inf is divergence) or a finite number > 1",
        )
        for name in ("shard_workers", "replica_workers"):
            value = getattr(self, name)
            _check(
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
