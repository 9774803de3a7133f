"""One objective everywhere: every algorithm's job reports F(w) on the training data, computed the same way,
in its result, its metrics, the job list and the CLI; Downpour's mini-batch loss is labelled as such."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distbelief import models
from distbelief.api import Client
from distbelief.api.cli import main
from tests.api.conftest import LOGISTIC, TOKEN, tiny_xy

JOBS: dict[str, dict[str, Any]] = {
    "sandblaster-lbfgs": {"l2": 0.05},
    "sandblaster-gd": {"l2": 0.05, "maxiter": 20},
    "sandblaster-owlqn": {"l2": 0.05, "l1": 0.01},
    "downpour-sgd": {"l2": 0.05, "epochs": 30, "replicas": 2, "rule": "adagrad", "lr": 0.2},
}


def test_every_algorithm_reports_f_of_w_on_the_training_data(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    X, y = tiny_xy()
    model = models.Logistic(4)
    with Client(server, TOKEN) as api:
        ids = {
            algorithm: api.submit(
                {"algorithm": algorithm, "dataset": "tiny", "eval_dataset": "tiny", "model": LOGISTIC}
                | {"options": options}
            )["id"]
            for algorithm, options in JOBS.items()
        }
        listed = {}
        for algorithm, job_id in ids.items():
            record = api.wait(job_id, timeout=120, progress=False)
            assert record["status"] == "succeeded", record["message"]
            w = api.params(job_id)
            f = (
                models.objective(model, w, X, y, l2=0.05)[0]
                + JOBS[algorithm].get("l1", 0.0) * np.abs(w).sum()
            )
            result = record["result"]
            # The same F(w) for every algorithm, computed the same way; held-out metrics beside it.
            assert result["objective"] == pytest.approx(f, rel=1e-10), algorithm
            assert "eval_loss" in result and "eval_accuracy" in result
            metrics = api.metrics(job_id)
            assert "objective" in metrics
            assert float(metrics.objective.values[-1]) == pytest.approx(f, rel=1e-9), algorithm
            assert record["latest"]["objective"] == pytest.approx(f, rel=1e-9)
            listed[job_id] = f
        # Sandblaster's own value of F at its last iterate is the same number.
        fun = api.job(ids["sandblaster-lbfgs"])["result"]["fun"]
        assert fun == pytest.approx(listed[ids["sandblaster-lbfgs"]], rel=1e-10)
        for job in api.jobs():
            if job["id"] in listed:
                assert job["result"]["objective"] == pytest.approx(listed[job["id"]], rel=1e-10)
        downpour = api.metrics(ids["downpour-sgd"])
        assert (
            downpour.train_loss.attrs.get("long_name", "running mini-batch loss") == "running mini-batch loss"
        )

    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    assert main(["status", "--url", server]) == 0
    out = capsys.readouterr().out
    assert "F(w) train" in out.splitlines()[0]
    for job_id, f in listed.items():
        line = next(line for line in out.splitlines() if line.startswith(job_id[:16]))
        shown = float(re.split(r"\s+", line)[5])
        assert shown == pytest.approx(f, rel=1e-5)


def test_the_dashboard_labels_the_running_mini_batch_loss() -> None:
    script = (Path(__file__).resolve().parents[2] / "api" / "dashboard" / "app.js").read_text()
    assert 'train_loss: "running mini-batch loss"' in script and 'objective: "F(w) train"' in script
