"""The numba-compiled single-pass kernels (models._compiled): against a plain numpy two-pass oracle, how the
models use them on a big X, the numpy fallback without numba, non-finite input, and lazy import."""

from __future__ import annotations

import doctest
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray
from scipy.special import expit, logsumexp

from distbelief.errors import DatasetError
from distbelief.models import LeastSquares, Logistic, Softmax, _compiled, _linear

FloatArray = NDArray[np.float64]
LinearModel = LeastSquares | Logistic | Softmax

FAST = settings(max_examples=40, deadline=None)

rows = st.integers(1, 41)  # every remainder of the groups of 4 rows, and n = 1
features = st.integers(1, 9)
classes = st.integers(2, 6)
block_rows = st.integers(1, 9)
seeds = st.integers(0, 2**32 - 1)
scales = st.sampled_from([0.1, 1.0, 4.0])


def _kernel(kind: Any) -> Any:
    kernel = _compiled.fused_kernel(kind)
    if kernel is None:  # pragma: no cover - numba is a dependency
        pytest.skip("numba is not usable here")
    return kernel


# --- the plain numpy two-pass oracle ------------------------------------------------------------------------


def _oracle(
    kind: str, X: FloatArray, y: NDArray[Any], coef: FloatArray, intercept: Any
) -> tuple[float, FloatArray, FloatArray, float]:
    """Loss, ``X.T @ R``, ``sum(R, axis=0)`` and a size for the loss tolerance, in two passes over ``X``.

    Independent of the kernels: ``X @ coef``, scipy's ``logsumexp`` / ``expit``, numpy's ``logaddexp``.
    """
    Z = X @ coef + intercept
    if kind == "least_squares":
        R = Z - y
        loss = 0.5 * float(R @ R)
        size = float(((np.abs(Z) + np.abs(y)) ** 2).sum())
    elif kind == "logistic":
        loss = float(np.logaddexp(0.0, np.where(y == 1, -Z, Z)).sum())
        R = np.where(y == 1, -expit(-Z), expit(Z))  # sigmoid(z) - y without cancellation
        size = float(np.abs(Z).sum())
    else:
        lse = logsumexp(Z, axis=1)
        picked = Z[np.arange(len(y)), y]
        loss = float((lse - picked).sum())  # cancels to ~eps * |Z|: hence the size
        R = np.exp(Z - lse[:, None])
        R[np.arange(len(y)), y] -= 1.0
        size = float(np.abs(Z).sum())
    return loss, X.T @ R, R.sum(axis=0), size


def _assert_close(
    loss: float, grad: FloatArray, X: FloatArray, ref: tuple[float, FloatArray, FloatArray, float]
) -> None:
    ref_loss, ref_grad, _, size = ref
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10, atol=1e-13 * size)
    # Gradient entries can cancel to ~0: bound their error by the size of the summed terms too.
    atol = 1e-12 * (1.0 + float(np.abs(X).sum()) * max(1.0, float(np.abs(ref_grad).max())))
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=atol)


def _glm_problem(
    logistic: bool, n: int, d: int, seed: int, scale: float
) -> tuple[FloatArray, FloatArray, FloatArray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(scale=scale, size=(n, d))
    y = rng.integers(0, 2, size=n).astype(float) if logistic else rng.normal(size=n)
    return X, y, rng.normal(size=d)


# --- the kernels against the oracle -------------------------------------------------------------------------


@FAST
@given(n=rows, d=features, logistic=st.booleans(), intercept=st.booleans(), seed=seeds, scale=scales)
def test_glm_kernel_matches_oracle(
    n: int, d: int, logistic: bool, intercept: bool, seed: int, scale: float
) -> None:
    kind = "logistic" if logistic else "least_squares"
    X, y, coef = _glm_problem(logistic, n, d, seed, scale)
    b = 0.7 if intercept else 0.0
    grad = np.zeros(d)
    loss, r_sum = _kernel(kind)(X, y, coef, b, grad)
    ref = _oracle(kind, X, y, coef, b)
    _assert_close(loss, grad, X, ref)
    np.testing.assert_allclose(
        r_sum, ref[2], rtol=1e-10, atol=1e-12 * n * (1.0 + float(np.abs(X @ coef).max()))
    )


def test_glm_kernel_adds_to_grad() -> None:
    """The gradient is added to what ``grad_coef`` holds (the models pass zeros)."""
    X, y, coef = _glm_problem(True, 9, 3, seed=1, scale=1.0)
    grad = np.ones(3)
    _kernel("logistic")(X, y, coef, 0.0, grad)
    np.testing.assert_allclose(grad - 1.0, _oracle("logistic", X, y, coef, 0.0)[1], rtol=1e-12)


@FAST
@given(n=rows, d=features, k=classes, block=block_rows, intercept=st.booleans(), seed=seeds, scale=scales)
def test_softmax_kernel_matches_oracle(
    n: int, d: int, k: int, block: int, intercept: bool, seed: int, scale: float
) -> None:
    rng = np.random.default_rng(seed)
    X = rng.normal(scale=scale, size=(n, d))
    labels = rng.integers(0, k, size=n).astype(np.intp)
    W = rng.normal(size=(d, k))
    b = rng.normal(size=k) if intercept else np.zeros(k)
    grad_W, grad_b = np.zeros((d, k)), np.zeros(k)
    loss = _kernel("softmax")(X, labels, W, b, grad_W, grad_b, block)
    ref = _oracle("softmax", X, labels, W, b)
    _assert_close(loss, grad_W, X, ref)
    np.testing.assert_allclose(grad_b, ref[2], rtol=1e-10, atol=1e-12 * n)


def test_softmax_kernel_keeps_tiny_losses() -> None:
    """A confidently right row: log1p keeps its ~1e-20 loss, and the label entry does not cancel to 0."""
    X = np.array([[1.0]])
    W = np.array([[0.0, -46.0]])  # p(class 1) = exp(-46) ~ 1e-20
    grad_W, grad_b = np.zeros((1, 2)), np.zeros(2)
    loss = _kernel("softmax")(X, np.array([0]), W, np.zeros(2), grad_W, grad_b, 4)
    np.testing.assert_allclose(loss, np.exp(-46.0), rtol=1e-14)
    np.testing.assert_allclose(grad_b, [-np.exp(-46.0), np.exp(-46.0)], rtol=1e-14)


def test_exp_matches_numpy() -> None:
    """The vectorizable exp of the softmax kernel: <= 1 ulp from np.exp, and the special values."""
    _kernel("softmax")
    exp = _compiled._exp_nonpositive
    rng = np.random.default_rng(3)
    x = np.concatenate([-rng.exponential(20.0, 3000), -rng.uniform(700.0, 760.0, 300), -rng.random(300)])
    got = np.array([exp(v) for v in x])
    want = np.exp(x)
    normal = want >= np.finfo(float).tiny
    assert np.all(np.abs(got - want)[normal] <= np.spacing(want[normal]))
    assert np.all(np.abs(got - want)[~normal] <= 5e-324)  # subnormal results: within one step
    assert exp(0.0) == exp(-0.0) == 1.0
    assert exp(-np.inf) == exp(-800.0) == 0.0
    assert np.isnan(exp(np.nan))


def test_kernels_accept_read_only_and_strided_inputs() -> None:
    """Read-only X (as deserialized by a Dask worker) and strided targets are taken without a copy."""
    X, y, coef = _glm_problem(False, 10, 3, seed=4, scale=1.0)
    X.setflags(write=False)
    y2 = np.repeat(y, 2)[::2]
    grad = np.zeros(3)
    loss, _ = _kernel("least_squares")(X, y2, coef, 0.0, grad)
    _assert_close(loss, grad, X, _oracle("least_squares", X, y, coef, 0.0))
    labels = np.repeat(np.arange(10) % 3, 2)[::2]
    grad_W, grad_b = np.zeros((3, 3)), np.zeros(3)
    W = np.ones((3, 3))
    W.setflags(write=False)
    loss = _kernel("softmax")(X, labels, W, np.zeros(3), grad_W, grad_b, 4)
    _assert_close(loss, grad_W, X, _oracle("softmax", X, labels, W, 0.0))


def test_kernels_release_the_gil() -> None:
    _kernel("logistic")
    _kernel("softmax")
    assert _compiled._glm_pass.targetoptions["nogil"]  # type: ignore[attr-defined]  # a numba dispatcher
    assert _compiled._softmax_pass.targetoptions["nogil"]  # type: ignore[attr-defined]


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="mlp"):
        _compiled.fused_kernel("mlp")  # type: ignore[call-overload]


def test_module_examples_run() -> None:
    result = doctest.testmod(_compiled, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


# --- the models' big-X path ---------------------------------------------------------------------------------


def _model_problem(
    model: LinearModel, n: int, seed: int, scale: float = 1.0
) -> tuple[FloatArray, FloatArray, FloatArray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(scale=scale, size=(n, model.n_features))
    w = rng.normal(scale=0.1, size=model.n_params)
    if isinstance(model, LeastSquares):
        y = rng.normal(size=n)
    else:
        y = rng.integers(0, 2 if isinstance(model, Logistic) else model.n_classes, size=n).astype(float)
    return w, X, y


def _model_oracle(
    model: LinearModel, w: FloatArray, X: FloatArray, y: FloatArray
) -> tuple[float, FloatArray, FloatArray, float]:
    """The oracle in the layout of the model's gradient (``[X.T @ R, sum(R)]``)."""
    k = model.n_classes if isinstance(model, Softmax) else 1
    d = model.n_features
    n_coef = d * k
    coef = w[:n_coef] if k == 1 else w[:n_coef].reshape(d, k)
    intercept = (w[n_coef] if k == 1 else w[n_coef:]) if model.fit_intercept else 0.0
    labels = y.astype(np.intp) if k > 1 else y
    loss, grad_coef, grad_b, size = _oracle(model.kind, X, labels, coef, intercept)
    grad = grad_coef.ravel()
    if model.fit_intercept:
        grad = np.concatenate([grad, np.atleast_1d(grad_b)])
    return loss, grad, grad_b, size


@pytest.fixture
def spy() -> Iterator[list[str]]:
    """Records the kinds of the compiled kernels the models run; numpy blocks are a failure."""
    kinds: list[str] = []
    real = _compiled.fused_kernel

    def recording(kind: Any) -> Any:
        kernel: Callable[..., Any] | None = real(kind)
        if kernel is None:  # pragma: no cover - numba is a dependency
            pytest.skip("numba is not usable here")

        def run(*args: Any) -> Any:
            kinds.append(kind)
            return kernel(*args)

        return run

    def no_blocks(*args: Any) -> Any:
        pytest.fail("the numpy blocked pass ran although the compiled kernel is available")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_compiled, "fused_kernel", recording)
        mp.setattr(_linear._Linear, "_blocked_pass", no_blocks)
        yield kinds


def _models(d: int) -> list[LinearModel]:
    return [LeastSquares(d), Logistic(d), Softmax(d, 10), Logistic(d, fit_intercept=False)]


@pytest.mark.parametrize("index", range(4), ids=["least_squares", "logistic", "softmax", "logistic_no_b"])
def test_big_x_uses_the_compiled_kernel(spy: list[str], index: int) -> None:
    """Above _BLOCK_MIN_BYTES (8 MiB) loss_and_grad runs the compiled kernel, once, and equals the oracle."""
    model = _models(500)[index]
    w, X, y = _model_problem(model, 2100, seed=index)  # 8.4 MB
    assert _linear._block_rows(X, 10) > 0
    loss, grad = model.loss_and_grad(w, X, y)
    assert spy == [model.kind]
    _assert_close(loss, grad, X, _model_oracle(model, w, X, y))


@FAST
@given(
    n=rows,
    d=features,
    k=classes,
    which=st.sampled_from(["least_squares", "logistic", "softmax"]),
    intercept=st.booleans(),
    seed=seeds,
    scale=scales,
)
def test_models_on_the_compiled_path_match_oracle(
    n: int, d: int, k: int, which: str, intercept: bool, seed: int, scale: float
) -> None:
    """Every X on the fused path (threshold 0): the models' compiled results against the oracle."""
    model: LinearModel
    if which == "least_squares":
        model = LeastSquares(d, fit_intercept=intercept)
    elif which == "logistic":
        model = Logistic(d, fit_intercept=intercept)
    else:
        model = Softmax(d, k, fit_intercept=intercept)
    w, X, y = _model_problem(model, n, seed, scale)
    with pytest.MonkeyPatch.context() as mp:
        kinds: list[str] = []
        real = _compiled.fused_kernel

        def recording(kind: Any) -> Any:
            kinds.append(kind)
            return real(kind)

        mp.setattr(_compiled, "fused_kernel", recording)
        mp.setattr(_linear, "_BLOCK_MIN_BYTES", 0)
        loss, grad = model.loss_and_grad(w, X, y)
    assert kinds == [model.kind]
    _assert_close(loss, grad, X, _model_oracle(model, w, X, y))


@pytest.fixture
def no_numba() -> Iterator[list[int]]:
    """numba reported unavailable (and no kernels built yet); yields the rows of every numpy blocked pass."""
    calls: list[int] = []
    blocked = _linear._Linear._blocked_pass

    def counting(self: Any, w: Any, X: Any, rows: int, residual_: Any, Z_all: Any = None) -> Any:
        calls.append(rows)
        return blocked(self, w, X, rows, residual_, Z_all)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_compiled, "_built", {})
        mp.setattr(_compiled, "_import_numba", lambda: None)
        mp.setattr(_linear._Linear, "_blocked_pass", counting)
        yield calls


@pytest.mark.parametrize("index", range(4), ids=["least_squares", "logistic", "softmax", "logistic_no_b"])
def test_without_numba_the_numpy_blocks_run(no_numba: list[int], index: int) -> None:
    model = _models(500)[index]
    assert _compiled.fused_kernel(model.kind) is None  # type: ignore[call-overload]
    w, X, y = _model_problem(model, 2100, seed=10 + index)
    loss, grad = model.loss_and_grad(w, X, y)
    assert no_numba == [131]
    _assert_close(loss, grad, X, _model_oracle(model, w, X, y))


def test_numba_disabled_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """NUMBA_DISABLE_JIT would run the kernels as pure Python: the numpy pass is used instead."""
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(_compiled, "_built", {})
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    assert _compiled.fused_kernel("logistic") is None


def test_failed_compilation_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(nb: Any, family: str, cache: bool) -> Any:
        raise TypeError("no such thing")

    monkeypatch.setattr(_compiled, "_built", {})
    monkeypatch.setattr(_compiled, "_import_numba", lambda: object())
    monkeypatch.setattr(_compiled, "_build", broken)
    with pytest.warns(RuntimeWarning, match="numpy blocked pass"):
        assert _compiled.fused_kernel("softmax") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compiled.fused_kernel("softmax") is None  # warned once: the failure is remembered


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("cannot cache function: no locator available"),
        # A cache entry written while this file was imported as models._compiled (a checkout's root).
        ModuleNotFoundError("No module named 'models'"),
    ],
)
def test_uncachable_kernels_are_compiled_without_cache(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    caches: list[bool] = []

    def build(nb: Any, family: str, cache: bool) -> Callable[..., Any]:
        caches.append(cache)
        if cache:
            raise error
        return sum

    monkeypatch.setattr(_compiled, "_built", {})
    monkeypatch.setattr(_compiled, "_import_numba", lambda: object())
    monkeypatch.setattr(_compiled, "_build", build)
    kernel: object = _compiled.fused_kernel("softmax")
    assert kernel is sum
    assert caches == [True, False]


# --- non-finite input ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow/invalid warnings on the numpy path
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("index", range(4), ids=["least_squares", "logistic", "softmax", "logistic_no_b"])
def test_non_finite_x_is_diagnosed_as_before(index: int, value: float) -> None:
    """A NaN/inf in X: the compiled path raises the same diagnosis as the numpy blocks (or neither does)."""
    model = _models(3)[index]
    w, X, y = _model_problem(model, 23, seed=20 + index)
    X[13, 1] = value
    outcomes = []
    for compiled in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_linear, "_BLOCK_MIN_BYTES", 0)
            if not compiled:
                mp.setattr(_compiled, "fused_kernel", lambda kind: None)
            try:
                loss, _ = model.loss_and_grad(w, X, y)
                outcomes.append(f"finite {np.isfinite(loss)}")
            except DatasetError as exc:
                assert "first at row 13" in str(exc)
                outcomes.append("diagnosed")
    assert outcomes[0] == outcomes[1]
    if np.isnan(value):
        assert outcomes[0] == "diagnosed"


@pytest.mark.parametrize("index", range(3), ids=["least_squares", "logistic", "softmax"])
def test_nan_in_x_makes_the_kernel_loss_nan(index: int) -> None:
    X = np.ones((6, 2))
    X[5, 0] = np.nan
    if index < 2:
        loss, _ = _kernel(["least_squares", "logistic"][index])(X, np.zeros(6), np.ones(2), 0.0, np.zeros(2))
    else:
        loss = _kernel("softmax")(
            X, np.zeros(6, np.intp), np.ones((2, 3)), np.zeros(3), np.zeros((2, 3)), np.zeros(3), 4
        )
    assert np.isnan(loss)


def test_non_finite_target_is_diagnosed() -> None:
    model = LeastSquares(2)
    y = np.zeros(10)
    y[7] = np.inf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_linear, "_BLOCK_MIN_BYTES", 0)
        with pytest.raises(DatasetError, match=r"targets y .* \(first at row 7\)"):
            model.loss_and_grad(np.zeros(3), np.ones((10, 2)), y)


# --- laziness -----------------------------------------------------------------------------------------------


def test_small_problems_never_import_numba() -> None:
    """Importing the models and running them on a small X (digits-sized) does not import numba."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from distbelief.models import LeastSquares, Logistic, Softmax
        X = np.random.default_rng(0).normal(size=(1797, 64))
        y = np.arange(1797) % 2
        for model in (LeastSquares(64), Logistic(64), Softmax(64, 10)):
            model.loss_and_grad(model.init_params(), X, y)
        assert "numba" not in sys.modules, "numba was imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
