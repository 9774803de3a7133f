"""``sandblaster.minimize``: the one front door to distributed batch optimization (paper, section 4.2)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import xarray as xr
from distributed import Client

from distbelief.errors import DatasetError, InvalidOptionError, ShardLostError
from distbelief.models import objective
from distbelief.models.internal import FittedMixin
from distbelief.options import (
    PARTITIONS_DOC,
    REST_MAX_ACTORS,
    REST_MAX_ITER,
    check_fields,
    check_option,
    option,
    options_of,
    refuse_unknown,
    worker_tuple,
)
from distbelief.storage import (
    Dataset,
    ParameterServer,
    as_dataset,
    embedded_client,
    partition_layout,
    partition_shards,
    start_vector,
    worker_addresses,
)
from distbelief.storage.internal import Communication, ShardRecovery, run_store, use_sparse

from ._cg import _minimize_cg
from ._coordinator import Coordinator, IterationRecord, RunState
from ._gd import _minimize_gd
from ._linesearch import LBFGSB_FTOL
from ._owlqn import _minimize_owlqn
from ._partitioned import (
    PartitionedScheduler,
    check_partitioned,
    start_replicas,
)
from ._replica import Replica
from ._scheduler import PortionScheduler
from ._space import InProcessSpace, ParameterSpace
from ._vlbfgs import _minimize_lbfgs

__all__ = [
    "HISTORY_DTYPE_OPTIONS",
    "OptimizeResult",
    "SandblasterOptions",
    "auto_history_dtype",
    "minimize",
    "open_session",
]

Method = Literal["lbfgs", "cg", "gd", "owlqn"]
HistoryDtype = Literal["auto", "float64", "float32"]
#: The values of ``history_dtype``.
HISTORY_DTYPE_OPTIONS: tuple[str, ...] = get_args(HistoryDtype)
#: Vectors an L-BFGS (OWL-QN) run keeps on a shard beside its ``2(m + 1)`` history slots: ``x`` and the
#: trial point, their gradients, the direction and the gradient accumulator (and the pseudo-gradient's two
#: buffers and the orthant).
WORKING_VECTORS = {"lbfgs": 6, "owlqn": 9}

#: How many times a run rolls back to its checkpoint after losing a shard before it gives up.
MAX_RECOVERIES = 3
#: Below this many parameters the default is a single shard.
SHARD_MIN_PARAMS = 1 << 17
#: Row-parameter products per portion by default: ~9 ms of gradient work on one core here with the models'
#: compiled kernel (200,000 x 501 logistic: ~3 ms per 8.4 M products). Every portion costs the replica a
#: kernel call and an exact-sum deposit, and every ``push_every`` portions a push (a message, and a wakeup
#: of its event loop): measured on 200,000 x 500, interleaved in one cluster (load average ~30), 6
#: portions took 0.78x the CPU per evaluation of 12 (83 against 106 ms) and 1.70x the kernel floor
#: against 2.02x.
PORTION_WORK = 25_000_000
#: Row-parameter products one stored nonzero of a CSR row counts for, per coefficient of its column. A wide
#: sparse model's work is its nonzeros, not ``rows x parameters``: sized by the latter, a 2^20-wide set of
#: 500k rows x 40 nonzeros took 65 portions of 7,700 rows. Beyond the kernel (~4 ns a nonzero against
#: ~0.36 ns a dense product), every sparse portion costs work per distinct key (its parameters gathered,
#: its gradient cut per shard and pushed, 12 bytes a key, and added on the shards), and neighbouring
#: portions share most keys; so fewer, wider portions pay. Measured on a quiet box (issue 29, 2 workers,
#: L-BFGS, 10 iterations): 2^20 parameters 0.144 s/iter with 8 portions against 0.124 with 4; 2^24 0.71
#: against 0.48. 5 gives 4 portions (the floor of two a replica) on those sets.
SPARSE_NONZERO_WORK = 5
#: Whether a dense model on one shard has that shard hand out the work calls with the parameters
#: (:meth:`storage.ShardActor.hand_out`) rather than every replica fetching and pushing by itself; off
#: only to measure the difference (benchmarks) and to test the other path.
HAND_OUT = True


@dataclass(frozen=True, kw_only=True)
class SandblasterOptions:
    """Every option of :func:`minimize`, validated: the one definition of their types, defaults and bounds.

    :func:`minimize`'s keywords take their defaults from here, the REST service's ``SandblasterJobOptions``
    is made from the fields declared with ``rest=True`` (:func:`distbelief.options.rest_model`), and
    :func:`minimize`'s docstring explains each at length.

    Examples
    --------
    >>> SandblasterOptions(method="cg", restart_every=5).restart_every
    5
    >>> SandblasterOptions(maxls=0)
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: option maxls=0 is invalid: expected an int >= 1
    """

    method: Method = option("lbfgs")
    l2: float = option(0.0, ge=0, rest=True, rest_le=1e6, doc="L2 strength")
    l1: float = option(0.0, ge=0, rest=True, rest_le=1e6, doc="L1 strength (sandblaster-owlqn only)")
    l1_exclude: tuple[tuple[int, int], ...] = option((), check=False)
    shards: int | None = option(None, ge=1, rest=True, rest_le=REST_MAX_ACTORS)
    replicas: int | None = option(None, ge=1, rest=True, rest_le=REST_MAX_ACTORS)
    partitions: int = option(
        1, ge=1, rest=True, rest_le=REST_MAX_ACTORS, doc=PARTITIONS_DOC,
        expected="an int >= 1 (partition actors per model replica; 1: the whole model in one replica)",
    )  # fmt: skip
    history: int = option(10, ge=1, le=1000, rest=True, doc="L-BFGS memory m")
    history_dtype: HistoryDtype = option(
        "auto",
        rest=True,
        doc="how the shards store the L-BFGS pairs (float64 arithmetic either way): 'auto' (default) takes "
        "float32 only when a float64 history would not fit a shard's memory",
    )
    gtol: float = option(1e-5, ge=0, rest=True)
    ftol: float = option(LBFGSB_FTOL, ge=0, rest=True)
    maxiter: int = option(15000, ge=1, rest=True, rest_le=REST_MAX_ITER)
    maxfev: int = option(15000, ge=1, rest=True, rest_le=REST_MAX_ITER)
    maxls: int = option(20, ge=1)
    portions: int | None = option(None, ge=1, rest=True, rest_le=100_000)
    push_every: int = option(4, ge=1, rest=True, rest_le=100_000)
    backups: bool = option(True, rest=True)
    in_flight: int = option(2, ge=1)
    slowdown: dict[int, float] = option(factory=dict, check=False)
    shard_workers: tuple[str, ...] | None = option(None, check=False)
    replica_workers: tuple[str, ...] | None = option(None, check=False)
    step: float = option(1.0, gt=0)
    restart_every: int | None = option(None, ge=1)
    seed: int | None = option(0, ge=0, rest=True, rest_le=2**32 - 1)
    checkpoint_every: int = option(
        0, ge=0, rest=True, rest_le=REST_MAX_ITER, expected="an int >= 0 (0: never)",
        doc="0: never; default from the server settings",
    )  # fmt: skip
    resume: bool = option(False)
    communication: Communication = option("auto")
    shard_memory: int | str | None = option("auto", check=False)
    local: bool = option(False)

    def __post_init__(self) -> None:
        # Sequences as the tuples (and a dict) the fields hold; anything else stays for the checks to refuse.
        if _are_ranges(self.l1_exclude):
            object.__setattr__(self, "l1_exclude", tuple(tuple(r) for r in self.l1_exclude))
        for name in ("shard_workers", "replica_workers"):
            object.__setattr__(self, name, worker_tuple(getattr(self, name)) or None)
        object.__setattr__(self, "slowdown", dict(self.slowdown or {}))
        check_fields(self)
        check_option(
            _are_ranges(self.l1_exclude),
            "l1_exclude",
            self.l1_exclude,
            "ranges (start, stop) of parameters with 0 <= start < stop",
        )
        if self.l1 > 0 and self.method != "owlqn":
            raise InvalidOptionError(
                f"l1={self.l1!r} makes F nonsmooth, which method={self.method!r} cannot minimize; "
                'use method="owlqn" (L1 / elastic-net L-BFGS)'
            )
        if self.partitions > 1:
            if self.communication == "sparse":
                raise InvalidOptionError(
                    f'communication="sparse" is not supported with partitions={self.partitions}: a partition '
                    'fetches its whole parameter slice (use communication="dense" or "auto")'
                )
            if self.slowdown:
                raise InvalidOptionError(
                    f"slowdown is not supported with partitions={self.partitions} (fault injection slows an "
                    "unpartitioned replica); leave it empty"
                )
            if self.shards is not None and self.shards % self.partitions:
                raise InvalidOptionError(
                    f"shards={self.shards} with partitions={self.partitions}: the shards are aligned to the "
                    "partitions, so give a multiple of partitions (or None: one shard per partition)"
                )
        if self.local:
            # In this process there are no shards, replicas, portions or checkpoints to set.
            cluster_only: dict[str, object] = {
                "shards": None, "replicas": None, "portions": None, "slowdown": {}, "shard_workers": None,
                "replica_workers": None, "checkpoint_every": 0, "resume": False, "partitions": 1,
            }  # fmt: skip
            for name, default in cluster_only.items():
                if getattr(self, name) != default:
                    raise InvalidOptionError(
                        f"{name}={getattr(self, name)!r} has no meaning with local=True (a run in this "
                        f"process, no cluster); leave it at {default!r} or use local=False"
                    )
        for r, factor in self.slowdown.items():
            check_option(factor >= 1.0, f"slowdown[{r}]", factor, "a factor >= 1")
        for name in ("shard_workers", "replica_workers"):
            workers = getattr(self, name)
            check_option(
                workers is None or (isinstance(workers, tuple) and all(isinstance(w, str) for w in workers)),
                name,
                workers,
                "None or a list of worker addresses",
            )
        check_option(
            self.shard_memory in (None, "auto")
            or (
                isinstance(self.shard_memory, int)
                and not isinstance(self.shard_memory, bool)
                and self.shard_memory >= 0
            ),
            "shard_memory",
            self.shard_memory,
            "bytes per shard (an int >= 0), 'auto' or None",
        )


def auto_history_dtype(method: str, m: int, sizes: Sequence[int], budgets: Sequence[int | None]) -> str:
    """``history_dtype="auto"``: ``"float32"`` when some shard's budget cannot hold a float64 history beside
    the run's other vectors, else ``"float64"``.

    A shard of ``size`` parameters keeps :data:`WORKING_VECTORS` vectors and ``2(m + 1)`` history slots;
    at 8 bytes an element all of them must fit its memory budget (``None``: no limit). When they do not,
    the history would spill to disk and be streamed twice an iteration (issue 29 measured 489 GB of spill
    reads at 2^27): float32 halves that, or keeps it in RAM. When they do, float64 keeps the run bit for bit
    what it was (and its agreement with SciPy's L-BFGS-B to ~1e-9, which a float32 history's rounding of
    the pairs, ~6e-8 relative, need not keep). CG and gradient descent keep no history: float64.

    Examples
    --------
    >>> auto_history_dtype("lbfgs", 10, [1000, 1000], [None, None])
    'float64'
    >>> auto_history_dtype("lbfgs", 10, [1 << 26], [3 << 30])      # 28 vectors of 512 MiB: 14 GiB > 3 GiB
    'float32'
    """
    working = WORKING_VECTORS.get(method)
    if working is None:
        return "float64"
    need = (working + 2 * (m + 1)) * 8
    fits = [budget is None or need * size <= budget for size, budget in zip(sizes, budgets, strict=True)]
    return "float64" if all(fits) else "float32"


def _history_dtype(opts: SandblasterOptions, ps: ParameterServer, resumed: dict[str, Any] | None) -> str:
    """The run's history dtype: the option's, or for ``"auto"`` the checkpoint's when resuming (a run keeps
    its dtype), else :func:`auto_history_dtype` of the shards' budgets (one round trip, before the run)."""
    if opts.history_dtype != "auto":
        return opts.history_dtype
    if resumed is not None:
        return str(resumed.get("history_dtype", "float64"))
    if opts.method not in WORKING_VECTORS:
        return "float64"
    budgets = [report["budget"] for report in ps.memory()]
    sizes = [hi - lo for lo, hi in ps.layout.ranges()]
    return auto_history_dtype(opts.method, opts.history, sizes, budgets)


def _are_ranges(ranges: object) -> bool:
    """Whether ``ranges`` is a sequence of pairs of ints ``(start, stop)`` with ``0 <= start < stop``."""
    try:
        pairs = [tuple(r) for r in ranges]  # type: ignore[attr-defined]
    except TypeError:
        return False
    return all(
        len(p) == 2
        and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in p)
        and 0 <= p[0] < p[1]
        for p in pairs
    )


@dataclass
class OptimizeResult(FittedMixin):
    """What :func:`minimize` found. Not converging is reported here (``success=False``), not raised.

    ``predict(X)`` / ``predict_proba(X)`` go through ``model`` at ``x``; ``to_zarr(url)`` saves the result
    with the model's spec and ``OptimizeResult.from_zarr(url)`` loads it (see ``models._fitted``).

    Attributes
    ----------
    x : numpy.ndarray
        The solution (gathered from the shards once, at the end).
    fun : float
        ``F(x)``.
    grad_norm : float
        ``max|grad F(x)|``.
    nit, nfev : int
        Iterations and evaluations of F and its gradient (the initial one included).
    success : bool
        Whether a convergence test stopped the run.
    status : int
        0 converged, 1 iteration or evaluation limit, 2 line search or direction failure, 3 stopped by the
        callback.
    message : str
        Why the run stopped.
    history : xarray.Dataset
        One row per iteration: objective, grad_norm, step, nfev, wall_time, portions, backups_issued,
        backups_won, recomputed, fetches (parameter fetches by replicas), round_trips (coordinator to
        shards), time_gradient, time_shard_ops, time_coordinator.
    store : str
        Where the parameter server's checkpoints are.
    model : Model
        The model that was minimized (set by :func:`minimize`).
    """

    x: np.ndarray
    fun: float
    grad_norm: float
    nit: int
    nfev: int
    success: bool
    status: int
    message: str
    history: xr.Dataset
    store: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    model: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return (
            f"OptimizeResult(fun={self.fun:.10g}, nit={self.nit}, nfev={self.nfev}, success={self.success}, "
            f"message={self.message!r})"
        )


def _result(
    state: RunState, x: np.ndarray, success: bool, message: str, store: str, stats: dict[str, Any]
) -> OptimizeResult:
    """What a run that ended in ``state`` at ``x`` found (``status`` from ``message``, see
    :class:`OptimizeResult`)."""
    status = 0 if success else 1 if "maximum" in message else 3 if "callback" in message else 2
    return OptimizeResult(
        x=x, fun=state.f, grad_norm=state.g_inf, nit=state.nit, nfev=state.nfev, success=success,
        status=status, message=message, history=_history(state.records), store=store, stats=stats,
    )  # fmt: skip


#: Every option at its default: :func:`minimize`'s keywords take theirs from here (written once).
_DEFAULT = SandblasterOptions()


@refuse_unknown
def minimize(
    model: Any,
    data: Dataset | tuple[np.ndarray, np.ndarray],
    *,
    x0: np.ndarray | None = None,
    client: Client | str | None = None,
    store: str | os.PathLike[str] | None = None,
    callback: Callable[[IterationRecord], None] | None = None,
    method: Method = _DEFAULT.method,
    l2: float = _DEFAULT.l2,
    l1: float = _DEFAULT.l1,
    l1_exclude: Sequence[tuple[int, int]] = _DEFAULT.l1_exclude,
    shards: int | None = _DEFAULT.shards,
    replicas: int | None = _DEFAULT.replicas,
    partitions: int = _DEFAULT.partitions,
    history: int = _DEFAULT.history,
    history_dtype: HistoryDtype = _DEFAULT.history_dtype,
    gtol: float = _DEFAULT.gtol,
    ftol: float = _DEFAULT.ftol,
    maxiter: int = _DEFAULT.maxiter,
    maxfev: int = _DEFAULT.maxfev,
    maxls: int = _DEFAULT.maxls,
    portions: int | None = _DEFAULT.portions,
    push_every: int = _DEFAULT.push_every,
    backups: bool = _DEFAULT.backups,
    in_flight: int = _DEFAULT.in_flight,
    slowdown: Mapping[int, float] = _DEFAULT.slowdown,
    shard_workers: Sequence[str] | None = _DEFAULT.shard_workers,
    replica_workers: Sequence[str] | None = _DEFAULT.replica_workers,
    step: float = _DEFAULT.step,
    restart_every: int | None = _DEFAULT.restart_every,
    seed: int | None = _DEFAULT.seed,
    checkpoint_every: int = _DEFAULT.checkpoint_every,
    resume: bool = _DEFAULT.resume,
    communication: Communication = _DEFAULT.communication,
    shard_memory: int | str | None = _DEFAULT.shard_memory,
    local: bool = _DEFAULT.local,
) -> OptimizeResult:
    """Minimize ``F(w) = (1/N) sum_i loss_i(w) + (l2/2)||w||^2 + l1 ||w||_1`` with Sandblaster on Dask.

    The coordinator (this process) holds scalars only; ``x``, the gradient, the direction and the L-BFGS
    history live on parameter-server shards; replicas compute the data term portion by portion.

    Parameters
    ----------
    model : Model
        Anything with ``n_params``, ``init_params(seed)`` and ``loss_and_grad(w, X, y)`` (sum over rows).
    data : storage.Dataset or (X, y)
        Training rows; arrays are first written to a dataset in ``store``.
    method : {"lbfgs", "cg", "gd", "owlqn"}
        Vector-free L-BFGS (default), Polak-Ribiere+ CG, gradient descent with backtracking, or vector-free
        OWL-QN (L1 / elastic net, Andrew & Gao 2007; the only method that takes ``l1 > 0``).
    x0 : numpy.ndarray, optional
        Starting point (default ``model.init_params(seed)``).
    l2 : float
        L2 regularization, applied on the shards.
    l1 : float
        L1 regularization (``method="owlqn"``; with ``l2`` the elastic net). The history then has a column
        ``nnz``, the nonzero count of each iterate, and ``grad_norm`` is the pseudo-gradient's inf-norm.
    l1_exclude : sequence of (start, stop)
        Ranges of ``w`` the L1 term leaves out (e.g. intercepts, which scikit-learn does not penalize):
        ``F`` then has ``l1 * sum |w_i|`` over the other parameters only.
    shards, replicas : int, optional
        Number of parameter-server shards and model replicas (default: one of each per worker).
    history : int
        L-BFGS memory ``m``.
    gtol, ftol, maxiter, maxfev : float, float, int, int
        Stop when ``max|g_i| <= gtol``, when the relative decrease of F is ``<= ftol`` (as SciPy's
        L-BFGS-B), or after ``maxiter`` iterations / ``maxfev`` evaluations.
    maxls : int
        Most evaluations of ``F`` one line search may take (every method) before the iteration fails with
        a line search failure (``status=2``).
    client : distributed.Client or str, optional
        The cluster: a ``Client`` (the default one or not), or a scheduler address such as
        ``'tcp://10.0.0.1:8786'``. ``None``: the default Dask client if one runs, else this process's one
        embedded ``LocalCluster`` (started on first use, kept until exit).
    store : str or path, optional
        Directory or URL for the parameter server's checkpoints (default: a temporary directory).
    callback : callable, optional
        Called with an :class:`IterationRecord` after every iteration; raising ``StopIteration`` stops
        the run cleanly (``status=3``).
    portions : int, optional
        Portions per evaluation (default: the dataset's portions).
    push_every : int
        Replicas push their accumulated gradient every this many portions.
    backups : bool
        Give idle replicas backup copies of outstanding portions at the end of a batch.
    in_flight : int
        Portions each replica is given ahead (queued behind the one it computes), so it never waits for the
        coordinator between two; 1: one at a time.
    slowdown : dict, optional
        Fault injection: ``{replica: factor}`` makes a replica ``factor`` times slower.
    shard_workers, replica_workers : list of str, optional
        Worker addresses to place shards and replicas on (default: all workers).
    step : float
        Gradient descent (``method="gd"``): the first iteration's trial step along ``-g`` (the later ones
        start at the Barzilai-Borwein step).
    restart_every : int, optional
        CG (``method="cg"``): restart from steepest descent every this many iterations (default: ``n``,
        the number of parameters; 1 is steepest descent with CG's line search).
    seed : int, optional
        Seed of ``model.init_params`` when ``x0`` is not given.
    checkpoint_every : int
        Save ``x``, the gradient, the method's history and the run's scalars to ``store`` every this many
        iterations (0: never). A shard lost with its worker is then rebuilt, every shard is rolled back to
        the checkpoint, and the run goes on from there.
    resume : bool
        Continue the run checkpointed in ``store`` (same model, data and method) instead of starting anew.
    communication : {"auto", "dense", "sparse"}
        How replicas move parameters and gradients. ``"sparse"``: each pulls only the parameters its
        portions' rows touch and pushes only those gradient entries, as key-value pairs per shard
        (ps-lite's pull/push; needs CSR data and a linear model); the iterates are those of ``"dense"``
        (whole slices). ``"auto"`` (default): sparse for sparse data and a linear model. Bytes moved are in
        ``stats["bytes_per_evaluation"]``.
    shard_memory : int, "auto" or None
        Bytes of vectors each shard keeps in RAM; colder ones (the L-BFGS history first) spill to local
        files and are streamed in chunks. ``"auto"``: a share of the worker's ``memory_limit``; ``None``:
        no limit. See ``ParameterServer.create(memory_budget=...)``.
    partitions : int
        Model parallelism (paper, section 3): every replica is split into this many partition actors on
        different workers, each holding only its parameter slice, fetching from and pushing to only the
        shards that hold it, and exchanging only the activations that cross its boundaries
        (``models.MLP``, ``models.LocallyConnected`` and ``models.LocallyConnected2D``, dense rows). The
        iterates are those of ``partitions=1`` up to rounding (~1e-13: a partitioned pass adds partial
        products in another order). A partition whose worker dies is rebuilt on a live one.
        ``stats["rebuilt_partitions"]`` lists them.

    local : bool
        Run in this process, without a cluster: the same method and kernels on numpy vectors
        (:class:`~sandblaster._space.InProcessSpace`), ``F`` from :func:`models.objective` on ``data``
        given as ``(X, y)`` arrays (dense or CSR). For problems whose gradient costs milliseconds, where a
        cluster's round trips (~2-11 ms each) would cost more than the work; the estimators choose it for
        small data given without a ``client``. ``client``, ``store``, shards, replicas, portions,
        partitions and checkpoints have no meaning then and are refused.
    history_dtype : {"auto", "float64", "float32"}
        How the shards store the L-BFGS (and OWL-QN) pairs ``s_i``, ``y_i``: in RAM, in spill files and in
        checkpoints. The arithmetic is float64 either way: each pair is formed in float64 and rounded once
        when stored, the dot products accumulate in float64 over the stored values and the direction is a
        float64 combination of them. ``"float32"`` halves the history's memory and the bytes its passes
        read (the history is most of a wide model's vectors: 22 of 28 at ``history=10``); the iterates
        differ from float64's by that rounding (``benchmarks/history_dtype.py``): on the peer problems
        the same iteration counts and final objectives within 1e-10, on the ill-conditioned scale set
        within 5e-8 after 12 iterations, but long runs there drift apart as they do under any
        perturbation (float64 with ``l2`` changed by 1e-12 too: ~1e-3 at a few hundred iterations). ``"auto"``
        (default): float32 only when a float64 history would not fit a shard's memory budget
        (:func:`auto_history_dtype`; ``local=True``: float64), so small and medium runs stay bit for bit as
        they were. ``stats["history_dtype"]`` says which one ran. CG and GD keep no history.

    Returns
    -------
    OptimizeResult

    Examples
    --------
    >>> from distbelief.models import Logistic
    >>> from distbelief.storage import load_digits
    >>> X, y = load_digits()
    >>> res = minimize(Logistic(64), (X, (y == 0).astype(float)), l2=1e-3)   # doctest: +SKIP
    >>> res.success                                                           # doctest: +SKIP
    True
    """
    # Every keyword after callback is an option: their one definition (and check) is SandblasterOptions.
    opts = options_of(SandblasterOptions, locals())
    for a, b in opts.l1_exclude:
        if b > model.n_params:
            raise InvalidOptionError(
                f"l1_exclude range ({a}, {b}) ends past the model's {model.n_params} parameters"
            )
    if local:
        if client is not None or store is not None or not isinstance(data, tuple):
            raise InvalidOptionError(
                "local=True runs in this process on rows in memory: give data as (X, y) arrays, and no "
                "client= or store= (or use local=False for the cluster)"
            )
        result = _run_local(model, data, start_vector(model, x0, seed), opts, callback)
        result.model = model
        return result
    if partitions > 1:
        # Refused before anything is written: a model with no partitioned form, too many partitions, rows
        # the partition passes cannot read.
        check_partitioned(model, data, partitions)
    if resume and store is None:
        raise InvalidOptionError("resume=True needs the store= of the run to continue")
    x_start = start_vector(model, x0, seed)
    with run_store(store, "sandblaster-") as root, embedded_client(client) as c:
        result = _run(model, as_dataset(data, root), x_start, c, root, opts, callback)
        result.model = model
        return result


@contextlib.contextmanager
def open_session(
    model: Any,
    dataset: Dataset,
    client: Client,
    store: str,
    opts: SandblasterOptions,
    *,
    n: int,
    x0: np.ndarray | None = None,
) -> Iterator[Coordinator]:
    """Shards, replicas and scheduler for one run, wired into a :class:`Coordinator`; torn down on exit.

    New shards start with ``x0`` as the coordinator's ``x`` when it is given (``opts.resume`` restores
    every vector from the store instead).
    """
    dataset.check_model(model)
    workers = worker_addresses(client, required=True)
    shard_workers = list(opts.shard_workers or workers)
    replica_workers = list(opts.replica_workers or workers)
    # Sharding pays once a vector op costs more than the extra round trip per shard (~1-2 ms here): below
    # ~128 Ki parameters one shard is faster.
    n_shards = min(opts.shards or (len(shard_workers) if n >= SHARD_MIN_PARAMS else 1), n)
    n_replicas = opts.replicas or len(replica_workers)
    n_portions_wanted = opts.portions
    if n_portions_wanted is None:
        # Every portion costs about one round trip: make each carry >= ~10 ms of gradient work
        # (PORTION_WORK row-parameter products), but give every replica a few, for balance and backups.
        # A batch smaller than one replica's worth of work goes to one replica as one portion: splitting
        # it would only add messages.
        if getattr(dataset, "layout", "dense") == "csr" and dataset.n_rows:
            nonzeros = int(getattr(dataset, "nnz", dataset.n_rows * dataset.n_features))
            per_row = nonzeros / dataset.n_rows * (n / max(1, dataset.n_features)) * SPARSE_NONZERO_WORK
        else:
            per_row = n
        by_work = math.ceil(dataset.n_rows * per_row / PORTION_WORK)
        if by_work >= n_replicas:
            # A multiple of the replica count, so every replica starts with an equal share.
            by_work = max(2 * n_replicas, math.ceil(by_work / n_replicas) * n_replicas)
        n_portions_wanted = min(dataset.n_portions, by_work)
    if n_portions_wanted != dataset.n_portions:
        rows = math.ceil(dataset.n_rows / n_portions_wanted)
        # Portions are whole zarr chunks: round up to the chunk grid (the count may then be a bit lower).
        rows = math.ceil(rows / dataset.chunk_rows) * dataset.chunk_rows
        dataset = dataset.with_portion_rows(rows)
    n_portions = dataset.n_portions
    sparse = use_sparse(opts.communication, model, getattr(dataset, "layout", "dense") == "csr")
    params = str(Path(store) / "params")
    if opts.partitions > 1:
        with _partitioned_session(
            model, dataset, client, opts, params, shard_workers, replica_workers, n_replicas, n_portions, x0
        ) as coord:
            yield coord
        return
    replica_futures: list[Any] = []
    replicas: list[tuple[Any, Any]] = []
    ps: ParameterServer | None = None
    try:
        # The replicas first, told their shards only once those exist (attach): each is built (its rows
        # found in its worker's memory, or read) while the client creates the shards, instead of after.
        # Measured on 200,000 x 500: 13 ms for the shards, then 13 ms for the replicas, one after the other.
        blocks = PortionScheduler.initial_blocks(n_portions, n_replicas)
        for r in range(n_replicas):
            replica_futures.append(
                client.submit(
                    Replica,
                    r,
                    model,
                    dataset,
                    None,
                    blocks[r],
                    opts.slowdown.get(r, 1.0),
                    "sparse" if sparse else "dense",
                    actor=True,
                    workers=[replica_workers[r % len(replica_workers)]],
                    allow_other_workers=False,
                    pure=False,
                )
            )
        if opts.resume:
            ps = _checkpointed(client, params, shard_workers, opts, n)
        else:
            ps = ParameterServer.create(
                client,
                n,
                shards=n_shards,
                store=params,
                workers=shard_workers,
                overwrite=True,
                vectors=None if x0 is None else {RunState.x: x0},
                memory_budget=opts.shard_memory,
            )
        shard_map = ps.shard_map()
        replicas = [(f.result(), f) for f in replica_futures]
        attached = [actor.attach(shard_map) for actor, _ in replicas]
        held = [answer.result()["cached_portions"] for answer in attached]
        scheduler = PortionScheduler(
            client,
            replicas,
            n_portions,
            held=held,
            push_every=opts.push_every,
            backups=opts.backups,
            in_flight=opts.in_flight,
            # One shard holds every parameter: it hands the work out with them (PortionScheduler._send).
            hand_out=shard_map.actors[0] if HAND_OUT and ps.shards == 1 and not sparse else None,
        )
        yield Coordinator(
            ps,
            scheduler,
            n_rows=dataset.n_rows,
            l2=opts.l2,
            checkpoint_every=opts.checkpoint_every,
            method=opts.method,
            # The replicas push every portion's own gradient; the shards add them in portion order: the
            # same bits whichever replica computed which portion, at an add per element (issue 29).
            ordered_sums=True,
        )
    finally:
        for actor, _ in replicas:
            with contextlib.suppress(Exception):
                actor.close()  # stops its compute thread; not waited for
        for f in replica_futures:
            with contextlib.suppress(Exception):
                f.release()
        if ps is not None:
            ps.close()


def _checkpointed(
    client: Client, params: str, workers: Sequence[str], opts: SandblasterOptions, n: int
) -> ParameterServer:
    """The shards of the checkpointed run at ``params`` (``resume=True``); it must have ``n`` parameters."""
    ps = ParameterServer.open(client, store=params, workers=workers, memory_budget=opts.shard_memory)
    if ps.n != n or not ps.checkpoint_id:
        ps.close()
        raise InvalidOptionError(
            f"{params!r} holds no checkpoint of a run with {n} parameters; "
            "start runs with checkpoint_every=k to be able to resume them"
        )
    return ps


@contextlib.contextmanager
def _partitioned_session(
    model: Any,
    dataset: Dataset,
    client: Client,
    opts: SandblasterOptions,
    params: str,
    shard_workers: Sequence[str],
    replica_workers: Sequence[str],
    n_replicas: int,
    n_portions: int,
    x0: np.ndarray | None,
) -> Iterator[Coordinator]:
    """:func:`open_session` with every replica split into ``opts.partitions`` partition actors
    (:mod:`sandblaster._partitioned`); the shards are aligned to the partitions and hold ``x[plan.perm]``."""
    plan = check_partitioned(model, dataset, opts.partitions)
    K = plan.partitions
    replicas: list[tuple[Any, Any]] = []
    scheduler: PartitionedScheduler | None = None
    ps: ParameterServer | None = None
    try:
        if opts.resume:
            ps = _checkpointed(client, params, shard_workers, opts, plan.perm.size)
        else:
            layout = partition_layout(plan.bounds, shards_per_partition=(opts.shards or K) // K)
            owned = partition_shards(layout, plan.bounds)
            ps = ParameterServer.create(
                client, layout.n, store=params, overwrite=True, layout=layout,
                workers=[shard_workers[k % len(shard_workers)] for k in range(K) for _ in owned[k]],
                vectors=None if x0 is None else {RunState.x: np.asarray(x0)[plan.perm]},
                memory_budget=opts.shard_memory,
            )  # fmt: skip
        owned = partition_shards(ps.layout, plan.bounds)
        shard_map = ps.shard_map()
        replicas = start_replicas(
            client, plan, dataset, shard_map, owned, replica_workers, n_replicas, ps.timeout
        )
        scheduler = PartitionedScheduler(
            client, replicas, n_portions, plan=plan, dataset=dataset, shard_map=shard_map, owned=owned,
            workers=replica_workers, call_timeout=ps.timeout, push_every=opts.push_every,
            backups=opts.backups, in_flight=opts.in_flight,
        )  # fmt: skip
        coord = Coordinator(
            ps, scheduler, n_rows=dataset.n_rows, l2=opts.l2, checkpoint_every=opts.checkpoint_every,
            method=opts.method,
        )  # fmt: skip
        coord.perm = plan.perm
        yield coord
    finally:
        for head, group in scheduler.replicas if scheduler is not None else replicas:
            with contextlib.suppress(Exception):
                head.close()
            group.release()
        if ps is not None:
            ps.close()


def _run(
    model: Any,
    dataset: Dataset,
    x_start: np.ndarray,
    client: Client,
    store: str,
    opts: SandblasterOptions,
    callback: Callable[[IterationRecord], None] | None,
) -> OptimizeResult:
    t_start = time.perf_counter()
    n = x_start.size
    with open_session(model, dataset, client, store, opts, n=n, x0=x_start) as coord:
        ps, scheduler = coord.ps, coord.scheduler
        resume_meta: dict[str, Any] | None = None
        if opts.resume:
            resume_meta = coord.resume_from(ps.checkpoint_meta)
        opts = replace(opts, history_dtype=_history_dtype(opts, ps, resume_meta))  # type: ignore[arg-type]
        ps.stats.reset()
        attempt: dict[str, Any] = {"resume": resume_meta}

        def run_method() -> tuple[bool, str]:
            if attempt["resume"] is None:
                coord.start()
            return _run_method(coord, opts, n, callback, attempt["resume"])

        def roll_back(lost: ShardLostError) -> None:
            # A shard came back from the last checkpoint: bring the others back to it too, go on.
            ps.rollback()
            scheduler.refresh_shards(ps.shard_map())
            attempt["resume"] = coord.resume_from(ps.checkpoint_meta)

        recovery = ShardRecovery(ps, max_recoveries=MAX_RECOVERIES, on_restored=roll_back)
        try:
            success, message = recovery.run(run_method)
        except StopIteration:
            success, message = False, "stopped by the callback"
        # Counted before the final gather: during the run the coordinator only ever received scalars.
        stats = {
            "round_trips": ps.stats.round_trips,
            "max_values_received": ps.stats.max_received,
            "values_received": ps.stats.values_received,
            "lost_replicas": list(scheduler.lost_replicas),
            "shards": ps.shards,
            "replicas": len(scheduler.replicas),
            "portions": scheduler.n_portions,
            "recoveries": recovery.recoveries,
            "portions_per_replica": list(scheduler.portions_done),
            "history_dtype": opts.history_dtype,
        }
        stats.update(_bytes_moved(scheduler.replicas, coord.state.nfev))
        x = ps.gather(coord.state.x)
        if coord.perm is not None:
            # The shards hold the partition-major vector (section 3, Figure 2): back to the model's layout.
            x_model = np.empty_like(x)
            x_model[coord.perm] = x
            x = x_model
            stats["partitions"] = opts.partitions
            stats["rebuilt_partitions"] = list(getattr(scheduler, "rebuilt", []))
        stats["wall_s"] = time.perf_counter() - t_start
        return _result(coord.state, x, success, message, ps.url, stats)


def _run_local(
    model: Any,
    data: tuple[Any, Any],
    x_start: np.ndarray,
    opts: SandblasterOptions,
    callback: Callable[[IterationRecord], None] | None,
) -> OptimizeResult:
    """The method of ``opts`` in an :class:`InProcessSpace` on the rows in memory (``minimize(local=True)``):
    the same code and kernels as on the shards, ``F`` from :func:`models.objective`, no Dask at all."""
    t_start = time.perf_counter()
    X, y = data
    n_features = getattr(model, "n_features", None)
    if n_features is not None and np.ndim(X) == 2 and X.shape[1] != n_features:
        raise DatasetError(f"the model expects {n_features} features, the data has {X.shape[1]}")
    l2 = opts.l2

    def fun_and_grad(w: np.ndarray) -> tuple[float, np.ndarray]:
        return objective(model, w, X, y, l2=l2)

    space = InProcessSpace(fun_and_grad, x_start)
    space.start()
    if opts.history_dtype == "auto":
        opts = replace(opts, history_dtype="float64")  # no shard budget: the history is in this process
    try:
        success, message = _run_method(space, opts, x_start.size, callback, None)
    except StopIteration:
        success, message = False, "stopped by the callback"
    stats = {"local": True, "wall_s": time.perf_counter() - t_start, "history_dtype": opts.history_dtype}
    return _result(space.state, space.vector(space.state.x).copy(), success, message, "", stats)


def _run_method(
    coord: ParameterSpace,
    opts: SandblasterOptions,
    n: int,
    callback: Callable[[IterationRecord], None] | None,
    resume: dict[str, Any] | None,
) -> tuple[bool, str]:
    gtol, ftol, maxiter, maxfev = opts.gtol, opts.ftol, opts.maxiter, opts.maxfev
    dtype = opts.history_dtype
    if opts.method == "lbfgs":
        return _minimize_lbfgs(
            coord, m=opts.history, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev, maxls=opts.maxls,
            callback=callback, resume=resume, history_dtype=dtype,
        )  # fmt: skip
    if opts.method == "owlqn":
        return _minimize_owlqn(
            coord, l1=opts.l1, m=opts.history, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev,
            maxls=opts.maxls, callback=callback, resume=resume, l1_exclude=opts.l1_exclude,
            history_dtype=dtype,
        )  # fmt: skip
    if opts.method == "cg":
        return _minimize_cg(
            coord, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev, maxls=opts.maxls,
            restart_every=opts.restart_every or n, callback=callback,
        )  # fmt: skip
    return _minimize_gd(
        coord, gtol=gtol, ftol=ftol, maxiter=maxiter, maxfev=maxfev, step=opts.step, maxls=opts.maxls,
        callback=callback,
    )  # fmt: skip


def _bytes_moved(replicas: Sequence[Any], nfev: int) -> dict[str, Any]:
    """Parameter and gradient bytes the replicas moved (keys included), in total and per evaluation, and
    the replicas' seconds summed (``replica_compute_s``: gradient work; ``replica_fetch_s`` and
    ``replica_push_s``: waiting for the shards' answers), and the work calls the shard handed out with the
    parameters (``handed_out_calls``)."""
    pulled = pushed = handed_out = 0
    mode = "dense"
    seconds = {"compute_s": 0.0, "read_s": 0.0, "fetch_s": 0.0, "push_s": 0.0}
    for replica in replicas:
        actor = replica[0] if isinstance(replica, tuple) else replica
        with contextlib.suppress(Exception):  # a lost replica's bytes are not known
            got = actor.stats().result(timeout=10)
            pulled += int(got.get("bytes_pulled", 0))
            pushed += int(got.get("bytes_pushed", 0))
            handed_out += int(got.get("handed_out", 0))
            mode = "sparse" if got.get("sparse") else mode
            for key in seconds:
                seconds[key] += float(got.get(key, 0.0))
    per = max(1, nfev)
    return {
        "communication": mode,
        "bytes_pulled": pulled,
        "bytes_pushed": pushed,
        "bytes_per_evaluation": (pulled + pushed) / per,
        "handed_out_calls": handed_out,
        **{f"replica_{key}": value for key, value in seconds.items()},
    }


def _history(records: list[IterationRecord]) -> xr.Dataset:
    if not records:
        return xr.Dataset(coords={"iteration": np.arange(0)})
    # Field by field (dataclasses.asdict deep-copies every record: 0.1 ms each, a tenth of a small fit).
    names = [f.name for f in fields(IterationRecord)]
    # ``nnz`` is OWL-QN's column only.
    columns = {
        k: np.array([getattr(r, k) for r in records])
        for k in names
        if k != "iteration" and not (k == "nnz" and getattr(records[0], k) is None)
    }
    return xr.Dataset(
        {k: ("iteration", v) for k, v in columns.items()},
        coords={"iteration": np.array([r.iteration for r in records])},
    )
