"""Models: the :class:`Model` protocol and built-in models with analytic gradients.

A model maps a flat float64 parameter vector ``w`` and rows ``X`` with labels ``y`` to the **sum** of the
per-example losses and its gradient (``loss_and_grad``); the optimizers minimize
``F(w) = (1/N) * sum_i loss_i(w) + (l2/2) * ||w||^2`` (see :func:`objective`).

Built-ins: :class:`LeastSquares`, :class:`Logistic`, :class:`Softmax`, :class:`MLP`,
:class:`LocallyConnected` and :class:`LocallyConnected2D` (model parallelism: :func:`partition_plan`,
:func:`run_partitioned`), and :class:`JaxModel` (any JAX loss function, with ``distbelief[jax]``); build all
but the last from a JSON-able spec with :func:`from_spec` (``model.spec`` round-trips), whose JSON schemas
are in :data:`SPEC_SCHEMAS` / :func:`spec_schema` and whose pydantic classes (:data:`ModelSpec` and one per
kind) can serve as request bodies.

Examples
--------
>>> import numpy as np
>>> from distbelief import models
>>> m = models.from_spec({"kind": "logistic", "n_features": 2})
>>> X, y = np.array([[1.0, 2.0], [-1.0, -2.0]]), np.array([1.0, 0.0])
>>> value, grad = models.objective(m, m.init_params(), X, y, l2=0.1)
>>> round(value, 6)
0.693147
"""

from ._base import Model, objective
from ._factory import from_spec
from ._jax import JaxModel
from ._linear import LeastSquares, Logistic, Softmax
from ._local import LocallyConnected
from ._local2d import LocallyConnected2D
from ._mlp import MLP
from ._partitioned import (
    LocallyConnected2DPlan,
    LocallyConnectedPlan,
    MLPPlan,
    PartitionedModel,
    Traffic,
    max_partitions,
    partition_plan,
    run_partitioned,
)
from ._specs import (
    ACTIVATIONS,
    MODEL_KINDS,
    SPEC_SCHEMAS,
    LeastSquaresSpec,
    LogisticSpec,
    MLPSpec,
    ModelSpec,
    SoftmaxSpec,
    spec_schema,
)

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "MODEL_KINDS",
    "SPEC_SCHEMAS",
    "JaxModel",
    "LeastSquares",
    "LeastSquaresSpec",
    "LocallyConnected",
    "LocallyConnected2D",
    "LocallyConnected2DPlan",
    "LocallyConnectedPlan",
    "Logistic",
    "LogisticSpec",
    "MLPPlan",
    "MLPSpec",
    "Model",
    "ModelSpec",
    "PartitionedModel",
    "Softmax",
    "SoftmaxSpec",
    "Traffic",
    "from_spec",
    "max_partitions",
    "objective",
    "partition_plan",
    "run_partitioned",
    "spec_schema",
]
