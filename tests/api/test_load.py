"""A bounded load test: 50 concurrent submissions and 200 concurrent status reads against real uvicorn."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

from distributed import Client as DaskClient

from distbelief.api import Client
from tests.api.conftest import TOKEN, live_server, tiny_xy


def _benchmark() -> ModuleType:
    # The benchmark's load generator is the one tested here: its published figures come from tested code.
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "api_load.py"
    spec = importlib.util.spec_from_file_location("api_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fifty_submissions_and_two_hundred_reads_lose_nothing(tmp_path: Path, client: DaskClient) -> None:
    bench = _benchmark()
    with live_server(tmp_path, client, max_concurrent_jobs=2) as url:
        with Client(url, TOKEN) as api:
            api.upload_dataset("tiny", *tiny_xy())
        result = asyncio.run(bench.run_load(url, TOKEN, n_jobs=50, n_reads=200, timeout=150))
        with Client(url, TOKEN) as api:
            jobs = {j["id"]: j for j in api.jobs()}
    assert result["submit"]["errors"] == 0 and result["status_read"]["errors"] == 0
    assert len(set(result["job_ids"])) == 50
    assert result["lost"] == 0 and result["not_final"] == 0
    failures = {i: jobs[i].get("message") for i in result["job_ids"] if jobs[i]["status"] != "succeeded"}
    assert result["final_statuses"] == {"succeeded": 50}, failures
    assert all(jobs[i]["status"] == "succeeded" and jobs[i]["result"]["nit"] == 3 for i in result["job_ids"])
    assert result["submit"]["p99_ms"] < 60_000 and result["status_read"]["p99_ms"] < 60_000
