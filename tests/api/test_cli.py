"""The ``distbelief`` CLI: every command that talks to the service reports a server that is down, a bad URL,
a wrong token and a timeout in one actionable line with a non-zero exit code (the traceback only with
``--debug``); ``distbelief datasets upload|list|show|delete``, ``cancel``, ``delete``, ``metrics`` and
``params`` against a real server; the service's messages said in the CLI's terms."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distbelief.api.cli import main
from tests.api.conftest import LOGISTIC, TOKEN, tiny_xy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cli")
    X, y = tiny_xy(n=40)
    np.savez(tmp / "small.npz", X=X, y=y)
    model = {"kind": "logistic", "n_features": 4}
    job = {"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": model}
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "t.csv").write_text("a,b,label\n1,2,0\n3,4,1\n5,6,0\n")
    return {"npz": tmp / "small.npz", "job": tmp / "job.json", "csv": tmp / "t.csv", "out": tmp / "out"}


UNKNOWN = "0123456789abcdef"


def commands(files: dict[str, Path]) -> list[list[str]]:
    """Every command that talks to a service."""
    return [
        ["status"],
        ["status", UNKNOWN],
        ["submit", str(files["job"])],
        ["submit", "--wait", str(files["job"])],
        ["datasets", "list"],
        ["datasets", "show", "tiny"],
        ["datasets", "upload", str(files["npz"])],
        ["datasets", "delete", "tiny"],
        ["cancel", UNKNOWN],
        ["delete", UNKNOWN],
        ["metrics", UNKNOWN],
        ["metrics", UNKNOWN, "--csv", str(files["out"] / "m.csv")],
        ["params", UNKNOWN, "-o", str(files["out"] / "p.npy")],
    ]


N_COMMANDS = 13


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A socket that accepts connections and never answers: every request to it times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distbelief: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("which", range(N_COMMANDS))
def test_a_server_that_is_down(
    which: int, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    code, _, err = run([*commands(files)[which], "--url", url], capsys)
    assert_one_line(code, err, f"cannot reach the service at {url}", "distbelief serve", "--url")


@pytest.mark.parametrize("which", range(N_COMMANDS))
@pytest.mark.parametrize("url", ["not a url", "localhost:8000", "ftp://127.0.0.1/x", "http://"])
def test_a_bad_url(which: int, url: str, files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*commands(files)[which], "--url", url], capsys)
    assert code == 2
    assert_one_line(code, err, repr(url), "http://127.0.0.1:8000")


@pytest.mark.parametrize("which", range(N_COMMANDS))
def test_a_bad_token(
    which: int,
    files: dict[str, Path],
    server: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", "not-the-token-0123456789")
    code, _, err = run([*commands(files)[which], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 401", "set DISTBELIEF_API_TOKEN")
    monkeypatch.delenv("DISTBELIEF_API_TOKEN")
    code, _, err = run([*commands(files)[which], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 401", "set DISTBELIEF_API_TOKEN")


@pytest.mark.parametrize("which", range(N_COMMANDS))
def test_a_timeout(which: int, files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with silent_server() as url:
        code, _, err = run([*commands(files)[which], "--url", url, "--timeout", "0.3"], capsys)
    assert_one_line(code, err, f"the service at {url} did not answer within 0.3 s", "--timeout")


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    url = f"http://127.0.0.1:{_free_port()}"
    for argv in (["--debug", "status", "--url", url], ["status", "--url", url, "--debug"]):
        with pytest.raises(httpx.ConnectError):
            main(argv)


def test_the_console_script_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
    url = f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "distbelief.api.cli", "datasets", "list", "--url", url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert_one_line(proc.returncode, proc.stderr, "cannot reach the service")
    debug = subprocess.run(
        [sys.executable, "-m", "distbelief.api.cli", "--debug", "datasets", "list", "--url", url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_local_mistakes_are_one_line_too(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["submit", str(files["npz"].with_name("missing.json"))], capsys)
    assert_one_line(code, err, "cannot read", "missing.json")
    code, _, err = run(["submit", str(files["csv"])], capsys)
    assert_one_line(code, err, "is not valid JSON")
    code, _, err = run(["datasets", "upload", str(files["job"])], capsys)
    assert_one_line(code, err, "neither .npz", "nor .csv")
    for not_an_object in ("[1, 2]", '"job"', "null"):  # was "unexpected ValueError", exit code 3
        files["job"].with_name("list.json").write_text(not_an_object)
        code, _, err = run(["submit", str(files["job"].with_name("list.json"))], capsys)
        assert_one_line(code, err, "list.json holds", "not a JSON object")
        assert code == 2


def test_datasets_upload_list_show(
    files: dict[str, Path], server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    code, out, err = run(["datasets", "upload", str(files["npz"]), "--url", server], capsys)
    assert code == 0, err
    assert out.strip() == "uploaded small: 40 rows x 4 features (binary labels)"
    code, out, err = run(
        [
            "datasets",
            "upload",
            str(files["csv"]),
            "--name",
            "csv-data",
            "--label-column",
            "label",
            "--url",
            server,
        ],
        capsys,
    )
    assert code == 0, err
    assert out.startswith("uploaded csv-data: 3 rows x 2 features")
    # The same name again needs --overwrite: the server's message is passed on, in one line.
    code, _, err = run(["datasets", "upload", str(files["npz"]), "--url", server], capsys)
    assert_one_line(code, err, "small")
    assert run(["datasets", "upload", str(files["npz"]), "--overwrite", "--url", server], capsys)[0] == 0

    code, out, _ = run(["datasets", "list", "--url", server], capsys)
    assert code == 0
    names = [line.split()[0] for line in out.strip().splitlines()[1:]]
    assert {"small", "csv-data", "tiny"} <= set(names)
    code, out, _ = run(["datasets", "show", "small", "--url", server], capsys)
    assert code == 0
    shown = json.loads(out)
    assert shown["name"] == "small" and shown["n_rows"] == 40 and shown["n_features"] == 4
    code, _, err = run(["datasets", "show", "no-such-data", "--url", server], capsys)
    assert_one_line(code, err, "HTTP 404", "no-such-data")


def test_serve_on_a_port_in_use_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("DISTBELIEF_API_TOKEN", "DISTBELIEF_HOST", "DISTBELIEF_PORT", "DISTBELIEF_SCHEDULER"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = run(["serve", "--port", str(port), "--store", str(tmp_path)], capsys)
    assert_one_line(code, err, f"cannot listen on 127.0.0.1:{port}", "--port")
    code, _, err = run(["serve", "--host", "0.0.0.0", "--store", str(tmp_path)], capsys)
    assert_one_line(code, err, "refusing to listen on 0.0.0.0 without a token", "DISTBELIEF_API_TOKEN")


# ------------------------------------------------------------------ jobs: cancel, delete, metrics, params


def _finished_job(server: str) -> dict[str, Any]:
    from distbelief.api.client import Client

    with Client(server, TOKEN) as api:
        job = api.submit({"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC})
        record = api.wait(job["id"], timeout=90, progress=False)
    assert record["status"] == "succeeded", record
    return record


def test_metrics_params_delete_of_a_job(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distbelief.api.client import Client

    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    job = _finished_job(server)
    with Client(server, TOKEN) as api:
        columns = api.metrics_columns(job["id"])["columns"]
        want_params = api.params(job["id"])
        want_csv = api.metrics_csv(job["id"])

    code, out, err = run(["metrics", job["id"], "--url", server], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == list(columns)  # a header of metric names, then one row each
    assert len(lines) == 1 + len(columns["iteration"])
    last = lines[-1].split()
    assert int(last[0]) == columns["iteration"][-1]
    assert float(last[1]) == pytest.approx(columns[list(columns)[1]][-1], rel=1e-5)

    code, out, err = run(["metrics", job["id"], "--csv", str(tmp_path / "m.csv"), "--url", server], capsys)
    assert code == 0, err
    assert (tmp_path / "m.csv").read_text() == want_csv
    assert (
        out.strip()
        == f"wrote {len(columns['iteration'])} rows of job {job['id']}'s metrics to {tmp_path / 'm.csv'}"
    )
    code, out, _ = run(["metrics", job["id"], "--csv", "-", "--url", server], capsys)
    assert code == 0 and out == want_csv

    code, out, err = run(["params", job["id"], "-o", str(tmp_path / "w.npy"), "--url", server], capsys)
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"), want_params)
    assert "numpy.load" in out and "w.npy" in out
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "w.npy").stat().st_mode & 0o777 == 0o666 & ~mask
    code, _, err = run(["params", job["id"], "-o", str(tmp_path / "no" / "w.npy"), "--url", server], capsys)
    assert code == 2
    assert_one_line(code, err, "cannot write", "No such file or directory", "-o")

    # a finished job has nothing to cancel: one line, non-zero, and it is still there
    code, _, err = run(["cancel", job["id"], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 409", "nothing to cancel")
    code, out, err = run(["delete", job["id"], "--url", server], capsys)
    assert code == 0, err
    assert out.strip() == f"deleted job {job['id']} and what it stored"
    code, _, err = run(["status", job["id"], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 404", "distbelief status")
    code, _, err = run(["delete", job["id"], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 404")


@pytest.mark.parametrize(
    "argv",
    [
        ["cancel", UNKNOWN],
        ["delete", UNKNOWN],
        ["metrics", UNKNOWN],
        ["metrics", UNKNOWN, "--csv", "{out}/m.csv"],
        ["params", UNKNOWN, "-o", "{out}/p.npy"],
        ["status", UNKNOWN],
    ],
)
def test_an_unknown_job_is_one_line_in_cli_terms_and_changes_nothing(
    argv: list[str],
    server: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    before = _job_ids(server)
    code, out, err = run([*(a.format(out=tmp_path) for a in argv), "--url", server], capsys)
    assert code == 1 and out == ""
    # "list the jobs with GET /api/jobs" was an HTTP client's advice
    assert_one_line(
        code, err, "HTTP 404", f"no job with id {UNKNOWN!r}", "list the jobs with distbelief status"
    )
    assert "/api/" not in err
    assert list(tmp_path.iterdir()) == []  # no file written, not even an empty one
    assert _job_ids(server) == before


def _job_ids(server: str) -> list[str]:
    from distbelief.api.client import Client

    with Client(server, TOKEN) as api:
        return sorted(j["id"] for j in api.jobs())


def test_bad_job_ids_are_refused_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens: a request would say "cannot reach"
    for command in (["cancel"], ["delete"], ["metrics"], ["params", "-o", "x.npy"]):
        code, _, err = run([command[0], "..", *command[1:], "--url", url], capsys)
        assert code == 2
        assert_one_line(code, err, "job id '..' is not valid")


def test_cancel_a_running_job_and_a_dataset_in_use(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distbelief.api.client import Client
    from distbelief.storage import load_digits

    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    with Client(server, TOKEN) as api:
        api.upload_dataset("digits", *load_digits(), overwrite=True)
        job = api.submit(
            {
                "algorithm": "sandblaster-lbfgs",
                "dataset": "digits",
                "model": {"kind": "softmax", "n_features": 64, "n_classes": 10},
                "options": {"gtol": 0.0, "ftol": 0.0, "maxiter": 10**5},
            }
        )
    # in use: the service's advice ("POST /api/jobs/{{id}}/cancel") comes as the CLI's command
    code, _, err = run(["datasets", "delete", "digits", "--url", server], capsys)
    assert_one_line(code, err, "HTTP 409", "digits", "distbelief cancel ID")
    assert "/api/" not in err
    code, _, err = run(["delete", job["id"], "--url", server], capsys)
    assert_one_line(code, err, "HTTP 409", f"cancel it first (distbelief cancel {job['id']})")
    code, out, err = run(["cancel", job["id"], "--wait", "--url", server], capsys)
    assert code == 0, err
    assert out.startswith(f"job {job['id']} ended cancelled") or out.strip() == f"cancelled job {job['id']}"
    with Client(server, TOKEN) as api:
        assert api.job(job["id"])["status"] == "cancelled"
    code, out, err = run(["datasets", "delete", "digits", "--url", server], capsys)
    assert code == 0, err
    assert out.strip() == "deleted dataset digits"
    code, _, err = run(["datasets", "delete", "digits", "--url", server], capsys)
    assert_one_line(code, err, "HTTP 404", "digits")
    assert run(["delete", job["id"], "--url", server], capsys)[0] == 0


def test_the_services_advice_names_cli_flags(
    files: dict[str, Path], server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTBELIEF_API_TOKEN", TOKEN)
    assert run(["datasets", "upload", str(files["npz"]), "--name", "twice", "--url", server], capsys)[0] == 0
    code, _, err = run(["datasets", "upload", str(files["npz"]), "--name", "twice", "--url", server], capsys)
    # was: "... choose another name, delete it first, or send overwrite=true"
    assert_one_line(code, err, "HTTP 409", "'twice' exists already", "pass --overwrite")
    assert "overwrite=true" not in err
    code, _, err = run(["datasets", "show", "no-such-data", "--url", server], capsys)
    assert_one_line(code, err, "HTTP 404", "no-such-data", "distbelief datasets upload FILE")
    assert "/api/" not in err
    assert run(["datasets", "delete", "twice", "--url", server], capsys)[0] == 0


@pytest.mark.parametrize(
    ("api", "cli"),
    [
        ("send overwrite=true", "pass --overwrite"),
        ("list the jobs with GET /api/jobs", "list the jobs with distbelief status"),
        ("saved (GET /api/jobs/ab12/params), but", "saved (distbelief params ab12 -o FILE.npy), but"),
        ("cancel it first (POST /api/jobs/ab12/cancel)", "cancel it first (distbelief cancel ab12)"),
        ("first (POST /api/jobs/{{id}}/cancel) or", "first (distbelief cancel ID) or"),
        ("DELETE /api/jobs/ab12 removes", "distbelief delete ab12 removes"),
        ("forget it (DELETE /api/datasets/d1)", "forget it (distbelief datasets delete d1)"),
        ("wait (GET /api/datasets/{name}), then", "wait (distbelief datasets show NAME), then"),
        ("upload it first (POST /api/datasets) —", "upload it first (distbelief datasets upload FILE) —"),
        ("instead (multipart POST /api/datasets)", "instead (distbelief datasets upload FILE)"),
        ("see GET /api/cluster", "see GET /api/cluster"),  # no command for it: left as it is
    ],
)
def test_cli_terms(api: str, cli: str) -> None:
    from distbelief.api.cli import cli_terms

    assert cli_terms(api) == cli


def test_metrics_table_of_no_rows_and_missing_values() -> None:
    from distbelief.api.cli import metrics_table

    table = metrics_table("step", {"step": [0, 10], "loss": [0.5, None]}).splitlines()
    assert table[0].split() == ["step", "loss"] and table[2].split() == ["10", "-"]
    assert metrics_table("step", {}) == ""


# ------------------------------------------------------------------ a quick start


HEAVY = (
    "pandas",
    "xarray",
    "dask",
    "dask.dataframe",
    "distributed",
    "fastapi",
    "uvicorn",
    "pydantic",
    "zarr",
)


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", UNKNOWN],
        ["cancel", UNKNOWN],
        ["delete", UNKNOWN],
        ["metrics", UNKNOWN],
        ["params", UNKNOWN, "-o", "{tmp}/p.npy"],
        ["datasets", "list"],
        ["datasets", "delete", "tiny"],
    ],
)
def test_commands_that_talk_to_a_service_import_nothing_heavy(argv: list[str], tmp_path: Path) -> None:
    # `distbelief status` spent ~4 s of a busy box importing pandas through xarray (the client's metrics):
    # the CLI module and these commands must not load pandas, xarray, Dask, FastAPI or pydantic at all.
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens: the command fails in one line, quickly
    code = (
        "import sys\n"
        "import distbelief.api.cli as cli\n"
        f"loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        f"cli.main({[*(a.format(tmp=tmp_path) for a in argv), '--url', url]!r})\n"
        f"print(loaded, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] []", f"{argv} imported {proc.stdout.strip()}"
    assert "cannot reach the service" in proc.stderr


# ------------------------------------------------------------------ Ctrl-C


def _ctrl_c(argv: list[str], ready: str, tmp_path: Path) -> tuple[float, list[str], int]:
    """Start ``distbelief ARGV`` in its own process group, wait until it prints ``ready``, then press Ctrl-C
    as a terminal does (SIGINT to the whole group: the CLI and the Dask workers it started). Returns the
    seconds it took to exit, the lines it printed after the signal, and its exit code."""
    import queue
    import signal
    import threading
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distbelief.api.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        before: list[str] = []
        deadline = time.monotonic() + 240
        while not any(ready in line for line in before):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "\n".join(before)
            before.append(line)
        time.sleep(1.0)  # what it prints as it settles is not "after the signal"
        while not lines.empty():
            line = lines.get()
            assert line is not None, "\n".join(before)
            before.append(line)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        after: list[str] = []
        while (line := lines.get(timeout=10)) is not None:
            after.append(line)
        return elapsed, after, code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(300)
def test_ctrl_c_on_serve_exits_quickly_in_one_line(tmp_path: Path) -> None:
    # It printed 62 lines: each Dask worker process's KeyboardInterrupt tracebacks and uvicorn's shutdown log.
    argv = ["serve", "--port", str(_free_port()), "--store", str(tmp_path / "store")]
    elapsed, after, code = _ctrl_c(argv, "Uvicorn running on", tmp_path)
    assert after == ["distbelief: interrupted"], "\n".join(after)
    assert code == 130
    assert elapsed <= 5.0, f"{elapsed:.1f} s"


@pytest.mark.timeout(300)
def test_ctrl_c_on_demo_exits_quickly_in_one_line(tmp_path: Path) -> None:
    elapsed, after, code = _ctrl_c(["demo", "--epochs", "1"], "until Ctrl-C", tmp_path)
    assert after == ["stopping the service ..."], "\n".join(after)
    assert code == 0
    assert elapsed <= 5.0, f"{elapsed:.1f} s"
