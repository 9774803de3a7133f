"""OWL-QN (L1 / elastic-net L-BFGS, vector-free): its shard ops against numpy, its optimum and zero pattern
against scikit-learn's L1 logistic regression, the same iterates in either space, and its options."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from sklearn.linear_model import LogisticRegression

from distbelief import models, sandblaster
from distbelief.errors import InvalidOptionError
from distbelief.sandblaster._minimize import SandblasterOptions
from distbelief.sandblaster._owlqn import _minimize_owlqn, check_l1
from distbelief.sandblaster._space import InProcessSpace, IterationRecord
from distbelief.sandblaster._vlbfgs import _minimize_lbfgs
from distbelief.storage import Dataset, ParameterServer, Shard, reduce_results
from tests.sandblaster._reference import minimize_owlqn_reference
from tests.sandblaster.conftest import Problem
from tests.sandblaster.test_methods import final_x, started_space

TIGHT: dict[str, Any] = {"gtol": 1e-10, "ftol": 1e-15}


# -- the ops: against the paper's definitions, coordinate by coordinate ---------------------------------
def _pseudo_gradient_loop(g: np.ndarray, x: np.ndarray, l1: float) -> np.ndarray:
    """Andrew & Gao (2007), eq. (4), one coordinate at a time."""
    out = np.zeros_like(g)
    for i in range(g.size):
        if x[i] > 0:
            out[i] = g[i] + l1
        elif x[i] < 0:
            out[i] = g[i] - l1
        elif g[i] + l1 < 0:
            out[i] = g[i] + l1
        elif g[i] - l1 > 0:
            out[i] = g[i] - l1
    return out


# Exact zeros are where OWL-QN's cases differ: draw plenty of them.
_entries = st.one_of(st.just(0.0), st.floats(-10, 10, allow_nan=False), st.sampled_from([-1.0, 1.0]))


@settings(max_examples=80, deadline=None)
@given(
    vecs=hnp.arrays(np.float64, (4, 9), elements=_entries),
    l1=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 5.0)),
    cut=st.integers(0, 9),
)
def test_the_l1_ops_follow_the_paper_on_any_split_into_shards(vecs: np.ndarray, l1: float, cut: int) -> None:
    g, x, d, v0 = vecs
    v = _pseudo_gradient_loop(g, x, l1)
    xi = np.array([np.sign(x[i]) if x[i] != 0 else np.sign(-v[i]) for i in range(9)])
    d_aligned = np.array([d[i] if np.sign(d[i]) == np.sign(-v[i]) else 0.0 for i in range(9)])
    x_proj = np.array([d[i] if np.sign(d[i]) == xi[i] else 0.0 for i in range(9)])
    # Two shards holding [0, cut) and [cut, 9), reduced as the server reduces them, and the in-process space.
    # One shard holding everything computes the same bits as the in-process space; two, up to summation order.
    shards, whole = [Shard(0, 0, cut), Shard(1, cut, 9)], Shard(2, 0, 9)
    space = InProcessSpace(lambda w: (0.0, w), np.zeros(9))
    for name, vec in {"g": g, "x": x, "d": d, "t": d, "v0": v0}.items():
        space.vectors[name] = vec.copy()
        for s in [*shards, whole]:
            s.set(name, s.lo, s.hi, vec[s.lo : s.hi])
    ops = [
        ("pseudo_grad", "v", "g", "x", l1),
        ("sign_align", "d", "v"),
        ("orthant", "xi", "x", "v"),
        ("project_orthant", "t", "xi"),
        ("nnz", "x"),
        ("norm1", "x"),
        ("pseudo_grad", "v0", "v0", "x", 0.0),  # dst among the inputs; l1 = 0 gives g back
    ]
    local = space.run(ops)
    assert whole.run(ops) == local
    count, norm = reduce_results(ops, [s.run(ops) for s in shards])[4:6]
    assert count == local[4] and norm == pytest.approx(local[5], rel=1e-14)
    assert local[4] == np.count_nonzero(x)
    assert local[5] == pytest.approx(np.abs(x).sum(), rel=1e-15)
    for name, want in {"v": v, "d": d_aligned, "xi": xi, "t": x_proj, "v0": v0}.items():
        np.testing.assert_array_equal(space.vector(name), want, err_msg=name)
        np.testing.assert_array_equal(np.concatenate([s.vector(name) for s in shards]), want, err_msg=name)
    # The aligned direction is a descent direction for F unless it is 0 (each kept entry opposes v: by
    # signs, as d @ v underflows to 0 for tiny entries); the projection stays in xi.
    kept = space.vector("d") != 0
    assert np.all(np.sign(space.vector("d")[kept]) == -np.sign(v[kept]))
    assert np.all(space.vector("t") * xi >= 0)


def test_the_server_knows_the_l1_ops_and_how_to_reduce_them(client: Client, tmp_path: Path) -> None:
    x = np.array([0.0, -2.0, 0.5, 0.0, 3.0, 0.0, -0.25])
    ps = ParameterServer.create(client, x.size, shards=2, store=str(tmp_path / "ps"), vectors={"x": x})
    try:
        assert ps.run([("nnz", "x"), ("norm1", "x")]) == [4, 5.75]
    finally:
        ps.close()


# -- against scikit-learn ---------------------------------------------------------------------------------
def _sklearn(X: np.ndarray, y: np.ndarray, C: float, solver: str, l1_ratio: float = 1.0) -> np.ndarray:
    """sklearn's ``min ||w||_1 + C sum_i loss_i`` (or its elastic net), solved to a tiny tolerance.

    ``random_state`` pinned: liblinear and saga visit the coordinates in a random order, and at this
    tolerance some orders took minutes instead of a second (a test that hung one run in several).
    """
    penalty = {"penalty": "l1"} if l1_ratio == 1.0 else {"penalty": "elasticnet", "l1_ratio": l1_ratio}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FutureWarning on `penalty` in recent releases
        est = LogisticRegression(
            C=C, solver=solver, fit_intercept=False, tol=1e-14, max_iter=100_000, random_state=0, **penalty
        )
        return np.asarray(est.fit(X, y).coef_).ravel()


def _sparse_truth() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 30))
    w = np.zeros(30)
    w[:5] = [3.0, -2.0, 1.5, -1.0, 2.0]
    return X, (rng.random(400) < 1 / (1 + np.exp(-X @ w))).astype(float)


def _digits_binary(digits: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    X, y = digits
    return X / 16.0, (y == 0).astype(float)


@pytest.mark.parametrize(
    ("data", "C", "solver", "l1_ratio"),
    [
        ("digits", 0.1, "liblinear", 1.0),
        ("digits", 1.0, "liblinear", 1.0),
        ("sparse_truth", 0.05, "saga", 1.0),
        ("sparse_truth", 0.5, "liblinear", 1.0),
        ("sparse_truth", 0.05, "saga", 0.5),  # elastic net
        ("sparse_truth", 0.5, "saga", 0.3),
    ],
)
def test_owlqn_reaches_sklearns_l1_objective_and_zero_pattern(
    digits: tuple[np.ndarray, np.ndarray], data: str, C: float, solver: str, l1_ratio: float
) -> None:
    X, y = _digits_binary(digits) if data == "digits" else _sparse_truth()
    n, p = X.shape
    # sklearn: ||w||_1 + C sum loss (elastic net: r||w||_1 + (1-r)/2 ||w||^2 + C sum loss); ours is / CN.
    l1, l2 = l1_ratio / (C * n), (1.0 - l1_ratio) / (C * n)
    model = models.Logistic(p, fit_intercept=False)

    def smooth(w: np.ndarray) -> tuple[float, np.ndarray]:
        return models.objective(model, w, X, y, l2=l2)

    w_sk = _sklearn(X, y, C, solver, l1_ratio)
    f_sk = smooth(w_sk)[0] + l1 * np.abs(w_sk).sum()
    res = minimize_owlqn_reference(smooth, np.zeros(p), l1=l1, **TIGHT)
    assert res.success, res.message
    assert res.fun == pytest.approx(f_sk, rel=1e-6)
    assert res.fun <= f_sk * (1 + 1e-9), "no worse than sklearn's"
    np.testing.assert_array_equal(res.x == 0.0, w_sk == 0.0)
    assert 0 < np.count_nonzero(res.x) < p, "a sparse solution, neither empty nor dense"


# -- the same method in either space -------------------------------------------------------------------
@pytest.fixture(scope="module")
def elastic_digits(digits: tuple[np.ndarray, np.ndarray]) -> Problem:
    X, y = _digits_binary(digits)
    model = models.Logistic(64)
    return Problem(model, X, y, 1e-4, np.zeros(model.n_params))


def test_both_spaces_take_the_same_owlqn_iterates(
    client: Client, tmp_path: Path, elastic_digits: Problem
) -> None:
    """Same steps, F, nonzero counts and evaluations, iteration by iteration; no coordinator round trip in a
    typical iteration."""
    problem, l1 = elastic_digits, 2e-3
    runs: dict[str, tuple[list[IterationRecord], np.ndarray, tuple[bool, str]]] = {}
    for kind in ("in_process", "sharded"):
        with started_space(kind, problem, client, tmp_path / kind) as space:
            seen: list[IterationRecord] = []
            outcome = _minimize_owlqn(
                space, l1=l1, m=10, gtol=1e-8, ftol=1e-13, maxiter=25, maxfev=1000, callback=seen.append
            )
            assert seen == space.state.records[1:]
            runs[kind] = (space.state.records, final_x(space), outcome)
            if kind == "sharded":
                own_calls = space.ps.stats.by_method.get("run", 0)  # type: ignore[attr-defined]
    (local, x_local, out_local), (sharded, x_sharded, out_sharded) = runs["in_process"], runs["sharded"]
    assert out_local == out_sharded
    assert len(local) == 26
    assert [r.nfev for r in local] == [r.nfev for r in sharded]
    assert [r.nnz for r in local] == [r.nnz for r in sharded]
    np.testing.assert_allclose([r.step for r in sharded], [r.step for r in local], rtol=1e-8)
    np.testing.assert_allclose([r.objective for r in sharded], [r.objective for r in local], rtol=1e-11)
    np.testing.assert_allclose(x_sharded, x_local, rtol=1e-8, atol=1e-12)
    assert local[-1].nnz == np.count_nonzero(x_local) < x_local.size
    # F (L1 term included) goes down monotonically and is the F of the final x.
    objective = [r.objective for r in local]
    assert np.all(np.diff(objective) < 0)
    f_smooth = problem.fun_and_grad(x_local)[0]
    assert objective[-1] == pytest.approx(f_smooth + l1 * np.abs(x_local).sum(), rel=1e-13)
    # The first iteration asks for the pseudo-gradient at x0 and its dots; then every op rides on evaluations.
    # (An evaluation whose last pushes' reports were lost asks the shards for their results: "final_results",
    # the scheduler's fallback, not the method's.)
    assert own_calls == 1 and sharded[1].round_trips >= 1
    assert np.median([r.round_trips for r in sharded[1:]]) == 0


def test_minimize_runs_owlqn_on_the_cluster_and_reports_nonzeros(
    client: Client, tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    X, y = _digits_binary(digits)
    C = 1.0
    l1 = 1.0 / (C * len(y))
    ds = Dataset.from_arrays(X, y, path=str(tmp_path / "data"), portion_rows=512, overwrite=True)
    model = models.Logistic(64, fit_intercept=False)
    res = sandblaster.minimize(model, ds, method="owlqn", l1=l1, client=client, **TIGHT)
    w_sk = _sklearn(X, y, C, "liblinear")
    f_sk = models.objective(model, w_sk, X, y)[0] + l1 * np.abs(w_sk).sum()
    assert res.success, res.message
    assert res.fun == pytest.approx(f_sk, rel=1e-6)
    np.testing.assert_array_equal(res.x == 0.0, w_sk == 0.0)
    nnz = res.history.nnz.values
    assert nnz[0] == 0 and nnz[-1] == np.count_nonzero(res.x) == np.count_nonzero(w_sk)
    assert np.median(res.history.round_trips.values[1:]) == 0
    smooth = sandblaster.minimize(model, ds, maxiter=2, client=client)
    assert "nnz" not in smooth.history


# -- l1 = 0, resume, options -------------------------------------------------------------------------------
def test_owlqn_with_no_l1_takes_lbfgs_iterates(logistic_digits: Problem) -> None:
    problem = logistic_digits
    records = []
    for method in ("owlqn", "lbfgs"):
        space = InProcessSpace(problem.fun_and_grad, problem.x0)
        space.start()
        common: dict[str, Any] = {"m": 10, "gtol": 1e-5, "ftol": 1e-12, "maxiter": 30, "maxfev": 1000}
        if method == "owlqn":
            out = _minimize_owlqn(space, l1=0.0, **common)
        else:
            out = _minimize_lbfgs(space, **common)
        records.append(([(r.objective, r.step, r.nfev) for r in space.state.records], out))
    assert records[0] == records[1]
    assert len(records[0][0]) > 10 and records[0][1][0], records[0][1]


def test_an_owlqn_run_resumes_from_its_checkpoint_exactly(elastic_digits: Problem) -> None:
    problem = elastic_digits
    common: dict[str, Any] = {"l1": 2e-3, "m": 5, "gtol": 1e-10, "ftol": 0.0, "maxfev": 1000}
    full = InProcessSpace(problem.fun_and_grad, problem.x0)
    full.start()
    _minimize_owlqn(full, maxiter=16, **common)
    part = InProcessSpace(problem.fun_and_grad, problem.x0, checkpoint_every=4)
    part.start()
    _minimize_owlqn(part, maxiter=10, **common)
    meta = part.restore()
    assert part.state.nit == 8
    _minimize_owlqn(part, maxiter=16, resume=meta, **common)
    assert [(r.objective, r.nnz) for r in part.state.records] == [
        (r.objective, r.nnz) for r in full.state.records
    ]
    np.testing.assert_array_equal(part.vector(part.state.x), full.vector(full.state.x))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"method": "owlqn", "l1": -1.0}, r"l1=.* is invalid: expected a finite number >= 0"),
        ({"method": "owlqn", "l1": math.nan}, r"l1=.* is invalid: expected a finite number >= 0"),
        ({"method": "owlqn", "l1": math.inf}, r"l1=.* is invalid: expected a finite number >= 0"),
        ({"method": "lbfgs", "l1": 0.1}, 'use method="owlqn"'),
        ({"method": "cg", "l1": 1e-9}, 'use method="owlqn"'),
        ({"method": "owlqn", "l1": 0.1, "l2": math.nan}, r"l2=nan is invalid"),
        (
            {"method": "owlqn", "l1": 0.1, "l1_exclude": [(3, 2)]},
            r"l1_exclude=.* is invalid: expected ranges",
        ),
        ({"method": "owlqn", "l1": 0.1, "l1_exclude": 5}, r"l1_exclude=5 is invalid"),
    ],
)
def test_bad_l1_options_are_refused_with_a_message(options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        SandblasterOptions(**options)


def test_the_method_itself_refuses_a_bad_l1() -> None:
    space = InProcessSpace(lambda x: (float(x @ x), 2 * x), np.ones(2))
    space.start()
    for bad in (-0.5, math.nan, True, "0.1"):
        with pytest.raises(InvalidOptionError, match="l1 must be"):
            _minimize_owlqn(space, l1=bad, m=3, gtol=1e-6, ftol=0.0, maxiter=5, maxfev=50)  # type: ignore[arg-type]
    assert SandblasterOptions(method="owlqn", l1=0.1).l1 == check_l1(0.1) == 0.1


def test_a_large_l1_stops_at_zero_at_once() -> None:
    """With ``l1 >= max|g(0)|`` the pseudo-gradient at 0 is 0: x0 = 0 is the optimum."""
    fg = lambda x: (0.5 * float(x @ x) - float(x @ [1.0, -2.0]), x - np.array([1.0, -2.0]))  # noqa: E731
    res = minimize_owlqn_reference(fg, np.zeros(2), l1=2.0)
    assert (res.success, res.nit, res.nfev, res.message) == (
        True,
        0,
        1,
        "pseudo-gradient inf-norm <= gtol at x0",
    )
    res = minimize_owlqn_reference(fg, np.zeros(2), l1=1.5, gtol=1e-12)
    np.testing.assert_allclose(res.x, [0.0, -0.5], atol=1e-12)
    assert res.x[0] == 0.0


# -- parameters without an L1 term (intercepts) ---------------------------------------------------------
def test_l1_exclude_leaves_those_parameters_out_of_the_l1_term() -> None:
    # f = 0.5 ||x - c||^2: the argmin soft-thresholds c by l1, except where the L1 term is left out.
    c = np.array([3.0, -0.5, 2.0, -3.0])
    fg = lambda x: (0.5 * float((x - c) @ (x - c)), x - c)  # noqa: E731
    r = minimize_owlqn_reference(fg, np.zeros(4), l1=1.0, gtol=1e-12, l1_exclude=[(1, 3)])
    assert r.success, r.message
    np.testing.assert_allclose(r.x, [2.0, -0.5, 2.0, -2.0], atol=1e-12)
    assert r.fun == pytest.approx(0.5 * 2 + 1.0 * 4)  # the excluded ones fit c exactly, and cost no L1
    g, x = np.array([0.5, -0.5, 0.25]), np.zeros(3)
    # Split into shards, a shard's ops on its slice give the slice of the whole vector's.
    whole = Shard(0, 0, 3)
    whole.vectors.update({"g": g.copy(), "x": x.copy()})
    whole.run([("pseudo_grad", "v", "g", "x", 1.0, ((1, 3),))])
    halves = [Shard(0, 0, 2), Shard(1, 2, 3)]
    for h in halves:
        h.vectors.update({"g": g[h.lo : h.hi].copy(), "x": x[h.lo : h.hi].copy()})
        h.run([("pseudo_grad", "v", "g", "x", 1.0, ((1, 3),))])
    np.testing.assert_array_equal(whole.vector("v"), [0.0, -0.5, 0.25])
    np.testing.assert_array_equal(np.concatenate([h.vector("v") for h in halves]), whole.vector("v"))
    n1 = [h.run([("norm1", "g", ((1, 3),))])[0] for h in halves]
    assert sum(n1) == 0.5


def test_minimize_with_l1_exclude_on_shards_matches_the_in_process_run(
    client: Client, tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    X, y = _digits_binary(digits)
    l1 = 1.0 / len(y)
    model = models.Logistic(64)
    ds = Dataset.from_arrays(X, y, path=str(tmp_path / "data"), portion_rows=512, overwrite=True)
    # Two shards, the intercept (parameter 64) in the second: its range is cut to that shard's slice.
    res = sandblaster.minimize(
        model, ds, method="owlqn", l1=l1, l1_exclude=[(64, 65)], shards=2, client=client, **TIGHT
    )
    ref = minimize_owlqn_reference(
        lambda w: models.objective(model, w, X, y), np.zeros(65), l1=l1, l1_exclude=[(64, 65)], **TIGHT
    )
    assert res.success and ref.success, (res.message, ref.message)
    assert res.fun == pytest.approx(ref.fun, rel=1e-9)
    np.testing.assert_array_equal(res.x == 0.0, ref.x == 0.0)
    assert res.x[64] != 0.0  # the intercept of an unbalanced problem, not shrunk to zero
    for where in ({"client": client}, {"local": True}):
        with pytest.raises(InvalidOptionError, match=r"l1_exclude range \(64, 66\) ends past"):
            data = ds if "client" in where else (X, y)
            sandblaster.minimize(model, data, method="owlqn", l1=l1, l1_exclude=[(64, 66)], **where)


def test_a_float32_history_ends_within_1e_6_of_float64(elastic_digits: Problem) -> None:
    problem = elastic_digits
    common: dict[str, Any] = {"l1": 2e-3, "m": 10, "gtol": 1e-7}
    f64 = minimize_owlqn_reference(problem.fun_and_grad, problem.x0, history_dtype="float64", **common)
    f32 = minimize_owlqn_reference(problem.fun_and_grad, problem.x0, history_dtype="float32", **common)
    assert f64.success and f32.success, (f64.message, f32.message)
    assert f32.nit == f64.nit
    assert abs(f32.fun - f64.fun) <= 1e-6 * abs(f64.fun)
    np.testing.assert_array_equal(f32.x == 0.0, f64.x == 0.0)  # the same sparsity pattern
    assert not np.array_equal(f32.x, f64.x)
