"""Sandblaster's portion scheduler on the cluster: carries the state machine's messages (section 4.2).

Every decision (which portions go to which replica and when, backup copies, what a lost replica costs,
counting each portion exactly once) is :class:`sandblaster._portions.PortionMachine`'s, which has no I/O;
see its module for the policy. This driver only moves messages on the client's event loop: it sends each
:class:`~sandblaster._portions.Send` as a :class:`~sandblaster._messages.WorkCall` (one pickled frame),
hands each :class:`~sandblaster._messages.WorkReport` back, notices dead replicas, and wakes the machine
when a call returns, when a backup copy falls due, and every ``_POLL`` seconds to look for dead workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future

from distbelief.errors import ClusterError
from distbelief.storage.internal import (
    DEAD_STATES,
    HandOut,
    confirm_dead_async,
    direct_call,
    gather_calls,
    start_call,
)
from distbelief.storage.internal import POLL as _POLL

from ._messages import WorkCall, WorkReport, decode, encode
from ._portions import (
    BALANCED_PACE,
    READ_COST_PRIOR,
    Cancel,
    Done,
    EvaluationStats,
    Instruction,
    PortionMachine,
    Send,
    initial_blocks,
)
from ._replica import Replica

__all__ = ["BALANCED_PACE", "READ_COST_PRIOR", "EvaluationStats", "PortionScheduler"]


class PortionScheduler:
    """Hands portions of one evaluation to replica actors, as its :class:`PortionMachine` decides.

    Parameters
    ----------
    client : distributed.Client
        The coordinator's client (its event loop carries the messages).
    replicas : list of (Actor, Future)
        The replica actors and the futures that hold them (to notice a dead worker).
    n_portions, push_every, backups, in_flight, held
        The scheduling policy's: see :class:`PortionMachine`.

    Examples
    --------
    >>> scheduler = PortionScheduler(client, replicas, n_portions=16)  # doctest: +SKIP
    >>> stats = scheduler.evaluate(1, "x", "acc", prep=[("reset_acc", "acc", 1)])  # doctest: +SKIP
    >>> stats.loss_sum / stats.rows  # doctest: +SKIP
    0.6931471805599453
    """

    def __init__(
        self,
        client: Client,
        replicas: list[tuple[Any, Future[Any]]],
        n_portions: int,
        *,
        push_every: int = 4,
        backups: bool = True,
        in_flight: int = 2,
        held: Sequence[Sequence[int]] | None = None,
        hand_out: Any = None,
    ) -> None:
        self.client = client
        self.replicas = list(replicas)
        #: The one shard of a dense model, which hands each work call out with the parameters and takes
        #: the gradient back (:meth:`storage.ShardActor.hand_out`); None: replicas fetch and push themselves.
        self.hand_out = hand_out
        #: Every scheduling decision, and the state they are made from (paces, data affinity, order).
        self.machine = PortionMachine(
            len(self.replicas),
            n_portions,
            push_every=push_every,
            backups=backups,
            in_flight=in_flight,
            held=held,
        )

    initial_blocks = staticmethod(initial_blocks)

    @property
    def n_portions(self) -> int:
        """Portions per evaluation."""
        return self.machine.n_portions

    @property
    def in_flight(self) -> int:
        """Work calls outstanding per replica."""
        return self.machine.in_flight

    @property
    def alive(self) -> list[bool]:
        """Whether each replica is alive (as far as the scheduler knows)."""
        return self.machine.alive

    @property
    def lost_replicas(self) -> list[int]:
        """The replicas lost so far, in the order they were."""
        return self.machine.lost_replicas

    @property
    def portions_done(self) -> list[int]:
        """Portions each replica computed (and won) over the run: fast replicas do more."""
        return self.machine.portions_done

    @property
    def dispatch_order(self) -> list[int]:
        """The order work is sent in: the replica that reported last in the previous evaluation first."""
        return self.machine.dispatch_order

    def balanced(self) -> bool:
        """Whether every live replica keeps pace with the fastest (see :meth:`PortionMachine.balanced`)."""
        return self.machine.balanced()

    def evaluate(
        self, eval_id: int, x_name: str, acc_name: str, prep: Sequence[Sequence[Any]] = ()
    ) -> EvaluationStats:
        """Run one evaluation at the parameters ``x_name``; gradients are summed into ``acc_name``.

        ``prep`` are shard ops to run first, once, fused into the replicas' parameter fetch; their reduced
        results come back in ``EvaluationStats.prep``.
        """
        loop = self.client.loop
        assert loop is not None
        aio: asyncio.AbstractEventLoop = loop.asyncio_loop  # type: ignore[attr-defined]  # tornado's AsyncIOLoop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is aio:
            raise RuntimeError(
                "PortionScheduler.evaluate blocks: call it from a thread other than the client's loop"
            )
        # Straight onto the client's asyncio loop and back: distributed's ``sync`` adds a tornado coroutine
        # and an extra turn of the loop to every call, and an evaluation is one call (small problems make
        # hundreds a second).
        future = asyncio.run_coroutine_threadsafe(self._evaluate(eval_id, x_name, acc_name, tuple(prep)), aio)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupt (or an error) while waiting: stop the evaluation's coroutine
            raise

    def refresh_shards(self, shard_map: Any, timeout: float = 60.0) -> None:
        """Point every live replica at ``shard_map`` (after the parameter server rebuilt lost shards)."""
        if self.hand_out is not None:
            self.hand_out = shard_map.actors[0]
        live = [r for r in range(len(self.replicas)) if self.alive[r] and not self._dead(r)]
        calls = [start_call(self.replicas[r][0], "attach", shard_map) for r in live]
        answers = gather_calls(self.client, calls, timeout=timeout, gone=lambda k: self._dead(live[k]))
        for r, (ok, error) in zip(live, answers, strict=True):
            if not ok and not self._dead(r):  # a replica that died meanwhile is lost at the next evaluation
                raise error

    async def _confirm_dead(self, r: int, exc: BaseException) -> bool:
        """Whether replica ``r``'s worker died (a connection error may come before the scheduler knows)."""
        return await confirm_dead_async(lambda: self._dead(r), exc, errors=(OSError,))

    def _dead(self, r: int) -> bool:
        return self.replicas[r][1].status in DEAD_STATES

    async def _replica_lost(self, r: int) -> list[Instruction]:
        """Replica ``r``'s worker died: the machine's instructions (a partitioned replica is rebuilt)."""
        return self.machine.lose(r)

    async def _send(self, request: WorkCall, replica: Any) -> WorkReport:
        """One work call, answered once every shard holds its gradient.

        A plain RPC, not an actor call (half its cost, measured in :mod:`storage._direct`); a lost worker
        fails it with ``OSError``, as an actor call. With one shard, a call to a replica on another worker
        goes to the shard, which runs
        the evaluation's prep ops, hands the work out with the parameters, and accumulates the gradient that
        comes back with the replica's report: on 200,000 x 500 that is two messages fewer on the path of
        the replica on the other worker (a fetch and a push answer), and that replica no longer waits
        for the shard's worker to answer its fetch while the replica there computes.
        """
        if self.hand_out is None or replica._address == self.hand_out._address:
            # A replica beside the shard fetches and pushes in-process: handing out would save no message
            # and add a frame's pickling (digits: 1.58 against 1.51 ms per evaluation, 16 rounds each).
            return decode(await direct_call(self.client.rpc, replica, "work", encode(request)), WorkReport)
        call = HandOut(
            request.eval_id, list(request.prep), [request.x_name], replica.key, replica._address,
            Replica.work_with.__name__, encode(request),
        )  # fmt: skip
        message = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        handed = await direct_call(self.client.rpc, self.hand_out, "hand_out", message)
        answer, finalized = pickle.loads(handed)
        report = decode(answer, WorkReport)
        if finalized is not None:
            # The shard accumulated the last gradient itself: its batch's finalize results come from it.
            report = dataclasses.replace(report, final={**report.final, 0: finalized})
        return report

    async def _evaluate(
        self, eval_id: int, x_name: str, acc_name: str, prep: tuple[Any, ...]
    ) -> EvaluationStats:
        machine = self.machine
        machine.begin(time.perf_counter())
        # The calls out, both ways: future -> what it carries, call number -> future.
        calls: dict[asyncio.Future[Any], Send] = {}
        futures: dict[int, asyncio.Future[Any]] = {}

        def carry(instructions: list[Instruction]) -> EvaluationStats | None:
            for ins in instructions:
                if isinstance(ins, Send):
                    # Every call carries the prep ops: calls to one replica may arrive in any order
                    # (separate connections), and whichever runs first fetches; the shards run the ops
                    # once per evaluation.
                    request = WorkCall(
                        eval_id, x_name, acc_name, ins.portions, ins.solo, prep, machine.push_every
                    )
                    fut = asyncio.ensure_future(self._send(request, self.replicas[ins.replica][0]))
                    # A call abandoned (a lost replica's, a backup still running) may fail later: mark its
                    # exception seen so asyncio does not log it as never retrieved.
                    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                    calls[fut] = ins
                    futures[ins.call] = fut
                elif isinstance(ins, Cancel):
                    cancelled = futures.pop(ins.call, None)
                    if cancelled is not None:
                        calls.pop(cancelled, None)
                        cancelled.cancel()
                elif isinstance(ins, Done):
                    return ins.stats
            return None

        while True:
            if not machine.complete:
                for r in machine.live:
                    if self._dead(r):
                        carry(await self._replica_lost(r))
            stats = carry(machine.dispatch(time.perf_counter()))
            if stats is not None:
                return stats
            timeout = _POLL
            due = machine.next_due()
            if due is not None:
                timeout = min(_POLL, max(1e-3, due - time.perf_counter()))
            done, _ = await asyncio.wait(list(calls), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                if fut not in calls:
                    continue  # cancelled by a loss while we waited
                send = calls.pop(fut)
                futures.pop(send.call)
                exc = fut.exception()
                if exc is not None:
                    if await self._confirm_dead(send.replica, exc):
                        carry(await self._replica_lost(send.replica))
                        continue
                    raise ClusterError(
                        f"replica {send.replica} failed while computing portions {list(send.portions)}: "
                        f"{exc!r}"
                    ) from exc
                machine.report(send.call, fut.result(), time.perf_counter())
