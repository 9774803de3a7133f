"""A Downpour job whose run diverges fails, with the run's message (api/runner.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from distributed import Client as DaskClient

from tests.api.conftest import LOGISTIC, running_app, settings_for, tiny_xy, upload_datasets, wait_final

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("lr", [1e3, 0.05])
async def test_a_diverging_downpour_job_fails_with_the_runs_message(
    tmp_path: Path, client: DaskClient, lr: float
) -> None:
    X, y = tiny_xy()
    Xe, ye = tiny_xy(seed=1)
    async with running_app(settings_for(tmp_path / "store"), client) as (_, http):
        await upload_datasets(http, {"tiny": (X, y), "held": (Xe, ye)})
        body = {
            "algorithm": "downpour-sgd",
            "dataset": "tiny",
            "eval_dataset": "held",
            "model": LOGISTIC,
            "options": {"rule": "sgd", "lr": lr, "epochs": 20, "replicas": 1, "eval_every": 0.05},
        }
        r = await http.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        record = await wait_final(http, r.json()["id"])
        params = await http.get(f"/api/jobs/{record['id']}/params")
    if lr > 1:
        # lr 1000 on a logistic model: the held-out loss climbs far past its starting value.
        assert record["status"] == "failed", record
        assert record["message"].startswith("diverged: ") and "lower lr" in record["message"]
        assert record["result"]["stop_reason"] == "diverged"
        # Its parameters are saved, and served, with the job's status alongside.
        assert params.status_code == 200, params.text
        assert params.headers["X-Job-Status"] == "failed"
        assert np.load(io.BytesIO(params.content)).shape == (LOGISTIC["n_features"] + 1,)
    else:
        assert record["status"] == "succeeded", record["message"]
        assert params.status_code == 200 and params.headers["X-Job-Status"] == "succeeded"
