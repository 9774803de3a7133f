"""Vector-free L-BFGS: the coefficients on the dot-product matrix against the classic two-loop recursion,
the dot-request protocol (exact counts, dimension-free), the curvature check, and the reference driver
against SciPy's L-BFGS-B."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from distbelief.errors import DatasetError, InvalidOptionError, ProtocolError
from distbelief.sandblaster._space import InProcessSpace
from distbelief.sandblaster._vlbfgs import (
    VLBFGSHistory,
    _minimize_lbfgs,
    _SpeculativePair,
    history_ops,
    vlbfgs_coefficients,
)
from tests.sandblaster._problems import Problem, ill_conditioned_lsq, logistic_digits, rosenbrock
from tests.sandblaster._reference import minimize_lbfgs_reference, two_loop_reference


@pytest.fixture(autouse=True)
def _one_blas_thread() -> Iterator[None]:
    # These problems are tiny: BLAS threads only add contention (the machine is shared), not speed.
    with threadpool_limits(1):
        yield


def _deliver(hist: VLBFGSHistory, vec: dict[str, np.ndarray], grad: str = "g") -> list[tuple[str, str]]:
    """One dots round trip, with numpy standing in for the shards."""
    requests = hist.dot_requests(grad)
    hist.update_dots([float(vec[a] @ vec[b]) for a, b in requests])
    return requests


def _direction(hist: VLBFGSHistory, vec: dict[str, np.ndarray]) -> np.ndarray:
    return sum((c * vec[name] for c, name in hist.direction_coefficients()), np.zeros_like(vec["g"]))


def _expected_count(kept_before: int, m: int, pushed: bool) -> int:
    """Requests per iteration, derived in VLBFGSHistory's docstring."""
    if not pushed:
        return 2 * kept_before + 1
    if kept_before < m:
        return 6 * (kept_before + 1)
    return 6 * m + 2


def _relerr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 1e-300)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 40),
    iters=st.integers(0, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_coefficients_match_two_loop_and_counts(m: int, n: int, iters: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    hist = VLBFGSHistory(m)
    vec = {"g": rng.standard_normal(n)}
    kept_s: list[np.ndarray] = []
    kept_y: list[np.ndarray] = []
    requests = _deliver(hist, vec)
    assert len(requests) == 1
    np.testing.assert_allclose(_direction(hist, vec), -vec["g"], rtol=0, atol=0)
    for _ in range(iters):
        kept_before = hist.n_pairs
        s_name, y_name = hist.push_pair()
        s = rng.standard_normal(n)
        y = rng.uniform(0.2, 5.0, n) * s  # y = D s with D positive diagonal: s.y > 0
        vec[s_name], vec[y_name], vec["g"] = s, y, rng.standard_normal(n)
        requests = _deliver(hist, vec)
        assert len(requests) == _expected_count(kept_before, m, pushed=True)
        assert len(set(map(frozenset, requests))) == len(requests)  # each symmetric entry once
        assert hist._last_accepted is True
        kept_s, kept_y = [*kept_s, s][-m:], [*kept_y, y][-m:]
        assert hist.n_pairs == len(kept_s)
        # The cached matrix is the Gram matrix of the base vectors, old entries included.
        base = np.stack([vec[name] for name in hist.base_names()])
        np.testing.assert_allclose(hist.dot_matrix(), base @ base.T, rtol=1e-12, atol=1e-12)
        expected = two_loop_reference(vec["g"], kept_s, kept_y)
        assert _relerr(_direction(hist, vec), expected) <= 1e-10
    # A second gradient at the same history (e.g. after a restart elsewhere) needs 2k + 1 dots.
    vec["g"] = rng.standard_normal(n)
    assert len(_deliver(hist, vec)) == _expected_count(hist.n_pairs, m, pushed=False)
    assert _relerr(_direction(hist, vec), two_loop_reference(vec["g"], kept_s, kept_y)) <= 1e-10
    # Never more than m + 1 slot pairs in use, whatever the number of iterations.
    used = {name for pair in hist.pair_names for name in pair}
    assert used <= set(hist._s_names) | set(hist._y_names)


@pytest.mark.parametrize("m", [1, 3, 7])
def test_requests_do_not_depend_on_dimension(m: int) -> None:
    def run(n: int) -> list[list[tuple[str, str]]]:
        rng = np.random.default_rng(0)
        hist = VLBFGSHistory(m)
        vec = {"g": rng.standard_normal(n)}
        out = [_deliver(hist, vec)]
        for _ in range(2 * m + 3):
            s_name, y_name = hist.push_pair()
            vec[s_name] = rng.standard_normal(n)
            vec[y_name] = 2.0 * vec[s_name]
            vec["g"] = rng.standard_normal(n)
            out.append(_deliver(hist, vec))
        return out

    small, large = run(3), run(5000)
    assert small == large
    assert max(len(r) for r in small) == 6 * m + 2  # O(m) per iteration, once the memory is full


def test_vlbfgs_coefficients_equal_two_loop_directly() -> None:
    rng = np.random.default_rng(1)
    n, k = 25, 6
    a = rng.standard_normal((n, n))
    hess = a @ a.T + n * np.eye(n)
    s_list = [rng.standard_normal(n) for _ in range(k)]
    y_list = [hess @ s for s in s_list]
    g = rng.standard_normal(n)
    base = np.stack([*s_list, *y_list, g])
    d = vlbfgs_coefficients(base @ base.T) @ base
    assert _relerr(d, two_loop_reference(g, s_list, y_list)) <= 1e-12
    with pytest.raises(InvalidOptionError):
        vlbfgs_coefficients(np.eye(4))


def test_two_loop_reference_is_exact_on_a_quadratic_after_n_steps() -> None:
    # BFGS with exact line searches on a quadratic recovers the inverse Hessian after n conjugate steps;
    # a weaker but oracle-independent check: H y_k = s_k holds for the newest pair (secant equation).
    rng = np.random.default_rng(2)
    n = 8
    a = rng.standard_normal((n, n))
    hess = a @ a.T + np.eye(n)
    s_list = [rng.standard_normal(n) for _ in range(4)]
    y_list = [hess @ s for s in s_list]
    np.testing.assert_allclose(-two_loop_reference(y_list[-1], s_list, y_list), s_list[-1], rtol=1e-10)


def _small_history(
    m: int, pairs: int, n: int = 6, seed: int = 0
) -> tuple[VLBFGSHistory, dict[str, np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    hist = VLBFGSHistory(m)
    vec: dict[str, np.ndarray] = {"g": rng.standard_normal(n)}
    _deliver(hist, vec)
    s_list: list[np.ndarray] = []
    y_list: list[np.ndarray] = []
    for _ in range(pairs):
        s_name, y_name = hist.push_pair()
        vec[s_name] = rng.standard_normal(n)
        vec[y_name] = 3.0 * vec[s_name] + 0.1 * rng.standard_normal(n)
        vec["g"] = rng.standard_normal(n)
        assert _deliver(hist, vec) and hist._last_accepted
        s_list.append(vec[s_name])
        y_list.append(vec[y_name])
    return hist, vec, s_list[-m:], y_list[-m:]


@pytest.mark.parametrize(("m", "pairs"), [(3, 1), (3, 3), (2, 5)])
@pytest.mark.parametrize("bad_y", ["negative", "tiny"])
def test_curvature_check_skips_pair_and_keeps_memory(m: int, pairs: int, bad_y: str) -> None:
    hist, vec, s_list, y_list = _small_history(m, pairs)
    kept = hist.pair_names
    s_name, y_name = hist.push_pair()
    assert (s_name, y_name) not in kept  # a free slot: a skipped pair destroys nothing
    s = np.arange(1.0, 7.0)
    if bad_y == "negative":
        y = -s
    else:
        # s.y = 1e-20 * y.y > 0, yet below eps * y.y: skipped.
        perp = np.array([2.0, -1.0, 0, 0, 0, 0]) * 1e3  # orthogonal to s
        y = perp + 1e-20 * (perp @ perp) * s / (s @ s)
        assert s @ y > 0
    vec[s_name], vec[y_name] = s, y
    vec["g"] = np.linspace(-1.0, 2.0, 6)
    _deliver(hist, vec)
    assert hist._last_accepted is False
    assert hist.pair_names == kept
    assert _relerr(_direction(hist, vec), two_loop_reference(vec["g"], s_list, y_list)) <= 1e-10
    # The skipped pair's slot is the next one handed out.
    assert hist.push_pair() == (s_name, y_name)


@pytest.mark.parametrize("scale", [1e-50, 1.0, 1e50])
def test_the_curvature_check_given_the_descent_is_scale_free(scale: float) -> None:
    """With ``descent = -g.s`` the check is L-BFGS-B's ``s.y > eps * (-g.s)``: the same decision for F
    scaled by any factor (y, g and the descent scale with F, s does not). Without it, ``s.y > eps * y.y``
    skips the pair once F is scaled by 1e50."""
    s = np.array([1.0, 0.5, 0.0])
    y = scale * np.array([2.0, 0.0, 1.0])
    g = scale * np.array([-1.0, 0.0, 0.5])
    decisions = []
    for descent in (float(-(g @ s)), None):
        hist = VLBFGSHistory(3)
        _deliver(hist, {"g": g})
        s_name, y_name = hist.push_pair()
        vec = {s_name: s, y_name: y, "g": g}
        requests = hist.dot_requests("g")
        decisions.append(hist.update_dots([float(vec[a] @ vec[b]) for a, b in requests], descent=descent))
    assert decisions == [True, scale < 1e10]


def test_alternating_gradient_names() -> None:
    # The coordinator keeps the trial gradient under a second name and swaps the two each iteration.
    rng = np.random.default_rng(4)
    n, m = 9, 3
    hist = VLBFGSHistory(m, prefix="h")
    vec = {"ga": rng.standard_normal(n)}
    hist.update_dots([float(vec[a] @ vec[b]) for a, b in hist.dot_requests("ga")])
    s_list: list[np.ndarray] = []
    y_list: list[np.ndarray] = []
    grad = "ga"
    decisions = []
    for it in range(8):
        s_name, y_name = hist.push_pair()
        assert s_name.startswith("hs") and y_name.startswith("hy")
        new = "gb" if grad == "ga" else "ga"
        vec[new] = rng.standard_normal(n)
        vec[s_name] = rng.standard_normal(n)
        vec[y_name] = vec[new] - vec[grad] if it % 3 else 2.0 * vec[s_name]
        grad = new
        hist.update_dots([float(vec[a] @ vec[b]) for a, b in hist.dot_requests(grad)])
        decisions.append(hist._last_accepted)
        if hist._last_accepted:
            s_list, y_list = [*s_list, vec[s_name]][-m:], [*y_list, vec[y_name]][-m:]
        assert hist.base_names()[-1] == grad
        d = sum((c * vec[name] for c, name in hist.direction_coefficients()), np.zeros(n))
        assert _relerr(d, two_loop_reference(vec[grad], s_list, y_list)) <= 1e-10
    assert True in decisions and False in decisions  # both branches exercised


def test_reset_gives_steepest_descent() -> None:
    hist, vec, _, _ = _small_history(4, 3)
    hist.reset()
    assert hist.n_pairs == 0
    np.testing.assert_array_equal(_direction(hist, vec), -vec["g"])
    s_name, _ = hist.push_pair()
    assert s_name == "s0"


def test_mapping_delivery_in_any_order() -> None:
    hist, vec, s_list, y_list = _small_history(3, 2)
    s_name, y_name = hist.push_pair()
    vec[s_name], vec[y_name] = np.ones(6), 2.0 * np.ones(6)
    vec["gt"] = np.arange(6.0)
    requests = hist.dot_requests("gt")
    assert hist.update_dots({(b, a): float(vec[a] @ vec[b]) for a, b in reversed(requests)}) is True
    d = sum((c * vec[name] for c, name in hist.direction_coefficients()), np.zeros(6))
    expected = two_loop_reference(vec["gt"], [*s_list, vec[s_name]], [*y_list, vec[y_name]])
    assert _relerr(d, expected) <= 1e-10


def test_protocol_errors() -> None:
    with pytest.raises(InvalidOptionError):
        VLBFGSHistory(0)
    with pytest.raises(InvalidOptionError):
        VLBFGSHistory(3, curvature_eps=-1.0)
    hist = VLBFGSHistory(2)
    with pytest.raises(ProtocolError):
        hist.update_dots([1.0])
    with pytest.raises(ProtocolError):
        hist.direction_coefficients()
    with pytest.raises(InvalidOptionError):
        hist.dot_requests("s0")
    requests = hist.dot_requests("g")
    with pytest.raises(ProtocolError):
        hist.update_dots([1.0, 2.0])
    with pytest.raises(ProtocolError):
        hist.push_pair()
    with pytest.raises(ProtocolError):
        hist.update_dots({("x", "y"): 1.0})
    with pytest.raises(DatasetError):
        hist.update_dots([float("nan")] * len(requests))
    hist.dot_requests("g")
    hist.update_dots([4.0])
    assert hist.direction_coefficients() == [(-1.0, "g")]
    hist.push_pair()
    with pytest.raises(ProtocolError):
        hist.push_pair()
    with pytest.raises(ProtocolError):
        hist.direction_coefficients()


# -- the reference driver against SciPy's L-BFGS-B ----------------------------------------------------


# Default tolerances on the logistic problem (the runs coincide step for step). On the two slow problems
# the ftol rule fires while f is still ~1e-7 (relative) above the optimum, at a point that depends on
# rounding; tighter tolerances make both runs reach the optimum, so their objectives can be compared.
CASES = [
    ("logistic", logistic_digits, 10, {}),
    ("logistic-m3", logistic_digits, 3, {}),
    ("lsq", ill_conditioned_lsq, 10, {"gtol": 1e-8, "ftol": 1e-13}),
    ("rosenbrock", rosenbrock, 10, {"gtol": 1e-8, "ftol": 1e-13}),
    ("rosenbrock-m3", rosenbrock, 3, {"gtol": 1e-8, "ftol": 1e-13}),
]


@pytest.mark.parametrize(("name", "make", "m", "tols"), CASES, ids=[c[0] for c in CASES])
def test_reference_lbfgs_matches_scipy(
    name: str, make: Callable[[], Problem], m: int, tols: dict[str, Any]
) -> None:
    fg, x0 = make()
    ref = minimize_lbfgs_reference(fg, x0, m=m, maxiter=5000, **tols)
    sp = minimize(fg, x0, jac=True, method="L-BFGS-B", options={"maxcor": m, "maxiter": 5000, **tols})
    assert ref.success and sp.success
    assert abs(ref.fun - sp.fun) <= 1e-8 * max(abs(sp.fun), 1.0)
    assert abs(ref.nit - sp.nit) <= 0.2 * sp.nit
    if name.startswith("logistic"):
        # Same algorithm, same arithmetic up to rounding: identical counts on a benign problem.
        assert (ref.nit, ref.nfev) == (sp.nit, sp.nfev)


def test_reference_lbfgs_budget_and_bad_input() -> None:
    fg, x0 = rosenbrock(10)
    r = minimize_lbfgs_reference(fg, x0, maxiter=5)
    assert (r.success, r.nit) == (False, 5)
    start = minimize_lbfgs_reference(fg, np.ones(10))
    assert (start.success, start.nit, start.nfev) == (True, 0, 1)
    with pytest.raises(DatasetError):
        minimize_lbfgs_reference(lambda x: (float("nan"), x), np.ones(3))
    with pytest.raises(InvalidOptionError):
        minimize_lbfgs_reference(fg, x0, maxiter=0)
    with pytest.raises(InvalidOptionError):
        minimize_lbfgs_reference(fg, x0, gtol=-1.0)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 6), iters=st.integers(0, 12), seed=st.integers(0, 2**32 - 1))
def test_copy_is_independent_and_equals_deepcopy(m: int, iters: int, seed: int) -> None:
    import copy

    rng = np.random.default_rng(seed)
    n = 5
    vec = {"g": rng.normal(size=n)}
    hist = VLBFGSHistory(m)
    for _ in range(iters):
        _deliver(hist, vec)
        snapshot = hist.to_state()
        fast, slow = hist.copy(), copy.deepcopy(hist)
        assert fast.to_state() == slow.to_state() == snapshot
        # Push a pair on the copy only: the original must not see it.
        s_name, y_name = fast.push_pair()
        vec[s_name], vec[y_name] = rng.normal(size=n), rng.normal(size=n)
        _deliver(fast, vec)
        assert hist.to_state() == snapshot
        hist = fast


@pytest.mark.parametrize(("m", "pairs"), [(3, 0), (3, 2), (2, 5)])
def test_a_history_rebuilt_from_its_json_state_goes_on_alike(m: int, pairs: int) -> None:
    """A checkpoint's state (through JSON, as the store keeps it), taken with dot products outstanding,
    rebuilds a history that takes the same values and gives the same coefficients, bit for bit."""
    import json

    hist, vec, _, _ = _small_history(m, pairs)
    s_name, y_name = hist.push_pair()
    vec[s_name], vec[y_name] = np.ones(6), 2.5 * np.ones(6)
    vec["gt"] = np.arange(6.0)
    requests = hist.dot_requests("gt")
    rebuilt = VLBFGSHistory.from_state(json.loads(json.dumps(hist.to_state())))
    assert rebuilt.to_state() == hist.to_state()
    values = [float(vec[a] @ vec[b]) for a, b in requests]
    assert rebuilt.update_dots(values) is hist.update_dots(values) is True
    assert rebuilt.direction_coefficients() == hist.direction_coefficients()
    np.testing.assert_array_equal(rebuilt.dot_matrix(), hist.dot_matrix())
    base = np.stack([vec[name] for name in hist.base_names()])
    np.testing.assert_allclose(hist.dot_matrix(), base @ base.T, rtol=1e-12, atol=1e-12)


def test_a_state_that_is_not_a_historys_is_refused() -> None:
    hist, _, _, _ = _small_history(3, 2)
    state = hist.to_state()
    with pytest.raises(ProtocolError, match="neither a slot"):
        VLBFGSHistory.from_state({**state, "dots": [*state["dots"], ["s0", "elsewhere", 1.0]]})
    with pytest.raises(ProtocolError, match="slots"):
        VLBFGSHistory.from_state({**state, "s_names": state["s_names"][:-1]})
    # A Gram entry of a kept pair missing from the state: the matrix says so rather than using a hole.
    short = VLBFGSHistory.from_state({**state, "dots": state["dots"][1:]})
    with pytest.raises(ProtocolError, match="missing"):
        short.dot_matrix()


# -- history stored as float32 (issue 29, item 3) ------------------------------------------------------------


class _Spy(InProcessSpace):
    """An in-process space that keeps, per direction it forms, the history it was formed from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.directions: list[tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray]] = []

    def _lincomb(self, dst: str, coeffs: Any, names: Any, dtype: str | None = None) -> None:
        super()._lincomb(dst, coeffs, names, dtype)
        if dst == "d" and len(names) > 1:
            k = (len(names) - 1) // 2
            s = [self.vector(n).copy() for n in names[:k]]
            y = [self.vector(n).copy() for n in names[k : 2 * k]]
            self.directions.append((self.vector(names[-1]).copy(), s, y, self.vector("d").copy()))


def test_a_float32_history_is_the_exact_recursion_of_its_stored_pairs() -> None:
    fg, x0 = logistic_digits()
    space = _Spy(fg, x0)
    space.start()
    _minimize_lbfgs(space, m=4, gtol=1e-8, ftol=0.0, maxiter=12, maxfev=200, history_dtype="float32")
    assert len(space.directions) >= 8
    for g, s, y, d in space.directions:
        # Stored as float32, each rounded once from its float64 value; the direction is float64.
        assert all(v.dtype == np.float32 for v in s + y) and d.dtype == g.dtype == np.float64
        # The oracle: the classic two-loop recursion in float64 on the pairs as stored (upcast exactly).
        want = two_loop_reference(g, [v.astype(np.float64) for v in s], [v.astype(np.float64) for v in y])
        np.testing.assert_allclose(d, want, rtol=1e-10, atol=1e-12 * float(np.abs(want).max()))
    # Every kept pair is in float32; x, the gradients and the direction are not.
    stored = {n: v.dtype for n, v in space.vectors.items()}
    assert {t for n, t in stored.items() if n.startswith(("hs", "hy"))} == {np.dtype(np.float32)}
    assert {t for n, t in stored.items() if not n.startswith(("hs", "hy"))} == {np.dtype(np.float64)}


@pytest.mark.parametrize(("name", "make"), [("logistic_digits", logistic_digits)])
def test_a_float32_history_ends_within_1e_6_of_float64(name: str, make: Callable[[], Problem]) -> None:
    fg, x0 = make()
    f64 = minimize_lbfgs_reference(fg, x0, history_dtype="float64")
    f32 = minimize_lbfgs_reference(fg, x0, history_dtype="float32")
    assert f64.success and f32.success, (f64.message, f32.message)
    assert f32.nit == f64.nit
    assert abs(f32.fun - f64.fun) <= 1e-6 * abs(f64.fun)
    assert not np.array_equal(f32.x, f64.x)  # it did run with another history


def test_a_float64_history_sends_the_ops_it_always_sent() -> None:
    hist = VLBFGSHistory(3, prefix="h")
    hist.update_dots([1.0] * len(hist.dot_requests("ga")))
    ops64 = _SpeculativePair(hist, "ga", "gb", history_ops("float64"))(0.5)
    ops32 = _SpeculativePair(hist, "ga", "gb", history_ops("float32"))(0.5)
    assert ops64[:2] == [("lincomb", "hs0", [0.5], ["d"]), ("lincomb", "hy0", [1.0, -1.0], ["gb", "ga"])]
    assert [op[:4] for op in ops32[:2]] == ops64[:2] and [op[4:] for op in ops32[:2]] == [("float32",)] * 2
    for bad in ("float16", "auto", "", None):
        with pytest.raises(InvalidOptionError, match="history_dtype"):
            history_ops(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match="history_dtype"):
            minimize_lbfgs_reference(*logistic_digits(), history_dtype=bad)


def test_a_float32_run_resumes_from_its_checkpoint_exactly_and_refuses_another_dtype() -> None:
    fg, x0 = logistic_digits()
    common: dict[str, Any] = {"m": 5, "gtol": 1e-10, "ftol": 0.0, "maxfev": 1000, "history_dtype": "float32"}
    full = InProcessSpace(fg, x0)
    full.start()
    _minimize_lbfgs(full, maxiter=14, **common)
    part = InProcessSpace(fg, x0, checkpoint_every=4)
    part.start()
    _minimize_lbfgs(part, maxiter=10, **common)
    meta = part.restore()
    assert meta["history_dtype"] == "float32" and part.state.nit == 8
    assert {part.vectors[n].dtype for n in part.vectors if n.startswith("h")} == {np.dtype(np.float32)}
    with pytest.raises(InvalidOptionError, match="started with history_dtype='float32'"):
        _minimize_lbfgs(part, maxiter=14, resume=meta, **{**common, "history_dtype": "float64"})
    _minimize_lbfgs(part, maxiter=14, resume=meta, **common)
    assert [r.objective for r in part.state.records] == [r.objective for r in full.state.records]
    np.testing.assert_array_equal(part.vector(part.state.x), full.vector(full.state.x))
