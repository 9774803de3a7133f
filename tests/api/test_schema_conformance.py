"""The API does what its OpenAPI says: schemathesis against the real app on a real server (issue 18).

Every phase runs (the schema's examples, coverage of the documented constraints, fuzzing of positive and
negative data, and stateful sequences along the schema's links: create a dataset or job, then read, cancel
or delete it), with every check but one: no 5xx, only documented status codes, content types, headers
and bodies that match their schemas, 4xx for data the schema forbids, a deleted resource is gone, a
created one is there, 405 with a true ``Allow`` for an undocumented method, 401 without the token.

Left out, with reasons:

- ``positive_data_acceptance`` (data valid by the schema must get 2xx): a job that names a dataset that does
  not exist, or a model that does not fit the dataset, is valid JSON by the schema and rightly a 422; no
  schema can say which datasets exist.
- ``GET /api/jobs/{job_id}/events``: a server-sent event stream stays open while the job runs; it is tested
  in test_app.py.

The run is bounded: at most ``MAX_EXAMPLES`` cases per operation and phase, ``MAX_SECONDS`` in all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client as DaskClient

from distbelief.api import Client
from distbelief.storage import load_digits
from tests.api.conftest import TOKEN, live_server, tiny_xy

pytest.importorskip("schemathesis")

MAX_EXAMPLES = 15
MAX_SECONDS = 120


@pytest.fixture
def served(tmp_path: Path, client: DaskClient) -> Iterator[str]:
    # The schema's job example trains on 'digits'; 'tiny' gives fuzzed jobs a second dataset to find.
    with live_server(tmp_path / "store", client) as url:
        with Client(url, TOKEN) as api:
            api.upload_dataset("digits", *load_digits())
            api.upload_dataset("tiny", *tiny_xy())
        yield url


@pytest.mark.timeout(MAX_SECONDS + 120)
def test_the_api_conforms_to_its_openapi_schema(served: str, tmp_path: Path) -> None:
    report = tmp_path / "schemathesis.json"
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{served}/openapi.json",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--exclude-path-regex",
        "/events$",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(MAX_SECONDS),
        "--request-timeout",
        "30",
        "--workers",
        "1",
        "--seed",
        "18",
        "--no-shrink",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=MAX_SECONDS + 90, check=False)
    output = run.stdout[-20_000:] + run.stderr[-5_000:]
    assert report.exists(), output
    result: dict[str, Any] = json.loads(report.read_text())
    print(
        "schemathesis:",
        json.dumps({k: result[k] for k in ("operations", "phases", "test_cases", "running_time")}),
    )
    assert result["failures"] == [], output
    assert result["errors"] == [], output
    assert result["operations"]["tested"] == result["operations"]["selected"] >= 14, result["operations"]
    assert all(p["status"] == "success" for p in result["phases"].values()), result["phases"]
    assert result["test_cases"]["generated"] >= 500, result["test_cases"]
    assert run.returncode == 0, output
