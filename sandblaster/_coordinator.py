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
trials repeats the evaluation. The methods themselves are not here: :class:`Coordinator` is the sharded
:class:`~sandblaster._space.ParameterSpace`, and L-BFGS, CG and GD (``_minimize_lbfgs`` in
:mod:`sandblaster._vlbfgs`, ``_minimize_cg``, ``_minimize_gd``) run in it exactly as in the in-process space;
the fusing above is what a method gets by handing its ops to :meth:`Coordinator.evaluate`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from distbelief.errors import DatasetError, InvalidOptionError, ProtocolError
from distbelief.storage import ParameterServer, reduce_results

from ._scheduler import EvaluationStats, PortionScheduler
from ._space import Evaluation, IterationRecord, Op, RunState

__all__ = ["Coordinator", "IterationRecord", "RunState"]

ACC = "acc"


class Coordinator:
    """The sharded :class:`~sandblaster._space.ParameterSpace`: a :class:`ParameterServer` holds the vectors,
    a :class:`PortionScheduler` evaluates with the replicas.

    The batch methods (``_minimize_lbfgs``, ``_minimize_cg``, ``_minimize_gd``) run in it as they run in
    an :class:`~sandblaster._space.InProcessSpace`; the coordinator keeps names and scalars only.

    Parameters
    ----------
    ps : ParameterServer
        Holds ``x`` (as ``state.x``) when :meth:`start` runs.
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
        ordered_sums: bool = False,
    ) -> None:
        #: Whether the shards sum the gradient portion by portion in portion order (the replicas push each
        #: portion's own gradient), else exactly over summed pushes (partitioned replicas).
        self.ordered_sums = ordered_sums
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

        #: The server's round-trip count when the current iteration began (reset with its stats).
        self._rt_mark = 0
        #: Partitioned replicas (``minimize(partitions=K)``): the shards hold ``x[perm]`` (else None).
        self.perm: np.ndarray | None = None
        #: ``{name: dtype}`` of the vectors the method's ops had the shards store in a dtype of their own
        #: (``("lincomb", dst, coeffs, names, "float32")``: the L-BFGS history with ``history_dtype``), for
        #: the checkpoint arrays (float32 ones for float32 vectors).
        self.vector_dtypes: dict[str, str] = {}

    def _note_dtypes(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if op[0] == "lincomb" and len(op) > 4:
                self.vector_dtypes[op[1]] = str(op[4])

    # -- one evaluation --------------------------------------------------------------------------------
    def run(self, ops: Sequence[Op]) -> list[Any]:
        """Run ``ops`` on every shard in one round trip; the shards' results, reduced."""
        self._note_dtypes(ops)
        t = time.perf_counter()
        try:
            return self.ps.run(list(ops))
        finally:
            self._t_shard += time.perf_counter() - t

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
        """Form ``out_x = base + step*direction``, evaluate F and its gradient there into ``out_g``.

        ``prefix_ops`` run first, in the round trip that forms ``out_x``; ``suffix_ops`` run last, in the
        round trip that forms ``out_g``. Returns ``(F, out_g . direction (or nan), max|out_g|, results of
        the prefix ops followed by those of the suffix ops)``.
        """
        ops: list[tuple[Any, ...]] = list(prefix_ops or [])
        self._note_dtypes(ops)
        self._note_dtypes(suffix_ops or [])
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
        ops += [("dot", out_x, out_x), ("reset_acc", ACC, epoch, n_portions, final, self.ordered_sums)]
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
        return Evaluation(f, gd, g_inf, prefix + res[n_final:])

    def _count_received(self, values: list[Any]) -> None:
        """Count scalars that reached the coordinator through the replicas, as the server counts its own."""
        n = sum(len(v) if isinstance(v, list) else int(v is not None) for v in values)
        self.ps.stats.values_received += n
        self.ps.stats.max_received = max(self.ps.stats.max_received, n)

    def end_iteration(self, step: float) -> IterationRecord:
        """Append the record of the iteration just accepted: work done, round trips and time spent."""
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
            round_trips=self.ps.stats.round_trips - self._rt_mark,
            time_gradient=self._t_grad,
            time_shard_ops=self._t_shard,
            time_coordinator=max(0.0, (now - self._iter_start) - self._t_grad - self._t_shard),
        )
        self.state.records.append(rec)
        self._eval_stats = []
        self._t_grad = self._t_shard = 0.0
        self._iter_start = now
        # Everything from here to the next record is the next iteration's, ops before its first trial too.
        self._rt_mark = self.ps.stats.round_trips
        return rec

    def checkpoint(self, names: list[str], extra: dict[str, Any]) -> None:
        """Save ``names`` (x, g and the method's vectors) and the run's scalars to the store."""
        meta = {"method": self.method, "state": self.state.to_meta(), **extra}
        dtypes = {n: self.vector_dtypes[n] for n in names if n in self.vector_dtypes}
        self.ps.checkpoint(names, meta=meta, dtypes=dtypes or None)

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

    def start(self) -> None:
        """Evaluate F and its gradient at ``state.x`` (iteration 0)."""
        self._iter_start = time.perf_counter()
        self._rt_mark = self.ps.stats.round_trips
        f, _, g_inf, _ = self.evaluate(self.state.x, self.state.g)
        if not (math.isfinite(f) and math.isfinite(g_inf)):
            raise DatasetError("the objective or its gradient is not finite at x0; check the data and x0")
        self.state.f, self.state.g_inf = f, g_inf
        self.end_iteration(0.0)
