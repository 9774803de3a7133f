"""Runs a page's Python blocks as scripts, one after another in one fresh interpreter.

Each block is its own file in its own directory and runs there as ``__main__`` (``runpy``: fresh globals,
so a block that forgets an import fails as it would alone). They share the interpreter, and with it the
embedded cluster the first block starts, as a reader running them in turn in one session would: a fresh
interpreter and cluster per block cost ~4 s each (the workers' imports too), more than most
blocks' work. While the first block runs, ``sys.modules["__main__"]`` is that block, so its worker
processes (spawned) import it as a script's workers would; every block is checked for the
``__main__`` guard those need by :func:`unguarded`.

>>> from tests._scripts import unguarded
>>> unguarded(['import numpy\\nif __name__ == "__main__":\\n    print(1)\\n', "print(2)\\n"])
[1]
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: ``python -c`` program: runs argv[2:] in turn, each in its folder, and writes one result each to argv[1].
_RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
results = []
for path in sys.argv[2:]:
    out, err, ok = io.StringIO(), io.StringIO(), True
    os.chdir(os.path.dirname(path))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except BaseException:  # SystemExit too: the block failed, the next ones still run
            ok = False
            traceback.print_exc()
    results.append({"ok": ok, "stdout": out.getvalue(), "stderr": err.getvalue()})
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@dataclass(frozen=True)
class Outcome:
    """One block's run: whether it raised, and what it printed."""

    ok: bool
    stdout: str
    stderr: str


def run_blocks(
    blocks: list[str], tmp: Path, *, env: dict[str, str] | None = None, timeout: float = 280.0
) -> list[Outcome]:
    """Runs ``blocks`` in turn in one ``python`` process (folders under ``tmp``); one outcome each.

    A crash or a hang of the interpreter fails every block, with its output."""
    paths = []
    for i, code in enumerate(blocks):
        (tmp / f"block{i}").mkdir()
        paths.append(tmp / f"block{i}" / f"block{i}.py")
        paths[-1].write_text(code)
    results = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(results), *map(str, paths)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0 or not results.exists():
        failed = f"the interpreter running the blocks exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
        return [Outcome(False, proc.stdout, failed) for _ in blocks]
    return [Outcome(**r) for r in json.loads(results.read_text())]


def unguarded(blocks: list[str]) -> list[int]:
    """The blocks without an ``if __name__ == "__main__":`` guard (the embedded cluster's worker processes
    import the script: without it, each would run the script again)."""
    return [i for i, code in enumerate(blocks) if 'if __name__ == "__main__":' not in code]
