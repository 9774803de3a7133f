"""Specs: round trips, JSON schemas, and every way a spec can be wrong."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from distbelief import models
from distbelief.errors import ModelSpecError
from distbelief.models import (
    MLP,
    MODEL_KINDS,
    SPEC_SCHEMAS,
    LeastSquares,
    Logistic,
    Model,
    ModelSpec,
    Softmax,
    from_spec,
    spec_schema,
)

SPECS: list[dict[str, Any]] = [
    {"kind": "least_squares", "n_features": 5, "fit_intercept": True},
    {"kind": "least_squares", "n_features": 1, "fit_intercept": False},
    {"kind": "logistic", "n_features": 500, "fit_intercept": True},
    {"kind": "logistic", "n_features": 3, "fit_intercept": False},
    {"kind": "softmax", "n_features": 64, "n_classes": 10, "fit_intercept": True},
    {"kind": "softmax", "n_features": 2, "n_classes": 2, "fit_intercept": False},
    {"kind": "mlp", "layer_sizes": [64, 32, 10], "activation": "tanh"},
    {"kind": "mlp", "layer_sizes": [4, 3], "activation": "sigmoid"},
    {"kind": "mlp", "layer_sizes": [8, 16, 16, 3], "activation": "relu"},
    {
        "kind": "locally_connected",
        "n_features": 64,
        "n_classes": 10,
        "fields": [5, 3],
        "strides": [2, 1],
        "activation": "tanh",
    },
    {
        "kind": "locally_connected_2d",
        "image_shape": [8, 8],
        "channels": 1,
        "n_classes": 10,
        "patches": [[3, 3], [2, 3]],
        "strides": [[1, 1], [2, 1]],
        "filters": [4, 2],
        "activation": "relu",
    },
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: json.dumps(s))
def test_spec_round_trips_through_json(spec: dict[str, Any]) -> None:
    model = from_spec(spec)
    assert isinstance(model, Model)
    assert model.spec == spec
    rebuilt = from_spec(json.loads(json.dumps(model.spec)))
    assert rebuilt == model and hash(rebuilt) == hash(model)
    assert type(rebuilt) is type(model) and rebuilt.n_params == model.n_params
    assert pickle.loads(pickle.dumps(model)) == model  # models travel to Dask workers


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(MODEL_KINDS),
    d=st.integers(1, 1000),
    k=st.integers(2, 50),
    hidden=st.lists(st.integers(1, 100), max_size=3),
    intercept=st.booleans(),
    activation=st.sampled_from(models.ACTIVATIONS),
)
def test_any_valid_spec_round_trips(
    kind: str, d: int, k: int, hidden: list[int], intercept: bool, activation: str
) -> None:
    spec: dict[str, Any] = {"kind": kind}
    if kind == "mlp":
        spec |= {"layer_sizes": [d, *hidden, k], "activation": activation}
    elif kind == "locally_connected":
        fields = [min(d, 1 + h % 7) for h in hidden[:1]] or [1]
        spec |= {"n_features": d, "n_classes": k, "fields": fields, "strides": [1 + d % 3]}
        spec["activation"] = activation
    elif kind == "locally_connected_2d":
        side = 1 + d % 9
        spec |= {"image_shape": [side, 1 + k % 5], "channels": 1 + d % 2, "n_classes": k}
        spec |= {"patches": [[1, 1]], "strides": [[1 + k % 2, 1]], "filters": [1 + d % 3]}
        spec["activation"] = activation
        model = from_spec(spec)
        assert model.spec == spec and from_spec(model.spec) == model
        assert model.n_features == side * (1 + k % 5) * (1 + d % 2)
        return
    else:
        spec |= {"n_features": d, "fit_intercept": intercept}
        if kind == "softmax":
            spec["n_classes"] = k
    model = from_spec(spec)
    assert model.spec == spec
    assert from_spec(model.spec) == model
    assert model.n_features == d
    assert model.init_params(seed=0).shape == (model.n_params,)


def test_defaults_are_filled_in() -> None:
    assert from_spec({"kind": "logistic", "n_features": 3}).spec["fit_intercept"] is True
    assert from_spec({"kind": "mlp", "layer_sizes": [3, 2]}).spec["activation"] == "sigmoid"


def test_spec_matches_constructor_and_numpy_integers_are_accepted() -> None:
    spec = {"kind": "softmax", "n_features": np.int64(4), "n_classes": np.int32(3)}
    assert from_spec(spec) == Softmax(4, 3)
    assert MLP(np.array([4, 5, 3]), activation="relu") == MLP((4, 5, 3), activation="relu")
    no_intercept = LeastSquares(2, fit_intercept=np.bool_(False))  # type: ignore[arg-type]
    assert no_intercept.spec["fit_intercept"] is False
    assert Softmax(3, 2) != Logistic(3)
    assert Logistic(3) != Logistic(3, fit_intercept=False)


@pytest.mark.parametrize(
    ("model", "n_params", "label_kind", "n_classes"),
    [
        (LeastSquares(5), 6, "real", None),
        (LeastSquares(5, fit_intercept=False), 5, "real", None),
        (Logistic(5), 6, "binary", 2),
        (Softmax(5, 3), 18, "classes", 3),
        (Softmax(5, 3, fit_intercept=False), 15, "classes", 3),
        (MLP([5, 4, 3]), 5 * 4 + 4 + 4 * 3 + 3, "classes", 3),
    ],
    ids=repr,
)
def test_sizes_and_label_metadata(model: Any, n_params: int, label_kind: str, n_classes: int | None) -> None:
    assert model.n_params == n_params
    assert model.n_features == 5
    assert model.label_kind == label_kind
    assert model.n_classes == n_classes


# --- bad specs -------------------------------------------------------------------------------------------

BAD_SPECS: list[tuple[Any, list[str]]] = [
    # (spec, fragments the message must contain)
    ("softmax", ["dict", "kind"]),
    ({}, ["'kind'", "'least_squares'", "'mlp'"]),
    (
        {"kind": "svm", "n_features": 3},
        ["'svm'", "'kind'", "'least_squares'", "'logistic'", "'softmax'", "'mlp'"],
    ),
    ({"kind": 3, "n_features": 3}, ["kind", "'logistic'"]),
    ({"kind": "logistic", "n_feature": 3}, ["'n_feature'", "did you mean 'n_features'", "'fit_intercept'"]),
    ({"kind": "logistic", "n_features": 3, "l2": 0.1}, ["'l2'", "'n_features'", "'fit_intercept'"]),
    ({"kind": "logistic"}, ["missing", "'n_features'"]),
    ({"kind": "softmax", "n_features": 3}, ["missing", "'n_classes'"]),
    ({"kind": "mlp"}, ["missing", "'layer_sizes'"]),
    ({"kind": "logistic", "n_features": "64"}, ["'n_features'", "integer", "'64'"]),
    ({"kind": "logistic", "n_features": 64.0}, ["'n_features'", "integer", "64.0"]),
    ({"kind": "logistic", "n_features": True}, ["'n_features'", "integer"]),
    ({"kind": "logistic", "n_features": None}, ["'n_features'", "integer"]),
    ({"kind": "logistic", "n_features": 3, "fit_intercept": 1}, ["'fit_intercept'", "true or false"]),
    (
        {"kind": "least_squares", "n_features": 3, "fit_intercept": "yes"},
        ["'fit_intercept'", "true or false"],
    ),
    ({"kind": "least_squares", "n_features": 0}, ["'n_features'", ">= 1", "0"]),
    ({"kind": "logistic", "n_features": -5}, ["'n_features'", ">= 1", "-5"]),
    ({"kind": "softmax", "n_features": 3, "n_classes": 1}, ["'n_classes'", ">= 2"]),
    ({"kind": "softmax", "n_features": 3, "n_classes": 0}, ["'n_classes'", ">= 2"]),
    ({"kind": "softmax", "n_features": 3, "n_classes": 2.5}, ["'n_classes'", "integer"]),
    ({"kind": "mlp", "layer_sizes": [3]}, ["'layer_sizes'", "at least 2"]),
    ({"kind": "mlp", "layer_sizes": []}, ["'layer_sizes'", "at least 2"]),
    ({"kind": "mlp", "layer_sizes": "64,10"}, ["'layer_sizes'", "list"]),
    ({"kind": "mlp", "layer_sizes": 64}, ["'layer_sizes'", "list"]),
    ({"kind": "mlp", "layer_sizes": [64, 0, 10]}, ["'layer_sizes[1]'", ">= 1"]),
    ({"kind": "mlp", "layer_sizes": [64, 32.0, 10]}, ["'layer_sizes[1]'", "integer"]),
    ({"kind": "mlp", "layer_sizes": [64, 32, 1]}, ["'layer_sizes'", "number of classes", ">= 2"]),
    (
        {"kind": "mlp", "layer_sizes": [4, 2], "activation": "elu"},
        ["'activation'", "'sigmoid'", "'tanh'", "'relu'"],
    ),
    ({"kind": "mlp", "layer_sizes": [4, 2], "fit_intercept": True}, ["'fit_intercept'", "'activation'"]),
    ({"kind": "mlp", "layer_sizes": [4, 2], "n_features": 4}, ["'n_features'", "'layer_sizes'"]),
]


@pytest.mark.parametrize(
    ("spec", "fragments"), BAD_SPECS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else ""
)
def test_bad_spec_raises_model_spec_error_naming_the_field(spec: Any, fragments: list[str]) -> None:
    with pytest.raises(ModelSpecError) as info:
        from_spec(spec)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert isinstance(info.value, ValueError)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ModelSpecError) as info:
        from_spec({"kind": "softmax", "n_features": 0, "n_classes": "ten", "bias": True})
    message = str(info.value)
    assert "'n_features'" in message and "'n_classes'" in message and "'bias'" in message


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: LeastSquares(0), "'n_features'"),
        (lambda: Logistic(3.0), "'n_features'"),  # type: ignore[arg-type]
        (lambda: Logistic(3, fit_intercept="no"), "'fit_intercept'"),  # type: ignore[arg-type]
        (lambda: Softmax(3, 1), "'n_classes'"),
        (lambda: MLP([3]), "'layer_sizes'"),
        (lambda: MLP("33"), "'layer_sizes'"),  # type: ignore[arg-type]
        (lambda: MLP([3, 2], activation="softplus"), "'activation'"),
    ],
)
def test_constructors_validate_like_from_spec(build: Any, fragment: str) -> None:
    with pytest.raises(ModelSpecError, match=fragment):
        build()


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Logistic(3, False)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        MLP([3, 2], "tanh")  # type: ignore[call-arg]


# --- schemas ---------------------------------------------------------------------------------------------


def _value_accepts(prop: dict[str, Any], value: Any) -> bool:
    if "anyOf" in prop:
        return any(_value_accepts(option, value) for option in prop["anyOf"])
    if "const" in prop and value != prop["const"]:
        return False
    if "enum" in prop and value not in prop["enum"]:
        return False
    kind = prop.get("type")
    if kind == "null":
        return value is None
    if kind == "integer":
        return type(value) is int and value >= prop.get("minimum", -np.inf)
    if kind == "boolean":
        return type(value) is bool
    if kind == "array":
        if not isinstance(value, list) or not prop.get("minItems", 0) <= len(value) <= prop.get(
            "maxItems", 1e9
        ):
            return False
        return all(_value_accepts(prop["items"], v) for v in value)
    return True


def _schema_accepts(schema: dict[str, Any], spec: dict[str, Any]) -> bool:
    """A small JSON-schema check (no jsonschema package here) of the keywords pydantic emits for specs."""
    props = schema["properties"]
    if not set(schema["required"]) <= set(spec) or (
        not schema.get("additionalProperties", True) and set(spec) - set(props)
    ):
        return False
    return all(_value_accepts(props[key], value) for key, value in spec.items())


def test_schemas_cover_every_kind_and_describe_the_specs() -> None:
    assert (
        set(SPEC_SCHEMAS)
        == set(MODEL_KINDS)
        == {
            "least_squares",
            "logistic",
            "softmax",
            "mlp",
            "locally_connected",
            "locally_connected_2d",
        }
    )
    for kind in MODEL_KINDS:
        schema = spec_schema(kind)
        assert schema == SPEC_SCHEMAS[kind]
        json.dumps(schema)
        assert schema["additionalProperties"] is False
        assert schema["properties"]["kind"]["const"] == kind
    for spec in SPECS:
        assert _schema_accepts(SPEC_SCHEMAS[spec["kind"]], spec)
    assert not _schema_accepts(SPEC_SCHEMAS["logistic"], {"kind": "logistic", "n_features": 0})
    assert not _schema_accepts(SPEC_SCHEMAS["logistic"], {"kind": "logistic", "n_features": 2, "x": 1})
    assert not _schema_accepts(SPEC_SCHEMAS["softmax"], {"kind": "softmax", "n_features": 2, "n_classes": 1})
    assert not _schema_accepts(SPEC_SCHEMAS["mlp"], {"kind": "mlp", "layer_sizes": [2], "activation": "tanh"})
    assert not _schema_accepts(
        SPEC_SCHEMAS["mlp"], {"kind": "mlp", "layer_sizes": [2, 2], "activation": "elu"}
    )
    lc2 = {"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 10}
    assert _schema_accepts(SPEC_SCHEMAS["locally_connected_2d"], lc2)
    assert not _schema_accepts(SPEC_SCHEMAS["locally_connected_2d"], {**lc2, "image_shape": [8]})
    assert not _schema_accepts(SPEC_SCHEMAS["locally_connected_2d"], {**lc2, "patches": [[3, 3, 3]]})
    assert _schema_accepts(SPEC_SCHEMAS["locally_connected_2d"], {**lc2, "patches": [3, [2, 3]]})
    assert not _schema_accepts(SPEC_SCHEMAS["locally_connected_2d"], {**lc2, "patches": [0]})
    assert not _schema_accepts(
        SPEC_SCHEMAS["locally_connected"], {"kind": "locally_connected", "n_features": 4}
    )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"kind": "locally_connected", "n_features": 4, "n_classes": 2, "fields": [5]}, "receptive field"),
        ({"kind": "locally_connected", "n_features": 8, "n_classes": 2, "fields": []}, "fields"),
        ({"kind": "locally_connected", "n_features": 8, "n_classes": 2, "fields": [3], "strides": [1, 1]},
         "same length"),
        ({"kind": "locally_connected", "n_features": 8, "n_classes": 2, "fields": [3.0]}, "integer"),
        ({"kind": "locally_connected_2d", "image_shape": [4, 4], "n_classes": 2, "patches": [5]}, "patch"),
        ({"kind": "locally_connected_2d", "image_shape": [4], "n_classes": 2}, "image_shape"),
        ({"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 2, "patches": [[3, 0]]},
         ">= 1"),
        ({"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 2, "filters": [2, 2]},
         "same length"),
        ({"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 2, "channel": 3}, "channels"),
        ({"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 1}, "n_classes"),
    ],
)  # fmt: skip
def test_bad_locally_connected_specs_say_what_is_wrong(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        from_spec(spec)


def test_spec_schema_rejects_unknown_kind() -> None:
    with pytest.raises(ModelSpecError, match="'least_squares'"):
        spec_schema("perceptron")


def test_model_spec_union_validates_json_bodies() -> None:
    # The REST service can take ModelSpec as a request body type; it must agree with from_spec.
    adapter: TypeAdapter[Any] = TypeAdapter(ModelSpec)
    for spec in SPECS:
        parsed = adapter.validate_json(json.dumps(spec))
        assert from_spec(parsed.model_dump()) == from_spec(spec) == from_spec(parsed)
    with pytest.raises(ValueError, match="n_features"):
        adapter.validate_json('{"kind": "logistic", "n_features": "3"}')
    with pytest.raises(ValueError):
        adapter.validate_json('{"kind": "svm"}')


def test_repr_is_informative() -> None:
    assert repr(MLP([4, 3, 2], activation="relu")) == "MLP(layer_sizes=[4, 3, 2], activation='relu')"
    assert repr(Logistic(3)) == "Logistic(n_features=3, fit_intercept=True)"
