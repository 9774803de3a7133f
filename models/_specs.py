"""Model specifications: pydantic models that validate a spec dict and give its JSON schema.

A *spec* is the JSON-able description of a model, e.g. ``{"kind": "softmax", "n_features": 64,
"n_classes": 10}``. Every built-in model validates its constructor arguments through the spec class of its
kind, so the constructors, :func:`models.from_spec` and the REST service reject bad input with the same
:class:`errors.ModelSpecError` messages.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from distbelief.errors import ModelSpecError

__all__ = [
    "ACTIVATIONS",
    "MODEL_KINDS",
    "SPEC_CLASSES",
    "SPEC_SCHEMAS",
    "LeastSquaresSpec",
    "LocallyConnected2DSpec",
    "LocallyConnectedSpec",
    "LogisticSpec",
    "MLPSpec",
    "ModelSpec",
    "SoftmaxSpec",
    "spec_schema",
    "validate_spec",
]

ACTIVATIONS: tuple[str, ...] = ("sigmoid", "tanh", "relu")

# Strict: a spec is data (JSON), and silently turning 64.0, "64" or True into 64 hides mistakes.
_PositiveInt = Annotated[int, Strict(), Field(ge=1)]
_StrictBool = Annotated[bool, Strict()]


class _SpecBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LeastSquaresSpec(_SpecBase):
    """Spec of :class:`models.LeastSquares`.

    Examples
    --------
    >>> LeastSquaresSpec(kind="least_squares", n_features=3).model_dump()
    {'kind': 'least_squares', 'n_features': 3, 'fit_intercept': True}
    """

    kind: Literal["least_squares"] = Field(description="Model kind.")
    n_features: _PositiveInt = Field(description="Number of input features (columns of X).")
    fit_intercept: _StrictBool = Field(True, description="Learn an intercept (kept as the last parameter).")


class LogisticSpec(_SpecBase):
    """Spec of :class:`models.Logistic`.

    Examples
    --------
    >>> LogisticSpec(kind="logistic", n_features=3, fit_intercept=False).fit_intercept
    False
    """

    kind: Literal["logistic"] = Field(description="Model kind.")
    n_features: _PositiveInt = Field(description="Number of input features (columns of X).")
    fit_intercept: _StrictBool = Field(True, description="Learn an intercept (kept as the last parameter).")


class SoftmaxSpec(_SpecBase):
    """Spec of :class:`models.Softmax`.

    Examples
    --------
    >>> SoftmaxSpec(kind="softmax", n_features=64, n_classes=10).n_classes
    10
    """

    kind: Literal["softmax"] = Field(description="Model kind.")
    n_features: _PositiveInt = Field(description="Number of input features (columns of X).")
    n_classes: Annotated[int, Strict(), Field(ge=2)] = Field(
        description="Number of classes; labels are the integers 0..n_classes-1."
    )
    fit_intercept: _StrictBool = Field(True, description="Learn one intercept per class (last parameters).")


class MLPSpec(_SpecBase):
    """Spec of :class:`models.MLP`.

    Examples
    --------
    >>> MLPSpec(kind="mlp", layer_sizes=[64, 32, 10], activation="tanh").layer_sizes
    [64, 32, 10]
    """

    kind: Literal["mlp"] = Field(description="Model kind.")
    layer_sizes: Annotated[list[_PositiveInt], Field(min_length=2)] = Field(
        description="[n_features, hidden_1, ..., n_classes]; the last entry (number of classes) must be >= 2."
    )
    activation: Literal["sigmoid", "tanh", "relu"] = Field(
        "sigmoid", description="Activation of the hidden layers (the output layer is always softmax)."
    )

    @field_validator("layer_sizes")
    @classmethod
    def _at_least_two_classes(cls, sizes: list[int]) -> list[int]:
        if sizes[-1] < 2:
            raise ValueError(
                f"the last entry of layer_sizes is the number of classes and must be >= 2, got {sizes[-1]}"
            )
        return sizes


_Activation = Literal["sigmoid", "tanh", "relu"]
_Pair = Annotated[list[_PositiveInt], Field(min_length=2, max_length=2)]


def _int_or_pair(schema: dict[str, Any]) -> None:
    """The JSON schema of a list of pairs says an integer is accepted too (``_pairs`` widens it)."""
    schema["items"] = {"anyOf": [{"type": "integer", "minimum": 1}, schema["items"]]}


def _int_or_pair_or_null(schema: dict[str, Any]) -> None:
    for option in schema.get("anyOf", []):
        if option.get("type") == "array":
            _int_or_pair(option)


def _pairs(value: Any) -> Any:
    """``p`` in a list of pairs means ``[p, p]`` (a square patch or stride)."""
    if isinstance(value, list | tuple):
        return [
            [v, v] if isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) else v
            for v in value
        ]
    return value


class LocallyConnectedSpec(_SpecBase):
    """Spec of :class:`models.LocallyConnected` (1-D receptive fields, no weight sharing).

    Examples
    --------
    >>> LocallyConnectedSpec(kind="locally_connected", n_features=64, n_classes=10, fields=[5, 3]).fields
    [5, 3]
    """

    kind: Literal["locally_connected"] = Field(description="Model kind.")
    n_features: _PositiveInt = Field(description="Input width (columns of X).")
    n_classes: Annotated[int, Strict(), Field(ge=2)] = Field(
        description="Number of classes; labels are the integers 0..n_classes-1."
    )
    fields: Annotated[list[_PositiveInt], Field(min_length=1, max_length=100)] = Field(
        [5], description="Receptive field of every local layer (one entry per layer)."
    )
    strides: Annotated[list[_PositiveInt], Field(min_length=1, max_length=100)] | None = Field(
        None, description="Stride of every local layer (as many as fields); default 1 each."
    )
    activation: _Activation = Field("tanh", description="Activation of the local layers.")


class LocallyConnected2DSpec(_SpecBase):
    """Spec of :class:`models.LocallyConnected2D` (image patches, no weight sharing).

    Examples
    --------
    >>> LocallyConnected2DSpec(kind="locally_connected_2d", image_shape=[8, 8], n_classes=10,
    ...                        patches=[3]).patches
    [[3, 3]]
    """

    kind: Literal["locally_connected_2d"] = Field(description="Model kind.")
    image_shape: _Pair = Field(description="[height, width] of the images; X holds them row-major.")
    channels: _PositiveInt = Field(
        1, description="Channels per pixel (X is flattened (height, width, channels))."
    )
    n_classes: Annotated[int, Strict(), Field(ge=2)] = Field(
        description="Number of classes; labels are the integers 0..n_classes-1."
    )
    patches: Annotated[list[_Pair], Field(min_length=1, max_length=100)] = Field(
        [[3, 3]],
        description="[rows, columns] of every local layer's patch (an integer p means [p, p]).",
        json_schema_extra=_int_or_pair,
    )
    strides: Annotated[list[_Pair], Field(min_length=1, max_length=100)] | None = Field(
        None,
        description="[rows, columns] stride of every local layer (an integer s means [s, s]); default 1.",
        json_schema_extra=_int_or_pair_or_null,
    )
    filters: Annotated[list[_PositiveInt], Field(min_length=1, max_length=100)] | None = Field(
        None, description="Filters per location of every local layer; default 4 each."
    )
    activation: _Activation = Field("tanh", description="Activation of the local layers.")

    @field_validator("patches", "strides", mode="before")
    @classmethod
    def _square(cls, value: Any) -> Any:
        return _pairs(value)


SPEC_CLASSES: Mapping[str, type[_SpecBase]] = MappingProxyType(
    {
        "least_squares": LeastSquaresSpec,
        "logistic": LogisticSpec,
        "softmax": SoftmaxSpec,
        "mlp": MLPSpec,
        "locally_connected": LocallyConnectedSpec,
        "locally_connected_2d": LocallyConnected2DSpec,
    }
)
MODEL_KINDS: tuple[str, ...] = tuple(SPEC_CLASSES)

#: Any spec, discriminated by ``kind``: usable directly as a FastAPI request-body type.
ModelSpec = Annotated[
    LeastSquaresSpec | LogisticSpec | SoftmaxSpec | MLPSpec | LocallyConnectedSpec | LocallyConnected2DSpec,
    Field(discriminator="kind"),
]


def _choices(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in SPEC_CLASSES:
        raise ModelSpecError(
            f"unknown model kind {kind!r} in field 'kind'; valid kinds: {_choices(list(MODEL_KINDS))}"
        )
    return kind


def spec_schema(kind: str) -> dict[str, Any]:
    """JSON schema of the spec of one model kind.

    Parameters
    ----------
    kind : str
        One of :data:`MODEL_KINDS` (``"least_squares"``, ``"logistic"``, ``"softmax"``, ``"mlp"``,
        ``"locally_connected"``, ``"locally_connected_2d"``).

    Returns
    -------
    dict
        A JSON schema (draft 2020-12) as produced by pydantic; a fresh dict on every call.

    Raises
    ------
    distbelief.errors.ModelSpecError
        If ``kind`` is not a known model kind.

    Examples
    --------
    >>> spec_schema("softmax")["required"]
    ['kind', 'n_features', 'n_classes']
    """
    return SPEC_CLASSES[_check_kind(kind)].model_json_schema()


#: JSON schema of every model kind's spec, keyed by kind (read-only).
SPEC_SCHEMAS: Mapping[str, dict[str, Any]] = MappingProxyType({k: spec_schema(k) for k in MODEL_KINDS})


def _plain(value: Any) -> Any:
    """Turn numpy scalars (e.g. ``X.shape`` arithmetic, ``np.int64``) into Python ones, so strictness
    only rejects values of the wrong *kind* (a float, a string), not of the wrong library."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _field_name(loc: tuple[int | str, ...]) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def _describe(error: Mapping[str, Any], kind: str, cls: type[_SpecBase]) -> str:
    loc = tuple(error["loc"])
    field = _field_name(loc)
    fields = list(cls.model_fields)
    given = error.get("input")
    typ = error["type"]
    if typ == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[0]), fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown field {field!r} for model kind {kind!r}{hint}; valid fields: {_choices(fields)}"
    if typ == "missing":
        required = [name for name, info in cls.model_fields.items() if info.is_required()]
        return f"missing required field {field!r} for model kind {kind!r}; required: {_choices(required)}"
    if typ == "int_type":
        return f"field {field!r} must be an integer, got {type(given).__name__} {given!r}"
    if typ == "bool_type":
        return f"field {field!r} must be true or false, got {type(given).__name__} {given!r}"
    if typ in ("greater_than_equal", "greater_than"):
        bound = error["ctx"].get("ge", error["ctx"].get("gt"))
        op = ">=" if typ == "greater_than_equal" else ">"
        return f"field {field!r} must be an integer {op} {bound}, got {given!r}"
    if typ == "literal_error":
        return f"field {field!r} must be one of {error['ctx']['expected']}, got {given!r}"
    if typ in ("list_type", "too_short") and kind == "mlp":
        return (
            f"field {field!r} must be a list of at least 2 positive integers "
            f"[n_features, hidden_1, ..., n_classes], got {given!r}"
        )
    if typ == "value_error":
        return f"field {field!r}: {error['ctx']['error']}"
    return f"field {field!r}: {error['msg']}, got {given!r}"


def validate_spec(spec: Mapping[str, Any] | BaseModel) -> _SpecBase:
    """Validate a spec dict (or an already parsed spec object) and return the spec object of its kind.

    Raises
    ------
    distbelief.errors.ModelSpecError
        Naming every bad field and the valid choices.
    """
    if isinstance(spec, _SpecBase):
        spec = spec.model_dump()
    if not isinstance(spec, Mapping):
        raise ModelSpecError(
            f"a model spec must be a dict with a 'kind' field, got {type(spec).__name__}; "
            f"e.g. {{'kind': 'softmax', 'n_features': 64, 'n_classes': 10}}"
        )
    if "kind" not in spec:
        raise ModelSpecError(
            f"model spec has no 'kind' field; add one of {_choices(list(MODEL_KINDS))}, "
            f"e.g. {{'kind': 'softmax', 'n_features': 64, 'n_classes': 10}}"
        )
    kind = _check_kind(spec["kind"])
    cls = SPEC_CLASSES[kind]
    try:
        return cls.model_validate({key: _plain(value) for key, value in spec.items()})
    except ValidationError as exc:
        problems = [_describe(err, kind, cls) for err in exc.errors()]
        raise ModelSpecError(f"invalid {kind} model spec: " + "; ".join(problems)) from None
