"""Every estimator test fits on the session's LocalCluster: estimators made with client=None use the default
Dask client, which the session client is once it exists (so no test starts a cluster of its own)."""

from __future__ import annotations

import pytest
from distributed import Client


@pytest.fixture(autouse=True)
def _default_client(client: Client) -> Client:
    return client
