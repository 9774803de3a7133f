"""Cancel is atomic (issue 27, item 2): a cancel answered 200 means the job ends ``cancelled``, even when the
run ended on its own before its callback could see the cancel (api/runner.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from distributed import Client as DaskClient

from tests.api.conftest import LOGISTIC, running_app, settings_for, tiny_xy, upload_datasets, wait_final

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("evaluation", ["succeeds", "fails"])
async def test_a_cancel_between_the_runs_end_and_its_record_wins(
    tmp_path: Path, client: DaskClient, evaluation: str
) -> None:
    X, y = tiny_xy()
    async with running_app(settings_for(tmp_path / "store"), client) as (app, http):
        await upload_datasets(http, {"tiny": (X, y)})
        runner = app.state.runner
        ended, release = threading.Event(), threading.Event()
        evaluate = runner._evaluate

        def held_evaluate(*args: Any) -> dict[str, Any]:
            # The run is over (its callback will not run again): hold the job here, before its final status.
            ended.set()
            assert release.wait(60)
            if evaluation == "fails":
                raise RuntimeError("the evaluation task was lost")
            return dict(evaluate(*args))

        runner._evaluate = held_evaluate
        body = {
            "algorithm": "sandblaster-lbfgs",
            "dataset": "tiny",
            "model": LOGISTIC,
            "options": {"maxiter": 3},
        }
        r = await http.post("/api/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        with anyio.fail_after(60):
            while not ended.is_set():
                await anyio.sleep(0.02)
        cancel = await http.post(f"/api/jobs/{job_id}/cancel")
        assert cancel.status_code == 200, cancel.text
        release.set()
        record = await wait_final(http, job_id)
        assert record["status"] == "cancelled", record
        assert record["message"].startswith("cancelled while running")
        if evaluation == "fails":
            assert "evaluation of its final loss failed" in record["message"]
        # The parameters the run paid for stay available.
        params = await http.get(f"/api/jobs/{job_id}/params")
        assert params.status_code == 200 and params.headers["X-Job-Status"] == "cancelled"
        # And a job already final refuses a cancel: 409, status unchanged.
        again = await http.post(f"/api/jobs/{job_id}/cancel")
        assert (
            again.status_code == 409
            and (await http.get(f"/api/jobs/{job_id}")).json()["status"] == "cancelled"
        )
