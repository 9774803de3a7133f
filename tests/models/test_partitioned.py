"""Model parallelism in one process: partitioned models equal the whole model; the locally connected model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distbelief.errors import InvalidOptionError, ModelSpecError
from distbelief.models import (
    MLP,
    LocallyConnected,
    LocallyConnected2D,
    Softmax,
    partition_plan,
    run_partitioned,
)
from tests.models._helpers import assert_gradient_matches

FAST = settings(max_examples=30, deadline=None)
activations = st.sampled_from(["sigmoid", "tanh", "relu"])


@st.composite
def local_models(draw: st.DrawFn) -> LocallyConnected:
    n_layers = draw(st.integers(1, 3))
    fields, strides = [], []
    width = draw(st.integers(1, 40))
    n_features = width
    for _ in range(n_layers):
        if width < 1:
            break
        f = draw(st.integers(1, min(width, 5)))
        s = draw(st.integers(1, 3))
        fields.append(f)
        strides.append(s)
        width = (width - f) // s + 1
    return LocallyConnected(
        n_features, draw(st.integers(2, 4)), fields=fields, strides=strides, activation=draw(activations)
    )


@st.composite
def mlps(draw: st.DrawFn) -> MLP:
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    return MLP([*sizes, draw(st.integers(2, 5))], activation=draw(activations))


def _check_equal(model: MLP | LocallyConnected, K: int, seed: int, rows: int) -> None:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, model.n_features))
    y = rng.integers(0, model.n_classes, size=rows)
    w = model.init_params(seed) + rng.normal(scale=0.1, size=model.n_params)
    loss, grad = model.loss_and_grad(w, X, y)
    plan = partition_plan(model, K)
    assert sorted(plan.perm.tolist()) == list(range(model.n_params))  # every parameter owned exactly once
    p_loss, p_grad, traffic = run_partitioned(plan, w, X, y)
    assert abs(p_loss - loss) <= 1e-10 * max(1.0, abs(loss))
    np.testing.assert_allclose(p_grad, grad, rtol=0, atol=1e-10)
    if K == 1:
        assert traffic.messages == 0


@FAST
@given(model=mlps(), K=st.integers(1, 4), seed=st.integers(0, 2**31), rows=st.integers(1, 7))
def test_partitioned_mlp_equals_the_mlp(model: MLP, K: int, seed: int, rows: int) -> None:
    _check_equal(model, K, seed, rows)


@FAST
@given(model=local_models(), K=st.integers(1, 4), seed=st.integers(0, 2**31), rows=st.integers(1, 7))
def test_partitioned_locally_connected_equals_the_whole_model(
    model: LocallyConnected, K: int, seed: int, rows: int
) -> None:
    _check_equal(model, K, seed, rows)


@FAST
@given(model=local_models(), seed=st.integers(0, 2**31), rows=st.integers(1, 6))
def test_locally_connected_gradient_matches_finite_differences(
    model: LocallyConnected, seed: int, rows: int
) -> None:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, model.n_features))
    y = rng.integers(0, model.n_classes, size=rows)
    w = rng.normal(scale=0.5, size=model.n_params)
    if model.activation == "relu":  # keep away from the kinks, where differences are not derivatives
        w = model.init_params(seed) + rng.normal(scale=0.01, size=model.n_params)
    assert_gradient_matches(model, w, X, y)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_message_counts_are_the_fewest_a_pass_needs(K: int) -> None:
    # MLP with 2 hidden layers: per hidden layer an all-gather (K(K-1)) forward and a reduce-scatter
    # (K(K-1)) backward, plus the logits to partition 0 and their gradients back (2(K-1)).
    mlp = MLP([16, 12, 12, 4])
    X, y = np.ones((3, 16)), np.array([0, 1, 2])
    traffic = run_partitioned(partition_plan(mlp, K), mlp.init_params(0), X, y)[2]
    assert traffic.messages == 2 * 2 * K * (K - 1) + 2 * (K - 1)
    # Locally connected, 2 local layers: layer 2's halo comes only from the neighbours (at most one
    # message per neighbour pair each way), forward (h) and the matching input-gradients back (g), plus
    # the output reduce and broadcast.
    lc = LocallyConnected(64, 4, fields=[5, 3], strides=[1, 1])
    traffic = run_partitioned(partition_plan(lc, K), lc.init_params(0), np.ones((3, 64)), y)[2]
    assert K - 1 <= traffic.by_kind["h"] == traffic.by_kind["g"] <= 2 * (K - 1)
    assert (traffic.by_kind["z"], traffic.by_kind["dz"]) == (K - 1, K - 1)
    lc_bytes, mlp_bytes = (
        traffic.bytes,
        run_partitioned(partition_plan(mlp, K), mlp.init_params(0), X, y)[2].bytes,
    )
    assert lc_bytes < mlp_bytes


def test_a_partitions_input_is_its_receptive_fields_only() -> None:
    plan = partition_plan(LocallyConnected(20, 2, fields=[4], strides=[2]), 2)
    # 9 units: partition 0 owns units 0-3 (inputs 0..9), partition 1 units 4-8 (inputs 8..19).
    assert plan.input_columns(0) == slice(0, 10)
    assert plan.input_columns(1) == slice(8, 20)


def test_models_without_a_partitioned_form_are_refused() -> None:
    with pytest.raises(InvalidOptionError, match="partitions=1"):
        partition_plan(Softmax(3, 2), 2)
    with pytest.raises(InvalidOptionError, match="positive integer"):
        partition_plan(MLP([3, 2]), 0)


def test_bad_locally_connected_shapes_are_refused() -> None:
    with pytest.raises(ModelSpecError, match="receptive field"):
        LocallyConnected(4, 2, fields=[5], strides=[1])
    with pytest.raises(ModelSpecError, match="same length"):
        LocallyConnected(8, 2, fields=[3, 2], strides=[1])
    with pytest.raises(ModelSpecError, match="n_classes"):
        LocallyConnected(8, 1)
    # A number where a list per layer is expected: a ModelSpecError that shows the form, not a TypeError.
    with pytest.raises(ModelSpecError, match=r"fields must be a list with one entry per local layer"):
        LocallyConnected(10, 2, fields=5)  # type: ignore[arg-type]
    with pytest.raises(ModelSpecError, match=r"strides must be a list"):
        LocallyConnected(10, 2, fields=[3], strides=2)  # type: ignore[arg-type]
    for bad in ({"patches": 3}, {"strides": 2}, {"filters": 2}):
        with pytest.raises(ModelSpecError, match=f"{next(iter(bad))} must be a list"):
            LocallyConnected2D((8, 8), 2, **bad)  # type: ignore[arg-type]
    # An iterator is read once, not once for the fields and again for the default strides.
    assert LocallyConnected(10, 2, fields=iter([3, 2])).widths == (10, 8, 7)  # type: ignore[arg-type]


def test_the_docs_of_partitions_name_every_model_that_can_be_partitioned() -> None:
    import re
    from pathlib import Path

    from distbelief import downpour, models, sandblaster

    built_in: list[models.Model] = [
        models.LeastSquares(4),
        models.Logistic(4),
        models.Softmax(4, 3),
        MLP([4, 3, 2]),
        LocallyConnected(8, 2, fields=[3]),
        LocallyConnected2D((4, 4), 2, patches=[2]),
    ]
    splittable = set()
    for model in built_in:
        try:
            partition_plan(model, 2)
        except InvalidOptionError:
            continue
        splittable.add(type(model).__name__)
    assert splittable == {"MLP", "LocallyConnected", "LocallyConnected2D"}

    def section(doc: str, start: str) -> str:
        # From the parameter's line to the next parameter's or section's (or the end of the docstring).
        tail = doc[doc.index(start) :]
        end = re.search(r"\n    \S", tail[1:])
        return tail if end is None else tail[: end.start() + 1]

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    bullet = readme[readme.index("- **Model parallelism**") :].split("\n- ", 1)[0]
    texts = {
        "sandblaster.minimize(partitions=)": section(sandblaster.minimize.__doc__ or "", "    partitions :"),
        "downpour.train(partitions=)": section(downpour.train.__doc__ or "", "    partitions :"),
        "README": bullet,
    }
    for where, text in texts.items():
        named = {name for name in splittable if re.search(rf"\b{name}\b", text)}
        assert named == splittable, f"{where} omits {sorted(splittable - named)}"
        for model in built_in:
            name = type(model).__name__
            assert name in splittable or not re.search(rf"\b{name}\b", text), f"{where} names {name}"


def _drive(passes: list[Any], K: int) -> list[Any]:
    """Run K partition passes to their ends in one process, delivering their messages."""
    mailbox: dict[tuple[int, int, str], np.ndarray] = {}
    results: list[Any] = [None] * K
    waiting: list[Any] = [None] * K

    def advance(k: int, value: np.ndarray | None) -> None:
        try:
            op = passes[k].send(value)
            while hasattr(op, "array"):  # a Send
                mailbox[(op.dest, k, op.tag)] = op.array
                op = passes[k].send(None)
            waiting[k] = op
        except StopIteration as stop:
            results[k], waiting[k] = stop.value, None

    for k in range(K):
        advance(k, None)
    while any(r is None for r in results):
        for k in range(K):
            op = waiting[k]
            if op is not None and (k, op.src, op.tag) in mailbox:
                advance(k, mailbox.pop((k, op.src, op.tag)))
    return results


@pytest.mark.parametrize(
    "model",
    [
        MLP([6, 5, 4, 3]),
        LocallyConnected(20, 3, fields=[4, 3], strides=[2, 1]),
        LocallyConnected2D((9, 7), 3, channels=2, patches=[3, (2, 3)], strides=[(2, 1), 1], filters=[3, 2]),
    ],
)
@pytest.mark.parametrize("K", [1, 2, 3])
def test_a_pass_writes_its_gradient_into_the_buffer_given(model: Any, K: int) -> None:
    # The actors pass one buffer for every step's gradient: the same numbers as a pass's own new array,
    # written over whatever the buffer held, and the buffer returned.
    plan = partition_plan(model, K)
    rng = np.random.default_rng(K)
    w = model.init_params(0)[plan.perm]
    X, y = rng.normal(size=(5, model.n_features)), rng.integers(0, 3, size=5)
    slices = [w[plan.bounds[k] : plan.bounds[k + 1]] for k in range(K)]
    cols = [plan.input_columns(k) for k in range(K)]
    fresh = _drive([plan.partition_pass(k, slices[k], X[:, cols[k]], y) for k in range(K)], K)
    buffers = [np.full(s.size, np.nan) for s in slices]
    into = _drive([plan.partition_pass(k, slices[k], X[:, cols[k]], y, out=buffers[k]) for k in range(K)], K)
    for k in range(K):
        assert into[k][1] is buffers[k]
        np.testing.assert_array_equal(into[k][1], fresh[k][1])
        assert into[k][0] == fresh[k][0]
    with pytest.raises(ValueError, match="shape"):
        next(plan.partition_pass(0, slices[0], X[:, cols[0]], y, out=np.empty(slices[0].size + 1)))
