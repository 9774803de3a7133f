"""Every code block of the README runs as written.

The README starts with exactly its two commands (install and demo; install and test): those are not run
here (CI runs the second; ``tests/api/test_demo.py`` runs the demo). Every ``python`` block runs as a
script in a fresh temporary directory; every other ``bash`` block runs there with ``distbelief`` meaning
this checkout's command line, against a live service whose URL and token are in ``DISTBELIEF_URL`` and
``DISTBELIEF_API_TOKEN``, as the README says. Its links point into the repository, at files that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client as DaskClient

from tests.api.conftest import TOKEN, live_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)]
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


def _env(**extra: str) -> dict[str, str]:
    # This checkout's code (first on the path), and none of the caller's DISTBELIEF_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTBELIEF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def test_the_readme_starts_with_its_two_commands() -> None:
    assert README.startswith("# distbelief\n\n```bash\n")
    assert BLOCKS[0] == ("bash", 'pip install . && distbelief demo\npip install ".[test]" && pytest\n')
    assert len(PYTHON) >= 2 and len(BASH) >= 2


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs_as_a_script(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(PYTHON[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, (
        f"README python block {index} failed:\n{PYTHON[index]}\n{proc.stderr[-4000:]}"
    )
    assert proc.stdout.strip(), "the example prints what it computed"


@pytest.mark.parametrize("index", range(1, len(BASH)))
def test_bash_block_runs_against_a_live_service(index: int, tmp_path: Path, client: DaskClient) -> None:
    # `distbelief` is this checkout's CLI (the console script on PATH may belong to another installation).
    prelude = f'set -euo pipefail\ndistbelief() {{ "{sys.executable}" -m distbelief.api.cli "$@"; }}\n'
    with live_server(tmp_path / "store", client) as url:
        proc = subprocess.run(
            ["bash", "-c", prelude + BASH[index]],
            cwd=tmp_path,
            # `python` is this interpreter, as in the shell the README's reader installed distbelief in.
            env=_env(
                DISTBELIEF_URL=url,
                DISTBELIEF_API_TOKEN=TOKEN,
                PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            ),
            capture_output=True,
            text=True,
            timeout=280,
        )
    assert proc.returncode == 0, f"README bash block {index} failed:\n{BASH[index]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr


def test_links_stay_inside_the_repository() -> None:
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert links, "the README links its docs"
    for link in links:
        assert "://" not in link and not link.startswith(("/", "..")), link
        assert (ROOT / link.split("#")[0]).is_file(), link
    assert "../" not in README and "DESIGN.md" not in README
