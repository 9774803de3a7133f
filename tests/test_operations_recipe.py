"""docs/operations.md's multi-machine recipe, run as written on one machine (issue 25, item 5).

The bash block of "A real multi-machine Dask cluster" is split at its ``# on ...`` comments into what each
machine runs; each part runs in a shell of its own, in a directory of its own, with only addresses changed:
``scheduler.example``, ``worker1.example`` and ``0.0.0.0`` become ``127.0.0.1``, the fixed ports free ones,
and ``/shared/distbelief`` (the shared file system) a temporary directory. ``pip install .`` is not run: the
processes import this checkout (``PYTHONPATH``), as tests/api/test_compose.py's do. The API part's shell
also writes the token it generated to a file, for the test to use. Then a job runs through the API, the
page's Python block runs against the scheduler's address, and the cluster's metrics page is read.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from distributed import Client as DaskClient

from distbelief.api import Client
from tests.api.conftest import LOGISTIC, tiny_xy

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SECTION = re.search(
    r"^## A real multi-machine Dask cluster\n(.*?)^## ",
    (ROOT / "docs" / "operations.md").read_text(),
    re.M | re.S,
)
assert SECTION, "docs/operations.md has no section 'A real multi-machine Dask cluster'"
BASH = re.findall(r"^```bash\n(.*?)^```$", SECTION.group(1), re.M | re.S)
PYTHON = re.findall(r"^```python\n(.*?)^```$", SECTION.group(1), re.M | re.S)
START_TIMEOUT = 120.0


def machines(block: str) -> dict[str, list[str]]:
    r"""The block's commands by machine: each ``# on ...`` comment starts one; continued lines joined.

    Examples
    --------
    >>> machines("# on a box (x): why\n# more why\necho 1 \\\n  2\n# on another\necho 3\n")
    {'a box': ['echo 1 2'], 'another': ['echo 3']}
    """
    out: dict[str, list[str]] = {}
    current = None
    for line in re.sub(r"\\\n\s*", "", block).splitlines():
        heading = re.match(r"#\s*on (?:the |each |every )?([^(:]+)", line)
        if heading:
            current = heading.group(1).strip()
            out[current] = []
        elif line.strip() and not line.lstrip().startswith("#"):
            assert current is not None, f"a command before any '# on ...' line: {line}"
            out[current].append(line.strip())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recipe:
    """The recipe's processes, on 127.0.0.1."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.shared = tmp / "shared"
        self.ports = {"8786": _free_port(), "8787": _free_port(), "8000": _free_port()}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
        self.env["PATH"] = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

    def localize(self, text: str) -> str:
        p = self.ports
        text = text.replace("scheduler.example:8786", f"127.0.0.1:{p['8786']}")
        text = text.replace("scheduler.example:8787", f"127.0.0.1:{p['8787']}")
        text = text.replace("--port 8786", f"--port {p['8786']}").replace(
            "--port 8000", f"--port {p['8000']}"
        )
        text = text.replace("--dashboard-address :8787", f"--dashboard-address 127.0.0.1:{p['8787']}")
        text = text.replace("worker1.example", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
        text = text.replace("/shared/distbelief", str(self.shared))
        assert ".example" not in text and "0.0.0.0" not in text, text
        return text

    def start(self, name: str, lines: list[str]) -> None:
        """``lines`` in a bash of its own (its own process group and directory), the last one ``exec``-ed."""
        cwd = self.tmp / name.replace(" ", "-")
        cwd.mkdir()
        script = "set -e\n" + "\n".join([*lines[:-1], "exec " + lines[-1]]) + "\n"
        log = open(self.tmp / f"{cwd.name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs.append(
            subprocess.Popen(
                ["bash", "-c", self.localize(script)],
                cwd=cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def wait(self, what: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                assert proc.poll() is None, (
                    f"a recipe process exited while waiting for {what}:\n{self.logs()}"
                )
            with contextlib.suppress(OSError, httpx.HTTPError):
                if ready():
                    return
            time.sleep(0.2)
        raise AssertionError(f"{what} not ready after {timeout} s:\n{self.logs()}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


@pytest.fixture
def recipe(tmp_path: Path) -> Iterator[Recipe]:
    assert len(BASH) == 1 and len(PYTHON) == 1, (len(BASH), len(PYTHON))
    steps = machines(BASH[0])
    assert list(steps) == ["machine", "scheduler machine", "worker machine", "API machine"], list(steps)
    assert steps["machine"] == ["pip install ."]  # not run: the processes import this checkout
    r = Recipe(tmp_path)
    r.shared.mkdir()
    try:
        r.start("scheduler", steps["scheduler machine"])
        r.wait("the scheduler", lambda: _listening(r.ports["8786"]))
        r.start("worker", steps["worker machine"])
        api = steps["API machine"]
        # The one line added: the token the part generated, written where the test reads it.
        r.start("api", [*api[:-1], f'printf %s "$DISTBELIEF_API_TOKEN" > {tmp_path}/token', api[-1]])
        with DaskClient(f"tcp://127.0.0.1:{r.ports['8786']}", set_as_default=False, timeout=60) as dask:
            dask.wait_for_workers(2, timeout=START_TIMEOUT)
            workers = dask.scheduler_info()["workers"]
        assert all(w.startswith("tcp://127.0.0.1:") for w in workers), workers
        url = f"http://127.0.0.1:{r.ports['8000']}/api/health"
        r.wait("the API", lambda: httpx.get(url, timeout=2).status_code == 200)
        yield r
    finally:
        r.stop()


@pytest.mark.timeout(600)
def test_the_recipe_runs_a_job_the_python_block_and_shows_the_metrics(recipe: Recipe) -> None:
    r = recipe
    token = (r.tmp / "token").read_text()
    assert len(token) >= 32
    with Client(f"http://127.0.0.1:{r.ports['8000']}", token) as api:
        cluster = api.cluster()
        assert not cluster["embedded"] and len(cluster["workers"]) == 2
        X, y = tiny_xy()
        api.upload_dataset("tiny", X, y)
        job = api.submit({"algorithm": "sandblaster-lbfgs", "dataset": "tiny", "model": LOGISTIC})
        done = api.wait(job["id"], timeout=240, progress=False)
        assert done["status"] == "succeeded", (done, r.logs())
    assert any(r.shared.rglob("*")), "the service wrote nothing to the shared store"

    script = r.tmp / "example.py"
    script.write_text(r.localize(PYTHON[0]))
    ran = subprocess.run(
        [sys.executable, str(script)], cwd=r.tmp, env=r.env, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split()[0] == "True", ran.stdout
    # The workers wrote the run's shards to the shared store, where the page's store= put them.
    assert (r.shared / "runs" / "example" / "params").is_dir()

    # The cluster's metrics page, on the scheduler's dashboard port: one section per worker.
    page = f"http://127.0.0.1:{r.ports['8787']}/distbelief/metrics"
    with urllib.request.urlopen(page, timeout=30) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    assert len(re.findall(r'^distbelief_actors\{worker="tcp://127\.0\.0\.1:\d+"\} \d+$', text, re.M)) == 2, (
        text
    )
    # The dashboard the API links to answers too.
    with urllib.request.urlopen(f"http://127.0.0.1:{r.ports['8787']}/status", timeout=30) as answer:
        assert answer.status == 200
