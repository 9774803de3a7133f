"""downpour._watch alone (no cluster): when a run counts as diverged, when its step rule as stalled."""

from __future__ import annotations

import math

import pytest

from distbelief.downpour import DownpourOptions
from distbelief.downpour._watch import STALL_FLAT, STALL_GRAD, Watchdog, stall_message
from distbelief.errors import InvalidOptionError


def feed(w: Watchdog, rows: list[tuple[float, float]]) -> list[str | None]:
    return [w.observe(train_loss=a, test_loss=b) for a, b in rows]


def test_nan_or_inf_is_divergence_but_an_unmeasured_window_is_not() -> None:
    nan = math.nan
    w = Watchdog(10.0)
    # No held-out rows (NaN from the start) and a window with no steps (NaN): nothing measured, no verdict.
    assert feed(w, [(nan, nan), (2.0, nan), (nan, nan)]) == [None, None, None]
    msg = w.observe(train_loss=math.inf, test_loss=nan)
    assert msg is not None and "training loss became inf" in msg and "lower lr" in msg
    # A held-out loss once measured that turns NaN is divergence (the parameters hold NaN).
    w = Watchdog(None)
    assert feed(w, [(nan, 2.3)]) == [None]
    assert "held-out loss became nan" in (w.observe(train_loss=1.0, test_loss=nan) or "")
    w = Watchdog(10.0)
    assert "parameters became NaN" in (w.observe(train_loss=1.0, test_loss=1.0, x_finite=False) or "")


def test_growth_past_the_bound_is_divergence() -> None:
    # The digits MLP with 4 replicas at a fixed rate: held-out loss 2.3 at the start, 0.39, then 5.4.
    w = Watchdog(10.0)
    assert feed(w, [(math.nan, 2.3), (1.0, 0.39), (0.9, 0.6)]) == [None, None, None]
    assert w.bound("held-out loss") == pytest.approx(3.9)
    assert w.observe(train_loss=0.9, test_loss=5.4) is None  # one row past the bound: a spike so far
    msg = w.observe(train_loss=0.9, test_loss=5.5)
    assert (
        msg is not None and "grew from 0.39 (its lowest) to 5.5" in msg and "2 history rows in a row" in msg
    )
    # Once diverged, it stays so.
    assert w.observe(train_loss=0.1, test_loss=0.1) == msg
    # A loss that fell a hundredfold: the bound is its first value, not ten times a tiny one.
    w = Watchdog(10.0)
    assert feed(w, [(0.7, math.nan), (0.001, math.nan), (0.5, math.nan), (0.71, math.nan)]) == [None] * 4
    assert w.observe(train_loss=0.71, test_loss=math.nan) is not None
    # None: only NaN / inf count.
    w = Watchdog(None)
    assert feed(w, [(0.7, 0.7), (1e6, 1e6)]) == [None, None]


def test_a_loss_back_at_its_starting_value_is_not_divergence() -> None:
    # Logistic regression from w = 0 (every row's loss ln 2): a replica whose first fetch came before any
    # push was applied takes its first step there, after the other's running loss fell tenfold. Its row read
    # ln 2 one ulp up (a difference of cumulative sums) against a first row of exactly ln 2: "diverged".
    ln2 = math.log(2.0)
    loss_sum = 20.0  # the replicas' cumulative loss before the row; then one 16-row step at w = 0
    window = ((loss_sum + 16 * ln2) - loss_sum) / 16
    assert window == math.nextafter(ln2, math.inf)  # the driver's rounding, not a made-up ulp
    w = Watchdog(10.0)
    assert feed(w, [(math.nan, math.nan), (ln2, math.nan), (0.0171, math.nan)]) == [None, None, None]
    assert w.observe(train_loss=window, test_loss=math.nan) is None
    assert w.observe(train_loss=ln2 * (1 + 1e-9), test_loss=math.nan) is None
    # A millionth above its start and more is growth past it, as before (on two rows in a row).
    assert w.observe(train_loss=ln2 * (1 + 2e-6), test_loss=math.nan) is None
    msg = w.observe(train_loss=ln2 * (1 + 2e-6), test_loss=math.nan)
    assert msg is not None and "to 0.6931" in msg


def test_the_objective_not_one_mini_batch_is_judged_for_growth() -> None:
    # A short run records a row every step: a row's running loss is one 16-row mini-batch. Breast-cancer
    # logistic regression from w = 0: batches scored ln 2 (the first row), then 0.005, then 0.74 while F at
    # the row's parameters was 0.23, and the run stopped as "diverged".
    ln2 = math.log(2.0)
    rows = [(math.nan, ln2), (ln2, 0.48), (0.005, 0.24), (0.74, 0.23)]  # (running loss, objective)
    w = Watchdog(10.0, running_loss_growth=False)
    assert [w.observe(train_loss=a, test_loss=math.nan, objective=f) for a, f in rows] == [None] * 4
    # The objective is judged: back above its value at the start after falling tenfold is divergence.
    assert w.observe(train_loss=0.1, test_loss=math.nan, objective=0.02) is None
    assert w.observe(train_loss=0.1, test_loss=math.nan, objective=0.8) is None
    msg = w.observe(train_loss=0.1, test_loss=math.nan, objective=0.9)
    assert msg is not None and "training objective grew from 0.02 (its lowest) to 0.9" in msg
    # The running loss still counts when it is NaN or infinite; a row without parameters has no objective.
    w = Watchdog(10.0, running_loss_growth=False)
    assert w.observe(train_loss=1e9, test_loss=math.nan, objective=math.nan) is None
    assert "training loss became inf" in (w.observe(train_loss=math.inf, test_loss=math.nan) or "")
    # Judged on the running loss (a run whose rows carry no parameters), those batches are divergence once
    # the next row is past the bound too.
    w = Watchdog(10.0)
    verdicts = [w.observe(train_loss=a, test_loss=math.nan) for a, _ in [*rows, (0.75, 0.2)]]
    assert verdicts[:4] == [None] * 4 and verdicts[4] is not None


def test_a_spike_the_next_row_takes_back_is_not_divergence() -> None:
    # Asynchronous SGD with stale gradients: the objective jumps past its bound on one history row and is
    # back below it on the next (issue 27: a run stopped as diverged ended at training accuracy 1.0).
    w = Watchdog(10.0, running_loss_growth=False)
    values = [2.3, 0.5, 0.05, 0.01, 2.5, 0.02, 0.01, 2.6, 0.009]
    assert [w.observe(train_loss=0.1, test_loss=math.nan, objective=f) for f in values] == [None] * len(
        values
    )
    assert w.best["training objective"] == 0.009  # a spike does not move the lowest value
    # Two rows in a row past it are divergence, whatever came before.
    assert w.observe(train_loss=0.1, test_loss=math.nan, objective=2.4) is None
    assert w.observe(train_loss=0.1, test_loss=math.nan, objective=2.7) is not None


def test_stall_needs_a_flat_loss_and_a_gradient_that_is_not_small() -> None:
    t = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    flat = [1.0, 0.7, 0.6, 0.55, 0.55, 0.5499, 0.5498]
    falling = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2]
    msg = stall_message(t, flat, 2.0, 2.0 * 10 * STALL_GRAD, what="held-out loss")
    assert msg is not None and "held-out loss" in msg and "stalled" in msg
    assert stall_message(t, flat, 2.0, 2.0 * STALL_GRAD / 2) is None  # converged: the gradient is small
    assert stall_message(t, falling, 2.0, 1.0) is None  # still making progress
    assert stall_message(t[:2], flat[:2], 2.0, 1.0) is None  # too short to judge
    # Two rows in the last third (t >= 4 of 0..6): no trend is measured, whatever they say (a short run's
    # final rows were read as a 0% fall and warned of a stall).
    assert stall_message(t, flat, 2.0, 1.0) is not None  # three there: judged
    assert stall_message([0.0, 1.0, 2.0, 3.0], [1.0, 0.8, 0.8, 0.8], 2.0, 1.0) is None
    # Just below and above the flatness threshold over the last third (t >= 4).
    drop = [1.0, 0.9, 0.8, 0.7, 1.0, 1.0 - STALL_FLAT / 2, 1.0 - STALL_FLAT / 2]
    assert stall_message(t, drop, 1.0, 1.0) is not None
    drop = [1.0, 0.9, 0.8, 0.7, 1.0, 1.0 - 2 * STALL_FLAT, 1.0 - 2 * STALL_FLAT]
    assert stall_message(t, drop, 1.0, 1.0) is None


def test_options_resolve_staleness_scaling_and_refuse_a_bad_growth_bound() -> None:
    assert DownpourOptions(rule="sgd", max_steps=1).scales_staleness(2)
    assert not DownpourOptions(rule="sgd", max_steps=1).scales_staleness(1)
    assert not DownpourOptions(rule="adagrad", max_steps=1).scales_staleness(8)
    assert not DownpourOptions(rule="sgd", staleness_scale=False, max_steps=1).scales_staleness(4)
    assert DownpourOptions(rule="adagrad", staleness_scale=True, max_steps=1).scales_staleness(4)
    assert DownpourOptions(max_steps=1).max_loss_growth == 10.0
    assert DownpourOptions(max_loss_growth=None, max_steps=1).max_loss_growth is None
    for bad in (1.0, 0.5, math.inf, "ten"):
        with pytest.raises(InvalidOptionError, match="max_loss_growth"):
            DownpourOptions(max_loss_growth=bad, max_steps=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="staleness_scale"):
        DownpourOptions(staleness_scale="auto", max_steps=1)  # type: ignore[arg-type]


def test_a_row_whose_parameters_were_not_read_measured_no_held_out_loss() -> None:
    # A windowed sparse run leaves some rows without parameters (reading the shards was not affordable at
    # that poll): their held-out loss is NaN because it was not measured, not because the run diverged.
    from distbelief.downpour._watch import Watchdog

    watch = Watchdog(10.0)
    assert watch.observe(train_loss=0.7, test_loss=0.69) is None
    for _ in range(5):
        assert watch.observe(train_loss=0.6, test_loss=math.nan, evaluated=False) is None
    assert watch.observe(train_loss=0.6, test_loss=0.6) is None
    assert watch.observe(train_loss=0.6, test_loss=math.nan) is not None  # measured, and NaN: diverged


def test_rows_filled_after_the_run_are_judged_again_in_time_order() -> None:
    # The driver evaluates the newest rows first while a run goes, and older ones after it; the watchdog
    # that saw them in that order read a row of the start (F 3.05) as growth from the lowest F of the end
    # (0.256): the demo's converging job stopped as "diverged" once in CI. _Run._rewatch judges the whole
    # history in time order.
    from distbelief.downpour._train import _Row, _Run

    def rows(objectives: list[float]) -> list[_Row]:
        nan = math.nan
        return [
            _Row(time=float(t), step=t, epoch=0.0, train_loss=nan, test_loss=nan, test_accuracy=nan,
                 staleness_mean=nan, staleness_max=nan, replicas_alive=1, objective=f)
            for t, f in enumerate(objectives)
        ]  # fmt: skip

    run = object.__new__(_Run)
    run.opts, run.watch = DownpourOptions(max_steps=1), Watchdog(10.0)
    run.rows = rows([3.05, 3.1, 1.0, 0.5, 0.26, 0.2563])
    assert run._rewatch().message is None
    out_of_order = Watchdog(10.0)
    for f in (0.26, 0.2563, 3.05, 3.1):
        out_of_order.observe(train_loss=math.nan, test_loss=math.nan, objective=f)
    assert out_of_order.message is not None
    # A history that does grow past the bound, in time order, is still divergence.
    run.rows = rows([2.3, 0.5, 6.0, 7.0])
    assert run._rewatch().message is not None
