"""The job runner uses the cluster for a finished job's final loss, and builds each job's model once."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client as DaskClient

from distbelief import models
from distbelief.api import runner as runner_module
from distbelief.errors import ClusterError
from distbelief.storage import Dataset
from distbelief.storage.internal import task_result
from tests.api.conftest import LOGISTIC, running_app, settings_for, tiny_xy, upload_datasets, wait_final

pytestmark = pytest.mark.anyio


async def test_the_final_loss_is_computed_on_the_cluster_from_a_job_built_once(
    tmp_path: Path, client: DaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every read of a dataset's arrays goes through Dataset._read; the workers are other processes, so this
    # spy sees only the reads of this (the web) process.
    reads: list[str] = []
    real_read = Dataset._read

    def spy_read(self: Dataset, name: Any, start: int, stop: int) -> Any:
        reads.append(name)
        return real_read(self, name, start, stop)

    monkeypatch.setattr(Dataset, "_read", spy_read)
    built: list[Any] = []
    real_from_spec = models.from_spec

    def counting_from_spec(spec: Any) -> Any:
        built.append(real_from_spec(spec))
        return built[-1]

    monkeypatch.setattr(models, "from_spec", counting_from_spec)
    used: list[Any] = []
    real_adapter = runner_module._ADAPTERS["sandblaster-lbfgs"]

    def adapter(ctx: runner_module.RunContext) -> runner_module.RunOutcome:
        used.append(ctx.model)
        return real_adapter(ctx)

    monkeypatch.setitem(runner_module._ADAPTERS, "sandblaster-lbfgs", adapter)

    X, y = tiny_xy()
    Xe, ye = tiny_xy(seed=1)
    async with running_app(settings_for(tmp_path / "store"), client) as (_, http):
        await upload_datasets(http, {"tiny": (X, y), "held": (Xe, ye)})
        reads.clear()
        built.clear()
        body = {
            "algorithm": "sandblaster-lbfgs",
            "dataset": "tiny",
            "eval_dataset": "held",
            "model": LOGISTIC,
        }
        r = await http.post("/api/jobs", json={**body, "options": {"l2": 1e-2}})
        assert r.status_code == 201, r.text
        record = await wait_final(http, r.json()["id"])
        params = await http.get(f"/api/jobs/{record['id']}/params")
    assert record["status"] == "succeeded", record["message"]

    assert "X" not in reads, "the web process read a dataset's X"
    # The request's schema checks the spec by building it; the runner builds the job's model once.
    assert len(built) == 2 and used == [built[-1]]

    x = np.load(io.BytesIO(params.content), allow_pickle=False)
    model = models.Logistic(4)
    result = record["result"]
    assert result["train_loss"] == pytest.approx(model.loss_and_grad(x, X, y)[0] / len(y), rel=1e-12)
    assert result["eval_loss"] == pytest.approx(model.loss_and_grad(x, Xe, ye)[0] / len(ye), rel=1e-12)
    assert result["eval_accuracy"] == pytest.approx(float(np.mean(model.predict(x, Xe) == ye)))


def test_a_job_whose_evaluation_does_not_finish_in_time_says_so(client: DaskClient) -> None:
    with pytest.raises(ClusterError, match="did not finish within"):
        task_result(client.submit(time.sleep, 5.0, pure=False), timeout=0.2, what="the final loss")
