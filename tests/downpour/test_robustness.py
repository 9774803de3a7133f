"""Downpour on the session's cluster: divergence stops a run, staleness scaling keeps a fixed rate stable
with more replicas, the defaults converge against scipy's optimum, and a stalled step rule is warned."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.optimize
from distributed import Client

from distbelief import downpour, models
from distbelief.downpour._core import ADAGRAD_MAX_COALESCE
from distbelief.storage import load_digits, train_test_split_digits

X_TR, Y_TR, X_TE, Y_TE = train_test_split_digits(seed=0)


def two_feature_logistic(n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A well-conditioned binary problem: two standard-normal features, a logistic teacher."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 2))
    y = (rng.random(n) < 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0]) + 0.3)))).astype(float)
    return X, y


def optimum(model: models.Logistic, X: np.ndarray, y: np.ndarray, l2: float) -> float:
    res = scipy.optimize.minimize(
        lambda w: models.objective(model, w, X, y, l2=l2), np.zeros(model.n_params), jac=True,
        method="L-BFGS-B", options={"gtol": 1e-10},
    )  # fmt: skip
    return float(res.fun)


def test_a_diverging_run_stops_with_a_message(client: Client) -> None:
    # lr 5 on the digits MLP: the held-out loss climbs far above its starting value within a second.
    res = downpour.train(
        models.MLP([64, 32, 10], activation="tanh"), (X_TR, Y_TR), replicas=2, rule="sgd", lr=5.0,
        staleness_scale=False, time_limit=30.0, eval_every=0.1, eval_data=(X_TE, Y_TE), client=client,
    )  # fmt: skip
    assert res.stop_reason == "diverged" and not res.success
    assert res.message.startswith("diverged: the ") and "lower lr" in res.message
    assert res.wall_time < 20.0  # stopped by the watchdog, not by the time limit


def test_a_short_diverging_run_is_caught_on_the_rows_evaluated_after_it(client: Client) -> None:
    # Softmax at lr 1000 on the raw digits (pixels 0-16): ~1 s of steps, too short for the 5% budget to
    # evaluate many rows while it runs; the rows evaluated after it go to the watchdog too (the service's
    # dashboard job once "succeeded").
    X, y = load_digits()
    res = downpour.train(
        models.Softmax(64, 10), (X, y.astype(float)), replicas=1, rule="sgd", lr=1e3, epochs=20,
        eval_every=0.05, eval_data=(X, y.astype(float)), client=client, callback=lambda progress: None,
    )  # fmt: skip
    assert res.stop_reason == "diverged" and not res.success, res.message


def test_an_infinite_loss_stops_the_run(client: Client) -> None:
    X, y = two_feature_logistic(400)
    # Only NaN / inf count here (the growth bound, checked at every history row, would stop it sooner).
    res = downpour.train(
        models.LeastSquares(2), (X * 1e3, y), replicas=1, rule="sgd", lr=10.0, epochs=50, client=client,
        max_loss_growth=None,
    )  # fmt: skip
    assert (
        res.stop_reason == "diverged" and not res.success and "NaN" in res.message
    ) or "inf" in res.message


def test_a_fixed_rate_with_four_replicas_stays_stable_by_default(client: Client) -> None:
    # Without staleness scaling, 4 replicas at lr 0.2 ended at chance accuracy (0.10) in 2 of 3 runs of
    # benchmarks/downpour_figure4.py; the default scales each push by 1 / (1 + staleness) for rule="sgd".
    res = downpour.train(
        models.MLP([64, 64, 10], activation="tanh"), (X_TR, Y_TR), replicas=4, rule="sgd", lr=0.2,
        time_limit=5.0, eval_every=0.25, eval_data=(X_TE, Y_TE), client=client, seed=1,
    )  # fmt: skip
    assert res.success, res.message
    assert res.history.attrs["staleness_scale"] is True and res.stats["staleness_mean"] > 1
    assert float(res.history.test_accuracy.values[-1]) >= 0.85


#: Relative gap to scipy's optimum after 10 epochs (issue 17 item 3 aims at 3%). Measured at load average
#: ~22-27 on 2 cores, 5 seeds: Adagrad (the default) 1 replica 0.0-0.03%, 2 replicas 0.03-0.07% (pushes
#: coalesce at most ADAGRAD_MAX_COALESCE steps; uncapped they coalesced 25-58 and ended 1-10% above); SGD 1
#: replica ~0.02%.
AIM_GAP = 0.03
#: SGD with 2 replicas scales each step by the other replica's updates since the fetch: 0.04-4.8% (was
#: 2.4-12% when a replica's own pushes counted as staleness too).
TWO_REPLICA_SGD_GAP = 0.08


@pytest.mark.parametrize(
    ("rule", "replicas", "bound"),
    [
        ("adagrad", 1, AIM_GAP),
        ("sgd", 1, AIM_GAP),
        ("adagrad", 2, AIM_GAP),
        ("sgd", 2, TWO_REPLICA_SGD_GAP),
    ],
)
def test_the_default_rates_converge_within_ten_epochs(
    client: Client, rule: str, replicas: int, bound: float
) -> None:
    X, y = two_feature_logistic()
    model, l2 = models.Logistic(2), 1e-3
    f_star = optimum(model, X, y, l2)
    with warnings.catch_warnings():
        # The stall warning compares the objective over the last third of the run with the gradient norm;
        # a run that is already at the optimum can trip it (the gap bound is what this test checks).
        warnings.simplefilter("ignore", downpour.StepRuleStallWarning)
        res = downpour.train(
            model, (X, y), rule=rule, replicas=replicas, epochs=10, l2=l2, client=client,  # type: ignore[arg-type]
        )  # fmt: skip
    gap = (models.objective(model, res.x, X, y, l2=l2)[0] - f_star) / f_star
    assert res.success
    assert 0 <= gap < bound, gap


def test_adagrad_pushes_coalesce_at_most_the_cap(client: Client) -> None:
    # On a model this cheap, steps are far faster than a round trip: uncapped, pushes summed 25-58 steps.
    X, y = two_feature_logistic()
    res = downpour.train(models.Logistic(2), (X, y), replicas=2, epochs=3, client=client)
    assert res.success
    per = res.stats["per_replica"]
    for st in per.values():
        pushes = st["pushes"][0]
        # Every push sums at most the cap (the final flush too): steps <= cap * pushes, and the sum of the
        # squared step counts says no single push went past it either.
        assert st["steps"] <= ADAGRAD_MAX_COALESCE * pushes
        assert st["applied_steps_sq"][0] <= ADAGRAD_MAX_COALESCE * st["steps"]


def test_a_stalled_step_rule_is_warned(client: Client) -> None:
    # Adagrad at a rate far too small: the objective creeps, the gradient stays near its starting size.
    X, y = two_feature_logistic()
    with pytest.warns(downpour.StepRuleStallWarning, match="stalled"):
        res = downpour.train(
            models.Logistic(2), (X, y), rule="adagrad", lr=1e-4, replicas=1, epochs=10, eval_every=0.02,
            eval_data=two_feature_logistic(500, seed=1), client=client,
        )  # fmt: skip
    assert res.success and "warning: the step rule stalled: the training objective" in res.message
    assert res.history.attrs["warnings"] == [res.message.split("warning: ")[1]]
