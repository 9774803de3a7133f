"""The ``distbelief`` CLI: every command that talks to the service reports a server that is down, a bad URL,
a wrong token and a timeout in one actionable line with a non-zero exit code (the traceback only with
``--debug``); ``distbelief datasets upload|list|show``."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distbelief.api.cli import main
from tests.api.conftest import TOKEN, tiny_xy

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
    return {"npz": tmp / "small.npz", "job": tmp / "job.json", "csv": tmp / "t.csv"}


def commands(files: dict[str, Path]) -> list[list[str]]:
    """Every command that talks to a service."""
    return [
        ["status"],
        ["status", "0123456789abcdef"],
        ["submit", str(files["job"])],
        ["submit", "--wait", str(files["job"])],
        ["datasets", "list"],
        ["datasets", "show", "tiny"],
        ["datasets", "upload", str(files["npz"])],
    ]


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


@pytest.mark.parametrize("which", range(7))
def test_a_server_that_is_down(
    which: int, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    code, _, err = run([*commands(files)[which], "--url", url], capsys)
    assert_one_line(code, err, f"cannot reach the service at {url}", "distbelief serve", "--url")


@pytest.mark.parametrize("which", range(7))
@pytest.mark.parametrize("url", ["not a url", "localhost:8000", "ftp://127.0.0.1/x", "http://"])
def test_a_bad_url(which: int, url: str, files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*commands(files)[which], "--url", url], capsys)
    assert code == 2
    assert_one_line(code, err, repr(url), "http://127.0.0.1:8000")


@pytest.mark.parametrize("which", range(7))
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


@pytest.mark.parametrize("which", range(7))
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
