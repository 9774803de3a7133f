"""Bad input gets a 4xx whose message says what to fix; the server keeps serving, nothing stored changes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distbelief.storage import Dataset
from tests.api.conftest import AUTH, LOGISTIC, npz_bytes, running_app, settings_for, tiny_xy, wait_final

LBFGS = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC}
DOWNPOUR = {"algorithm": "downpour-sgd", "dataset": "tiny", "model": LOGISTIC}
UPLOAD_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module-scoped, so that ``guarded`` can be: one app serves every bad-input test of this module."""
    return "asyncio"


@pytest.fixture(scope="module")
def guarded_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("guarded-store")


@pytest.fixture(scope="module")
async def guarded(guarded_store: Path, session_client: DaskClient) -> AsyncIterator[httpx.AsyncClient]:
    """An app with a small upload limit, the dataset ``tiny`` and one finished job already stored.

    One per module (setting it up runs a job): every test here checks that the stored state is the same
    after its bad input as before it, so the tests need no fresh store each (the one good submission of
    the table adds a job, which no other test's before/after comparison depends on)."""
    session_client.wait_for_workers(2, timeout=60)
    settings = settings_for(guarded_store, max_upload_bytes=UPLOAD_LIMIT)
    async with running_app(settings, session_client) as (_, http):
        X, y = tiny_xy()
        assert (
            await http.post(
                "/api/datasets", data={"name": "tiny"}, files={"file": ("t.npz", npz_bytes(X, y))}
            )
        ).status_code == 201
        job = (await http.post("/api/jobs", json={**LBFGS, "options": {"maxiter": 3}})).json()
        await wait_final(http, job["id"])
        yield http


async def _stored_state(http: httpx.AsyncClient) -> tuple[Any, Any, Any]:
    jobs = (await http.get("/api/jobs")).json()
    datasets = (await http.get("/api/datasets")).json()
    job_id = jobs["data"][0]["id"]
    metrics = (await http.get(f"/api/jobs/{job_id}/metrics")).json()
    return jobs, datasets, metrics


def _spec(**changes: Any) -> dict[str, Any]:
    return {**LBFGS, **changes}


def _downpour(**options: Any) -> dict[str, Any]:
    return {**DOWNPOUR, "options": {"epochs": 1, **options}}


# Each case: request kwargs, expected status, words the message must hold.
JOB_CASES: list[tuple[str, dict[str, Any], int, tuple[str, ...]]] = [
    (
        "malformed JSON",
        {"content": b'{"algorithm": "sandblaster-lbfgs",', "headers": {"Content-Type": "application/json"}},
        400,
        ("not valid JSON",),
    ),
    (
        "not JSON at all",
        {"content": b"algorithm=lbfgs", "headers": {"Content-Type": "text/plain"}},
        400,
        ("JSON object",),
    ),
    (
        "unknown model kind",
        {"json": _spec(model={"kind": "svm", "n_features": 4})},
        422,
        ("unknown model kind 'svm'", "'softmax'"),
    ),
    (
        "misspelled model field",
        {"json": _spec(model={"kind": "logistic", "n_feature": 4})},
        422,
        ("did you mean 'n_features'",),
    ),
    (
        "wrong feature count",
        {"json": _spec(model={"kind": "logistic", "n_features": 7})},
        422,
        ("expects 7 features", "n_features=4"),
    ),
    (
        "labels of another kind",
        {"json": _spec(model={"kind": "least_squares", "n_features": 4}, algorithm="sandblaster-cg")},
        201,
        (),
    ),
    ("history=0", {"json": _spec(options={"history": 0})}, 422, ("history", "greater than or equal to 1")),
    (
        "a history dtype numpy has but the shards do not store",
        {"json": _spec(options={"history_dtype": "float16"})},
        422,
        ("'history_dtype'", "'auto', 'float64' or 'float32'"),
    ),
    ("negative lr", {"json": {**DOWNPOUR, "options": {"lr": -1}}}, 422, ("'lr'", "greater than 0")),
    (
        "a billion replicas",
        {"json": _spec(options={"replicas": 10**9})},
        422,
        ("'replicas'", "less than or equal to 64"),
    ),
    (
        "a billion Downpour replicas",
        {"json": {**DOWNPOUR, "options": {"replicas": 10**9}}},
        422,
        ("'replicas'",),
    ),
    ("unknown option", {"json": _spec(options={"histroy": 5})}, 422, ("unknown option 'histroy'", "history")),
    (
        "option of the wrong type",
        {"json": _spec(options={"maxiter": "50"})},
        422,
        ("'maxiter'", "valid integer"),
    ),
    (
        "NaN option",
        {
            "content": b'{"algorithm": "sandblaster-lbfgs", "dataset": "tiny", '
            b'"model": {"kind": "logistic", "n_features": 4}, "options": {"l2": NaN}}',
            "headers": {"Content-Type": "application/json"},
        },
        422,
        ("'l2'", "finite number"),
    ),
    (
        "infinite option",
        {
            "content": json.dumps(_spec(options={"l2": 1.0})).replace("1.0", "1e400").encode(),
            "headers": {"Content-Type": "application/json"},
        },
        422,
        ("'l2'", "finite number"),
    ),
    # Downpour's fuse, compression and max_coalesce (downpour.train's options, as JSON).
    ("fuse as a string", {"json": _downpour(fuse="no")}, 422, ("'fuse'", "valid boolean")),
    ("fuse as a number", {"json": _downpour(fuse=0)}, 422, ("'fuse'", "valid boolean")),
    ("compression as a number", {"json": _downpour(compression=0.1)}, 422, ('{"tau": <threshold > 0>}',)),
    ("compression as a list", {"json": _downpour(compression=[0.1])}, 422, ('{"tau"', "[0.1]")),
    ("compression without tau", {"json": _downpour(compression={})}, 422, ("'compression.tau'", "required")),
    ("tau = 0", {"json": _downpour(compression={"tau": 0})}, 422, ("'compression.tau'", "greater than 0")),
    ("negative tau", {"json": _downpour(compression={"tau": -1.0})}, 422, ("greater than 0",)),
    (
        "tau as a string",
        {"json": _downpour(compression={"tau": "0.1"})},
        422,
        ("'compression.tau'", "number"),
    ),
    ("huge tau", {"json": _downpour(compression={"tau": 1e7})}, 422, ("less than or equal to 1000000",)),
    (
        "NaN tau",
        {
            "content": json.dumps(_downpour(compression={"tau": 1.0})).replace("1.0", "NaN").encode(),
            "headers": {"Content-Type": "application/json"},
        },
        422,
        ("'compression.tau'", "finite number"),
    ),
    (
        "unknown key of compression",
        {"json": _downpour(compression={"tau": 0.1, "taus": 2})},
        422,
        ("unknown key 'compression.taus'", "takes: tau"),
    ),
    (
        "compression for L-BFGS",
        {"json": _spec(options={"compression": {"tau": 0.1}})},
        422,
        ("unknown option",),
    ),
    ("negative max_coalesce", {"json": _downpour(max_coalesce=-1)}, 422, ("'max_coalesce'", "0")),
    ("fractional max_coalesce", {"json": _downpour(max_coalesce=2.5)}, 422, ("'max_coalesce'", "integer")),
    ("max_coalesce as a bool", {"json": _downpour(max_coalesce=True)}, 422, ("'max_coalesce'", "integer")),
    ("huge max_coalesce", {"json": _downpour(max_coalesce=10**7)}, 422, ("'max_coalesce'", "less than")),
    ("unknown algorithm", {"json": _spec(algorithm="adam")}, 422, ("algorithm", "sandblaster-lbfgs")),
    ("l1 for a smooth method", {"json": _spec(options={"l1": 0.1})}, 422, ('use method="owlqn"',)),
    (
        "missing dataset field",
        {"json": {"algorithm": "sandblaster-lbfgs", "model": LOGISTIC}},
        422,
        ("dataset", "required"),
    ),
    (
        "dataset that does not exist",
        {"json": _spec(dataset="nope")},
        422,
        ("no dataset named 'nope'", "tiny"),
    ),
    ("dataset name with ../", {"json": _spec(dataset="../tiny")}, 422, ("path separator",)),
    (
        "held-out name with ..",
        {"json": _spec(eval_dataset="..")},
        422,
        ("would leave the dataset directory",),
    ),
    (
        "held-out set of another width",
        {"json": _spec(eval_dataset="tiny", model={"kind": "logistic", "n_features": 3})},
        422,
        ("features",),
    ),
    ("body too large", {"json": _spec(name="x" * 2_000_000)}, 413, ("larger than the limit",)),
]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("case", "request_kwargs", "code", "words"), JOB_CASES, ids=[c[0] for c in JOB_CASES]
)
async def test_bad_job_submissions_get_a_4xx_that_says_what_to_fix(
    guarded: httpx.AsyncClient, case: str, request_kwargs: dict[str, Any], code: int, words: tuple[str, ...]
) -> None:
    before = await _stored_state(guarded)
    r = await guarded.post("/api/jobs", **request_kwargs)
    assert r.status_code == code, (case, r.text)
    if code == 201:
        # Least squares takes any real labels: not bad input (the control case of the table).
        await wait_final(guarded, r.json()["id"])
        return
    detail = r.json()["detail"]
    for word in words:
        assert word in detail, (case, detail)
    assert await _stored_state(guarded) == before
    assert (await guarded.get("/api/health")).status_code == 200


@pytest.mark.anyio
async def test_bad_uploads_get_a_4xx_and_leave_the_store_as_it_was(
    guarded: httpx.AsyncClient, guarded_store: Path
) -> None:
    before = await _stored_state(guarded)
    X, y = tiny_xy()
    X_nan = X.copy()
    X_nan[3, 1] = np.nan
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        (
            "NaN data",
            {"data": {"name": "nan"}, "files": {"file": ("n.npz", npz_bytes(X_nan, y))}},
            422,
            "NaN",
        ),
        (
            "NaN in a CSV",
            {"data": {"name": "nancsv"}, "files": {"file": ("n.csv", b"a,b,y\n1,,0\n2,3,1\n")}},
            422,
            "NaN",
        ),
        (
            "name with ../",
            {"data": {"name": "../evil"}, "files": {"file": ("e.npz", npz_bytes(X, y))}},
            422,
            "path separator",
        ),
        (
            "name ..",
            {"data": {"name": ".."}, "files": {"file": ("e.npz", npz_bytes(X, y))}},
            422,
            "leave the dataset directory",
        ),
        (
            "hidden name",
            {"data": {"name": ".hidden"}, "files": {"file": ("e.npz", npz_bytes(X, y))}},
            422,
            "not allowed",
        ),
        (
            "existing name",
            {"data": {"name": "tiny"}, "files": {"file": ("e.npz", npz_bytes(X[:10], y[:10]))}},
            409,
            "exists already",
        ),
        (
            "npz without y",
            {"data": {"name": "noy"}, "files": {"file": ("e.npz", _npz(X=X))}},
            422,
            "no array named 'y'",
        ),
        (
            "pickled object array",
            {
                "data": {"name": "pickle"},
                "files": {"file": ("e.npz", _npz(X=np.array([{"a": 1}], dtype=object), y=[0.0]))},
            },
            422,
            "cannot read",
        ),
        (
            "rows and labels differ",
            {"data": {"name": "short"}, "files": {"file": ("e.npz", npz_bytes(X, y[:-1]))}},
            422,
            "240",
        ),
        ("no file", {"data": {"name": "nofile"}}, 422, "'file' is missing"),
        ("no name", {"files": {"file": ("e.npz", npz_bytes(X, y))}}, 422, "'name' is missing"),
        (
            "oversized upload",
            {
                "data": {"name": "big"},
                "files": {
                    "file": ("b.npz", npz_bytes(np.ones((UPLOAD_LIMIT // 8, 2)), np.ones(UPLOAD_LIMIT // 8)))
                },
            },
            413,
            "DISTBELIEF_MAX_UPLOAD_BYTES",
        ),
        (
            "register a path outside the store",
            {"json": {"name": "etc", "url": "/etc"}},
            422,
            "inside its store",
        ),
        ("register with ../", {"json": {"name": "up", "url": "../../etc"}}, 422, "inside its store"),
        ("register a bad name", {"json": {"name": "a/b", "url": "s3://bucket/x"}}, 422, "path separator"),
        (
            "wrong content type",
            {"content": b"X,y", "headers": {"Content-Type": "text/csv"}},
            415,
            "multipart/form-data",
        ),
    ]
    for case, kwargs, code, word in cases:
        r = await guarded.post("/api/datasets", **kwargs)
        assert r.status_code == code, (case, r.text)
        assert word in r.json()["detail"], (case, r.json()["detail"])
    assert await _stored_state(guarded) == before
    for name in ("..%2Fetc", "%2E%2E", "a%5Cb"):
        r = await guarded.get(f"/api/datasets/{name}")
        assert r.status_code in (404, 422), (name, r.text)
    assert not (guarded_store / "evil").exists() and not (guarded_store.parent / "evil").exists()
    ds = Dataset.in_store(guarded_store / "datasets", "tiny")
    np.testing.assert_array_equal(ds.read_all()[0], X)


@pytest.mark.anyio
async def test_an_upload_streamed_without_a_length_is_cut_off_at_the_limit(
    guarded: httpx.AsyncClient,
) -> None:
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        boundary = b"--b\r\n"
        yield boundary + b'Content-Disposition: form-data; name="name"\r\n\r\nstreamed\r\n'
        yield boundary + b'Content-Disposition: form-data; name="file"; filename="s.csv"\r\n\r\n'
        for _ in range(64):  # 4x the limit, in chunks
            sent += 4096
            yield b"1,2,0\n" * 682 + b"1,2,\n"
        yield b"\r\n--b--\r\n"

    r = await guarded.post(
        "/api/datasets", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    assert r.status_code == 413 and "larger than the limit" in r.json()["detail"]
    assert "streamed" not in [d["name"] for d in (await guarded.get("/api/datasets")).json()["data"]]


def _npz(**arrays: Any) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "algorithm": st.sampled_from(["sandblaster-lbfgs", "downpour-sgd", "lbfgs"]) | _json,
        "dataset": st.sampled_from(["tiny", "../tiny", "", "nope"]) | _json,
        "model": st.sampled_from([LOGISTIC, {"kind": "mlp", "layer_sizes": [4, 1]}]) | _json,
        "options": st.fixed_dictionaries({}, optional={"history": _json, "replicas": _json, "lr": _json})
        | _json,
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_no_job_body_makes_the_server_fail(server: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as http:
        r = http.post("/api/jobs", content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, r.text
        if r.status_code != 201:
            assert 400 <= r.status_code < 500 and isinstance(r.json()["detail"], str) and r.json()["detail"]
        else:
            http.post(f"/api/jobs/{r.json()['id']}/cancel")
        assert http.get("/api/health").status_code == 200
