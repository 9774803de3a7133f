"""Conformance of the batch methods: each one, written once against ``ParameterSpace``, runs in the in-process
space and in the sharded one (a real LocalCluster), reaches SciPy's optimum in both, and takes the same
iterates in both."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.optimize
from distributed import Client
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distbelief.sandblaster._cg import _minimize_cg
from distbelief.sandblaster._gd import _minimize_gd
from distbelief.sandblaster._minimize import SandblasterOptions, open_session
from distbelief.sandblaster._space import InProcessSpace, IterationRecord, ParameterSpace
from distbelief.sandblaster._vlbfgs import _minimize_lbfgs
from distbelief.storage import Dataset, Shard
from tests.sandblaster.conftest import Problem

SPACES = ["in_process", "sharded"]
METHODS = ["lbfgs", "cg", "gd"]
#: The problem each method is checked on: GD is too slow on the logistic one for a test.
PROBLEM_OF = {
    "lbfgs": "logistic_digits",
    "cg": "logistic_digits",
    "gd": "well_conditioned_least_squares",
}


def run_method(
    method: str,
    space: ParameterSpace,
    *,
    gtol: float = 1e-5,
    ftol: float = 2.220446049250313e-09,
    maxiter: int = 15000,
    callback: Callable[[IterationRecord], None] | None = None,
) -> tuple[bool, str]:
    """The method with ``sandblaster.minimize``'s defaults (restart period: the number of parameters)."""
    common: dict[str, Any] = {"gtol": gtol, "ftol": ftol, "maxiter": maxiter, "maxfev": 15000}
    if method == "lbfgs":
        return _minimize_lbfgs(space, m=10, callback=callback, **common)
    if method == "cg":
        return _minimize_cg(space, restart_every=_n_params(space), callback=callback, **common)
    return _minimize_gd(space, callback=callback, **common)


def _n_params(space: ParameterSpace) -> int:
    if isinstance(space, InProcessSpace):
        return space.vector(space.state.x).size
    return int(space.ps.n)  # type: ignore[attr-defined]


@contextlib.contextmanager
def started_space(kind: str, problem: Problem, client: Client, tmp: Path) -> Iterator[ParameterSpace]:
    """A space holding ``problem.x0``, evaluated there (iteration 0)."""
    if kind == "in_process":
        space = InProcessSpace(problem.fun_and_grad, problem.x0)
        space.start()
        yield space
        return
    ds = Dataset.from_arrays(problem.X, problem.y, path=str(tmp / "data"), portion_rows=256, overwrite=True)
    opts = SandblasterOptions(l2=problem.l2, portions=ds.n_portions)
    with open_session(
        problem.model, ds, client, str(tmp / "run"), opts, n=problem.x0.size, x0=problem.x0
    ) as coord:
        coord.start()
        yield coord


def final_x(space: ParameterSpace) -> np.ndarray:
    if isinstance(space, InProcessSpace):
        return space.vector(space.state.x).copy()
    return np.asarray(space.ps.gather(space.state.x))  # type: ignore[attr-defined]


@pytest.fixture
def space_client(request: pytest.FixtureRequest) -> Client | None:
    """The session's cluster, started only by tests that use the sharded space."""
    return (
        request.getfixturevalue("client") if request.node.callspec.params.get("kind") == "sharded" else None
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", SPACES)
def test_each_method_reaches_scipys_optimum_in_either_space(
    request: pytest.FixtureRequest, space_client: Client, tmp_path: Path, kind: str, method: str
) -> None:
    problem: Problem = request.getfixturevalue(PROBLEM_OF[method])
    with started_space(kind, problem, space_client, tmp_path) as space:
        if method == "lbfgs":
            # L-BFGS is SciPy's L-BFGS-B without bounds: the same optimum, about as many iterations.
            ref = problem.scipy(m=10)
            success, message = run_method(method, space)
            assert space.state.f == pytest.approx(ref.fun, rel=1e-8, abs=1e-12)
            assert abs(space.state.nit - ref.nit) <= max(1, 0.2 * ref.nit), (space.state.nit, ref.nit)
        else:
            ref = problem.scipy(gtol=1e-9, ftol=1e-15)
            success, message = run_method(method, space, gtol=1e-6, ftol=1e-13, maxiter=3000)
            assert space.state.f == pytest.approx(ref.fun, rel=1e-6)
        assert success, message
        objective = [r.objective for r in space.state.records]
        assert len(objective) == space.state.nit + 1
        assert np.all(np.diff(objective) <= 1e-15), "a monotone descent method"
        np.testing.assert_allclose(problem.fun_and_grad(final_x(space))[0], space.state.f, rtol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_both_spaces_take_the_same_iterates(
    request: pytest.FixtureRequest, client: Client, tmp_path: Path, method: str
) -> None:
    """Same steps, objectives and evaluation counts, iteration by iteration (the sharded gradient differs
    only in the order the portions are summed); and the coordinator's own round trips per iteration."""
    problem: Problem = request.getfixturevalue(PROBLEM_OF[method])
    runs: dict[str, tuple[list[IterationRecord], np.ndarray, tuple[bool, str]]] = {}
    for kind in SPACES:
        with started_space(kind, problem, client, tmp_path / kind) as space:
            seen: list[IterationRecord] = []
            outcome = run_method(method, space, maxiter=12, callback=seen.append)
            assert seen == space.state.records[1:]
            runs[kind] = (space.state.records, final_x(space), outcome)
    (local, x_local, out_local), (sharded, x_sharded, out_sharded) = runs["in_process"], runs["sharded"]
    assert out_local == out_sharded
    assert [r.nfev for r in local] == [r.nfev for r in sharded]
    np.testing.assert_allclose([r.step for r in sharded], [r.step for r in local], rtol=1e-8)
    np.testing.assert_allclose([r.objective for r in sharded], [r.objective for r in local], rtol=1e-11)
    np.testing.assert_allclose(x_sharded, x_local, rtol=1e-8, atol=1e-12)
    # Every method fuses its ops into the evaluations: a typical iteration costs the coordinator no round
    # trip of its own (before the ParameterSpace rewrite: CG 3, GD 1).
    assert np.median([r.round_trips for r in sharded[1:]]) == 0
    assert all(r.round_trips == 0 for r in local)


# -- the in-process space's ops are the shards' ops ---------------------------------------------------
_NAMES = ["a", "b", "c"]
_pair = st.tuples(st.sampled_from(_NAMES), st.sampled_from(_NAMES))
_op = st.one_of(
    st.tuples(st.just("dot"), st.sampled_from(_NAMES), st.sampled_from(_NAMES)),
    st.tuples(st.just("dots"), st.lists(_pair, max_size=3)),
    st.tuples(st.just("norm_inf"), st.sampled_from(_NAMES)),
    st.tuples(st.just("copy"), st.sampled_from(_NAMES), st.sampled_from([*_NAMES, "d"])),
    st.integers(1, 3).flatmap(
        lambda k: st.tuples(
            st.just("lincomb"),
            st.sampled_from([*_NAMES, "d"]),
            st.lists(st.floats(-3, 3, allow_nan=False), min_size=k, max_size=k),
            st.lists(st.sampled_from(_NAMES), min_size=k, max_size=k, unique=True),
        )
    ),
)


@settings(max_examples=60)
@given(
    vectors=hnp.arrays(np.float64, (3, 7), elements=st.floats(-1e3, 1e3, allow_nan=False)),
    ops=st.lists(_op, min_size=1, max_size=8),
)
def test_in_process_ops_equal_a_shards_ops_to_the_last_bit(vectors: np.ndarray, ops: list[Any]) -> None:
    space = InProcessSpace(lambda x: (0.0, x), np.zeros(7))
    shard = Shard(0, 0, 7)
    for name, vec in zip(_NAMES, vectors, strict=True):
        space.vectors[name] = vec.copy()
        shard.set(name, 0, 7, vec)
    for op in ops:
        if op[0] == "lincomb":
            op = ("lincomb", op[1], list(op[2]), list(op[3]))
        assert space.run([op]) == shard.run([op])
    for name in shard.vectors:
        np.testing.assert_array_equal(space.vector(name), shard.vector(name))


# -- every method against SciPy on random problems (in process: cheap) ------------------------------------
@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 12),
    log_cond=st.floats(0.0, 2.0),
    method=st.sampled_from(METHODS),
)
def test_each_method_solves_random_quadratics(seed: int, n: int, log_cond: float, method: str) -> None:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    hessian = (q * np.logspace(0.0, log_cond, n)) @ q.T
    b = rng.standard_normal(n)

    def fun_and_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
        hx = hessian @ x
        return float(0.5 * x @ hx - b @ x), hx - b

    x_star = np.linalg.solve(hessian, b)
    space = InProcessSpace(fun_and_grad, np.zeros(n))
    space.start()
    success, message = run_method(method, space, gtol=1e-6, ftol=1e-14, maxiter=5000)
    assert success, message
    np.testing.assert_allclose(space.vector(space.state.x), x_star, rtol=1e-4, atol=1e-5)
    if method == "lbfgs":
        # SciPy's L-BFGS-B takes the same steps: compare its first iterates' objective (later ones drift
        # apart by rounding once the gradient is tiny).
        seen: list[float] = []
        scipy.optimize.minimize(
            fun_and_grad, np.zeros(n), jac=True, method="L-BFGS-B",
            callback=lambda intermediate_result: seen.append(intermediate_result.fun),
            options={"maxcor": 10, "gtol": 1e-6, "ftol": 1e-14, "maxiter": 5000},
        )  # fmt: skip
        ours = [r.objective for r in space.state.records[1:]]
        k = min(5, len(seen))
        np.testing.assert_allclose(ours[:k], seen[:k], rtol=1e-10)


def test_an_in_process_lbfgs_run_resumes_exactly_from_its_checkpoint(logistic_digits: Problem) -> None:
    problem = logistic_digits
    full = InProcessSpace(problem.fun_and_grad, problem.x0)
    full.start()
    run_method("lbfgs", full, maxiter=12)
    first = InProcessSpace(problem.fun_and_grad, problem.x0, checkpoint_every=4)
    first.start()
    assert run_method("lbfgs", first, maxiter=10) == (False, "maximum number of iterations reached")
    meta = first.restore()
    assert first.state.nit == 8
    assert _minimize_lbfgs(
        first, m=10, gtol=1e-5, ftol=2.220446049250313e-09, maxiter=12, maxfev=15000, resume=meta
    ) == (False, "maximum number of iterations reached")
    np.testing.assert_array_equal(first.vector(first.state.x), full.vector(full.state.x))
    assert [r.objective for r in first.state.records] == [r.objective for r in full.state.records]


# -- the scale of F does not change the steps -------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e50, 1e-50])
@pytest.mark.parametrize("method", ["lbfgs", "cg"])
def test_lbfgs_and_cg_converge_whatever_the_scale_of_f(
    logistic_digits: Problem, method: str, scale: float
) -> None:
    """L-BFGS takes the same steps on ``scale * F`` as on ``F`` (and as many iterations as SciPy's
    L-BFGS-B where that one works); CG reaches the optimum in about as many. The first trial moves x by
    one unit along ``-g`` (L-BFGS-B's ``1/||g||``), the curvature check is L-BFGS-B's scale-free one."""
    problem = logistic_digits

    def scaled(x: np.ndarray) -> tuple[float, np.ndarray]:
        f, g = problem.fun_and_grad(x)
        return scale * f, scale * g

    spaces = {}
    for factor, fun in ((1.0, problem.fun_and_grad), (scale, scaled)):
        space = InProcessSpace(fun, problem.x0)
        space.start()
        # ftol=0: L-BFGS-B's relative test floors |f| at 1, which stops any run on F * 1e-50 at once.
        success, message = run_method(method, space, gtol=1e-5 * factor, ftol=0.0, maxiter=500)
        assert success, message
        spaces[factor] = space
    unit, other = spaces[1.0], spaces[scale]
    if method == "lbfgs":
        assert other.state.f / scale == pytest.approx(unit.state.f, rel=1e-9)
        assert other.state.nit == unit.state.nit
        np.testing.assert_allclose(other.vector(other.state.x), unit.vector(unit.state.x), rtol=1e-6)
        if scale > 1.0:
            # (SciPy itself stops after one step on F * 1e-50: its first step is capped at 1e10.)
            ref = scipy.optimize.minimize(
                scaled, problem.x0, jac=True, method="L-BFGS-B",
                options={"maxcor": 10, "gtol": 1e-5 * scale, "ftol": 0.0, "maxiter": 500},
            )  # fmt: skip
            assert other.state.nit == ref.nit
    else:
        # Both stop at max|g_i| <= 1e-5 (times the scale), a few 1e-7 of F above the optimum.
        assert other.state.f / scale == pytest.approx(unit.state.f, rel=1e-5)
        assert other.state.nit <= 2 * unit.state.nit


def test_gd_reaches_a_tight_tolerance_on_logistic_regression(logistic_digits: Problem) -> None:
    """Started at the Barzilai-Borwein step, GD meets max|g_i| <= 1e-7 in well under 200 iterations on
    logistic digits (~60); the step-doubling search alone needs ~470."""
    problem = logistic_digits
    ref = problem.scipy(gtol=1e-10, ftol=0.0)
    space = InProcessSpace(problem.fun_and_grad, problem.x0)
    space.start()
    success, message = _minimize_gd(space, gtol=1e-7, ftol=0.0, maxiter=2000, maxfev=10000)
    assert success, message
    assert space.state.nit < 200
    assert space.state.f == pytest.approx(ref.fun, rel=1e-9)
    np.testing.assert_allclose(space.vector(space.state.x), ref.x, atol=1e-4)
