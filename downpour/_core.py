"""The replica side of Downpour SGD as a small state machine, with no Dask and no threads in it.

DistBelief paper, section 4.1 and Algorithm 7.1 (the Appendix, "DownpourSGDClient")::

    step = 0; accrued = 0
    loop:
      if step % n_fetch == 0: start fetching parameters (async)   # replaces the local copy when it lands
      g = grad(params, next_minibatch()); accrued += g; params -= lr * g
      if step % n_push == 0: start pushing accrued (async); accrued = 0
      step += 1

:class:`ReplicaCore` holds the replica's local copy of the parameters, the accrued gradient and the
bookkeeping of fetches and pushes in flight; a transport (the Dask actor in :mod:`downpour._replica`, or a
test's in-process loop) moves the messages it produces and feeds back what the shards answer. Choices made
where the paper leaves room, each for a reason:

* **Read your own writes.** A transport sends one replica's pushes and fetches to a shard in order, so a
  fetch sees every push sent before it. When a fetch lands, the local copy becomes the fetched values *plus
  the local steps the fetch cannot contain* (those whose gradient was not yet sent when the fetch was
  issued, and those taken since). Replacing the copy outright would throw away the replica's last few
  steps whenever a fetch is slower than a step; with one replica and ``rule="sgd"`` this rule makes the run
  exactly sequential mini-batch SGD, whatever the timing.
* **The local step is plain SGD**, ``params -= local_lr * g`` as in Algorithm 7.1, with ``local_lr = lr``
  unless given (0: no local step), whatever the shards' rule. A local Adagrad step (the shards'
  accumulators fetched along with the parameters, twice the bytes) was tried: with 4 replicas on digits
  the held-out accuracy oscillated by 20 points, as each replica took many near-``lr`` steps per
  coordinate between fetches; plain SGD did not.
* **Pushes coalesce.** At most ``max_pushes_in_flight`` pushes are outstanding; while that many are, the
  gradient keeps accruing and goes out with the next push, so a slow network does not stall the computation
  (the push "thread" of the paper, busy, would do the same). As in the paper with ``n_push > 1``, the shards
  treat a push as one gradient: Adagrad adds the square of the *sum* to its accumulators. While the k
  gradients of a push agree (early in a run) that is ~k times the sum of their squares, and Adagrad never
  forgets: heavily coalesced pushes shrink its rate for the rest of the run. Near the optimum, where the
  gradients are mostly noise, the square of the sum equals the sum of the squares in expectation, so the
  rule itself stays the paper's; instead, with ``rule="adagrad"`` at most ``max_coalesce``
  (:data:`ADAGRAD_MAX_COALESCE`) steps accrue while pushes are outstanding, after which the replica waits
  for an answer. Measured (issue 17; two-feature logistic, 10 epochs, default rates, 5 seeds, load average
  ~22-27): 2 replicas coalesced 25-58 steps a push, their accumulators grew to 30-50 times those of
  sequential Adagrad and they ended 1-10% above the batch optimum; capped at 8, 0.03-0.07% (1 replica:
  0.25-0.9%, capped 0.0-0.03%). Adding the sum of squares instead (the same accumulators as k separate
  pushes, twice the bytes) was tried and made 2-replica runs on digits markedly less stable at the same
  ``lr``; dividing the square of the sum by k (k pushes of the mean) ended 0.2-17% above (too large steps
  once the gradients are noise).
* **Staleness** of a push, as the shard measures and reports it, is the number of updates the shard
  applied between the fetch the gradient's parameters came from and the push (own earlier pushes
  included). The staleness-aware step (``staleness_scale``) divides by one plus the *other* replicas'
  updates only (:meth:`storage.Shard.others_since`): the replica's own earlier pushes are in its local copy
  (read your own writes), so they do not make its gradient stale. Counting them too gave 2 replicas with
  ``rule="sgd"`` 14-28% of the unscaled rate and 2.4-12% gaps on the logistic problem above; without them
  26-52% and 0.04-4.8%. With ``max_staleness = s`` the replica waits, before computing, for a fresh fetch
  whenever what it knows (versions reported by the shards plus its own pushes still in flight) already puts
  the coming push more than ``s`` updates behind (a stale-synchronous bound in the spirit of Ho et al.
  2013; see the overview in ``papers/``). ``s = 0`` with one replica is sequential SGD or Adagrad, step for
  step.
* **Fused push and fetch** (``fuse=True``, with ``n_push == n_fetch``). Step ``k``'s push and step
  ``k + 1``'s fetch would go out back to back on every shard's channel; instead the push carries the fetch
  (:attr:`PushMessage.fetch`) and the shard answers both in one message (``Shard.push_and_fetch``), so a
  step costs one message per shard instead of two. The fetch starts right after the push is taken, so the
  local steps it cannot contain start from zero, as for a plain fetch sent then. A push that must wait (too
  many in flight) carries the fetch when it goes; meanwhile no plain fetch is sent for that step. Several
  fetches may then be in flight at once; each keeps its own record of the local steps it cannot contain,
  and a slice is replaced by whichever lands (they land in order on each shard's channel).
* **Compressed pushes** (``compression=``, Strom 2015: :mod:`downpour._compress`). The accrued gradient
  goes into a residual; only entries with ``|r| >= tau`` are sent, as ``+/-tau`` (sign-coded keys). The
  local copy is treated as if the whole gradient were pushed (the residual reaches the shards later), so
  one replica is no longer step-for-step sequential SGD.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distbelief.errors import InvalidOptionError
from distbelief.models import Model
from distbelief.storage import (
    accrue_at,
    accrue_rows,
    accrue_step,
    add_at_positions,
    add_rows_at_positions,
    axpy,
    check_rule,
    scaled_gradient,
    take_at,
)
from distbelief.storage.internal import kv_bytes, split_keys

from ._compress import Compression, ThresholdCompressor, encode, signed_bytes

__all__ = ["ADAGRAD_MAX_COALESCE", "FetchRequest", "PushMessage", "ReplicaCore", "ReplicaCounters"]

#: With ``rule="adagrad"``, the most steps a replica accrues while its pushes are all outstanding (see
#: "Pushes coalesce" above); then it waits for a push to be answered.
ADAGRAD_MAX_COALESCE = 8


@dataclass(frozen=True)
class FetchRequest:
    """A fetch to send to every shard: its id, the vector names, and the shard-map generation.

    Examples
    --------
    >>> ReplicaCore([(0, 4)], rule="sgd", lr=0.1).start_fetch()
    FetchRequest(fid=0, names=('x',), gen=0)
    """

    fid: int
    names: tuple[str, ...]
    gen: int
    #: Deterministic mode: the round whose starting parameters this fetch asks for (storage/_rounds.py).
    round: int | None = field(default=None, repr=False)
    #: Windowed key-value fetch (:meth:`ReplicaCore.use_windows`): per shard, the local offsets asked for.
    keys: tuple[np.ndarray, ...] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PushMessage:
    """An accrued gradient to push to every shard.

    ``fetched_versions[i]`` is the version of shard ``i`` that the oldest gradient in the sum was computed
    from (None when unknown, e.g. right after the shard was restored); the shard reports the push's
    staleness against it.

    Examples
    --------
    >>> msg = PushMessage(seq=0, grad=np.ones(2), fetched_versions=(3,), steps=1, gen=0)
    >>> msg.steps
    1
    """

    seq: int
    grad: np.ndarray
    fetched_versions: tuple[int | None, ...]
    steps: int
    gen: int
    #: Key-value push (``ReplicaCore.sparse``): per shard, the local offsets of the entries sent; ``grad``
    #: then holds their values, shard after shard. None: ``grad`` is the whole vector.
    keys: tuple[np.ndarray, ...] | None = None
    #: A fused push: the fetch each shard answers along with the push (``Shard.push_and_fetch``).
    fetch: FetchRequest | None = None
    #: A compressed push (Strom 2015): ``keys`` are sign-coded (``storage._keys.encode_signs``), each entry
    #: ``+tau`` or ``-tau``, and ``grad`` is empty.
    tau: float | None = None
    #: Deterministic mode: the round this push closes, and whether it is the replica's last one.
    round: int | None = None
    last: bool = False

    def parts(self, bounds: Sequence[int]) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
        """``(values, keys)`` for every shard: the slices of a dense push, the pairs of a key-value one,
        ``(None, sign-coded keys)`` of a compressed one.

        Examples
        --------
        >>> msg = PushMessage(0, np.array([5.0, 6.0]), (0, 0), 1, 0, keys=(np.array([1]), np.array([0])))
        >>> [(v.tolist(), k.tolist()) for v, k in msg.parts((0, 2, 4))]
        [([5.0], [1]), ([6.0], [0])]
        """
        if self.keys is None:
            return [(self.grad[bounds[i] : bounds[i + 1]], None) for i in range(len(bounds) - 1)]
        if self.tau is not None:
            return [(None, k) for k in self.keys]
        cuts = np.cumsum([0, *(k.size for k in self.keys)])
        return [(self.grad[cuts[i] : cuts[i + 1]], k) for i, k in enumerate(self.keys)]


@dataclass
class _Fetch:
    request: FetchRequest
    pending: set[int]
    #: The local steps its answer cannot contain, at the keys it asks for (a windowed fetch: None while no
    #: push has been sent since it was issued; its answer then lands on the unsent steps as they are).
    dx: np.ndarray | None
    #: Pushes this replica had sent when the fetch was issued (those after it are not in its answer).
    sent: int = 0
    #: A shard did not answer it (it is fetched again).
    failed: bool = False
    #: Windowed fetches: the steps ``[a, b)`` whose keys it asks for, those keys (global, sorted; ``dx`` is
    #: then held at them only), and, once ``dx`` is held, each key's place in it (a table over the whole
    #: vector, ``-1`` where not held, reused by later fetches: a step adds into it at its own keys only).
    cover: tuple[int, int] | None = None
    keys: np.ndarray | None = None
    positions: np.ndarray | None = None


@dataclass
class ReplicaCounters:
    """What a replica has done; cumulative unless said otherwise (lists: one entry per shard).

    Examples
    --------
    >>> ReplicaCore([(0, 2), (2, 4)], rule="sgd", lr=0.1).counters.pushes
    [0, 0]
    """

    steps: int = 0
    rows: int = 0
    loss_sum: float = 0.0
    fetches: list[int] = field(default_factory=list)
    pushes: list[int] = field(default_factory=list)
    fetch_errors: list[int] = field(default_factory=list)
    push_errors: list[int] = field(default_factory=list)
    duplicates: int = 0
    pushes_sent: int = 0
    staleness_sum: int = 0
    staleness_count: int = 0
    #: Largest staleness since the last :meth:`ReplicaCore.record` (which resets it, on the thread that
    #: counts the pushes' answers): every applied push is in exactly one record's window, and a snapshot
    #: taken in between reports the window so far, so the driver can give each history row the maximum of
    #: the pushes it counts. (Two windows, one reset by snapshots and one by records, let a row count pushes
    #: whose maximum an earlier row had taken: ``staleness_mean`` 4.5 beside ``staleness_max`` 0, issue 27.)
    staleness_max: int = 0
    #: Per shard, the sum over applied pushes of ``steps`` (``steps / (1 + staleness)`` with
    #: ``staleness_scale``): the learning-rate weight the shard gave this replica's gradients.
    applied_weight: list[float] = field(default_factory=list)
    #: Per shard, the sum over applied pushes of ``steps**2`` (how Adagrad's accumulators grow under a
    #: constant gradient).
    applied_steps_sq: list[int] = field(default_factory=list)
    stale_waits: int = 0
    #: Bytes of parameters (and keys) fetched and of gradients (and keys) pushed, as sent.
    bytes_fetched: int = 0
    bytes_pushed: int = 0
    #: Messages sent to shards (one per shard a fetch or push goes to; a fused push and fetch is one), and
    #: how many pushes carried a fetch.
    messages: int = 0
    fused: int = 0


class ReplicaCore:
    """One Downpour replica's local state and message bookkeeping; see the module docstring.

    Parameters
    ----------
    ranges : sequence of (int, int)
        The shards' parameter ranges ``[lo, hi)``, in order, covering the whole vector.
    rule : {"sgd", "adagrad"}
        The rule the shards apply.
    lr : float
        The shards' learning rate (Adagrad's gamma).
    local_lr : float, optional
        Rate of the local SGD step (default ``lr``; 0: no local step).
    n_fetch, n_push : int
        Fetch before every ``n_fetch``-th step; push after every ``n_push``-th.
    l2 : float
        L2 regularization, added to every mini-batch gradient (``l2 * w``).
    max_staleness : int, optional
        Wait for a fresh fetch rather than compute a gradient that will land more than this many updates
        behind.
    staleness_scale : bool
        Whether the shards divide the step by ``1 + staleness`` (only used for :attr:`counters`).
    max_pushes_in_flight : int
        Pushes outstanding before the gradient keeps accruing instead.
    max_coalesce : int, optional
        With that many pushes outstanding, the most steps that accrue before :meth:`push_backlogged` says
        the next step waits for an answer (None: no limit). :class:`downpour._replica.DownpourReplica`
        sets :data:`ADAGRAD_MAX_COALESCE` for ``rule="adagrad"``.
    trace : bool
        Keep every step's mini-batch loss in :attr:`losses`.
    fuse : bool
        With ``n_push == n_fetch``: every due push carries the next fetch (:attr:`PushMessage.fetch`; the
        transport must send it as one ``push_fetch`` message per shard). Ignored otherwise.
    compression : downpour.Compression, optional
        Compressed pushes (Strom 2015, :mod:`downpour._compress`); None: the accrued gradient as is.
    fetch_keys : sequence of numpy.ndarray, optional
        Key-value communication (ps-lite style pull/push): per shard, the local offsets of the parameters
        this replica's rows touch, the only ones it fetches; pushes then carry only the accrued gradient's
        nonzero entries. Exactly the dense run's floats when nothing but the data term moves a parameter
        (``l2 = 0``): a zero gradient leaves SGD and Adagrad (weights and accumulators) unchanged, and
        parameters no row touches are never read. May be set later, before the first fetch.

    Examples
    --------
    >>> from distbelief.storage import Shard
    >>> from distbelief import models
    >>> core = ReplicaCore([(0, 3)], rule="sgd", lr=0.1)
    >>> shard = Shard(0, 0, 3); shard.set("x", 0, 3, np.zeros(3))
    >>> req = core.start_fetch(); version, (x,) = 0, [shard.get("x")]
    >>> core.on_fetched(req.fid, 0, version, [x]); core.ready
    True
    >>> m = models.LeastSquares(2)
    >>> loss = core.compute(m, np.array([[1.0, 0.0]]), np.array([1.0]))
    >>> msg = core.take_push(); msg.steps, msg.grad.round(3).tolist()
    (1, [-1.0, 0.0, -1.0])
    """

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        *,
        rule: str,
        lr: float,
        local_lr: float | None = None,
        n_fetch: int = 1,
        n_push: int = 1,
        l2: float = 0.0,
        max_staleness: int | None = None,
        staleness_scale: bool = False,
        max_pushes_in_flight: int = 2,
        max_coalesce: int | None = None,
        trace: bool = False,
        fuse: bool = False,
        compression: Compression | None = None,
        fetch_keys: Sequence[np.ndarray] | None = None,
        deterministic: bool = False,
    ) -> None:
        check_rule(rule)
        if deterministic and n_fetch != n_push:
            raise InvalidOptionError(
                "deterministic=True works in rounds of n steps: give n_fetch == n_push "
                f"(got {n_fetch}, {n_push})"
            )
        #: Rounds of ``n_fetch`` steps, each from the parameters after every push of the rounds before it
        #: (storage/_rounds.py); ``_round_landed`` is the last round whose fetch every shard answered.
        self.deterministic = bool(deterministic)
        self._round_landed = -1
        self._last_sent = False
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        self.n_shards = len(self.ranges)
        self.n = self.ranges[-1][1]
        self.rule = rule
        self.lr = float(lr)
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.l2 = float(l2)
        self.max_staleness = max_staleness
        self.staleness_scale = staleness_scale
        self.max_pushes_in_flight = max_pushes_in_flight
        self.max_coalesce = max_coalesce
        self.local_rate = self.lr if local_lr is None else float(local_lr)
        self.fetch_names: tuple[str, ...] = ("x",)
        self.x = np.zeros(self.n)
        self.accrued = np.zeros(self.n)
        self.accrued_steps = 0
        self._accrued_base: tuple[int | None, ...] = (None,) * self.n_shards
        self._accrued_base_sent: tuple[int, ...] = (0,) * self.n_shards
        # Local steps whose gradient no fetch can contain yet (not sent in a push).
        self._unsent_dx = np.zeros(self.n)
        #: The step's mean gradient (reused: one allocation per replica, not per step).
        self._grad = np.zeros(self.n)
        self.gen = 0
        self.seq = 0
        self._next_fid = 0
        #: Fetches in flight, by id (more than one only with fused pushes).
        self._fetches: dict[int, _Fetch] = {}
        self._fetch_due = True
        self.fuse = bool(fuse) and n_push == n_fetch
        #: The step count at which a fused push last carried the fetch due at that step.
        self._fused_at = -1
        self.compressor = None if compression is None else ThresholdCompressor(self.n, compression)
        #: Per shard, the id of the newest fetch that landed (an older answer is never applied after it).
        self._landed_fid = [-1] * self.n_shards
        self._push_due = False
        #: Per shard: the version the local copy was fetched at, and the generation of that fetch.
        self.base: list[int | None] = [None] * self.n_shards
        self._base_gen = [-1] * self.n_shards
        #: Per shard: pushes sent before the fetch the local copy's slice came from was issued.
        self._base_sent = [0] * self.n_shards
        #: Per shard: the newest version the shard has reported (in the current generation).
        self.known = [0] * self.n_shards
        self._known_gen = [0] * self.n_shards
        # seq -> (shards not answered, steps, per shard: own pushes the shard applied after the push's base
        # fetch, which the shard leaves out of the staleness it scales by)
        self._pending: dict[int, tuple[set[int], int, tuple[int, ...]]] = {}
        self._landed_once = [False] * self.n_shards
        self.diverged = False
        self.counters = ReplicaCounters(
            fetches=[0] * self.n_shards,
            pushes=[0] * self.n_shards,
            fetch_errors=[0] * self.n_shards,
            push_errors=[0] * self.n_shards,
            applied_weight=[0.0] * self.n_shards,
            applied_steps_sq=[0] * self.n_shards,
        )
        self.trace = trace
        self.losses: list[float] = []
        self.fetch_keys: list[np.ndarray] | None = None
        if fetch_keys is not None:
            self.use_keys(fetch_keys)
        #: Windowed key-value communication (:meth:`use_windows`): the sorted global keys of steps ``[a, b)``.
        self.window_keys: Callable[[int, int], np.ndarray] | None = None
        #: Steps ``[0, _requested_until)`` are covered by fetches landed or in flight, ``[0, _landed_until)``
        #: by landed ones (windowed mode only).
        self._requested_until = 0
        self._landed_until = 0
        #: The step the accrued sum starts at.
        self._accrued_from = 0
        #: Position tables of settled windowed fetches, for the next ones (see ``_Fetch.positions``).
        self._tables: list[np.ndarray] = []

    @property
    def sparse(self) -> bool:
        """Whether fetches and pushes are key-value (see ``fetch_keys`` and :meth:`use_windows`)."""
        return self.fetch_keys is not None or self.window_keys is not None

    def _check_key_value(self) -> None:
        if self.l2:
            raise InvalidOptionError(
                "key-value communication needs l2 = 0: the replica adds l2 * w to every gradient, which "
                "moves every parameter"
            )

    def use_keys(self, fetch_keys: Sequence[np.ndarray]) -> None:
        """Switch to key-value communication with these per-shard local keys (see ``fetch_keys``)."""
        self._check_key_value()
        if len(fetch_keys) != self.n_shards:
            raise InvalidOptionError(f"fetch_keys: {len(fetch_keys)} key arrays for {self.n_shards} shards")
        self.fetch_keys = [np.asarray(k) for k in fetch_keys]

    def use_windows(self, window_keys: Callable[[int, int], np.ndarray]) -> None:
        """Windowed key-value communication: each fetch asks only for the keys of the steps ahead.

        ``window_keys(a, b)`` gives the sorted global parameter indices that steps ``a`` to ``b - 1`` (step
        numbers as :attr:`counters`' ``steps``) touch. A fetch started at step ``t`` covers the steps from
        the first one no fetch covers yet to the end of the next ``n_fetch`` window (the first fetch: two
        windows; then one window ahead, prefetched while the current one is computed, as a dense fetch
        lands while steps go on); a step waits until a fetch that covers it has landed. Steps go through
        :meth:`compute_at`, and every per-step operation costs the step's own keys: a replica of a 2^20-wide
        model keeps no dense pass per step (issue 29's Downpour on sparse data). The local copy :attr:`x`
        is exact only at the keys of the steps ahead; a history record asks for the shards' parameters
        instead (``x_wanted``).

        Not with compressed pushes or deterministic rounds (they use the replica's whole key set:
        :meth:`use_keys`).
        """
        self._check_key_value()
        if self.compressor is not None or self.deterministic:
            raise InvalidOptionError(
                "windowed key-value fetches do not combine with compression or deterministic=True; "
                "use use_keys"
            )
        self.window_keys = window_keys
        # The local steps no push has carried yet are -local_rate times the accrued gradient here (a push
        # clears both at the same keys): kept as that product, not as a vector every step adds into too.
        self._unsent_dx = np.zeros(0)

    # -- state -------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether every shard's slice has been fetched at least once."""
        return all(self._landed_once)

    @property
    def pushes_in_flight(self) -> int:
        """Pushes sent that not every shard has answered."""
        return len(self._pending)

    def staleness_estimate(self) -> int:
        """A lower bound on the staleness a push sent now would have, at its worst shard."""
        worst = 0
        unacked = [0] * self.n_shards
        for shards, _, _ in self._pending.values():
            for i in shards:
                unacked[i] += 1
        for i in range(self.n_shards):
            base = self.base[i]
            if base is None or self._base_gen[i] != self.gen:
                continue
            known = self.known[i] if self._known_gen[i] == self.gen else base
            worst = max(worst, known + unacked[i] - base)
        return worst

    def must_wait(self) -> bool:
        """Whether the next step must wait for a fetch (first parameters, the staleness bound, or in
        deterministic mode the fetch of the current round)."""
        if self.deterministic:
            return self._round_landed < self.counters.steps // self.n_fetch
        if not self.ready:
            return True
        if self.window_keys is not None and self.counters.steps >= self._landed_until:
            return True  # the parameters this step reads have not been fetched yet
        return self.max_staleness is not None and self.staleness_estimate() > self.max_staleness

    def push_backlogged(self) -> bool:
        """Whether the next step must wait for a push to be answered: ``max_coalesce`` steps have accrued
        and ``max_pushes_in_flight`` pushes are outstanding."""
        return (
            self.max_coalesce is not None
            and self.accrued_steps >= self.max_coalesce
            and len(self._pending) >= self.max_pushes_in_flight
        )

    # -- fetch -------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Mark a fetch as due on every ``n_fetch``-th step (it starts as soon as none is in flight).

        With fused pushes, the fetch due now was sent with the last push, or goes with the push still due.
        """
        steps = self.counters.steps
        if steps % self.n_fetch == 0 and not (self.fuse and (self._fused_at == steps or self._push_due)):
            self._fetch_due = True

    def fetch_wanted(self) -> bool:
        """Whether the transport should call :meth:`start_fetch` now."""
        return not self._fetches and (self._fetch_due or self.must_wait())

    def start_fetch(self) -> FetchRequest:
        """Begin a fetch from every shard; the local steps it cannot contain are tracked from here on."""
        self.counters.messages += self.n_shards
        return self._new_fetch()

    def _new_fetch(self) -> FetchRequest:
        round_ = self.counters.steps // self.n_fetch if self.deterministic else None
        if self.window_keys is not None:
            return self._new_window_fetch()
        request = FetchRequest(self._next_fid, self.fetch_names, self.gen, round=round_)
        self._next_fid += 1
        self._fetches[request.fid] = _Fetch(
            request, set(range(self.n_shards)), self._unsent_dx.copy(), self.seq
        )
        self._fetch_due = False
        if self.fetch_keys is None:
            self.counters.bytes_fetched += 8 * self.n * len(request.names)
        else:
            self.counters.bytes_fetched += sum(
                kv_bytes(k) + 8 * k.size * len(request.names) for k in self.fetch_keys
            )
        return request

    def _new_window_fetch(self) -> FetchRequest:
        assert self.window_keys is not None
        steps = self.counters.steps
        # Under a staleness bound a step must read the newest fetch: every fetch covers the current step
        # too (up to twice the keys). Otherwise the next window's keys are prefetched once, as a dense fetch
        # lands while the current window's steps go on; the pushes' staleness reports what they read.
        start = steps if self.max_staleness is not None else max(steps, self._requested_until)
        end = max(start, (steps // self.n_fetch + 2) * self.n_fetch)
        keys = self.window_keys(start, end)
        local = tuple(split_keys(self._bounds, keys))
        request = FetchRequest(self._next_fid, self.fetch_names, self.gen, keys=local)
        self._next_fid += 1
        # The local steps its answer cannot contain are the unsent ones (:meth:`_unsent_at`) until the next
        # push clears them: only then are they copied out and tracked step by step (_hold_fetch_steps).
        # A fetch that lands first, as a prefetched window's does, costs no per-step work.
        self._fetches[request.fid] = _Fetch(
            request, set(range(self.n_shards)), None, self.seq, cover=(start, end), keys=keys
        )
        self._requested_until = end
        self._fetch_due = False
        self.counters.bytes_fetched += kv_bytes(*local) + 8 * keys.size * len(request.names)
        return request

    @property
    def _bounds(self) -> list[int]:
        return [lo for lo, _ in self.ranges] + [self.n]

    def on_fetched(self, fid: int, shard: int, version: int, arrays: Sequence[np.ndarray]) -> None:
        """Shard ``shard`` answered fetch ``fid``: its slice of the local copy becomes fetched + own steps."""
        f = self._fetches.get(fid)
        if f is None or shard not in f.pending:
            return  # an abandoned fetch (the shard map changed): a newer one will come
        if fid < self._landed_fid[shard]:
            self._settle_fetch(f, shard)  # a newer fetch already landed here (never on an ordered channel)
            return
        self._landed_fid[shard] = fid
        lo, hi = self.ranges[shard]
        if f.keys is not None:
            assert f.request.keys is not None
            start = sum(k.size for k in f.request.keys[:shard])
            local = f.request.keys[shard]
            at = lo + local
            own = self._unsent_at(at) if f.dx is None else f.dx[start : start + local.size]
            self.x[at] = arrays[0] + own
        elif self.fetch_keys is None:
            assert f.dx is not None  # held from the start (only windowed fetches defer it)
            np.add(arrays[0], f.dx[lo:hi], out=self.x[lo:hi])
        else:
            assert f.dx is not None
            at = lo + self.fetch_keys[shard]
            self.x[at] = arrays[0] + f.dx[at]
        self.base[shard] = int(version)
        self._base_gen[shard] = f.request.gen
        self._base_sent[shard] = f.sent
        self._observe(shard, int(version), f.request.gen)
        self._landed_once[shard] = True
        self.counters.fetches[shard] += 1
        self._settle_fetch(f, shard)

    def on_fetch_failed(self, fid: int, shard: int) -> None:
        """Shard ``shard`` did not answer fetch ``fid``: keep the local slice, fetch again soon."""
        f = self._fetches.get(fid)
        if f is None or shard not in f.pending:
            return
        self.counters.fetch_errors[shard] += 1
        self._fetch_due = True
        f.failed = True
        self._settle_fetch(f, shard)

    def _settle_fetch(self, f: _Fetch, shard: int) -> None:
        f.pending.discard(shard)
        if not f.pending:
            self._fetches.pop(f.request.fid, None)
            self._release(f)
            if f.request.round is not None and not f.failed:
                self._round_landed = max(self._round_landed, f.request.round)
            if f.cover is not None:
                start, end = f.cover
                if f.failed:
                    self._requested_until = min(self._requested_until, start)  # ask for them again
                elif start <= self._landed_until:  # contiguous: no failed fetch left a gap before it
                    self._landed_until = max(self._landed_until, end)

    def _release(self, f: _Fetch) -> None:
        """Hand a settled or abandoned fetch's position table back (cleared at its keys)."""
        if f.positions is not None and f.keys is not None:
            f.positions[f.keys] = -1
            self._tables.append(f.positions)
            f.positions = None

    # -- compute -----------------------------------------------------------------------------------------
    def compute(self, model: Model, X: np.ndarray, y: np.ndarray) -> float:
        """One step: the mini-batch mean gradient at the local copy, accrued, and the local step.

        Returns the mini-batch mean loss. A non-finite loss or gradient is not applied and sets
        :attr:`diverged`.
        """
        rows = int(X.shape[0])
        loss, grad = model.loss_and_grad(self.x, X, y)
        # One pass for the mean gradient, its L2 term and the finiteness check (a 3.2 MB vector per step of
        # the MLP of issue 30: four numpy passes and a temporary were ~8% of the step).
        g = self._grad
        finite = scaled_gradient(g, np.asarray(grad).reshape(-1), 1.0 / rows, l2=self.l2, x=self.x)
        mean_loss = float(loss) / rows
        if not (math.isfinite(mean_loss) and finite):
            self.diverged = True
            return mean_loss
        self.apply(g)
        return self._count_rows(rows, float(loss))

    def compute_at(self, model: Model, keys: np.ndarray, X: Any, y: np.ndarray) -> float:
        """:meth:`compute` for a step whose rows touch only the parameters ``keys`` (distinct, global):
        ``model`` and ``X`` are narrowed to them (``storage.internal.compact_rows``), so the gradient and
        every update cost the step's keys, not the model's width (windowed mode, :meth:`use_windows`).
        The same floats as :meth:`compute` on the whole rows: the compact gradient is the whole one's at
        ``keys`` and zero elsewhere, and every update is elementwise.
        """
        loss, grad = model.loss_and_grad(self.x[keys], X, y)
        rows = int(X.shape[0])
        with np.errstate(over="ignore", invalid="ignore"):  # judged below
            g = np.multiply(np.asarray(grad, dtype=np.float64).reshape(-1), 1.0 / rows)
        mean_loss = float(loss) / rows
        if not (math.isfinite(mean_loss) and bool(np.isfinite(g).all())):
            self.diverged = True
            return mean_loss
        self._accrue_at(keys, g)
        return self._count_rows(rows, float(loss))

    def accrue_rows(
        self, X: Any, rows: np.ndarray, residuals: np.ndarray, loss: float, *, intercept: int | None
    ) -> float:
        """The end of a step of a linear model on rows ``rows`` of CSR ``X`` (windowed mode), whose summed
        ``loss`` and per-row ``residuals`` were computed on the local copy :attr:`x` (a model's
        ``rows_residuals``): the mean gradient ``X[rows].T @ residuals / n`` (and the residuals' mean at
        parameter ``intercept``) is accrued and the local step taken, straight from the rows (:func:`storage.
        accrue_rows`): a step's cost is its nonzeros, with no pass that numbers its columns (issue 29).

        Returns the mini-batch mean loss. A non-finite loss or residual is not applied and sets
        :attr:`diverged`.
        """
        if self.window_keys is None:
            raise InvalidOptionError("accrue_rows is for windowed replicas (use_windows); use compute_at")
        n = int(rows.size)
        with np.errstate(over="ignore", invalid="ignore"):  # judged below
            r = np.multiply(residuals, 1.0 / n)
        mean_loss = float(loss) / n
        if not (math.isfinite(mean_loss) and bool(np.isfinite(r).all())):
            self.diverged = True
            return mean_loss
        self._begin_accrual()
        a = -self.local_rate
        accrue_rows(X, rows, r, self.accrued, a, self.x)
        held = [f for f in self._fetches.values() if f.dx is not None]
        for f in held:
            assert f.dx is not None and f.positions is not None  # windowed fetches hold both or neither
            add_rows_at_positions(f.dx, f.positions, X, rows, r, a)
        if intercept is not None:
            self._accrue_at_keys(np.array([intercept]), np.array([r.sum()]), a, held)
        self._count_step()
        return self._count_rows(n, float(loss))

    def _count_rows(self, rows: int, loss: float) -> float:
        """Count a step's rows and loss (kept per step with ``trace``); returns its mean loss."""
        c = self.counters
        c.rows += rows
        c.loss_sum += loss
        mean_loss = loss / rows
        if self.trace:
            self.losses.append(mean_loss)
        return mean_loss

    def apply(self, g: np.ndarray) -> None:
        """Accrue gradient ``g`` and take the local step (used by :meth:`compute`)."""
        if self.window_keys is not None:
            raise InvalidOptionError(
                "a windowed replica's steps go through compute_at (their keys are the window's)"
            )
        self._begin_accrual()
        if self.local_rate:
            a = -self.local_rate
            accrue_step(g, self.accrued, a, self.x, self._unsent_dx)
            for f in self._fetches.values():
                assert f.dx is not None  # not windowed (see the check above)
                axpy(a, g, f.dx)
        else:
            axpy(1.0, g, self.accrued)
        self._count_step()

    def _accrue_at(self, keys: np.ndarray, g: np.ndarray) -> None:
        """:meth:`apply` of a gradient whose nonzero entries are ``g`` at ``keys`` (distinct, any order)."""
        self._begin_accrual()
        a = -self.local_rate
        self._accrue_at_keys(keys, g, a, [f for f in self._fetches.values() if f.dx is not None])
        self._count_step()

    def _accrue_at_keys(self, keys: np.ndarray, g: np.ndarray, a: float, held: list[_Fetch]) -> None:
        """``g`` at ``keys`` into the accrued gradient, and ``a * g`` into the local copy, the unsent steps
        and the fetches in flight that hold their own (``held``)."""
        if not a:
            self.accrued[keys] += g
            return
        unsent = None if self.window_keys is not None else self._unsent_dx  # windowed: see _unsent_at
        accrue_at(keys, g, self.accrued, a, self.x, unsent)
        if held:
            step = np.multiply(g, a)
            for f in held:
                assert f.dx is not None
                if f.positions is not None:
                    add_at_positions(f.dx, f.positions, keys, step)
                else:
                    f.dx[keys] += step

    def _unsent_at(self, keys: np.ndarray) -> np.ndarray:
        """Windowed mode: the local steps no push has carried yet, at ``keys`` (``-local_rate`` times the
        accrued gradient: both start at zero and a push clears both at the same keys)."""
        unsent: np.ndarray = np.multiply(self.accrued[keys], -self.local_rate)
        return unsent

    def _hold_fetch_steps(self) -> None:
        """Before a windowed push clears the unsent local steps: a fetch in flight copies them out at its
        keys and from now on adds each step's own (its answer cannot contain them)."""
        for f in self._fetches.values():
            if f.dx is None and f.keys is not None:
                f.dx = self._unsent_at(f.keys)
                f.positions = self._tables.pop() if self._tables else np.full(self.n, -1, dtype=np.int64)
                f.positions[f.keys] = np.arange(f.keys.size)

    @property
    def first_unpushed_step(self) -> int:
        """The first step whose gradient no push has carried yet (the current step when none has
        accrued)."""
        return self._accrued_from if self.accrued_steps else self.counters.steps

    def _begin_accrual(self) -> None:
        if self.accrued_steps == 0:
            self._accrued_from = self.counters.steps
            self._accrued_base = tuple(
                b if bg == self.gen else None for b, bg in zip(self.base, self._base_gen, strict=True)
            )
            self._accrued_base_sent = tuple(self._base_sent)
        self.accrued_steps += 1

    def _count_step(self) -> None:
        self.counters.steps += 1
        if self.counters.steps % self.n_push == 0:
            self._push_due = True

    # -- push --------------------------------------------------------------------------------------------
    def take_push(self, *, force: bool = False, last: bool = False) -> PushMessage | None:
        """The accrued gradient to push now, or None (not due, nothing accrued, or too many in flight).

        ``force`` pushes whatever has accrued even if no push is due (the final flush). A due push of a
        fused core carries the next fetch (:attr:`PushMessage.fetch`). ``last`` (deterministic mode, with
        ``force``): the replica's final push, sent once even with nothing accrued (the shards then know it
        takes no part in later rounds).
        """
        final = self.deterministic and last and force and not self._last_sent
        if (self.accrued_steps == 0 and not final) or not (self._push_due or force):
            return None
        if len(self._pending) >= self.max_pushes_in_flight:
            return None  # keep accruing: it goes out with the next push
        round_ = None
        if self.deterministic:
            steps = self.counters.steps
            round_ = (steps - 1) // self.n_push if self.accrued_steps else steps // self.n_push
            self._last_sent = final
        msg = PushMessage(
            self.seq, self.accrued, self._accrued_base, self.accrued_steps, self.gen, round=round_, last=final
        )
        if self.compressor is not None:
            # Strom 2015: the sum joins the residual; the entries past the threshold go out as +/-tau.
            idx, negative = self.compressor.add(self.accrued)
            codes = tuple(encode(idx, negative, [lo for lo, _ in self.ranges] + [self.n]))
            tau = self.compressor.tau
            msg = dataclasses.replace(msg, grad=np.zeros(0), keys=codes, tau=tau)
            self.counters.bytes_pushed += signed_bytes(codes)
        elif self.sparse:
            # Only the entries this push moves: a zero entry would leave the shard's floats unchanged.
            if self.window_keys is not None:
                # The keys the steps since the last push moved: those steps' keys (the window's, mostly
                # already united for its fetch), not a scan of the whole vector.
                # Taken and cleared (and with them the unsent local steps) in one pass over those keys.
                touched = self.window_keys(self._accrued_from, self.counters.steps)
                self._hold_fetch_steps()
                nonzero, values = take_at(touched, self.accrued)
            else:
                nonzero = np.flatnonzero(self.accrued)
                values = self.accrued[nonzero]
            keys = tuple(split_keys(self._bounds, nonzero))
            msg = dataclasses.replace(msg, grad=values, keys=keys)
            self.counters.bytes_pushed += kv_bytes(*keys, msg.grad)
        else:
            self.counters.bytes_pushed += msg.grad.nbytes
        fused = self.fuse and self._push_due
        # Own pushes sent after the base fetch was issued reach each shard after that fetch's answer and
        # before this push (one ordered channel per shard).
        own = tuple(self.seq - sent for sent in self._accrued_base_sent)
        self._pending[self.seq] = (set(range(self.n_shards)), self.accrued_steps, own)
        self.seq += 1
        if self.window_keys is None:  # windowed: take_at reset what the steps since the last push moved
            self.accrued = np.zeros(self.n)
            self._unsent_dx.fill(0.0)
        self.accrued_steps = 0
        self._push_due = False
        self.counters.pushes_sent += 1
        self.counters.messages += self.n_shards
        if fused:
            # The fetch due at the coming step, started now (nothing unsent: the push holds every step).
            msg = dataclasses.replace(msg, fetch=self._fetch_for_push())
            self.counters.fused += 1
        return msg

    def _fetch_for_push(self) -> FetchRequest:
        self._fused_at = self.counters.steps
        return self._new_fetch()

    def on_pushed(
        self, seq: int, shard: int, applied: bool, version_after: int, staleness: int, gen: int
    ) -> None:
        """Shard ``shard`` answered push ``seq`` with ``(applied, version_after, staleness)``."""
        steps, own = self._answer(seq, shard)
        c = self.counters
        if applied:
            c.pushes[shard] += 1
            c.staleness_sum += int(staleness)
            c.staleness_count += 1
            c.staleness_max = max(c.staleness_max, int(staleness))
            # The shard scales by the other replicas' updates only (storage.Shard.others_since).
            others = max(0, int(staleness) - own)
            c.applied_weight[shard] += steps / (1.0 + others) if self.staleness_scale else float(steps)
            c.applied_steps_sq[shard] += steps * steps
        else:
            c.duplicates += 1
        self._observe(shard, int(version_after), gen)

    def on_push_failed(self, seq: int, shard: int) -> None:
        """Shard ``shard`` did not answer push ``seq``: that slice of the gradient is lost."""
        self._answer(seq, shard)
        self.counters.push_errors[shard] += 1

    def _answer(self, seq: int, shard: int) -> tuple[int, int]:
        entry = self._pending.get(seq)
        if entry is None:
            return 0, 0
        shards, steps, own = entry
        shards.discard(shard)
        if not shards:
            del self._pending[seq]
        return steps, own[shard]

    def _observe(self, shard: int, version: int, gen: int) -> None:
        if gen > self._known_gen[shard]:
            self.known[shard], self._known_gen[shard] = version, gen
        elif gen == self._known_gen[shard]:
            self.known[shard] = max(self.known[shard], version)

    # -- recovery ----------------------------------------------------------------------------------------
    def reset_shards(self) -> None:
        """The shard map changed (a shard was restored from a checkpoint): forget versions, fetch afresh.

        The fetch in flight is abandoned (its late answers are ignored); pushes in flight still count when
        they are answered or fail.
        """
        self.gen += 1
        for f in self._fetches.values():
            self._release(f)
        self._fetches.clear()
        self._fetch_due = True
        self._requested_until = self._landed_until

    def snapshot(self) -> dict[str, Any]:
        """The counters as plain data (``staleness_max``: the largest staleness since the last
        :meth:`record`; a snapshot, read on another thread than the pushes' answers, does not reset it)."""
        return self._counters()

    def record(self, *, with_x: bool) -> dict[str, Any]:
        """The counters for a history row, and with ``with_x`` a copy of the local parameters.

        ``staleness_max`` here is the largest staleness since the previous record (see
        :class:`Counters`). The driver evaluates the objective on ``x`` after the fact, so a history row
        costs no round trip (:mod:`downpour._train`).

        Examples
        --------
        >>> core = ReplicaCore([(0, 2)], rule="sgd", lr=0.1)
        >>> rec = core.record(with_x=True); rec["steps"], rec["x"].tolist()
        (0, [0.0, 0.0])
        """
        c = self.counters
        out = self._counters()
        # Windowed: the local copy is exact only at the keys of the steps ahead; the driver reads the shards.
        windowed = self.window_keys is not None
        out["x"] = self.x.copy() if with_x and not windowed else None
        out["x_wanted"] = with_x and windowed
        c.staleness_max = 0
        return out

    def _counters(self) -> dict[str, Any]:
        c = self.counters
        return {
            "steps": c.steps,
            "rows": c.rows,
            "loss_sum": c.loss_sum,
            "fetches": list(c.fetches),
            "pushes": list(c.pushes),
            "fetch_errors": list(c.fetch_errors),
            "push_errors": list(c.push_errors),
            "duplicates": c.duplicates,
            "pushes_sent": c.pushes_sent,
            "staleness_sum": c.staleness_sum,
            "staleness_count": c.staleness_count,
            "staleness_max": c.staleness_max,
            "applied_weight": list(c.applied_weight),
            "applied_steps_sq": list(c.applied_steps_sq),
            "stale_waits": c.stale_waits,
            "bytes_fetched": c.bytes_fetched,
            "bytes_pushed": c.bytes_pushed,
            "messages": c.messages,
            "fused": c.fused,
            "known_versions": list(self.known),
            "diverged": self.diverged,
        }
