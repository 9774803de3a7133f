"""Build a model from its spec (the inverse of ``model.spec``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from distbelief.errors import ModelSpecError

from ._base import ModelBase
from ._linear import LeastSquares, Logistic, Softmax
from ._local import LocallyConnected
from ._local2d import LocallyConnected2D
from ._mlp import MLP
from ._specs import (
    LeastSquaresSpec,
    LocallyConnected2DSpec,
    LocallyConnectedSpec,
    LogisticSpec,
    MLPSpec,
    SoftmaxSpec,
    validate_spec,
)

BuiltIn = LeastSquares | Logistic | Softmax | MLP | LocallyConnected | LocallyConnected2D

__all__ = ["from_spec"]


def from_spec(spec: Mapping[str, Any] | BaseModel) -> BuiltIn:
    """Build a built-in model from its JSON-able spec.

    Parameters
    ----------
    spec : dict or a parsed spec (``models.ModelSpec``, e.g. a FastAPI request body)
        ``{"kind": ..., **fields}`` with kind one of

        - ``"least_squares"``, ``"logistic"``: ``n_features`` (int >= 1), ``fit_intercept`` (bool, default
          true);
        - ``"softmax"``: ``n_features`` (int >= 1), ``n_classes`` (int >= 2), ``fit_intercept`` (bool,
          default true);
        - ``"mlp"``: ``layer_sizes`` (list of >= 2 ints >= 1, the last >= 2), ``activation``
          (``"sigmoid"`` | ``"tanh"`` | ``"relu"``, default ``"sigmoid"``);
        - ``"locally_connected"``: ``n_features``, ``n_classes`` (int >= 2), ``fields`` (list of ints >= 1,
          one per local layer, default ``[5]``), ``strides`` (as many, default 1 each), ``activation``
          (default ``"tanh"``);
        - ``"locally_connected_2d"``: ``image_shape`` ([height, width]), ``channels`` (default 1),
          ``n_classes``, ``patches`` (list of [rows, columns] or ints, default ``[[3, 3]]``), ``strides``
          (as many, default 1), ``filters`` (filters per location, default 4 each), ``activation``
          (default ``"tanh"``).

        Integers must be integers (not 64.0 or "64") and booleans booleans. ``models.SPEC_SCHEMAS`` holds
        the JSON schema of each kind. A locally connected network whose maps are smaller than a layer's
        field or patch is refused too.

    Returns
    -------
    LeastSquares, Logistic, Softmax, MLP, LocallyConnected or LocallyConnected2D
        A model whose ``spec`` equals the validated spec with defaults filled in.

    Raises
    ------
    distbelief.errors.ModelSpecError
        For an unknown kind, an unknown or missing field, a value of the wrong type or out of range; the
        message names the field and lists the valid choices.

    Examples
    --------
    >>> from_spec({"kind": "softmax", "n_features": 64, "n_classes": 10})
    Softmax(n_features=64, fit_intercept=True, n_classes=10)
    >>> m = from_spec({"kind": "mlp", "layer_sizes": [64, 32, 10], "activation": "tanh"})
    >>> from_spec(m.spec) == m
    True
    >>> from_spec({"kind": "svm", "n_features": 3})
    Traceback (most recent call last):
    ...
    distbelief.errors.ModelSpecError: unknown model kind 'svm' in field 'kind'; ...
    """
    checked = validate_spec(spec)
    model: ModelBase
    if isinstance(checked, LeastSquaresSpec):
        model = LeastSquares(checked.n_features, fit_intercept=checked.fit_intercept)
    elif isinstance(checked, LogisticSpec):
        model = Logistic(checked.n_features, fit_intercept=checked.fit_intercept)
    elif isinstance(checked, SoftmaxSpec):
        model = Softmax(checked.n_features, checked.n_classes, fit_intercept=checked.fit_intercept)
    elif isinstance(checked, MLPSpec):
        model = MLP(checked.layer_sizes, activation=checked.activation)
    else:
        try:
            model = _locally_connected(checked)
        except ModelSpecError as exc:  # the geometry: a map smaller than its field or patch, ...
            kind = getattr(checked, "kind", "")
            raise ModelSpecError(f"invalid {kind} model spec: {exc}") from None
    assert isinstance(model, BuiltIn)
    return model


def _locally_connected(checked: BaseModel) -> LocallyConnected | LocallyConnected2D:
    if isinstance(checked, LocallyConnectedSpec):
        return LocallyConnected(
            checked.n_features,
            checked.n_classes,
            fields=checked.fields,
            strides=checked.strides,
            activation=checked.activation,
        )
    assert isinstance(checked, LocallyConnected2DSpec)
    return LocallyConnected2D(
        checked.image_shape,
        checked.n_classes,
        channels=checked.channels,
        patches=[tuple(p) for p in checked.patches],
        strides=None if checked.strides is None else [tuple(s) for s in checked.strides],
        filters=checked.filters,
        activation=checked.activation,
    )
