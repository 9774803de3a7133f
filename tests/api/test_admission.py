"""Issue 18: a job too big for the cluster or the settings is refused at submit (422, with its figures),
and nothing is stored for it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from distributed import Client as DaskClient

from distbelief import models
from distbelief.api._admission import estimate_cost
from distbelief.api.settings import Settings
from tests.api.conftest import npz_bytes, running_app, settings_for, tiny_xy, wait_final


def _job(layer_sizes: list[int], **options: Any) -> dict[str, Any]:
    return {
        "algorithm": "sandblaster-lbfgs",
        "dataset": "ten",
        "model": {"kind": "mlp", "layer_sizes": layer_sizes},
        "options": {"maxiter": 2, **options},
    }


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "mlp", "layer_sizes": [64, 32, 10]},
        {"kind": "mlp", "layer_sizes": [3, 7, 5, 2]},
        {"kind": "softmax", "n_features": 64, "n_classes": 10},
        {"kind": "softmax", "n_features": 64, "n_classes": 10, "fit_intercept": False},
        {"kind": "logistic", "n_features": 5},
        {"kind": "least_squares", "n_features": 5, "fit_intercept": False},
    ],
)
def test_the_estimate_counts_the_parameters_the_model_has(spec: dict[str, Any]) -> None:
    cost = estimate_cost(spec, "sandblaster-lbfgs", {}, n_rows=100, portion_rows=50, n_workers=2)
    assert cost.n_params == models.from_spec(spec).n_params
    assert cost.bytes_per_shard == cost.n_params * (2 * 10 + 6) * 8  # one shard below 128 Ki parameters
    for dtype, history_bytes in (("auto", 8), ("float64", 8), ("float32", 4)):
        options = {"history_dtype": dtype, "history": 5}
        for algorithm, working in (("sandblaster-lbfgs", 6), ("sandblaster-owlqn", 9)):
            cost = estimate_cost(spec, algorithm, options, n_rows=100, portion_rows=50, n_workers=2)
            assert cost.bytes_per_shard == cost.n_params * (2 * 5 * history_bytes + working * 8)


@pytest.mark.anyio
async def test_jobs_too_big_for_the_cluster_or_the_settings_are_refused_with_the_figures(
    tmp_path: Path, client: DaskClient
) -> None:
    async with running_app(settings_for(tmp_path, max_params=50_000), client) as (_, http):
        X, y = tiny_xy(d=10)
        r = await http.post("/api/datasets", data={"name": "ten"}, files={"file": ("t.npz", npz_bytes(X, y))})
        assert r.status_code == 201, r.text
        jobs_before = sorted(os.listdir(tmp_path / "jobs"))

        # 10**12 hidden units: ~94.6 TiB per vector. Refused now, not with a MemoryError later.
        r = await http.post("/api/jobs", json=_job([10, 10**12, 2]))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "13,000,000,000,002 parameters" in detail, detail
        assert "PiB per shard" in detail and "DISTBELIEF_MAX_PARAMS=50,000" in detail
        assert "a shard would need" in detail and "DISTBELIEF_JOB_MEMORY_FRACTION" in detail

        # 100,000 layers: refused by the layer limit.
        r = await http.post("/api/jobs", json=_job([10] * 100_000 + [2]))
        assert r.status_code == 422, r.text
        assert "100,001 layers" not in r.json()["detail"]  # counts are plain, limits named
        assert "100001 layers is more than DISTBELIEF_MAX_LAYERS=100" in r.json()["detail"]

        # Over the configured parameter limit, though it would fit in memory.
        r = await http.post("/api/jobs", json=_job([10, 5000, 2]))
        assert r.status_code == 422, r.text
        assert "65,002 parameters is more than DISTBELIEF_MAX_PARAMS=50,000" in r.json()["detail"]

        # Nothing was stored for any of them.
        assert sorted(os.listdir(tmp_path / "jobs")) == jobs_before
        assert (await http.get("/api/jobs")).json()["count"] == 0

        # A job within the limits runs.
        r = await http.post("/api/jobs", json=_job([10, 8, 2]))
        assert r.status_code == 201, r.text
        assert (await wait_final(http, r.json()["id"]))["status"] == "succeeded"


@pytest.mark.anyio
async def test_a_job_needing_more_memory_than_a_worker_has_is_refused(
    tmp_path: Path, client: DaskClient
) -> None:
    async with running_app(settings_for(tmp_path, job_memory_fraction=1e-6), client) as (_, http):
        X, y = tiny_xy(d=10)
        r = await http.post("/api/datasets", data={"name": "ten"}, files={"file": ("t.npz", npz_bytes(X, y))})
        assert r.status_code == 201, r.text
        r = await http.post("/api/jobs", json=_job([10, 300, 2]))
        assert r.status_code == 422, r.text
        assert "a shard would need" in r.json()["detail"] and "of a worker's" in r.json()["detail"]
        assert (await http.get("/api/jobs")).json()["count"] == 0


def test_the_limits_are_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTBELIEF_MAX_PARAMS", "1234")
    monkeypatch.setenv("DISTBELIEF_MAX_LAYERS", "7")
    monkeypatch.setenv("DISTBELIEF_JOB_MEMORY_FRACTION", "0.25")
    settings = Settings()
    assert (settings.max_params, settings.max_layers, settings.job_memory_fraction) == (1234, 7, 0.25)
    assert Settings.model_fields["max_pass_flops"].default == 1e13
