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
#: The run's time bound (the stateful phase runs until it). On a quiet box 120 s generated ~16,800 cases
#: with every phase and operation covered; 55 s keeps all of them and keeps the suite under 10 minutes
#: (the >= 3 minute run of issue 27 is a run of its own, not the suite's).
MAX_SECONDS = 55


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
    # In tmp_path: schemathesis keeps a cache of what it found under its working directory.
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=MAX_SECONDS + 90, check=False, cwd=tmp_path
    )
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


def test_the_schema_documents_the_error_statuses_and_the_name_rule(tmp_path: Path) -> None:
    from distbelief.api import Settings, create_app
    from distbelief.api.schemas import DATASET_NAME_PATTERN

    schema = create_app(Settings(store=str(tmp_path))).openapi()
    paths = schema["paths"]
    expected = {
        ("post", "/api/jobs"): {"201", "400", "401", "413", "422", "503"},
        ("delete", "/api/jobs/{job_id}"): {"204", "401", "404", "409", "422", "503"},
        ("post", "/api/jobs/{job_id}/cancel"): {"200", "401", "404", "409", "422", "503"},
        ("post", "/api/datasets"): {"201", "400", "401", "409", "413", "415", "422", "503"},
        ("delete", "/api/datasets/{name}"): {"204", "401", "404", "409", "422", "503"},
    }
    for (method, path), codes in expected.items():
        responses = paths[path][method]["responses"]
        assert set(responses) == codes, (method, path, sorted(responses))
        for code in codes - {"200", "201", "204"}:
            ref = responses[code]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorPublic", (method, path, code)
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # 422 bodies are ErrorPublic
    error = schema["components"]["schemas"]["ErrorPublic"]
    assert error["properties"]["detail"]["type"] == "string"

    def pattern(s: dict[str, Any]) -> str:
        return str(s.get("pattern") or next(a["pattern"] for a in s["anyOf"] if "pattern" in a))

    upload = paths["/api/datasets"]["post"]["requestBody"]["content"]
    assert pattern(upload["multipart/form-data"]["schema"]["properties"]["name"]) == DATASET_NAME_PATTERN
    assert upload["multipart/form-data"]["schema"]["additionalProperties"] is False
    assert pattern(upload["application/json"]["schema"]["properties"]["name"]) == DATASET_NAME_PATTERN
    job = schema["components"]["schemas"]["JobCreate"]["properties"]
    assert pattern(job["dataset"]) == pattern(job["eval_dataset"]) == DATASET_NAME_PATTERN
    (name,) = paths["/api/datasets/{name}"]["get"]["parameters"]
    assert pattern(name["schema"]) == DATASET_NAME_PATTERN
