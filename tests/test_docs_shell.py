"""Every shell block of the README and docs/*.md runs as written (issue 27 item 4), here or where named.

Each block is one test case, known by how its first line starts. This file runs docs/api.md's curl session
against a live service, and docs/operations.md's ``distbelief serve`` (started, asked for its health,
stopped with Ctrl-C). Only what cannot be the same on a test box changes, as in
tests/test_operations_recipe.py: the fixed port 8000 becomes a free one on 127.0.0.1,
``/srv/distbelief/store`` a temporary directory, and ``distbelief`` / ``python`` mean this checkout's
command line and interpreter. The others skip with the reason in :data:`ELSEWHERE`: another test runs them,
or they need what a test box has not (a Docker daemon, a fresh environment to install into). A block in
neither list fails, so a new block cannot go untested by omission.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from distributed import Client as DaskClient

from tests.api.conftest import TOKEN, live_server
from tests.test_docs_folder import SHELL_BLOCKS

ROOT = Path(__file__).resolve().parents[1]
#: ``distbelief`` is this checkout's CLI (the console script on PATH may belong to another installation).
PRELUDE = f'set -euo pipefail\ndistbelief() {{ "{sys.executable}" -m distbelief.api.cli "$@"; }}\n'

#: How a block's first line starts -> why it does not run here (and what runs it).
ELSEWHERE = {
    "pip install . && distbelief demo": (
        "installs distbelief and runs the whole suite: CI's .ci/run runs exactly that, "
        "tests/api/test_demo.py runs the demo"
    ),
    'python -c "import numpy as np; from distbelief.storage import load_digits;': (
        "the README's CLI session: tests/test_readme.py runs it against a live service"
    ),
    "export DISTBELIEF_API_TOKEN=": (
        "needs a Docker daemon and its compose plugin; tests/api/test_compose.py runs the commands "
        "docker-compose.yml runs, as processes on 127.0.0.1"
    ),
    "# on every machine:": (
        "a multi-machine recipe: tests/test_operations_recipe.py runs it on 127.0.0.1, a shell a machine"
    ),
}
#: How a block's first line starts -> the test below that runs it.
HERE = {
    "URL=http://127.0.0.1:8000": "curl",
    "distbelief serve ": "serve",
}


def _kind(block: str, table: dict[str, str]) -> str | None:
    """The key of ``table`` that the block's first line starts with (None if none; an error if several)."""
    first = block.splitlines()[0].strip()
    keys = [key for key in table if first.startswith(key)]
    assert len(keys) <= 1, (first, keys)
    return keys[0] if keys else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    """This checkout's code first on the path, this interpreter as ``python``, no DISTBELIEF_* of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env.update(extra)
    return env


def test_every_shell_block_is_run_here_or_says_where() -> None:
    assert len(SHELL_BLOCKS) >= 6
    unlisted = [
        (name, block.splitlines()[0])
        for name, block in SHELL_BLOCKS
        if _kind(block, ELSEWHERE) is None and _kind(block, HERE) is None
    ]
    assert unlisted == [], "add each to HERE (with a test) or ELSEWHERE (with the reason)"
    used = {_kind(block, ELSEWHERE) for _, block in SHELL_BLOCKS} | {_kind(b, HERE) for _, b in SHELL_BLOCKS}
    stale = (ELSEWHERE.keys() | HERE.keys()) - used
    assert not stale, f"no block starts so any more: {stale}"


@pytest.mark.parametrize("first", sorted(ELSEWHERE), ids=[f"elsewhere{i}" for i in range(len(ELSEWHERE))])
def test_blocks_that_run_elsewhere(first: str) -> None:
    pytest.skip(ELSEWHERE[first])


def _block(kind: str) -> str:
    blocks: list[str] = [b for _, b in SHELL_BLOCKS if HERE.get(_kind(b, HERE) or "") == kind]
    (block,) = blocks
    return block


@pytest.mark.timeout(240)
def test_the_api_pages_curl_session(tmp_path: Path, client: DaskClient) -> None:
    with live_server(tmp_path / "store", client) as url:
        script = _block("curl").replace("URL=http://127.0.0.1:8000", f"URL={url}", 1)
        proc = subprocess.run(
            ["bash", "-c", PRELUDE + script],
            cwd=tmp_path,
            env=_env(DISTBELIEF_API_TOKEN=TOKEN),
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    # It followed the job to its end, showed its record and metrics, and saved its parameters.
    assert "event: end" in proc.stdout and '"status":"succeeded"' in proc.stdout.replace(" ", "")
    assert proc.stdout.count("objective") >= 2  # the record's and the CSV's header
    w = np.load(tmp_path / "w.npy")
    assert w.shape == (650,) and np.isfinite(w).all()


@contextlib.contextmanager
def _started(script: str, cwd: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        ["bash", "-c", PRELUDE + script],
        cwd=cwd,
        env=_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C goes to it and its workers, as in a terminal
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(300)
def test_the_operations_pages_serve_command(tmp_path: Path) -> None:
    port = _free_port()
    store = tmp_path / "srv" / "store"
    script = (
        _block("serve").replace("/srv/distbelief/store", str(store)).replace("--port 8000", f"--port {port}")
    )
    with _started(script, tmp_path) as proc:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the service did not answer in 180 s"
            time.sleep(0.3)
        assert store.is_dir()  # it keeps its store where the page says
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert out.rstrip().splitlines()[-1] == "distbelief: interrupted" and "Traceback" not in out, out[-3000:]
