"""Sandblaster on a partitioned replica: every portion's gradient computed by the model's K partitions."""

from __future__ import annotations

import numpy as np
from distributed import Client

from distbelief import models, sandblaster
from distbelief.storage import load_digits


def test_lbfgs_on_a_partitioned_model_takes_the_same_iterates(client: Client) -> None:
    X, y = load_digits()
    X, y = X[:400], y[:400]
    model = models.LocallyConnected(64, 10, fields=[6, 3], strides=[2, 1])
    kw = {"l2": 1e-2, "maxiter": 8, "replicas": 2, "portions": 4, "client": client, "backups": False}
    whole = sandblaster.minimize(model, (X, y), **kw)  # type: ignore[arg-type]
    split = sandblaster.minimize(models.PartitionedModel(model, 2), (X, y), **kw)  # type: ignore[arg-type]
    assert split.nit == whole.nit == 8
    np.testing.assert_allclose(split.x, whole.x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(split.fun, whole.fun, rtol=1e-10)
