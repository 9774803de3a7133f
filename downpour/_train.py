"""``downpour.train``: asynchronous SGD with many replicas against the sharded parameter server (section 4.1).

The driver (this process) never takes part in the optimization. It places the shards and the replicas, lets
one replica warm up alone (the paper's "warmstarting"), then lets all of them loose, and from then on only
watches: every ``poll_every`` seconds it asks each replica for its counters (a cheap ``async`` call), every
5% of the time trained (at most ``checkpoint_every_s`` seconds apart) it checkpoints the shards to zarr
(:func:`downpour._resume.checkpoint_interval`), and it decides when to stop. The decisions are
:class:`downpour._driver.DriverMachine`'s; this module's :class:`_Run` is the one shell that carries them
out, for whole-model replicas (:class:`downpour._whole.WholeReplicas`) and replicas split into K partitions
(:class:`downpour._partitioned.PartitionedReplicas`, ``partitions=K``) alike, through their adapter.

The history costs no round trip of its own. Each replica records a history point at set step counts (about
``HISTORY_POINTS`` over the run, when its length is known in steps; at set times, re-planned by the measured
step rate, when it is known by a time limit; at least every ``eval_every`` seconds): its counters and a copy
of its parameters. The driver's regular poll carries the records back, and the driver evaluates the
training objective ``F(w)`` and the held-out metrics on the recorded parameters, once every replica has
reported past that time. (Gathering the shards' parameters for every point cost a round trip to every
replica and shard, ~20 ms idle and up to 150 ms loaded: a 0.3 s run got 15 points.) The first row is at the
starting point and the last at the shards' final parameters. Cost for big models: the parameter copies a
run sends for its history are bounded by ``HISTORY_X_BYTES`` (past it only every k-th record carries one;
the others have the counters and a NaN objective), and a replica holds at most
``_replica.MAX_PENDING_RECORD_BYTES`` of them between polls. Partitions hold only their slices: their
adapter makes a record from the polled counters, evaluated at the shards' parameters (read at most once a
poll and 5% of the time, as for a windowed sparse replica's records; a row without them has a NaN
objective).

Faults (the paper's "tolerate ... the wholesale failure of model replicas"): a whole replica whose worker
dies is dropped and the others carry on (its rows are no longer visited); a partitioned one is rebuilt on
the live workers from the step its surviving partitions reached. A shard lost with its worker is rebuilt by
the parameter server from its last checkpoint on a live worker; the driver hands the replicas the new shard
map, and training continues (the updates that shard received since its checkpoint are lost, as in the paper,
where shards restart from checkpoints).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr
from distributed import Client
from threadpoolctl import ThreadpoolController

from distbelief.errors import ClusterError, DatasetError, DistbeliefError, InvalidOptionError, StoreError
from distbelief.models import objective
from distbelief.models.internal import FittedMixin
from distbelief.options import refuse_unknown
from distbelief.storage import (
    Dataset,
    ParameterServer,
    ShardMap,
    as_dataset,
    embedded_client,
    start_vector,
)
from distbelief.storage.internal import (
    Communication,
    as_csr,
    is_sparse,
    run_store,
)

from ._batches import BatchPlan
from ._compress import Compression
from ._driver import MESSAGES, SUCCESS, Checkpoint, DriverMachine, Measure, Poll, Probe, Release, Report
from ._options import DownpourOptions, Rule, options_from
from ._partitioned import PartitionedReplicas, check_partitioned_options
from ._replica import RecordPlan
from ._resume import ResumePoint
from ._shards import Shards
from ._watch import StepRuleStallWarning, Watchdog, stall_message
from ._whole import WholeReplicas

__all__ = ["Progress", "TrainResult", "train"]

#: History entries a run aims at, whatever its length. The replicas record them at set step counts (or
#: times) and the driver's regular polls carry them back, so an entry costs no round trip.
HISTORY_POINTS = 100
#: The shortest time between two records of one replica, in seconds (a run known only by its time limit).
MIN_EVAL_EVERY = 0.002
#: Parameter copies the replicas send for the history, in bytes per run: past it, only every k-th record
#: carries one (the others have the counters and a NaN objective). 100 entries up to ~670,000 parameters.
HISTORY_X_BYTES = 512 << 20
#: The training objective is computed on at most this many values of X (rows x features); a larger dataset
#: is evaluated on an evenly spread sample of its portions.
OBJECTIVE_MAX_VALUES = 4_000_000
#: ... and on at most this many row-parameter products (rows x parameters of a dense model): an MLP's row
#: costs its parameters, not its features. The MLP 256-512-512-10 (399,370 parameters) on 40,000 rows took
#: ~3 s an objective on 15,600 rows (the values budget alone), and a 10 s run returned after ~110 s; on 250
#: rows an objective costs ~10 ms (issue 30, item 3).
OBJECTIVE_MAX_WORK = 100_000_000
#: The driver's evaluations of history rows (objective, held-out metrics) take at most this share of the
#: run's time while it runs, and at its end at most this share of its length (or END_EVAL_S): they run on
#: the cores the replicas train on.
EVAL_SHARE = 0.05
END_EVAL_S = 1.0

_blas: ThreadpoolController | None = None


def _one_blas_thread() -> Any:
    """``threadpool_limits(limits=1)`` for the driver's evaluations, from one controller made at first use:
    a fresh one scans every library the process has loaded (1-4 ms in a driver holding Dask), and the driver
    asks at every poll."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()
    return _blas.limit(limits=1)


@dataclass(frozen=True)
class Progress:
    """One row of the history, as passed to the callback.

    Attributes
    ----------
    time : float
        Seconds since the replicas started.
    step : int
        Mini-batch steps taken by all replicas together.
    epoch : float
        Rows visited by all replicas together, divided by the number of training rows.
    train_loss : float
        The running mini-batch loss: the mean loss (data term, per row) of the mini-batches of the steps
        since the previous row, each at the parameters the replica had then. Not the objective.
    objective : float
        ``F(w) = (1/N) sum_i loss_i(w) + (l2/2)||w||^2`` on the training rows at the parameters recorded
        for the row (a replica's local copy: its last fetch from the shards plus its own steps since; the
        shards' parameters on the first and last rows), computed as Sandblaster's objective
        (:func:`models.objective`); on a large dataset, on an evenly spread sample of its portions
        (``history.attrs["objective_rows"]`` says how many rows). NaN on a row recorded without its
        parameters (a model too big for ``HISTORY_X_BYTES``).
    test_loss, test_accuracy : float
        Held-out loss (data term, per row) and accuracy at the same parameters (NaN without
        ``eval_data``; accuracy NaN for a model without ``accuracy``).
    staleness_mean, staleness_max : float
        Over the pushes answered since the previous row (NaN if none). ``staleness_max`` is never below
        ``staleness_mean``; it can also count a push of an earlier row when a replica's status was polled
        between two of its records (a replica's window of the maximum runs from record to record).
    replicas_alive : int
        Replicas still running.

    Examples
    --------
    >>> def stop_at_95(p: Progress) -> None:
    ...     if p.test_accuracy >= 0.95:
    ...         raise StopIteration
    >>> downpour.train(model, data, eval_data=held_out, callback=stop_at_95)   # doctest: +SKIP
    """

    time: float
    step: int
    epoch: float
    train_loss: float
    test_loss: float
    test_accuracy: float
    staleness_mean: float
    staleness_max: float
    replicas_alive: int
    objective: float = math.nan


@dataclass
class TrainResult(FittedMixin):
    """What :func:`train` did.

    ``predict(X)`` / ``predict_proba(X)`` go through ``model`` at ``x``; ``to_zarr(url)`` saves the result
    with the model's spec and ``TrainResult.from_zarr(url)`` loads it (see ``models._fitted``).

    Attributes
    ----------
    x : numpy.ndarray
        The parameters on the shards at the end.
    history : xarray.Dataset
        One entry per record (see the module docstring), over ``time`` (seconds since the replicas
        started): ``step`` (steps all replicas had taken then), ``epoch``,
        ``train_loss``, ``test_loss``, ``test_accuracy``, ``staleness_mean``, ``staleness_max``,
        ``replicas_alive``, ``push_errors``, ``stale_waits``, and per ``shard`` (cumulative) ``pushes``,
        ``fetches`` and ``version`` (updates the shard has applied, as last reported), and ``applied``
        (measured on the shards every ``eval_every`` seconds, at the start and at the end)
        (pushes the shard's vectors hold, counted on the shard: :meth:`storage.Shard.counters`);
        ``bytes_moved``: parameter and gradient bytes (keys included) the replicas have fetched and pushed so
        far; ``messages``: messages the replicas have sent to shards so far (a fused push and fetch is one
        per shard).
    stop_reason : str
        ``"max_steps"``, ``"epochs"``, ``"time_limit"``, ``"callback"``, ``"diverged"`` or
        ``"replicas_lost"``.
    success : bool
        Whether the run stopped for one of the first four reasons.
    message : str
        The stop reason in words.
    steps : int
        Mini-batch steps taken by all replicas together.
    wall_time : float
        Seconds from the start of the replicas until they stopped (the end-of-run evaluation of the
        history rows still pending, at most ``END_EVAL_S`` or 5% of the run, comes after).
    store : str
        Where the parameter server's checkpoints are, the last one taken at the end of the run
        (``storage.ParameterServer.open(client, store=...)`` brings it back; deleted with a temporary
        store).
    stats : dict
        Totals: pushes, fetches, push/fetch errors, duplicates, staleness, recoveries, lost replicas, ...
    losses : dict of int to numpy.ndarray
        With ``trace=True``, every replica's per-step mini-batch losses.
    snapshots : list of (float, int, numpy.ndarray)
        With ``trace=True``, ``(time, step, w)`` for every history row that has its parameters: the ``w``
        its ``objective`` was evaluated at.

    Examples
    --------
    >>> res = downpour.train(model, data, max_steps=1000, eval_data=held_out)     # doctest: +SKIP
    >>> res.history.test_accuracy.plot(x="time")                               # doctest: +SKIP
    >>> res.stats["staleness_mean"], res.stats["pushes"]                       # doctest: +SKIP
    """

    x: np.ndarray
    history: xr.Dataset
    stop_reason: str
    success: bool
    message: str
    steps: int
    wall_time: float
    store: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    losses: dict[int, np.ndarray] = field(default_factory=dict)
    snapshots: list[tuple[float, int, np.ndarray]] = field(default_factory=list)
    model: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return (
            f"TrainResult(stop_reason={self.stop_reason!r}, success={self.success}, steps={self.steps}, "
            f"wall_time={self.wall_time:.3g})"
        )


@refuse_unknown
def train(
    model: Any,
    data: Dataset | tuple[np.ndarray, np.ndarray],
    *,
    replicas: int | None = None,
    shards: int | None = None,
    rule: Rule = "adagrad",
    lr: float | None = None,
    local_lr: float | None = None,
    batch_size: int = 32,
    n_fetch: int | None = None,
    n_push: int | None = None,
    warmstart_steps: int = 0,
    epochs: int | None = None,
    max_steps: int | None = None,
    time_limit: float | None = None,
    eval_data: Dataset | tuple[np.ndarray, np.ndarray] | None = None,
    eval_every: float = 1.0,
    l2: float = 0.0,
    client: Client | str | None = None,
    store: str | os.PathLike[str] | None = None,
    callback: Callable[[Progress], None] | None = None,
    staleness_scale: bool | None = None,
    max_staleness: int | None = None,
    max_loss_growth: float | None = 10.0,
    checkpoint_every_s: float = 5.0,
    resume: bool = False,
    seed: int = 0,
    x0: np.ndarray | None = None,
    shuffle: bool = True,
    shard_workers: Sequence[str] | None = None,
    replica_workers: Sequence[str] | None = None,
    trace: bool = False,
    poll_every: float = 0.05,
    call_timeout: float = 30.0,
    partitions: int | None = None,
    communication: Communication = "auto",
    fuse: bool = True,
    compression: Compression | None = None,
    max_coalesce: int | None = None,
    deterministic: bool = False,
) -> TrainResult:
    """Train ``model`` with Downpour SGD: asynchronous replicas, a sharded parameter server, Adagrad.

    Minimizes ``F(w) = (1/N) sum_i loss_i(w) + (l2/2)||w||^2`` by mini-batch SGD in ``replicas`` model
    replicas, each owning a contiguous part of the training rows; they fetch the parameters every
    ``n_fetch`` steps and push their accrued gradient every ``n_push`` steps, and the shards apply each push
    on its own (DistBelief paper, section 4.1).

    Parameters
    ----------
    model : Model
        Anything with ``n_params``, ``init_params(seed)`` and ``loss_and_grad(w, X, y)`` (sum over rows).
    data : storage.Dataset or (X, y)
        Training rows; arrays are first written to a dataset in ``store``.
    replicas, shards : int, optional
        Model replicas (default: one per worker) and parameter-server shards (default: one below 131,072
        parameters, else one per worker).
    rule : {"adagrad", "sgd"}
        Update rule on the shards: the paper's Adagrad, ``w -= lr * g / sqrt(sum of g^2)``, or ``w -= lr*g``.
    lr : float, optional
        Learning rate (Adagrad's gamma); default 0.1 for SGD, 0.2 for Adagrad.
    local_lr : float, optional
        Rate of the replicas' local SGD step between fetches (Algorithm 7.1's ``params -= lr * g``), whatever
        the shards' rule; default ``lr`` (0: no local step).
    batch_size : int
        Rows per mini-batch; the gradient is the mini-batch mean.
    n_fetch, n_push : int, optional
        Fetch the parameters every ``n_fetch`` steps; push the accrued gradient every ``n_push`` steps.
        A push that would find two others in flight waits and goes out with the next one. Default: chosen
        from the model and the data (:func:`downpour.auto_sync`): 50 for key-value windows on sparse rows,
        10 for a dense model of 2^17 parameters or more, else 1 (the paper's setting); when only one is
        given, the other takes its value.
    warmstart_steps : int
        Steps replica 0 takes alone before the others start.
    epochs : int, optional
        Passes of each replica over its own rows.
    max_steps : int, optional
        Steps of all replicas together (a single replica stops exactly there; several stop within one
        poll of it).
    time_limit : float, optional
        Seconds of training.
    eval_data : storage.Dataset or (X, y), optional
        Held-out rows, evaluated every ``eval_every`` seconds while the replicas go on training.
    eval_every : float
        Longest time between two history records of a replica; also how often the shards' ``applied``
        counters are measured. The cadence adapts to the run's length (known from ``epochs``,
        ``max_steps`` or ``time_limit``) so that a run records about ``HISTORY_POINTS`` entries however
        short it is: the replicas record them and the driver evaluates them afterwards (no round trip per
        entry).
    l2 : float
        L2 regularization (added to every mini-batch gradient).
    client : distributed.Client or str, optional
        The cluster: a ``Client`` (the default one or not), or a scheduler address such as
        ``'tcp://10.0.0.1:8786'``. ``None``: the default Dask client if one runs, else this process's one
        embedded ``LocalCluster`` (started on first use, kept until exit).
    store : str or path, optional
        Directory or URL for the data (when given as arrays) and the shards' checkpoints (default: a
        temporary directory, deleted at the end).
    callback : callable, optional
        Called with a :class:`Progress` after every history entry; raising ``StopIteration`` stops the run.
    staleness_scale : bool, optional
        Divide each push's step by ``1 + staleness`` on the shards (Zhang et al. 2016). Default (None): on
        for ``rule="sgd"`` with more than one replica, off otherwise (see
        :meth:`DownpourOptions.scales_staleness`).
    max_loss_growth : float, optional
        The run stops as diverged (``success=False``, the reason in ``message``) when the training
        objective, the running training loss or the held-out loss becomes NaN or infinite, or the objective
        or the held-out loss grows past this multiple of its lowest value (never below its value at the
        start) (None: only NaN / inf). At the end of a run whose loss is flat while the gradient is not
        small, the message carries a warning and a :class:`downpour.StepRuleStallWarning` is issued (see
        ``downpour._watch``).
    max_staleness : int, optional
        A replica that knows its next push would be more than this many updates stale waits for a fresh
        fetch first (0 with one replica is sequential SGD).
    checkpoint_every_s : float
        At most this many seconds between checkpoints of the shards to zarr (0: only the initial one);
        within it, a checkpoint is taken once 5% of the time trained has passed since the last (so a kill
        loses about 5% of the steps), unless checkpoints would then take more than 5% of the run. A lost
        shard is rebuilt from the last, and a run started again with ``resume=True`` continues from it.
    resume : bool
        Continue the run whose checkpoints are in ``store`` (which must be given) from its last checkpoint:
        parameters, Adagrad accumulators, shard clocks and the replicas' step and epoch counters as they
        were then (see :mod:`downpour._resume`); ``epochs``, ``max_steps`` and ``time_limit`` count the whole
        run. The other options should be those of the interrupted run.
    seed : int
        Seed of the starting point (``model.init_params``) and of the mini-batch shuffles.
    x0 : numpy.ndarray, optional
        Starting point.
    shuffle : bool
        Shuffle each replica's rows every epoch (within each portion); otherwise visit them in order.
    shard_workers, replica_workers : list of str, optional
        Worker addresses to place shards and replicas on (default: every worker, round robin).
    trace : bool
        Keep every replica's per-step mini-batch loss (``TrainResult.losses``) and the parameters of every
        history row (``TrainResult.snapshots``).
    poll_every : float
        Seconds between the driver's polls of the replicas.
    call_timeout : float
        Seconds a single call to a shard or replica may take before it counts as failed.
    partitions : int, optional
        Model parallelism (paper, section 3): split every replica into this many partition actors with
        shards aligned to them (:class:`downpour._partitioned.PartitionedReplicas`; ``models.MLP``,
        ``models.LocallyConnected`` and ``models.LocallyConnected2D``). ``None`` or 1: one actor per
        replica. The same driver runs both (history, checkpoints, ``resume``, watchdog, result); with
        partitions a replica that loses a partition's worker is rebuilt on the others
        (``stats["rebuilt_replicas"]``) rather than dropped, the driver polls every 0.2 s, a history
        row's objective and held-out metrics are at the shards' parameters (read at most 5% of the
        time), and ``stats`` adds ``partitions``, ``per_partition`` and the partitions' own traffic per
        step (``messages_per_step``, ``bytes_per_step``, ``messages_by_kind``). The options partitions
        have no use for (``poll_every``, ``fuse``, ``communication="sparse"``, ``warmstart_steps``,
        ``time_limit``, ``shards``, ...) are refused unless left at their defaults; ``epochs`` or
        ``max_steps`` is needed.
    communication : {"auto", "dense", "sparse"}
        ``"sparse"``: each replica fetches only the parameters its rows touch and pushes only the nonzero
        entries of its accrued gradient, as key-value pairs per shard (ps-lite's pull/push; needs CSR data,
        a linear model and ``l2 = 0``, since the replicas add ``l2 * w`` to every gradient); the shards'
        floats are those of ``"dense"``. ``"auto"`` (default): sparse when those hold. Bytes moved are in
        ``history.bytes_moved`` and ``stats["bytes_per_step"]``.
    fuse : bool
        When ``n_push == n_fetch`` (as by default), send each push and the next fetch as one message
        per shard (the shard applies the push and answers with its fresh slice), instead of two. Messages
        sent are in ``history.messages`` and ``stats["messages_per_step"]``.
    compression : downpour.Compression, optional
        Compressed pushes (Strom 2015, :mod:`downpour._compress`): each replica adds its accrued gradient
        to a residual of its own and sends only the entries with ``|r| >= tau``, as ``+tau`` or ``-tau``
        (4 bytes an entry), keeping the rest for later pushes. With SGD or Adagrad, dense or sparse
        communication, fused or not. The residual lives on the replica: a resumed run starts it at zero.
        None (default): uncompressed.
    max_coalesce : int, optional
        While all of a replica's pushes are outstanding its gradient accrues; past this many steps the
        replica waits for an answer instead. Default (None): 8 for ``rule="adagrad"``, whose
        accumulators a push of many summed gradients inflates for the rest of the run (uncapped, 2
        replicas on a cheap two-feature problem summed ~27 steps a push and ended 0.6-6.8% above the
        optimum after 10 epochs; capped, 0.05-0.17%), no limit for ``"sgd"``. 0: no limit. The cap costs
        waiting when round trips are slow against the steps: on that problem at load average ~31 on 2
        cores, 10 epochs took 3.4 s instead of 1.0 s (medians of 6).
    deterministic : bool
        The same bits on every rerun, with any number of replicas (:mod:`storage._rounds`): replicas work
        in rounds of ``n_fetch`` (= ``n_push``) steps, each starting from the parameters after every push
        of the rounds before it, and the shards apply a round's pushes in replica order whatever order they
        arrive in. The cost is waiting: at every round start a replica waits for the slowest one's push
        (synchronous SGD with a staleness of one round). A run stopped by ``time_limit`` or a callback ends
        at a step that depends on timing; a shard lost mid-run ends the guarantee. Needs
        ``warmstart_steps=0`` and ``resume=False``.

    Returns
    -------
    TrainResult

    Raises
    ------
    distbelief.errors.InvalidOptionError
        A bad option (including none of ``epochs``, ``max_steps``, ``time_limit``, ``callback``).
    distbelief.errors.DatasetError
        Data the model cannot train on.
    distbelief.errors.ClusterError
        No workers, or a replica failed (its error is in the message).

    Examples
    --------
    >>> from distbelief import downpour, models
    >>> from distbelief.storage import train_test_split_digits
    >>> X, y, Xt, yt = train_test_split_digits(seed=0)
    >>> res = downpour.train(models.Softmax(64, 10), (X, y), replicas=2, epochs=5,
    ...                      eval_data=(Xt, yt))                                   # doctest: +SKIP
    >>> float(res.history.test_accuracy[-1]) > 0.9                                # doctest: +SKIP
    True
    """
    if callback is not None and not callable(callback):
        raise InvalidOptionError(
            f"option callback={callback!r} is invalid: expected None or a function of one downpour.Progress "
            "(raise StopIteration in it to stop the run)"
        )
    given = locals()
    # True is not 1 here (check_partitioned_options refuses it).
    partitioned = partitions is not None and not (type(partitions) is int and partitions == 1)
    opts = check_partitioned_options(partitions, given) if partitioned else options_from(given)  # type: ignore[arg-type]
    return fit(model, data, opts, partitions=partitions if partitioned else None, eval_data=eval_data,
               client=client, store=store, callback=callback, x0=x0)  # fmt: skip


def fit(
    model: Any,
    data: Dataset | tuple[np.ndarray, np.ndarray],
    opts: DownpourOptions,
    *,
    partitions: int | None,
    eval_data: Dataset | tuple[np.ndarray, np.ndarray] | None,
    client: Client | str | None,
    store: str | os.PathLike[str] | None,
    callback: Callable[[Progress], None] | None,
    x0: np.ndarray | None,
) -> TrainResult:
    """:func:`train` with its options checked: whole replicas, or (``partitions``) partitioned ones, driven
    by one shell (:class:`_Run`) through their kind's adapter."""
    if opts.resume and store is None:
        raise InvalidOptionError("resume=True needs the store= of the run to continue")
    x_start = start_vector(model, x0, opts.seed)
    eval_arrays = _eval_arrays(model, eval_data)
    prefix = "downpour-mp-" if partitions is not None else "downpour-"
    with run_store(store, prefix) as run_dir, embedded_client(client) as c:
        # The workers, the model's partitions and their memory are checked before the data are stored.
        kind: Replicas
        if partitions is not None:
            kind = PartitionedReplicas(c, model, opts, partitions=partitions)
        else:
            kind = WholeReplicas(c, model, opts)
        dataset = as_dataset(data, run_dir)
        dataset.check_model(model)
        kind.attach(dataset)
        run = _Run(model, dataset, eval_arrays, run_dir, opts, x_start, callback, kind)
        try:
            run.setup()
            result = run.drive()
            result.model = model
            return result
        finally:
            run.teardown()


# ---------------------------------------------------------------------------------------------- helpers


def _diverged(watch: Watchdog, progress: Progress, x: np.ndarray | None) -> bool:
    """Feed a history row to the watchdog (downpour._watch); whether the run has diverged. A row without
    parameters (``x`` None: not read, or its evaluation not affordable) measured no held-out loss."""
    finite = x is None or bool(np.isfinite(x).all())
    verdict = watch.observe(
        train_loss=progress.train_loss,
        test_loss=progress.test_loss,
        x_finite=finite,
        objective=progress.objective,
        evaluated=x is not None,
    )
    return verdict is not None


def _with_stall_warning(run: _Run, history: xr.Dataset, x: np.ndarray, message: str) -> str:
    """``message`` with the stall warning of downpour._watch when the step rule stalled (also warned, and
    kept in ``history.attrs["warnings"]``). The gradient norms are computed here, on the rows the history's
    objective is computed on (:func:`objective_rows`: every row of a small dataset)."""
    history.attrs["warnings"] = []
    if history.sizes.get("time", 0) < 3:
        return message
    # The training objective says whether the step rule still makes progress (a held-out loss can flatten
    # while training goes on); the held-out loss stands in when too few windows measured it.
    # F(w) on the training data is exact where it was computed; the running mini-batch loss is noisy.
    if "objective" in history and np.isfinite(history.objective.values).sum() >= 3:
        what, losses = "training objective", history.objective.values
    elif np.isfinite(history.train_loss.values).sum() >= 3:
        what, losses = "training loss", history.train_loss.values
    else:
        what, losses = "held-out loss", history.test_loss.values
    try:
        X, y = run.objective_sample()
        with _one_blas_thread():
            g0, g1 = (
                float(np.linalg.norm(objective(run.model, w, X, y, l2=run.opts.l2)[1]))
                for w in (run.x_start, x)
            )
    except Exception:  # a diagnostic: a run that finished is not failed by it
        return message
    stall = stall_message(history.step.values, losses, g0, g1, what=what)
    if stall is None:
        return message
    history.attrs["warnings"] = [stall]
    warnings.warn(stall, StepRuleStallWarning, stacklevel=4)
    return f"{message}; warning: {stall}"


def _eval_arrays(model: Any, eval_data: Any) -> tuple[np.ndarray, np.ndarray] | None:
    if eval_data is None:
        return None
    if isinstance(eval_data, Dataset):
        eval_data.check_model(model)
        return eval_data.read_all()
    if not (isinstance(eval_data, tuple) and len(eval_data) == 2):
        raise InvalidOptionError("eval_data must be None, a storage.Dataset or a tuple (X, y) of arrays")
    sparse = is_sparse(eval_data[0])
    # Sparse rows: checked (indices, finite values) and made canonical CSR, as a sparse dataset stores them.
    X = as_csr(eval_data[0]) if sparse else np.ascontiguousarray(eval_data[0], dtype=np.float64)
    y = np.ascontiguousarray(eval_data[1], dtype=np.float64).ravel()
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise DatasetError(
            f"eval_data must be (X, y) with X of shape (rows, features) and one label per row; got X of "
            f"shape {X.shape} and {y.shape[0]} labels"
        )
    n_features = getattr(model, "n_features", X.shape[1])
    if X.shape[1] != n_features:
        raise DatasetError(f"eval_data has {X.shape[1]} features but the model expects {n_features}")
    if not ((sparse or np.isfinite(X).all()) and np.isfinite(y).all()):
        raise DatasetError("eval_data holds NaN or inf values; remove or impute them")
    check = getattr(model, "check_labels", None)
    if callable(check):
        check(y)
    return X, y


def objective_rows(dataset: Dataset, max_values: int = OBJECTIVE_MAX_VALUES) -> tuple[np.ndarray, np.ndarray]:
    """The training rows the history's ``objective`` is computed on: all of them, or (past ``max_values``
    values of X) whole portions spread evenly over the dataset.

    Examples
    --------
    >>> import tempfile
    >>> path = tempfile.mkdtemp() + "/ds"
    >>> ds = Dataset.from_arrays(np.ones((10, 2)), np.zeros(10), path=path, portion_rows=2)
    >>> objective_rows(ds, max_values=8)[0].shape  # 2 of the 5 portions: the first and the last
    (4, 2)
    """
    # A sparse dataset's size is its nonzeros, not rows x features.
    values = int(getattr(dataset, "nnz", dataset.n_rows * dataset.n_features))
    if values <= max_values:
        return dataset.read_all()
    per_portion = max(1, values * dataset.portion_rows // max(1, dataset.n_rows))
    budget = max(1, max_values // per_portion)
    chosen = np.unique(np.linspace(0, dataset.n_portions - 1, min(budget, dataset.n_portions)).round())
    parts = [dataset.read_portion(int(i)) for i in chosen]
    if is_sparse(parts[0][0]):  # CSR portions stack as CSR (numpy cannot concatenate them)
        import scipy.sparse as sp

        return sp.vstack([X for X, _ in parts], format="csr"), np.concatenate([y for _, y in parts])
    return np.concatenate([X for X, _ in parts]), np.concatenate([y for _, y in parts])


def _evaluate(model: Any, x: np.ndarray, arrays: tuple[np.ndarray, np.ndarray] | None) -> tuple[float, float]:
    if arrays is None:
        return math.nan, math.nan
    X, y = arrays
    loss, _ = model.loss_and_grad(x, X, y)
    accuracy = getattr(model, "accuracy", None)
    acc = float(accuracy(x, X, y)) if callable(accuracy) else math.nan
    return float(loss) / X.shape[0], acc


@dataclass(frozen=True)
class _Row(Progress):
    """A history row: its :class:`Progress` and the counters only the history has."""

    push_errors: int = 0
    stale_waits: int = 0
    pushes: list[int] = field(default_factory=list)
    fetches: list[int] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    messages: int = 0
    applied: list[int] = field(default_factory=list)


#: A kind of replica, as the driver shell (:class:`_Run`) sees it through its adapter: placed, started,
#: polled (statuses in the whole replicas' format, so history, checkpoints and the result are made alike),
#: stopped, repointed; a lost one dropped (whole) or rebuilt (partitioned, from the step it reached).
Replicas = WholeReplicas | PartitionedReplicas


class _Run:
    """One training run: the shards, the replicas (through their kind's adapter), and the driver loop."""

    def __init__(
        self,
        model: Any,
        dataset: Dataset,
        eval_arrays: tuple[np.ndarray, np.ndarray] | None,
        store: str,
        opts: DownpourOptions,
        x_start: np.ndarray,
        callback: Callable[[Progress], None] | None,
        kind: Replicas,
    ) -> None:
        self.kind = kind
        self.model = model
        self.dataset = dataset
        self.eval_arrays = eval_arrays
        self.store = store
        self.opts = opts
        self.x_start = x_start
        self.callback = callback
        self.ps: ParameterServer | None = None
        self.machine = DriverMachine(replicas=0)  # the run's, once setup() knows the replicas
        self.alive: list[bool] = []
        self.started: list[bool] = []
        self.status: dict[int, dict[str, Any]] = {}
        self.shards: Shards | None = None
        self.rows: list[_Row] = []
        self.t0 = 0.0
        self.stopped = False
        self._prev = (0, 0.0, 0, 0)  # rows, loss_sum, staleness_count, staleness_sum at the last row
        #: ``(time, staleness_max)`` of every status and record not yet in a row: a row's ``staleness_max`` is
        #: the largest of those up to its time, so it covers exactly the pushes its ``staleness_mean`` counts
        #: (a replica's windows end at its records: :meth:`downpour._core.ReplicaCore.record`).
        self._stale_windows: list[tuple[float, int]] = []
        #: Wall-clock time (time.time()) of the run's time 0: replicas stamp their records with it.
        self.t0_wall = 0.0
        #: Per replica, time-sorted ``(time, counters)``: its history records and its polled statuses.
        self.points: dict[int, list[tuple[float, dict[str, Any]]]] = {}
        #: Records not yet made history rows: ``(time, replica, record)``.
        self.pending: list[tuple[float, int, dict[str, Any]]] = []
        #: Rows made during the run whose parameters the budget could not evaluate then: ``(row index, x)``,
        #: evaluated at the end as its budget allows (:meth:`_fill`).
        self.unfilled: list[tuple[int, np.ndarray]] = []
        #: Shard-counted applied pushes, as measured: ``(time, per shard)``.
        self.applied_log: list[tuple[float, list[int]]] = []
        self.plan = RecordPlan()
        self.snapshots: list[tuple[float, int, np.ndarray]] = []
        self._planned_every: int | None = None
        self._rate_mark: tuple[float, int] | None = None  # (time, steps) at the last replan
        self._objective_rows: tuple[np.ndarray, np.ndarray] | None = None
        self._unreadable = False  # the objective's rows could not be read
        #: Seconds the driver spent evaluating history rows, and the rows with parameters it evaluated.
        self.eval_s = 0.0
        self.evals = 0
        self.watch = Watchdog(opts.max_loss_growth)
        #: The shards' parameters read during the current poll, for windowed sparse replicas' records.
        self._gathered_at = -math.inf
        #: Seconds the last history row with parameters took to evaluate (the first is timed before the run).
        self.row_cost = 0.0
        self._gather_s = 0.0
        #: With ``resume=True``: the checkpoint the run continues from.
        self.resumed: ResumePoint | None = None

    # -- setup / teardown ----------------------------------------------------------------------------------
    def setup(self) -> None:
        kind = self.kind
        # n_fetch and n_push left out: chosen from what the run communicates (DownpourOptions.with_sync).
        self.opts = opts = kind.prepare(self.opts)
        ps, self.resumed = kind.open_shards(self.store, opts, self.x_start)
        if self.resumed is not None:
            self.x_start = kind.to_model(ps.gather("x"))
        self.ps = ps
        clock = lambda: time.perf_counter() - self.t0  # noqa: E731
        self.shards = Shards(ps, clock, self._repoint, checkpoints=0 if opts.resume else 1)
        kind.place(self.shards, opts, self._record_plan(kind.row_ranges))
        n_replicas = kind.n_replicas
        self.started = [False] * n_replicas
        start = self.resumed.time if self.resumed is not None else 0.0
        self.machine = kind.machine = DriverMachine(
            replicas=n_replicas,
            start=start,
            checkpoint_every_s=opts.checkpoint_every_s,
            report_every=0.0,  # every poll: the rows the replicas recorded since the last
            measure_every=opts.eval_every,
            time_limit=opts.time_limit,
            max_steps=opts.max_steps,
            warm=opts.warmstart_steps > 0 and self.resumed is None,
            max_rebuilds=kind.max_rebuilds,
        )
        self.alive = self.machine.alive  # a lost replica is dropped by the machine, the list shared
        if self.resumed is not None:
            self._resume_replicas(self.resumed)

    def _resume_replicas(self, point: ResumePoint) -> None:
        """Hand every replica its counters at the checkpoint; they are the driver's starting totals."""
        for r, value in self.kind.resume(point).items():
            self.status[r] = value
            self.points[r] = [(point.time, value)]
        t = self._totals()
        self._prev = (t["rows"], t["loss_sum"], t["staleness_count"], t["staleness_sum"])

    def _checkpoint(self, now: float, **extra: Any) -> None:
        """A checkpoint of the shards, with the counters ``resume=True`` needs."""
        assert self.shards is not None
        self.shards.checkpoint(now, self.status, self.kind.n_replicas, **self.kind.meta, **extra)

    def teardown(self) -> None:
        live = [r for r, (a, s) in enumerate(zip(self.alive, self.started, strict=False)) if a and s]
        self.kind.close([] if self.stopped else live)
        if self.ps is not None:
            self.ps.close()

    # -- replica calls ---------------------------------------------------------------------------------
    def _start(self, which: Sequence[int]) -> None:
        for r, (ok, value) in self.kind.start(which).items():
            if ok:
                self.started[r] = True
            elif self.kind.is_dead(r):
                self.machine.lose(r)
            else:
                raise ClusterError(f"replica {r} could not start: {value!r}")

    def _poll(self) -> None:
        which = [r for r in range(self.kind.n_replicas) if self.alive[r] and self.started[r]]
        if not which:
            return
        timeout = max(5.0, 20 * self.kind.poll_every)
        wanted: list[dict[str, Any]] = []
        for r, (ok, value) in self.kind.poll(which, self.plan, timeout).items():
            if ok:
                wanted += self._ingest(r, value)
            elif self.kind.is_dead(r):
                self.machine.lose(r)
        if wanted:
            # A windowed sparse replica's local copy is exact only at the keys of its next steps, and
            # partitions hold only their slices: such a row is evaluated at the shards' parameters instead,
            # read at most once per poll and at most 5% of the time (the shards serve the replicas
            # meanwhile). Only the poll's latest such record gets them: the earlier ones were taken at other
            # parameters, and an objective copied onto them read as a flat loss (a stall) over their steps.
            now = time.perf_counter()
            if now - self._gathered_at >= 20 * self._gather_s:
                latest = max(wanted, key=lambda record: float(record["time"]))
                latest["x"] = self._ps_call(self._gather_x)
                self._gathered_at = time.perf_counter()
                self._gather_s = self._gathered_at - now

    def _ingest(self, r: int, value: dict[str, Any]) -> list[dict[str, Any]]:
        """A replica's status: the latest counters, and its history records queued for rows. Returns the
        records that want the shards' parameters (:meth:`_poll` gives them to the latest one)."""
        self.status[r] = value
        points = self.points.setdefault(r, [])
        wanted = []
        for record in value.pop("records", []):
            if record.get("x_wanted"):
                record["x"] = None
                wanted.append(record)
            t = float(record["time"]) - self.t0_wall
            points.append((t, record))
            self.pending.append((t, r, record))
            self._stale_windows.append((t, int(record["staleness_max"])))
        t = float(value["time"]) - self.t0_wall
        points.append((t, value))
        self._stale_windows.append((t, int(value["staleness_max"])))
        return wanted

    # -- parameter server ------------------------------------------------------------------------------
    def _gather_x(self) -> np.ndarray:
        assert self.ps is not None
        return self.kind.to_model(self.ps.gather("x"))

    def _ps_call(self, fn: Callable[[], Any]) -> Any:
        """Run a parameter-server op; a lost shard is restored (and the replicas told) and the op retried."""
        assert self.shards is not None
        return self.shards.run(fn)

    def _repoint(self, shard_map: ShardMap) -> None:
        """A shard came back from its checkpoint: the replicas are handed the new shard map."""
        live = [r for r in range(self.kind.n_replicas) if self.alive[r]]
        for r, (ok, _) in self.kind.set_shard_map(live, shard_map).items():
            if not ok and self.kind.is_dead(r):
                self.machine.lose(r)

    # -- history ---------------------------------------------------------------------------------------
    def _totals(self) -> dict[str, Any]:
        """The replicas' counters summed, as their latest statuses say."""
        return self._sum(list(self.status.values()))

    def _totals_at(self, t: float) -> dict[str, Any]:
        """The replicas' counters summed at time ``t`` (each one's last record or status at or before it)."""
        parts = []
        for points in self.points.values():
            i = bisect.bisect_right(points, t, key=lambda p: p[0]) - 1
            if i >= 0:
                parts.append(points[i][1])
        return self._sum(parts)

    def _sum(self, statuses: Sequence[dict[str, Any]]) -> dict[str, Any]:
        s = self.ps.shards if self.ps is not None else 1
        added = ("steps", "rows", "loss_sum", "staleness_count", "staleness_sum", "duplicates", "stale_waits",
                 "bytes_fetched", "bytes_pushed", "messages", "fused")  # fmt: skip
        out: dict[str, Any] = dict.fromkeys(added, 0)
        out.update(push_errors=0, fetch_errors=0, pushes=[0] * s, fetches=[0] * s, version=[0] * s)
        for st in statuses:
            for key in added:
                out[key] += st[key]
            out["push_errors"] += sum(st["push_errors"])
            out["fetch_errors"] += sum(st["fetch_errors"])
            for i in range(s):
                out["pushes"][i] += st["pushes"][i]
                out["fetches"][i] += st["fetches"][i]
                out["version"][i] = max(out["version"][i], st["known_versions"][i])
        return out

    def objective_sample(self) -> tuple[Any, np.ndarray]:
        """The training rows the history's objective is computed on (read once): :func:`objective_rows`
        within ``OBJECTIVE_MAX_VALUES`` values and ``OBJECTIVE_MAX_WORK`` row-parameter products (an MLP's
        row costs its parameters, not its features)."""
        if self._objective_rows is None:
            ds = self.dataset
            per_value = max(
                1.0, float(getattr(self.model, "n_params", ds.n_features)) / max(1, ds.n_features)
            )
            budget = min(OBJECTIVE_MAX_VALUES, max(ds.n_features, int(OBJECTIVE_MAX_WORK / per_value)))
            self._objective_rows = objective_rows(ds, max_values=budget)
        return self._objective_rows

    def _objective(self, x: np.ndarray | None) -> float:
        """F(w) on the training rows (:meth:`objective_sample`), as Sandblaster computes it."""
        if x is None or self._unreadable:
            return math.nan
        try:
            X, y = self.objective_sample()
        except StoreError:
            # NaN rather than the run's failure: the replicas read the same rows, and their error (with
            # its traceback) is the one to report.
            self._unreadable = True
            return math.nan
        return float(objective(self.model, x, X, y, l2=self.opts.l2)[0])

    def _record_plan(self, ranges: Sequence[tuple[int, int]]) -> RecordPlan:
        """When the replicas record history points: about ``HISTORY_POINTS`` over the run, whose length is
        known in steps (``max_steps``, ``epochs``) or seconds (``time_limit``), and at least every
        ``eval_every`` seconds; a parameter copy on every record while ``HISTORY_X_BYTES`` allows."""
        opts, n_replicas = self.opts, len(ranges)
        done = self.resumed.step if self.resumed is not None else 0
        planned: list[int] = [opts.max_steps] if opts.max_steps is not None else []
        if opts.epochs is not None:
            batches = [
                BatchPlan.for_rows(self.dataset, lo, hi, batch_size=opts.batch_size, seed=0, replica=r)
                .batches_per_epoch
                for r, (lo, hi) in enumerate(ranges)
            ]  # fmt: skip
            planned.append(opts.epochs * sum(batches))
        every_steps = max(1, (min(planned) - done) // HISTORY_POINTS) if planned else None
        every_s = opts.eval_every
        if opts.time_limit is not None:
            left = opts.time_limit - (self.resumed.time if self.resumed is not None else 0.0)
            every_s = min(every_s, max(MIN_EVAL_EVERY, n_replicas * left / HISTORY_POINTS))
        x_bytes = 8 * self.x_start.size
        x_every = 0 if x_bytes > HISTORY_X_BYTES else math.ceil(HISTORY_POINTS * x_bytes / HISTORY_X_BYTES)
        self.plan = RecordPlan(every_steps=every_steps, every_s=every_s, x_every=x_every)
        # Rows with parameters have the exact objective to judge growth by; without, the running loss is all.
        self.watch.running_loss_growth = x_every == 0
        self._planned_every = every_steps
        return self.plan

    def _replan(self, now: float) -> None:
        """A run known by its time limit: record by steps too, at the step rate measured since the first
        steps, so that the records left come to about ``HISTORY_POINTS`` (a record due by time waits for a
        step, and a loaded host delays steps in bursts: records by time alone came to about half). Records
        by steps stay at least half the time interval apart, so a rate misjudged low cannot flood the run."""
        opts = self.opts
        steps = self._totals()["steps"] if self.status else 0
        if opts.time_limit is None:
            return
        if self._rate_mark is None:
            if steps > 0:
                self._rate_mark = (now, steps)
            return
        t_mark, s_mark = self._rate_mark
        if now <= t_mark or steps <= s_mark:
            return
        rate = (steps - s_mark) / (now - t_mark)
        left = max(1, HISTORY_POINTS - len(self.rows) - len(self.pending))
        every = max(1, int(rate * max(0.0, opts.time_limit - now)) // left)
        if self._planned_every is not None:
            every = min(every, self._planned_every)
        self.plan = dataclasses.replace(self.plan, every_steps=every, min_s=self.plan.every_s / 2)

    def _frontier(self) -> float:
        """The time up to which every replica's records are in: rows before it can be made."""
        frontier = math.inf
        for r in range(self.kind.n_replicas):
            if not (self.alive[r] and self.started[r]):
                continue  # not started: no steps yet; lost: it will send no more
            points = self.points.get(r)
            if not points:
                return -math.inf
            if not self.status[r].get("done"):
                frontier = min(frontier, points[-1][0])
        return frontier

    def _rows_from_records(
        self, upto: float, budget_s: float = math.inf
    ) -> list[tuple[Progress, np.ndarray | None]]:
        """History rows for the replicas' records up to time ``upto``, in time order, with at most about
        ``budget_s`` seconds of evaluation (the driver must keep deciding when to stop; a row of the digits
        MLP took ~0.15 s to evaluate at load average ~30). Returns each row with the parameters it was
        evaluated at (None: none, or not evaluated yet).

        A row's counters are the replicas' at the record's time (the recording replica's exactly, the others'
        as of their last record or poll before it); its objective and held-out metrics are evaluated here
        on the recording replica's parameters (its local copy: the last fetch plus its own steps since).
        Every ready record becomes a row at once, so a callback sees the run as it goes; a finite budget goes
        to the newest rows first (a callback deciding when to stop wants the latest parameters: evaluated
        oldest first, a 6 s run's callback got the rows of steps 1 and 2, at 3.7 and 5.3 s), and the rows
        it does not cover are made with NaN metrics and evaluated at the end (:meth:`_fill`).
        """
        ready = sorted((p for p in self.pending if p[0] <= upto), key=lambda p: p[0])
        self.pending = [p for p in self.pending if p[0] > upto]
        with_x = [i for i, p in enumerate(ready) if p[2]["x"] is not None]
        evaluated: dict[int, tuple[float, float, float]] = {}
        deadline = time.perf_counter() + budget_s
        with _one_blas_thread():  # small evaluations; the cores are the replicas'
            for i in reversed(with_x) if math.isfinite(budget_s) else with_x:
                # An evaluation that would end past the budget is not started (the first of a call is, if
                # its measured cost alone fits).
                cost = self.row_cost
                if (cost > budget_s) if not evaluated else (time.perf_counter() + cost > deadline):
                    break
                evaluated[i] = self._timed_evaluations(ready[i][2]["x"])
                self.eval_s += self.row_cost
                self.evals += 1
        out: list[tuple[Progress, np.ndarray | None]] = []
        for i, (t_record, _, record) in enumerate(ready):
            x = record["x"]
            last = self.rows[-1].time if self.rows else -math.inf
            t = max(t_record, float(np.nextafter(last, math.inf)))
            # Parameters gone NaN / inf cost nothing to evaluate, and tell the watchdog the run diverged.
            if x is None or i in evaluated or not np.isfinite(x).all():
                out.append((self._record(t, x, self._totals_at(t), evaluated=evaluated.get(i)), x))
                continue
            out.append((self._record(t, None, self._totals_at(t)), None))
            self.unfilled.append((len(self.rows) - 1, x))
        if ready:
            self._prune(ready[-1][0])
        return out

    def _fill(self, budget_s: float) -> int:
        """Evaluate the rows :meth:`_rows_from_records` made without their metrics, as many as ``budget_s``
        affords at their measured cost, evenly spread in time, and none past it (the others keep NaN).
        Returns how many it evaluated."""
        filled = 0
        if not self.unfilled:
            return filled
        deadline = time.perf_counter() + budget_s
        affordable = int(budget_s / self.row_cost) if self.row_cost > 0 else len(self.unfilled)
        if affordable < len(self.unfilled):
            picks = np.linspace(0, len(self.unfilled) - 1, max(0, affordable)).round().astype(int)
            self.unfilled = [self.unfilled[i] for i in sorted(set(picks.tolist()))]
        with _one_blas_thread():
            for index, x in self.unfilled:
                if time.perf_counter() + self.row_cost > deadline:
                    break  # a loaded box: the measured cost was low
                objective_value, test_loss, accuracy = self._timed_evaluations(x)
                self.rows[index] = dataclasses.replace(
                    self.rows[index], objective=objective_value, test_loss=test_loss, test_accuracy=accuracy
                )
                row = self.rows[index]
                if self.opts.trace:
                    bisect.insort(self.snapshots, (row.time, row.step, x), key=lambda s: s[0])
                filled += 1
        self.unfilled = []
        return filled

    def _rewatch(self) -> Watchdog:
        """A watchdog that saw the whole history in time order, with the rows :meth:`_fill` evaluated (the
        run's own saw the newest rows first, and the filled ones are older: fed to it out of order, a row
        of the run's start read as growth from the lowest objective of its end)."""
        watch = Watchdog(self.opts.max_loss_growth)
        watch.running_loss_growth = self.watch.running_loss_growth
        for row in self.rows:
            evaluated = not (math.isnan(row.objective) and math.isnan(row.test_loss))
            watch.observe(
                train_loss=row.train_loss,
                test_loss=row.test_loss,
                objective=row.objective,
                evaluated=evaluated,
            )
        return watch

    def _thin_pending(self, keep: int) -> None:
        """Keep ``keep`` of the pending records, evenly spread in time (bounds the work left at the end), and
        every one that carries parameters within that count: a windowed run's records get the shards'
        parameters once a poll, and spreading would drop most of its rows with an objective."""
        if len(self.pending) <= keep:
            return
        ordered = sorted(self.pending, key=lambda p: p[0])
        with_x = [i for i, p in enumerate(ordered) if p[2].get("x") is not None]
        chosen = set(with_x[:: max(1, math.ceil(len(with_x) / max(1, keep)))])
        rest = keep - len(chosen)
        if rest > 0:
            chosen |= set(np.linspace(0, len(ordered) - 1, rest).round().astype(int).tolist())
        self.pending = [ordered[i] for i in sorted(chosen)]

    def _prune(self, t: float) -> None:
        """Forget points no later row needs: per replica, those before its last one at or before ``t``."""
        for r, points in self.points.items():
            i = bisect.bisect_right(points, t, key=lambda p: p[0]) - 1
            if i > 0:
                self.points[r] = points[i:]

    def _evaluations(self, x: np.ndarray | None) -> tuple[float, float, float]:
        """``(objective, test_loss, test_accuracy)`` at ``x`` (NaN without parameters, or non-finite ones)."""
        if x is None or not np.isfinite(x).all():
            return (math.nan,) * 3
        return (self._objective(x), *_evaluate(self.model, x, self.eval_arrays))

    def _timed_evaluations(self, x: np.ndarray) -> tuple[float, float, float]:
        """:meth:`_evaluations` at ``x``, its time kept as the measured cost of a row (``row_cost``)."""
        started = time.perf_counter()
        values = self._evaluations(x)
        self.row_cost = time.perf_counter() - started
        return values

    def _record(
        self,
        now: float,
        x: np.ndarray | None,
        t: dict[str, Any] | None = None,
        *,
        evaluated: tuple[float, float, float] | None = None,
    ) -> Progress:
        """The history row at ``now`` on the counters ``t`` (the latest statuses', all of them, if None), at
        the parameters ``x`` (their :meth:`_evaluations` if ``evaluated`` does not give them)."""
        if x is not None and not np.isfinite(x).all():
            x = None  # diverged (the watchdog is told by the caller): the model refuses such parameters
        objective_value, test_loss, test_acc = self._evaluations(x) if evaluated is None else evaluated
        upto = now if t is not None else math.inf
        t = self._totals() if t is None else t
        window = [m for when, m in self._stale_windows if when <= upto]
        self._stale_windows = [(when, m) for when, m in self._stale_windows if when > upto]
        rows0, loss0, count0, sum0 = self._prev
        d_rows, d_count = t["rows"] - rows0, t["staleness_count"] - count0
        row = _Row(
            time=now,
            step=t["steps"],
            epoch=t["rows"] / self.dataset.n_rows,
            train_loss=(t["loss_sum"] - loss0) / d_rows if d_rows else math.nan,
            objective=objective_value,
            test_loss=test_loss,
            test_accuracy=test_acc,
            staleness_mean=(t["staleness_sum"] - sum0) / d_count if d_count else math.nan,
            staleness_max=float(max(window, default=0)) if d_count else math.nan,
            replicas_alive=sum(a and s for a, s in zip(self.alive, self.started, strict=True)),
            push_errors=t["push_errors"],
            stale_waits=t["stale_waits"],
            pushes=t["pushes"],
            fetches=t["fetches"],
            version=t["version"],
            bytes_moved=t["bytes_fetched"] + t["bytes_pushed"],
            messages=t["messages"],
            applied=self._applied_at(now),
        )
        self.rows.append(row)
        if self.opts.trace and x is not None:
            self.snapshots.append((now, row.step, x))
        self._prev = (t["rows"], t["loss_sum"], t["staleness_count"], t["staleness_sum"])
        return Progress(**{f.name: getattr(row, f.name) for f in dataclasses.fields(Progress)})

    def _applied_at(self, t: float) -> list[int]:
        """The shards' applied-push counts as last measured at or before ``t`` (every ``eval_every``)."""
        i = bisect.bisect_right(self.applied_log, t, key=lambda p: p[0]) - 1
        if i >= 0:
            return list(self.applied_log[i][1])
        return [0] * (self.ps.shards if self.ps is not None else 1)

    def _measure_applied(self, now: float) -> None:
        counters = self._shard_counters()
        if counters is not None:  # else keep the last known counts
            self.applied_log.append((now, [int(c["applied"]) for c in counters]))

    def _shard_counters(self) -> list[dict[str, Any]] | None:
        """Every shard's applied-push counters (None if a shard does not answer)."""
        assert self.ps is not None
        ps = self.ps
        try:
            counters: list[dict[str, Any]] = self._ps_call(ps.counters)
        except ClusterError:
            return None
        return counters

    def _history(self) -> xr.Dataset:
        rows = self.rows
        s = self.ps.shards if self.ps is not None else 1
        times = np.array([r.time for r in rows])
        per_shard = ("pushes", "fetches", "version", "applied")
        scalar = [f.name for f in dataclasses.fields(_Row) if f.name not in ("time", *per_shard)]
        data: dict[str, Any] = {k: ("time", np.array([getattr(r, k) for r in rows])) for k in scalar}
        for k in per_shard:
            values = np.array([getattr(r, k) for r in rows], dtype=np.int64).reshape(-1, s)
            data[k] = (("time", "shard"), values)
        data["train_loss"] = (*data["train_loss"], {"long_name": "running mini-batch loss"})
        data["objective"] = (*data["objective"], {"long_name": "F(w) on the training data"})
        opts, n_replicas = self.opts, self.kind.n_replicas
        return xr.Dataset(
            data,
            coords={"time": times, "shard": np.arange(s)},
            attrs={
                **self.kind.meta,
                "rule": opts.rule,
                "lr": opts.step_size,
                "replicas": n_replicas,
                "shards": s,
                "batch_size": opts.batch_size,
                "n_fetch": opts.n_fetch,
                "n_push": opts.n_push,
                "n_rows": self.dataset.n_rows,
                "l2": opts.l2,
                "objective_rows": self._objective_rows[0].shape[0] if self._objective_rows else 0,
                "staleness_scale": opts.scales_staleness(n_replicas),
                "fused": opts.fuses,
                "compression_tau": opts.compression.tau if opts.compression is not None else 0.0,
            },
        )

    # -- the loop --------------------------------------------------------------------------------------
    def drive(self) -> TrainResult:
        """Poll the replicas every ``poll_every`` seconds and carry out what :class:`DriverMachine` says."""
        opts, m, shards = self.opts, self.machine, self.shards
        assert shards is not None
        n_replicas = self.kind.n_replicas
        # A resumed run's clock goes on from its checkpoint's (time_limit counts the whole run).
        start = self.resumed.time if self.resumed is not None else 0.0
        # The first row (the starting parameters' objective: up to ~1 s for an image model's sample) before
        # the replicas start and the clock runs: the driver's evaluation would take a core from them.
        evaluated = self._timed_evaluations(self.x_start)
        self.t0 = time.perf_counter() - start
        self.t0_wall = time.time() - start
        if m.waiting:
            self.kind.call([0], "hold", (opts.warmstart_steps,))
        self._start([0] if m.waiting else list(range(n_replicas)))
        self._measure_applied(start)
        _diverged(self.watch, self._record(start, self.x_start, evaluated=evaluated), self.x_start)
        while True:
            self.kind.wait(self.kind.poll_every)
            self._replan(time.perf_counter() - self.t0)
            self._poll()
            now = time.perf_counter() - self.t0
            for r, st in self.status.items():
                if st.get("error"):
                    self._fail(r, st)
            poll = self._poll_summary()
            for action in m.tick(now, poll):
                if isinstance(action, Release):
                    self._start(range(1, n_replicas))
                    self.kind.call([0], "release")
                elif isinstance(action, Probe):  # replicas cannot reach a shard: was it lost (restore it)?
                    with contextlib.suppress(ClusterError):
                        shards.probe()
                elif isinstance(action, Report):
                    self._report(m)
                elif isinstance(action, Measure):
                    self._measure_applied(now)
                elif isinstance(action, Checkpoint):
                    t_ckpt = time.perf_counter()
                    with contextlib.suppress(ClusterError):
                        self._checkpoint(now)
                    m.checkpointed(now, time.perf_counter() - t_ckpt)
            stop_reason = m.outcome(now, poll)
            if stop_reason is not None:
                return self._finish(stop_reason)

    def _report(self, m: DriverMachine) -> None:
        """History rows for the records every replica has reported past (no round trip of their own), each
        passed to the callback and the watchdog. Evaluations take at most EVAL_SHARE of the run's time so
        far, newest rows first (the others are evaluated at the end, as its budget allows)."""
        # One poll's share at a time, or one row's measured cost once the run's share covers it (a row
        # costlier than a poll's share would otherwise wait for the end, and the callback with it).
        share = EVAL_SHARE * (time.perf_counter() - self.t0) - self.eval_s
        allowed = min(share, max(self.opts.poll_every, self.row_cost))
        for progress, x in self._rows_from_records(self._frontier(), budget_s=allowed):
            stop = False
            if self.callback is not None and m.stopped is None:
                try:
                    self.callback(progress)
                except StopIteration:
                    stop = True
            m.verdict(progress.time, callback=stop, diverged=_diverged(self.watch, progress, x))

    def _poll_summary(self) -> Poll:
        """What the replicas' latest statuses say, for :meth:`DriverMachine.tick`."""
        status = self.status
        return Poll(
            steps=self._totals()["steps"],
            errors=sum(sum(st["fetch_errors"]) + sum(st["push_errors"]) for st in status.values()),
            done={r: str(st.get("stop_reason", "")) for r, st in status.items() if st.get("done")},
            diverged=any(st.get("diverged") for st in status.values()),
            holding=bool(status.get(0, {}).get("holding")),
        )

    def _fail(self, r: int, st: dict[str, Any]) -> None:
        exc = st.get("error_obj")
        if isinstance(exc, DistbeliefError):
            raise exc
        raise ClusterError(f"replica {r} failed; its traceback:\n{st['error']}")

    def _finish(self, stop_reason: str) -> TrainResult:
        assert self.ps is not None and self.shards is not None
        ps, shards = self.ps, self.shards
        kind, n_replicas = self.kind, self.kind.n_replicas
        live = [r for r in range(n_replicas) if self.alive[r] and self.started[r]]
        finals = kind.stop(live, self.opts.call_timeout + 5.0)
        self.stopped = True
        # The run's time is its training's: the history rows still to evaluate below (bounded by END_EVAL_S)
        # are not (a 10-step partitioned run spent more on them than on its steps).
        wall = time.perf_counter() - self.t0
        for r, (ok, value) in finals.items():
            if ok:
                self._ingest(r, value)
            elif kind.is_dead(r):
                self.machine.lose(r)
        for r in live:
            st = self.status.get(r, {})
            if st.get("error"):
                self._fail(r, st)
        # At most about HISTORY_POINTS more rows to evaluate (the run is over: only the history waits), and
        # no more than END_EVAL_S or EVAL_SHARE of the run take at the rows' measured cost (issue 30, item 3).
        per_row = self.eval_s / self.evals if self.evals else self.row_cost
        budget = max(END_EVAL_S, EVAL_SHARE * (time.perf_counter() - self.t0))
        affordable = int(budget / per_row) if per_row > 0 else HISTORY_POINTS
        self._thin_pending(max(2, min(affordable, max(HISTORY_POINTS, 2 * HISTORY_POINTS - len(self.rows)))))
        for progress, x_row in self._rows_from_records(math.inf):
            if _diverged(self.watch, progress, x_row) and stop_reason in SUCCESS:
                stop_reason = "diverged"
        # The history is judged again with the rows filled (a short diverging run may have had few rows
        # evaluated while it ran).
        if self._fill(budget - (time.perf_counter() - self.t0 - wall)) and stop_reason in SUCCESS:
            self.watch = self._rewatch()
            if self.watch.message is not None:
                stop_reason = "diverged"
        # The store ends up holding the final state (parameters, Adagrad accumulators, shard versions).
        self._checkpoint(wall, final=True)
        x = kind.to_model(self._ps_call(lambda: ps.gather("x")))
        t_last = max(wall, float(np.nextafter(self.rows[-1].time, math.inf)))
        self._measure_applied(t_last)
        last = self._record(t_last, x)
        if stop_reason in SUCCESS and _diverged(self.watch, last, x):
            stop_reason = "diverged"
        losses: dict[int, np.ndarray] = {}
        if self.opts.trace:
            losses = kind.losses([r for r in range(n_replicas) if self.alive[r]])
        t = self._totals()
        success = stop_reason in SUCCESS
        stats = {
            "replicas": n_replicas,
            "shards": ps.shards,
            "pushes": int(sum(t["pushes"])),
            "fetches": int(sum(t["fetches"])),
            "push_errors": t["push_errors"],
            "fetch_errors": t["fetch_errors"],
            "duplicates": t["duplicates"],
            "staleness_mean": t["staleness_sum"] / t["staleness_count"] if t["staleness_count"] else math.nan,
            "stale_waits": t["stale_waits"],
            "steps_per_s": t["steps"] / wall if wall > 0 else math.nan,
            "lost_replicas": list(self.machine.lost),
            "shard_losses": list(shards.shard_losses),
            "recoveries": len(shards.shard_losses),
            "checkpoints": shards.checkpoints,
            "communication": kind.communication,
            "bytes_fetched": t["bytes_fetched"],
            "bytes_pushed": t["bytes_pushed"],
            "bytes_per_step": (t["bytes_fetched"] + t["bytes_pushed"]) / max(1, t["steps"]),
            "bytes_pushed_per_step": t["bytes_pushed"] / max(1, t["steps"]),
            "messages": t["messages"],
            "messages_per_step": t["messages"] / max(1, t["steps"]),
            "fused_pushes": t["fused"],
            "shard_counters": self._shard_counters(),
            "resumed_from": self.resumed.step if self.resumed is not None else None,
            **kind.stats(self.status, int(t["steps"])),
        }
        history, message = self._history(), MESSAGES[stop_reason]
        if stop_reason == "diverged" and self.watch.message:
            message = self.watch.message
        if success:
            message = _with_stall_warning(self, history, x, message)
        return TrainResult(
            x=x,
            history=history,
            stop_reason=stop_reason,
            success=success,
            message=message,
            steps=int(t["steps"]),
            wall_time=wall,
            store=ps.url,
            stats=stats,
            losses=losses,
            snapshots=self.snapshots,
        )
