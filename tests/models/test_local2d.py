"""The 2-D locally connected network: a loop oracle, finite differences, and its row-band partitions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import ModelSpecError
from distbelief.models import (
    LocallyConnected,
    LocallyConnected2D,
    LocallyConnected2DPlan,
    _local2d,
    from_spec,
    max_partitions,
    partition_plan,
    run_partitioned,
)
from distbelief.models._local2d import local2d_backward, local2d_forward
from distbelief.storage import load_digits
from tests.models._helpers import assert_gradient_matches

FAST = settings(max_examples=25, deadline=None)


def _oracle_loss(model: LocallyConnected2D, w: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    """The loss by explicit loops over locations, filters and patch entries (no shared code)."""
    act: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "tanh": np.tanh, "relu": lambda z: np.maximum(z, 0), "sigmoid": lambda z: 1 / (1 + np.exp(-z))
    }  # fmt: skip
    f = act[model.activation]
    layers = model.unpack(w)
    total = 0.0
    for row, label in zip(X, y, strict=True):
        A = row.reshape(model.shapes[0])
        for (W, b), (sh, sw) in zip(layers[:-1], model.strides, strict=True):
            h2, w2, ph, pw, _, F = W.shape
            Z = np.empty((h2, w2, F))
            for i in range(h2):
                for j in range(w2):
                    patch = A[i * sh : i * sh + ph, j * sw : j * sw + pw, :]
                    for q in range(F):
                        Z[i, j, q] = float(np.sum(patch * W[i, j, :, :, :, q])) + b[i, j, q]
            A = f(Z)
        W, b = layers[-1]
        z = A.ravel() @ W + b
        total += float(np.log(np.sum(np.exp(z - z.max()))) + z.max() - z[int(label)])
    return total


@st.composite
def images(draw: st.DrawFn) -> LocallyConnected2D:
    height, width = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    h, w = height, width
    patches, strides, filters = [], [], []
    for _ in range(draw(st.integers(1, 2))):
        ph, pw = draw(st.integers(1, min(h, 3))), draw(st.integers(1, min(w, 3)))
        sh, sw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        patches.append((ph, pw))
        strides.append((sh, sw))
        filters.append(draw(st.integers(1, 3)))
        h, w = (h - ph) // sh + 1, (w - pw) // sw + 1
    return LocallyConnected2D(
        (height, width),
        draw(st.integers(2, 3)),
        channels=draw(st.integers(1, 2)),
        patches=patches,
        strides=strides,
        filters=filters,
        activation=draw(st.sampled_from(["sigmoid", "tanh", "relu"])),
    )


def _problem(model: LocallyConnected2D, seed: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, model.n_features))
    y = rng.integers(0, model.n_classes, size=rows)
    w = model.init_params(seed) + rng.normal(scale=0.1, size=model.n_params)
    return w, X, y


@FAST
@given(model=images(), seed=st.integers(0, 2**31), rows=st.integers(1, 4))
def test_loss_equals_a_loop_oracle_and_gradient_finite_differences(
    model: LocallyConnected2D, seed: int, rows: int
) -> None:
    w, X, y = _problem(model, seed, rows)
    loss, _ = model.loss_and_grad(w, X, y)
    assert loss == pytest.approx(_oracle_loss(model, w, X, y), rel=1e-12, abs=1e-12)
    assert_gradient_matches(model, w, X, y)


@FAST
@given(model=images(), K=st.integers(1, 4), seed=st.integers(0, 2**31), rows=st.integers(1, 5))
def test_row_band_partitions_equal_the_whole_model(
    model: LocallyConnected2D, K: int, seed: int, rows: int
) -> None:
    w, X, y = _problem(model, seed, rows)
    loss, grad = model.loss_and_grad(w, X, y)
    plan = partition_plan(model, K)
    assert isinstance(plan, LocallyConnected2DPlan)
    assert sorted(plan.perm.tolist()) == list(range(model.n_params))  # every parameter owned exactly once
    p_loss, p_grad, traffic = run_partitioned(plan, w, X, y)
    assert abs(p_loss - loss) <= 1e-10 * max(1.0, abs(loss))
    np.testing.assert_allclose(p_grad, grad, rtol=0, atol=1e-10)
    if K == 1:
        assert traffic.messages == 0


@pytest.mark.parametrize("K", [2, 3, 4])
def test_only_boundary_rows_cross_and_messages_are_counted(K: int) -> None:
    # Digits 8 x 8: layer 1 (3 x 3 patches, 4 filters) gives 6 x 6 x 4, layer 2 (3 x 3, 2 filters) 4 x 4 x 2.
    model = LocallyConnected2D((8, 8), 10, patches=[3, 3], filters=[4, 2])
    X, y = load_digits()
    X, y = X[:16], y[:16].astype(int)
    traffic = run_partitioned(partition_plan(model, K), model.init_params(0), X, y)[2]
    # Layer 2's bands read their neighbours' boundary rows only: one message per neighbour pair and
    # direction at most, forward (h) and the same back as input-gradients (g); the output layer costs a
    # reduce of partial logits at partition 0 and a broadcast of their gradient.
    assert K - 1 <= traffic.by_kind["h"] == traffic.by_kind["g"] <= 2 * (K - 1)
    assert (traffic.by_kind["z"], traffic.by_kind["dz"]) == (K - 1, K - 1)
    assert traffic.messages == 2 * traffic.by_kind["h"] + 2 * (K - 1)
    # A halo message holds at most ph - sh = 2 rows of the 6 x 6 x 4 map (one row = 24 values).
    halo = traffic.bytes - 2 * (K - 1) * 16 * 10 * 8
    assert 0 < halo <= 2 * traffic.by_kind["h"] * 16 * 2 * 24 * 8


def test_a_band_reads_only_its_rows_of_the_image() -> None:
    plan = partition_plan(LocallyConnected2D((8, 8), 10, patches=[(3, 2)], strides=[(2, 1)]), 2)
    # 3 rows of units: partition 0 owns row 0 (image rows 0-2), partition 1 rows 1-2 (image rows 2-6).
    assert plan.input_columns(0) == slice(0, 24)
    assert plan.input_columns(1) == slice(16, 56)
    assert plan.bounds[-1] == plan.model.n_params


def test_spec_round_trips_and_limits_partitions() -> None:
    m = LocallyConnected2D((28, 28), 10, patches=[5, (3, 3)], strides=[2, 1], filters=[8, 4], channels=1)
    assert m.shapes == ((28, 28, 1), (12, 12, 8), (10, 10, 4))
    assert from_spec(m.spec) == m
    assert max_partitions(m) == 10


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ModelSpecError, match="patch"):
        LocallyConnected2D((4, 4), 2, patches=[5])
    with pytest.raises(ModelSpecError, match="same length"):
        LocallyConnected2D((8, 8), 2, patches=[3, 3], filters=[2])
    with pytest.raises(ModelSpecError, match="pair"):
        LocallyConnected2D((8, 8), 2, patches=[(3, 3, 3)])
    with pytest.raises(ModelSpecError, match="image_shape"):
        LocallyConnected2D((8,), 2)
    with pytest.raises(ModelSpecError, match="n_classes"):
        LocallyConnected2D((8, 8), 1)
    with pytest.raises(ModelSpecError, match="channels"):
        LocallyConnected2D((8, 8), 2, channels=0)


@pytest.mark.parametrize(
    "m",
    [
        LocallyConnected2D((5, 4), 3, channels=2, patches=[(3, 2)], filters=[2]),
        LocallyConnected(8, 3, fields=[3, 2], strides=[2, 1]),
    ],
)
def test_no_rows_give_a_zero_loss_and_gradient_as_the_other_models(
    m: LocallyConnected2D | LocallyConnected,
) -> None:
    w = m.init_params(0)
    loss, grad = m.loss_and_grad(w, np.zeros((0, m.n_features)), np.zeros(0))
    assert loss == 0.0
    np.testing.assert_array_equal(grad, np.zeros(m.n_params))
    assert m.predict(w, np.zeros((0, m.n_features))).shape == (0,)
    loss, grad, _ = run_partitioned(partition_plan(m, 2), w, np.zeros((0, m.n_features)), np.zeros(0))
    assert loss == 0.0
    np.testing.assert_array_equal(grad, np.zeros(m.n_params))


def _einsum_layer(
    A: np.ndarray, W: np.ndarray, b: np.ndarray, delta: np.ndarray, stride: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's pre-activations, weight gradient and input gradient by one einsum over an explicit copy of
    every patch (the kernels' oracle: no shared code, no strided views)."""
    h2, w2, ph, pw, _, _ = W.shape
    sh, sw = stride
    patches = np.stack(
        [
            np.stack([A[:, i * sh : i * sh + ph, j * sw : j * sw + pw, :] for j in range(w2)], axis=1)
            for i in range(h2)
        ],
        axis=1,
    )  # (rows, h', w', ph, pw, c)
    Z = np.einsum("rijabc,ijabcf->rijf", patches, W) + b
    gW = np.einsum("rijf,rijabc->ijabcf", delta, patches)
    d_patches = np.einsum("rijf,ijabcf->rijabc", delta, W)
    dA = np.zeros_like(A)
    for i in range(h2):
        for j in range(w2):
            dA[:, i * sh : i * sh + ph, j * sw : j * sw + pw, :] += d_patches[:, i, j]
    return Z, gW, dA


@FAST
@given(
    shape=st.tuples(*(st.integers(1, 4) for _ in range(6))),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    extra=st.integers(0, 2),
    rows=st.integers(0, 3),
    transposed=st.booleans(),
    im2col=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_layer_kernels_equal_an_explicit_patch_oracle(
    shape: tuple[int, ...],
    stride: tuple[int, int],
    extra: int,
    rows: int,
    transposed: bool,
    im2col: bool,
    seed: int,
) -> None:
    # Any geometry, input rows past what the patches cover (a band's input), an input that is not
    # C-contiguous (the kernels read patch rows through strided views of it), and both ways of cutting the
    # patches (rows of views, or one copy of the whole patches for narrow rows).
    saved = _local2d.NARROW_ROW
    _local2d.NARROW_ROW = 1_000 if im2col else 0
    try:
        _check_layer_kernels(shape, stride, extra, rows, transposed, seed)
    finally:
        _local2d.NARROW_ROW = saved


def _check_layer_kernels(
    shape: tuple[int, ...], stride: tuple[int, int], extra: int, rows: int, transposed: bool, seed: int
) -> None:
    h2, w2, ph, pw, c, f = shape
    rng = np.random.default_rng(seed)
    h, w = (h2 - 1) * stride[0] + ph + extra, (w2 - 1) * stride[1] + pw
    A = rng.normal(size=(rows, h, w, c))
    if transposed:
        A = np.ascontiguousarray(A.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    W, b = rng.normal(size=shape), rng.normal(size=(h2, w2, f))
    delta = rng.normal(size=(rows, h2, w2, f))
    Z_ref, gW_ref, dA_ref = _einsum_layer(A, W, b, delta, stride)
    np.testing.assert_allclose(local2d_forward(A, W, b, stride), Z_ref, rtol=1e-12, atol=1e-12)
    gW, gb, dA = local2d_backward(A, W, delta, stride, need_input=True)
    np.testing.assert_allclose(gW, gW_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gb, delta.sum(axis=0), rtol=1e-12, atol=1e-12)
    assert dA is not None and dA.shape == A.shape
    np.testing.assert_allclose(dA, dA_ref, rtol=1e-12, atol=1e-12)
    gW_only, _, none = local2d_backward(A, W, delta, stride, need_input=False)
    assert none is None
    np.testing.assert_array_equal(gW_only, gW)
