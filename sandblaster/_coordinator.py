"""The Sandblaster coordinator: runs a batch method while every vector lives on the shards (section 4.2).

The coordinator holds names and scalars only. A typical L-BFGS iteration (the line search takes its first
trial) costs the coordinator NO round trip of its own to the shards, whatever the history size ``m``; it
only hands out portions to the replicas:

* the evaluation's setup ops (``d = sum_j delta_j b_j``, ``x_t = x + t*d``, ``x_t.x_t``, ``g.d``, open the
  gradient accumulator) ride on the replicas' parameter fetch: the first replica to fetch from a shard
  runs them there (``Shard.prepare``);
* the replicas compute the data term portion by portion and push it (:mod:`sandblaster._scheduler`);
* the push that brings a shard its last portion runs the final ops there (``Shard.push_portions``):
  ``g_t = acc/N + l2*x_t``, ``g_t.d``, ``max|g_t|`` and, speculatively (assuming the line search accepts
  ``t``), the next pair ``s = t*d``, ``y = g_t - g`` in a free slot with the new Gram entries of the
  vector-free recursion (VL-BFGS); their results travel back with the replica's report.

This is the prototype's "one coordinator phase per evaluation" (DESIGN.md). A line search needing more
trials repeats the evaluation. CG and gradient descent go through the same evaluation; only their direction
updates differ (with one extra batch of dot products per iteration).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from distbelief.errors import DatasetError, InvalidOptionError, ProtocolError
from distbelief.sandblaster._cg import CG_C1, CG_C2, polak_ribiere_plus
from distbelief.sandblaster._linesearch import (
    LBFGSB_C1,
    LBFGSB_C2,
    LBFGSB_STPMAX,
    LBFGSB_XTOL,
    ArmijoBacktracking,
    StrongWolfeLineSearch,
    interpolated_initial_step,
    lbfgsb_initial_step,
    relative_reduction_converged,
)
from distbelief.sandblaster._scheduler import EvaluationStats, PortionScheduler
from distbelief.sandblaster._vlbfgs import VLBFGSHistory
from distbelief.storage import ParameterServer, reduce_results

__all__ = ["Coordinator", "IterationRecord", "StopRun"]

ACC = "acc"


class StopRun(Exception):
    """Raised inside the coordinator when the user's callback asks to stop."""


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


@dataclass
class RunState:
    """Where a run stands (names of the vectors on the shards, and scalars)."""

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


class Coordinator:
    """Drives L-BFGS, CG or GD over a :class:`ParameterServer` and a :class:`PortionScheduler`.

    Parameters
    ----------
    ps : ParameterServer
        Holds ``x`` (as ``state.x``) when :meth:`run` starts.
    scheduler : PortionScheduler
        Computes the data term over the replicas.
    n_rows : int
        ``N`` in ``F(w) = (1/N) sum_i loss_i(w) + (l2/2)||w||^2``.
    l2 : float
        L2 regularization strength (applied on the shards).
    """

    def __init__(
        self,
        ps: ParameterServer,
        scheduler: PortionScheduler,
        *,
        n_rows: int,
        l2: float,
        checkpoint_every: int = 0,
        method: str = "lbfgs",
    ) -> None:
        self.ps = ps
        self.checkpoint_every = checkpoint_every
        self.method = method
        self.scheduler = scheduler
        self.n_rows = n_rows
        self.l2 = l2
        self.state = RunState()
        self._t_shard = 0.0
        self._t_grad = 0.0
        self._eval_stats: list[EvaluationStats] = []
        self._t0 = time.perf_counter()
        self._iter_start = self._t0

    # -- one evaluation --------------------------------------------------------------------------------
    def _shard_ops(self, ops: list[tuple[Any, ...]]) -> list[Any]:
        t = time.perf_counter()
        try:
            return self.ps.run(ops)
        finally:
            self._t_shard += time.perf_counter() - t

    def evaluate(
        self,
        out_x: str,
        out_g: str,
        *,
        prefix_ops: list[tuple[Any, ...]] | None = None,
        suffix_ops: list[tuple[Any, ...]] | None = None,
        base: str | None = None,
        step: float = 0.0,
        direction: str | None = None,
    ) -> tuple[float, float, float, list[Any]]:
        """Form ``out_x = base + step*direction``, evaluate F and its gradient there into ``out_g``.

        ``prefix_ops`` run first, in the round trip that forms ``out_x``; ``suffix_ops`` run last, in the
        round trip that forms ``out_g``. Returns ``(F, out_g . direction (or nan), max|out_g|, results of
        the prefix ops followed by those of the suffix ops)``.
        """
        ops: list[tuple[Any, ...]] = list(prefix_ops or [])
        if base is not None:
            if direction is None or step == 0.0:
                ops.append(("copy", base, out_x))
            else:
                ops.append(("lincomb", out_x, [1.0, step], [base, direction]))
        self.state.eval_id += 1
        epoch = self.state.eval_id
        n_portions = self.scheduler.n_portions
        final: list[tuple[Any, ...]] = [
            ("settle", ACC),
            ("lincomb", out_g, [1.0 / self.n_rows, self.l2], [ACC, out_x]),
            ("norm_inf", out_g),
        ]
        if direction is not None:
            final.append(("dot", out_g, direction))
        n_final = len(final)
        final += list(suffix_ops or [])
        # The setup ops ride on the replicas' parameter fetch (the first fetch runs them on each shard);
        # the final ops run on each shard when its last portion arrives, and their results ride back on
        # that push. The coordinator itself talks to no shard during an evaluation.
        ops += [("dot", out_x, out_x), ("reset_acc", ACC, epoch, n_portions, final)]
        t = time.perf_counter()
        stats = self.scheduler.evaluate(epoch, out_x, ACC, prep=ops)
        self._t_grad += time.perf_counter() - t
        if len(stats.prep) != len(ops):
            raise ProtocolError(f"evaluation {epoch}: the shards' setup results did not come back")
        self._count_received(stats.prep)
        xx = stats.prep[-2]
        prefix = stats.prep[: len(prefix_ops or [])]
        self._eval_stats.append(stats)
        missing = [i for i in range(self.ps.shards) if i not in stats.final]
        if missing:
            # The pushes that completed these shards were reported by no live replica: ask the shards.
            t = time.perf_counter()
            for i, results in zip(missing, self.ps.final_results(ACC, epoch, missing), strict=True):
                if results is not None:
                    stats.final[i] = results
            self._t_shard += time.perf_counter() - t
        if len(stats.final) != self.ps.shards:
            raise ProtocolError(f"evaluation {epoch}: shards {missing} never received every portion")
        per_shard = [stats.final[i] for i in range(self.ps.shards)]
        for part in per_shard:
            self._count_received(part)
        res = reduce_results(final, per_shard)
        if res[0] != n_portions:
            raise ProtocolError(
                f"a shard holds the gradient of {res[0]} of {n_portions} portions after "
                f"evaluation {epoch}; this is a bug in the portion scheduler"
            )
        f = stats.loss_sum / self.n_rows + 0.5 * self.l2 * xx
        g_inf = res[2]
        gd = res[3] if direction is not None else math.nan
        self.state.nfev += 1
        return f, gd, g_inf, prefix + res[n_final:]

    def _count_received(self, values: list[Any]) -> None:
        """Count scalars that reached the coordinator through the replicas, as the server counts its own."""
        n = sum(len(v) if isinstance(v, list) else int(v is not None) for v in values)
        self.ps.stats.values_received += n
        self.ps.stats.max_received = max(self.ps.stats.max_received, n)

    def _other(self, name: str) -> str:
        return {"xa": "xb", "xb": "xa", "ga": "gb", "gb": "ga"}[name]

    def _record(self, step: float, rt0: int) -> IterationRecord:
        now = time.perf_counter()
        stats = self._eval_stats
        rec = IterationRecord(
            iteration=self.state.nit,
            objective=self.state.f,
            grad_norm=self.state.g_inf,
            step=step,
            nfev=self.state.nfev,
            wall_time=now - self._t0,
            portions=sum(s.portions for s in stats),
            backups_issued=sum(s.backups_issued for s in stats),
            backups_won=sum(s.backups_won for s in stats),
            recomputed=sum(s.recomputed for s in stats),
            fetches=sum(s.fetches for s in stats),
            portions_read=sum(s.reads for s in stats),
            round_trips=self.ps.stats.round_trips - rt0,
            time_gradient=self._t_grad,
            time_shard_ops=self._t_shard,
            time_coordinator=max(0.0, (now - self._iter_start) - self._t_grad - self._t_shard),
        )
        self.state.records.append(rec)
        self._eval_stats = []
        self._t_grad = self._t_shard = 0.0
        self._iter_start = now
        return rec

    def checkpoint(self, names: list[str], extra: dict[str, Any]) -> None:
        """Save ``names`` (x, g and the method's vectors) and the run's scalars to the store."""
        meta = {"method": self.method, "state": self.state.to_meta(), **extra}
        self.ps.checkpoint(names, meta=meta)

    def checkpoint_due(self) -> bool:
        """Whether this iteration ends with a checkpoint (every ``checkpoint_every`` iterations)."""
        return bool(self.checkpoint_every) and self.state.nit % self.checkpoint_every == 0

    def resume_from(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Restore the scalars saved by :meth:`checkpoint` (the shards were restored by the server)."""
        if meta.get("method") != self.method:
            raise InvalidOptionError(
                f"the store holds a {meta.get('method')!r} run; resume it with method={meta.get('method')!r}"
            )
        # Evaluation ids only grow: shards refuse pushes and setup ops of epochs they have passed.
        eval_id = self.state.eval_id
        self.state = RunState.from_meta(meta["state"])
        self.state.eval_id = max(eval_id, self.state.eval_id)
        return meta

    # -- the methods -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Evaluate F and its gradient at ``state.x`` (iteration 0)."""
        self._iter_start = time.perf_counter()
        rt0 = self.ps.stats.round_trips
        f, _, g_inf, _ = self.evaluate(self.state.x, self.state.g)
        if not (math.isfinite(f) and math.isfinite(g_inf)):
            raise DatasetError("the objective or its gradient is not finite at x0; check the data and x0")
        self.state.f, self.state.g_inf = f, g_inf
        self._record(0.0, rt0)

    def run_lbfgs(
        self,
        *,
        m: int,
        gtol: float,
        ftol: float,
        maxiter: int,
        maxfev: int,
        maxls: int = 20,
        callback: Callable[[IterationRecord], None] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> tuple[bool, str]:
        """L-BFGS as SciPy's L-BFGS-B does it without bounds (see ``minimize_lbfgs_reference``)."""
        st = self.state
        if st.g_inf <= gtol:
            return True, "gradient inf-norm <= gtol at x0"
        hist = VLBFGSHistory(m, prefix="h")
        # The Gram entries for the next direction come back speculatively with each trial's gradient
        # (assuming the line search accepts it, as it usually does at the first trial): then an iteration
        # costs two shard round trips. ``next_dots`` holds them once a trial is accepted.
        next_dots: tuple[VLBFGSHistory, list[float]] | None = None
        if resume is not None:
            if resume["hist"]["m"] != m:
                raise InvalidOptionError(
                    f"the run was started with history={resume['hist']['m']}; resume with it"
                )
            next_dots = (VLBFGSHistory.from_state(resume["hist"]), list(resume["next_values"]))
            st = self.state
        while True:
            rt0 = self.ps.stats.round_trips
            if next_dots is None:
                values = self._shard_ops([("dots", hist.dot_requests(st.g))])[0]
            else:
                hist, values = next_dots
                next_dots = None
            hist.update_dots(values)
            coeffs = hist.direction_coefficients()
            d_norm = math.sqrt(hist.dot_matrix()[-1, -1]) if len(coeffs) == 1 else math.nan
            direction_op = ("lincomb", "d", [c for c, _ in coeffs], [n for _, n in coeffs])
            step0 = lbfgsb_initial_step(st.nit, d_norm) if st.nit == 0 else 1.0
            ls: StrongWolfeLineSearch | None = None
            x_trial, g_trial = self._other(st.x), self._other(st.g)
            t = step0
            failed_msg = ""
            while True:
                first = ls is None
                # Speculative next pair: s = t*d and y = g_t - g go to a free slot, so a rejected trial
                # never overwrites a kept pair.
                spec = hist.copy()
                s_name, y_name = spec.push_pair()
                requests = spec.dot_requests(g_trial)
                suffix = [
                    ("lincomb", s_name, [t], ["d"]),
                    ("lincomb", y_name, [1.0, -1.0], [g_trial, st.g]),
                    ("dots", requests),
                ]
                prefix = [direction_op, ("dot", st.g, "d")] if first else []
                f_t, gd_t, ginf_t, extra = self.evaluate(
                    x_trial, g_trial, prefix_ops=prefix, suffix_ops=suffix, base=st.x, step=t, direction="d"
                )
                if st.nfev > maxfev:
                    return False, "maximum number of function evaluations reached"
                if first:
                    gd0 = extra[1]
                    if not gd0 < 0.0:
                        failed_msg = "the search direction is not a descent direction"
                        break
                    ls = StrongWolfeLineSearch(
                        st.f,
                        gd0,
                        step=step0,
                        c1=LBFGSB_C1,
                        c2=LBFGSB_C2,
                        xtol=LBFGSB_XTOL,
                        stpmax=LBFGSB_STPMAX,
                        max_evals=maxls,
                    )
                assert ls is not None
                ls.tell(f_t, gd_t if math.isfinite(ginf_t) else math.nan)
                if ls.done:
                    break
                t = ls.step
            res = ls.result if ls is not None else None
            if res is None or not res.ok:
                if hist.n_pairs:
                    hist.reset()  # L-BFGS-B: back to x, drop the memory, retry along -g
                    continue
                return False, failed_msg or f"line search failed: {res.message if res else ''}"
            assert res.is_last_evaluated and res.step == t
            st.nit += 1
            next_dots = (spec, extra[-1])
            f_old = st.f
            st.x, st.g, st.f, st.g_inf = x_trial, g_trial, f_t, ginf_t
            rec = self._record(res.step, rt0)
            if self.checkpoint_due():
                pairs = [name for pair in spec.pair_names for name in pair]
                self.checkpoint(
                    [st.x, st.g, *pairs, s_name, y_name],
                    {"hist": spec.to_state(), "next_values": list(extra[-1])},
                )
            if callback is not None:
                callback(rec)
            if st.g_inf <= gtol:
                return True, "gradient inf-norm <= gtol"
            if relative_reduction_converged(f_old, st.f, ftol=ftol):
                return True, "relative reduction of f <= ftol"
            if st.nit >= maxiter:
                return False, "maximum number of iterations reached"

    def run_cg(
        self,
        *,
        gtol: float,
        ftol: float,
        maxiter: int,
        maxfev: int,
        maxls: int = 20,
        restart_every: int,
        callback: Callable[[IterationRecord], None] | None = None,
    ) -> tuple[bool, str]:
        """Polak-Ribiere+ nonlinear CG with restarts (see ``minimize_cg_reference``)."""
        st = self.state
        if st.g_inf <= gtol:
            return True, "gradient inf-norm <= gtol at x0"
        (gg,) = self._shard_ops([("dot", st.g, st.g)])
        self._shard_ops([("lincomb", "d", [-1.0], [st.g])])
        since_restart = 0
        f_prev = st.f + math.sqrt(gg) / 2.0
        while True:
            rt0 = self.ps.stats.round_trips
            (gd,) = self._shard_ops([("dot", st.g, "d")])
            ls = (
                StrongWolfeLineSearch(
                    st.f,
                    gd,
                    step=interpolated_initial_step(st.f, f_prev, gd),
                    c1=CG_C1,
                    c2=CG_C2,
                    max_evals=maxls,
                )
                if gd < 0
                else None
            )
            x_trial, g_trial = self._other(st.x), self._other(st.g)
            while ls is not None and not ls.done:
                f_t, gd_t, ginf_t, _ = self.evaluate(x_trial, g_trial, base=st.x, step=ls.step, direction="d")
                if st.nfev > maxfev:
                    return False, "maximum number of function evaluations reached"
                ls.tell(f_t, gd_t if math.isfinite(ginf_t) else math.nan)
            res = ls.result if ls is not None else None
            if res is None or not res.ok:
                if since_restart > 0:
                    self._shard_ops([("lincomb", "d", [-1.0], [st.g])])
                    since_restart = 0
                    continue
                return False, f"line search failed: {res.message if res else 'not a descent direction'}"
            st.nit += 1
            g1g1, g1g0, g1d = self._shard_ops(
                [("dots", [(g_trial, g_trial), (g_trial, st.g), (g_trial, "d")])]
            )[0]
            f_prev = st.f
            g_old_sq = gg
            st.x, st.g, st.f, st.g_inf = x_trial, g_trial, res.phi, ginf_t
            gg = g1g1
            rec = self._record(res.step, rt0)
            if self.checkpoint_due():
                self.checkpoint([st.x, st.g], {})
            if callback is not None:
                callback(rec)
            if st.g_inf <= gtol:
                return True, "gradient inf-norm <= gtol"
            if relative_reduction_converged(f_prev, st.f, ftol=ftol):
                return True, "relative reduction of f <= ftol"
            if st.nit >= maxiter:
                return False, "maximum number of iterations reached"
            beta, restart = polak_ribiere_plus(
                g1g1, g1g0, g_old_sq, g1d, since_restart=since_restart + 1, restart_every=restart_every
            )
            self._shard_ops([("lincomb", "d", [-1.0, beta], [st.g, "d"])])
            since_restart = 0 if restart else since_restart + 1

    def run_gd(
        self,
        *,
        gtol: float,
        ftol: float,
        maxiter: int,
        maxfev: int,
        step: float = 1.0,
        maxls: int = 30,
        callback: Callable[[IterationRecord], None] | None = None,
    ) -> tuple[bool, str]:
        """Gradient descent with Armijo backtracking (see ``minimize_gd_reference``)."""
        st = self.state
        search = ArmijoBacktracking(step=step, max_evals=maxls)
        while True:
            if st.g_inf <= gtol:
                return True, "gradient inf-norm <= gtol"
            if st.nit >= maxiter:
                return False, "maximum number of iterations reached"
            rt0 = self.ps.stats.round_trips
            (gg,) = self._shard_ops([("lincomb", "d", [-1.0], [st.g]), ("dot", st.g, st.g)])[1:]
            search.start(st.f, -gg)
            x_trial, g_trial = self._other(st.x), self._other(st.g)
            f_t = ginf_t = math.nan
            while not search.done:
                f_t, _, ginf_t, _ = self.evaluate(
                    x_trial, g_trial, base=st.x, step=search.step, direction="d"
                )
                if st.nfev > maxfev:
                    return False, "maximum number of function evaluations reached"
                search.tell(f_t)
            res = search.result
            assert res is not None
            if not res.ok:
                return False, f"line search failed: {res.message}"
            st.nit += 1
            f_old = st.f
            st.x, st.g, st.f, st.g_inf = x_trial, g_trial, f_t, ginf_t
            rec = self._record(res.step, rt0)
            if self.checkpoint_due():
                self.checkpoint([st.x, st.g], {})
            if callback is not None:
                callback(rec)
            if relative_reduction_converged(f_old, st.f, ftol=ftol):
                return True, "relative reduction of f <= ftol"
