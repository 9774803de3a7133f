"""The parameter space the batch methods run in: named vectors, a few ops on them, and trial evaluations.

DistBelief's Sandblaster (section 4.2) runs every batch method as "a sequence of scalar-vector products and
vector-vector inner products" that the parameter-server shards carry out, while the coordinator keeps only
scalars. :class:`ParameterSpace` is that contract. L-BFGS (:mod:`sandblaster._vlbfgs`), CG
(:mod:`sandblaster._cg`) and gradient descent (:mod:`sandblaster._gd`) are each written once against it,
as SciPy has one private ``_minimize_*`` per method, and run in either implementation:

* :class:`InProcessSpace` holds the vectors in a dict of numpy arrays and evaluates a callable
  ``fun(x) -> (f, g)``: ``minimize(local=True)``, and the tests' oracle of the distributed runs;
* :class:`sandblaster._coordinator.Coordinator` holds them on the shards and evaluates with the replicas.

An op is a tuple in the shards' language (:data:`distbelief.storage.OPS`): ``("dot", a, b)``,
``("dots", [(a, b), ...])``, ``("lincomb", out, coeffs, names)`` (``("lincomb", out, coeffs, names,
"float32")``: ``out`` stored as float32, the sum float64 rounded once), ``("copy", src, out)``,
``("norm_inf", name)``. :meth:`ParameterSpace.run` runs a list of them (one round trip on the shards).
:meth:`ParameterSpace.evaluate` forms a trial point ``x + t*d`` and evaluates F and its gradient there; it
takes ops to run before (``prefix_ops``) and after (``suffix_ops``) the evaluation, which is how the
sharded space fuses a method's ops into the evaluation's own messages (the prefix rides on the replicas'
parameter fetch, the suffix on their last push). A method that puts its ops there costs the coordinator
no round trip of its own; the in-process space simply runs them in order. :func:`wolfe_search` is the
strong Wolfe search (Moré & Thuente, as in L-BFGS-B) over a space with that fusing built in, shared by
L-BFGS and CG; :func:`accept_trial`, :func:`close_iteration` and :func:`stop_test` are the end of an
iteration every method shares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError, ProtocolError
from distbelief.storage.internal import kernels, l1_ops

from ._linesearch import (
    LineSearchResult,
    StrongWolfeLineSearch,
    relative_reduction_converged,
)

__all__ = [
    "Evaluation",
    "InProcessSpace",
    "IterationRecord",
    "Op",
    "ParameterSpace",
    "RunState",
    "Search",
    "accept_trial",
    "close_iteration",
    "other_buffer",
    "stop_test",
    "wolfe_search",
]

#: OWL-QN's ops (Andrew & Gao 2007), run with the shards' kernels (:mod:`storage._l1`).
_L1_OPS = ("pseudo_grad", "sign_align", "orthant", "project_orthant", "nnz", "norm1")

#: One vector op, in the shards' language: ``(name, *args)``.
Op = tuple[Any, ...]


class Evaluation(NamedTuple):
    """What one evaluation of F and its gradient at a trial point brings back (scalars only)."""

    #: ``F`` at the trial point.
    f: float
    #: ``grad F . direction`` at the trial point (``nan`` without a direction).
    gd: float
    #: ``max|grad F|`` at the trial point (not finite if the gradient holds NaN/inf).
    g_inf: float
    #: Results of the prefix ops, then of the suffix ops.
    extra: list[Any]


@dataclass
class IterationRecord:
    """One row of the run's history."""

    iteration: int
    objective: float
    grad_norm: float
    step: float
    nfev: int
    wall_time: float
    portions: int
    backups_issued: int
    backups_won: int
    recomputed: int
    fetches: int
    round_trips: int
    time_gradient: float
    time_shard_ops: float
    time_coordinator: float
    #: Portions read from the store during the iteration (not in a replica's memory yet).
    portions_read: int = 0
    #: Nonzero parameters at the iterate (OWL-QN only; ``None`` for the smooth methods).
    nnz: int | None = None


@dataclass
class RunState:
    """Where a run stands: the names of ``x`` and its gradient in the space, and scalars."""

    x: str = "xa"
    g: str = "ga"
    f: float = math.nan
    g_inf: float = math.nan
    nit: int = 0
    nfev: int = 0
    eval_id: int = 0
    records: list[IterationRecord] = field(default_factory=list)

    def to_meta(self) -> dict[str, Any]:
        """JSON-able form, saved with a checkpoint."""
        meta = {k: v for k, v in asdict(self).items() if k != "records"}
        meta["records"] = [asdict(r) for r in self.records]
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> RunState:
        """Inverse of :meth:`to_meta`."""
        fields = {k: meta[k] for k in ("x", "g", "f", "g_inf", "nit", "nfev", "eval_id")}
        return cls(**fields, records=[IterationRecord(**r) for r in meta.get("records", [])])


def other_buffer(name: str) -> str:
    """The other one of the two buffers of ``x`` (``xa``/``xb``) or of the gradient (``ga``/``gb``).

    A trial point goes into the buffer ``x`` is not in, so a rejected trial never overwrites ``x``.

    Examples
    --------
    >>> other_buffer("xa"), other_buffer("gb")
    ('xb', 'ga')
    """
    return {"xa": "xb", "xb": "xa", "ga": "gb", "gb": "ga"}[name]


def stop_test(
    state: RunState, f_old: float, *, gtol: float, ftol: float, maxiter: int
) -> tuple[bool, str] | None:
    """L-BFGS-B's stopping rules after an accepted step: ``(success, message)`` to stop, else ``None``.

    Stop on ``max|g_i| <= gtol``, on a relative decrease ``<= ftol`` from ``f_old`` to ``state.f``, or
    after ``maxiter`` iterations, tested in that order.

    Examples
    --------
    >>> stop_test(RunState(f=1.0, g_inf=1e-3, nit=3), 2.0, gtol=1e-5, ftol=1e-9, maxiter=3)
    (False, 'maximum number of iterations reached')
    """
    if state.g_inf <= gtol:
        return True, "gradient inf-norm <= gtol"
    if relative_reduction_converged(f_old, state.f, ftol=ftol):
        return True, "relative reduction of f <= ftol"
    if state.nit >= maxiter:
        return False, "maximum number of iterations reached"
    return None


def close_iteration(
    space: ParameterSpace,
    step: float,
    callback: Callable[[IterationRecord], None] | None,
    saved: list[str],
    extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    fields: dict[str, Any] | None = None,
) -> None:
    """Record the iteration just accepted, checkpoint it when due, and hand its record to ``callback``.

    A checkpoint holds the vectors ``saved`` (``x``, its gradient and the method's own) and ``extra``,
    the method's own scalars (or a function making them: called only when a checkpoint is due, as the
    L-BFGS history's snapshot costs the coordinator ~20-60 us an iteration). ``fields`` are the method's
    own columns of the record (OWL-QN's ``nnz``).
    """
    rec = space.end_iteration(step)
    for name, value in (fields or {}).items():
        setattr(rec, name, value)
    if space.checkpoint_due():
        space.checkpoint(saved, (extra() if callable(extra) else extra) or {})
    if callback is not None:
        callback(rec)


class Search(NamedTuple):
    """Outcome of :func:`wolfe_search`."""

    #: The line search's result; ``None`` when ``d`` was no descent direction or the budget ran out.
    result: LineSearchResult | None
    #: Whether the evaluation budget ran out.
    over_budget: bool
    #: ``phi'(0) = g.d``.
    dphi0: float
    #: The last trial (the accepted one when ``result.ok``).
    last: Evaluation


def wolfe_search(
    space: ParameterSpace,
    *,
    step: float,
    setup: Sequence[Op],
    speculate: Sequence[Op] | Callable[[float], Sequence[Op]],
    maxfev: int,
    **options: Any,
) -> Search:
    """A strong Wolfe line search along ``d`` from ``state.x``, every op riding on the evaluations.

    Trial points and their gradients go to the buffers ``state.x`` and ``state.g`` are not in. The
    ``setup`` ops (which must form ``d``) and ``g.d`` run with the first trial's setup; ``speculate`` (or
    ``speculate(t)``) are the ops to run with each trial's gradient (what the method needs next if the
    trial is accepted).
    ``g.d`` is only known once the first trial is back, so the first step ``step`` is the method's guess.

    Parameters
    ----------
    space : ParameterSpace
        Where ``x``, ``g`` and ``d`` live.
    step : float
        First trial step.
    setup : sequence of op
        Ops forming ``d``.
    speculate : sequence of op, or callable
        The ops, or ``t -> ops``, for each trial.
    maxfev : int
        Stop (``over_budget``) once ``state.nfev`` exceeds it.
    **options
        Options of :class:`~sandblaster._linesearch.StrongWolfeLineSearch` (``c1``, ``c2``, ...).

    Returns
    -------
    Search
    """
    st = space.state
    x_trial, g_trial = other_buffer(st.x), other_buffer(st.g)
    prefix: list[Op] = [*setup, ("dot", st.g, "d")]
    search: StrongWolfeLineSearch | None = None
    t, dphi0 = step, math.nan
    while True:
        suffix = speculate(t) if callable(speculate) else speculate
        trial = space.evaluate(
            x_trial, g_trial, prefix_ops=prefix, suffix_ops=suffix, base=st.x, step=t, direction="d"
        )
        if st.nfev > maxfev:
            return Search(None, True, dphi0, trial)
        if search is None:
            dphi0 = trial.extra[len(setup)]
            prefix = []
            if not dphi0 < 0.0:
                return Search(None, False, dphi0, trial)
            search = StrongWolfeLineSearch(st.f, dphi0, step=t, **options)
        search.tell(trial.f, trial.gd if math.isfinite(trial.g_inf) else math.nan)
        if search.result is not None:
            # dcsrch only ends "ok" at the point it evaluated last: the trial buffers hold that point.
            assert not search.result.ok or (search.result.is_last_evaluated and search.result.step == t)
            return Search(search.result, False, dphi0, trial)
        t = search.step


def accept_trial(state: RunState, trial: Evaluation) -> float:
    """Move ``state`` to the trial point (held in the other buffers); return the previous ``F``."""
    f_old = state.f
    state.nit += 1
    state.x, state.g = other_buffer(state.x), other_buffer(state.g)
    state.f, state.g_inf = trial.f, trial.g_inf
    return f_old


class ParameterSpace(Protocol):
    """Where a batch method's vectors live; the method itself only ever sees names and scalars.

    ``state`` names ``x`` and its gradient and holds ``F(x)``, ``max|grad F(x)|``, the iteration and
    evaluation counts. :meth:`start` evaluates at ``state.x``; a method then runs ops and trial
    evaluations, and closes each accepted iteration with :meth:`end_iteration`.
    """

    state: RunState

    def run(self, ops: Sequence[Op]) -> list[Any]:
        """Run ``ops`` in order (on the shards: one round trip); one result per op (``None`` for vectors)."""
        ...

    def evaluate(
        self,
        out_x: str,
        out_g: str,
        *,
        prefix_ops: Sequence[Op] | None = None,
        suffix_ops: Sequence[Op] | None = None,
        base: str | None = None,
        step: float = 0.0,
        direction: str | None = None,
    ) -> Evaluation:
        """Run ``prefix_ops``, form ``out_x = base + step*direction``, evaluate F and its gradient there
        into ``out_g``, run ``suffix_ops``; count one evaluation in ``state.nfev``."""
        ...

    def start(self) -> None:
        """Evaluate F and its gradient at ``state.x`` into ``state.g`` (iteration 0).

        Raises :class:`distbelief.errors.DatasetError` when either is not finite.
        """
        ...

    def end_iteration(self, step: float) -> IterationRecord:
        """Append the record of the iteration just accepted (``state`` already moved) and return it."""
        ...

    def checkpoint_due(self) -> bool:
        """Whether this iteration ends with a checkpoint."""
        ...

    def checkpoint(self, names: list[str], extra: dict[str, Any]) -> None:
        """Save the vectors ``names`` and the run's scalars (with ``extra``, the method's own state)."""
        ...


class InProcessSpace:
    """A :class:`ParameterSpace` in this process: numpy vectors in a dict, ``fun(x) -> (f, g)`` evaluated.

    Ops use the shards' kernels (:mod:`storage._kernels`, ``np.dot``) so a run here and one on a single
    shard agree but for the order in which the replicas' partial gradients are summed.

    Parameters
    ----------
    fun_and_grad : callable
        ``x -> (F(x), grad F(x))``.
    x0 : numpy.ndarray
        Starting point (copied, as float64).
    checkpoint_every : int
        Keep a copy of the checkpointed vectors and scalars in :attr:`saved` every this many iterations
        (0: never).

    Examples
    --------
    >>> space = InProcessSpace(lambda x: (float(x @ x), 2 * x), np.array([3.0, -4.0]))
    >>> space.start()
    >>> space.state.f, space.state.g_inf
    (25.0, 8.0)
    >>> space.run([("lincomb", "d", [-0.5], [space.state.g]), ("dot", "d", "d")])
    [None, 25.0]
    >>> space.evaluate("xb", "gb", base="xa", step=1.0, direction="d").f
    0.0
    """

    def __init__(
        self,
        fun_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]],
        x0: np.ndarray,
        *,
        checkpoint_every: int = 0,
    ) -> None:
        every = checkpoint_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise InvalidOptionError(f"checkpoint_every must be an int >= 0, got {checkpoint_every!r}")
        self.fun_and_grad = fun_and_grad
        self.checkpoint_every = checkpoint_every
        self.state = RunState()
        self.vectors: dict[str, np.ndarray] = {
            self.state.x: np.array(x0, dtype=np.float64, copy=True).ravel()
        }
        #: The last checkpoint: copies of its vectors, and its metadata (``state`` and the method's own).
        self.saved: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None
        self._t0 = time.perf_counter()
        #: Whether some vector is stored as float32 (dot products then go through kernels.dots_mixed).
        self._narrow = False

    def vector(self, name: str) -> np.ndarray:
        """The vector called ``name`` (not a copy)."""
        try:
            return self.vectors[name]
        except KeyError:
            raise ProtocolError(f"no vector {name!r} in the space; known: {sorted(self.vectors)}") from None

    # -- ops -------------------------------------------------------------------------------------------
    def run(self, ops: Sequence[Op]) -> list[Any]:
        """Run ``ops`` in order; one result per op (``None`` for the ops that write a vector)."""
        return [self._op(op) for op in ops]

    def _op(self, op: Op) -> Any:
        kind, *args = op
        if kind == "dots":
            return self._dots(self._pairs(args[0]))
        if kind == "lincomb":
            self._lincomb(*args)
            return None
        if kind == "dot":
            return self._dot(*args)
        if kind == "norm_inf":
            return kernels.norm_inf(self.vector(args[0]))
        if kind == "copy":
            src, dst = args
            self.vectors[dst] = self.vector(src).copy()
            return None
        if kind in _L1_OPS:
            return self._l1_op(kind, *args)
        raise ProtocolError(
            f"unknown op {kind!r}; an InProcessSpace runs dot, dots, norm_inf, copy, lincomb, "
            f"{', '.join(_L1_OPS)}"
        )

    def _l1_op(self, kind: str, *args: Any) -> Any:
        # OWL-QN's ops, with the shards' kernels (storage._l1); ranges without an L1 term come last.
        if kind == "pseudo_grad":
            dst, g, x, l1, *free = args
            self.vectors[dst] = l1_ops.pseudo_gradient(self.vector(g), self.vector(x), float(l1), *free)
        elif kind == "sign_align":
            l1_ops.sign_align(self.vector(args[0]), self.vector(args[1]))
        elif kind == "orthant":
            dst, x, v = args
            self.vectors[dst] = l1_ops.orthant(self.vector(x), self.vector(v))
        elif kind == "project_orthant":
            l1_ops.project_orthant(self.vector(args[0]), self.vector(args[1]), *args[2:])
        elif kind == "nnz":
            return l1_ops.nnz(self.vector(args[0]))
        else:
            return l1_ops.norm1(self.vector(args[0]), *args[1:])
        return None

    def _vectors(self, names: Sequence[str]) -> list[np.ndarray]:
        # One dict lookup a name (an L-BFGS iteration names ~150 vectors); self.vector says which is missing.
        try:
            vectors = self.vectors
            return [vectors[name] for name in names]
        except KeyError:
            return [self.vector(name) for name in names]

    def _pairs(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        try:
            vectors = self.vectors
            return [(vectors[a], vectors[b]) for a, b in pairs]
        except KeyError:
            return [(self.vector(a), self.vector(b)) for a, b in pairs]

    def _dot(self, a: str, b: str) -> float:
        return self._dots(self._pairs([(a, b)]))[0]

    def _dots(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        # Once a vector is stored as float32 (a float32 history), every dot product is a float64 one.
        return (kernels.dots_mixed if self._narrow else kernels.dots)(pairs)

    def _lincomb(
        self, dst: str, coeffs: Sequence[float], names: Sequence[str], dtype: str | None = None
    ) -> None:
        # The shard's kernel (storage/_shard.py), so both spaces round alike; ``dtype`` as on a shard.
        if len(coeffs) != len(names) or not names:
            raise InvalidOptionError("lincomb needs as many coefficients as vectors, and at least one")
        if dtype not in (None, "float64", "float32"):
            raise InvalidOptionError(f"lincomb stores a vector as 'float64' or 'float32', got {dtype!r}")
        values = [float(c) for c in coeffs]
        vectors = self._vectors(names)
        if dst in names:
            own = values[list(names).index(dst)]
            rest = [(c, v) for c, v, n in zip(values, vectors, names, strict=True) if n != dst]
            kernels.lincomb(self.vector(dst), [c for c, _ in rest], [v for _, v in rest], own=own)
        else:
            # float64 unless told otherwise (not the first term's dtype: a direction that starts with a
            # float32 history vector is float64).
            out = np.empty(vectors[0].size, dtype=dtype or np.float64)
            if dtype == "float32":
                self._narrow = True
            kernels.lincomb(out, values, vectors)
            self.vectors[dst] = out

    # -- evaluations -----------------------------------------------------------------------------------
    def evaluate(
        self,
        out_x: str,
        out_g: str,
        *,
        prefix_ops: Sequence[Op] | None = None,
        suffix_ops: Sequence[Op] | None = None,
        base: str | None = None,
        step: float = 0.0,
        direction: str | None = None,
    ) -> Evaluation:
        """See :meth:`ParameterSpace.evaluate`."""
        prefix = self.run(prefix_ops) if prefix_ops else []
        if base is not None:
            if direction is None or step == 0.0:
                self._op(("copy", base, out_x))
            else:
                self._lincomb(out_x, [1.0, step], [base, direction])
        f, g = self.fun_and_grad(self.vector(out_x))
        g = np.array(g, dtype=np.float64, copy=True).ravel()
        self.vectors[out_g] = g
        g_inf = float(np.abs(g).max()) if g.size else 0.0
        gd = self._dot(out_g, direction) if direction is not None else math.nan
        suffix = self.run(suffix_ops) if suffix_ops else []
        self.state.nfev += 1
        return Evaluation(float(f), gd, g_inf, prefix + suffix)

    def start(self) -> None:
        """See :meth:`ParameterSpace.start`."""
        st = self.state
        f, _, g_inf, _ = self.evaluate(st.x, st.g)
        if not (math.isfinite(f) and math.isfinite(g_inf)):
            raise DatasetError("the objective or its gradient is not finite at x0; check the data and x0")
        st.f, st.g_inf = f, g_inf
        self.end_iteration(0.0)

    # -- bookkeeping -----------------------------------------------------------------------------------
    def end_iteration(self, step: float) -> IterationRecord:
        """See :meth:`ParameterSpace.end_iteration` (the distributed-only counters are 0)."""
        st = self.state
        rec = IterationRecord(
            iteration=st.nit, objective=st.f, grad_norm=st.g_inf, step=step, nfev=st.nfev,
            wall_time=time.perf_counter() - self._t0, portions=0, backups_issued=0, backups_won=0,
            recomputed=0, fetches=0, round_trips=0, time_gradient=0.0, time_shard_ops=0.0,
            time_coordinator=0.0,
        )  # fmt: skip
        st.records.append(rec)
        return rec

    def checkpoint_due(self) -> bool:
        """Every ``checkpoint_every`` iterations."""
        return bool(self.checkpoint_every) and self.state.nit % self.checkpoint_every == 0

    def checkpoint(self, names: list[str], extra: dict[str, Any]) -> None:
        """Keep copies of ``names`` and the scalars in :attr:`saved`."""
        self.saved = (
            {name: self.vector(name).copy() for name in names},
            {"state": self.state.to_meta(), **extra},
        )

    def restore(self) -> dict[str, Any]:
        """Go back to the last checkpoint; return its metadata (pass it as a method's ``resume``)."""
        if self.saved is None:
            raise ProtocolError("no checkpoint to restore: run with checkpoint_every >= 1 first")
        vectors, meta = self.saved
        self.vectors = {name: vec.copy() for name, vec in vectors.items()}
        self._narrow = any(vec.dtype != np.float64 for vec in self.vectors.values())
        self.state = RunState.from_meta(meta["state"])
        return meta
