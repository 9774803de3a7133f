#!/usr/bin/env bash
# Builds the wheel and checks it in a clean virtualenv, away from the checkout: only `distbelief` is installed
# at the top level of site-packages, it ships py.typed and the dashboard, the front doors import, the console
# script runs, and the REST client imports neither FastAPI, uvicorn nor Dask.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
wheel="$(ls "$work"/dist/distbelief-*.whl)"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$wheel"

cd "$work"   # never import from the checkout
"$work/venv/bin/python" - "$wheel" <<'PY'
import subprocess, sys, zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert top == {"distbelief"}, f"the wheel installs more than distbelief at the top level: {sorted(top)}"
for required in ("distbelief/py.typed", "distbelief/api/dashboard/index.html", "distbelief/errors.py"):
    assert required in names, f"{required} is missing from the wheel"

import distbelief
from distbelief import downpour, models, sandblaster, storage  # noqa: F401
from distbelief.api.client import Client  # noqa: F401
for name in distbelief.__all__:
    getattr(distbelief, name)
assert "site-packages" in distbelief.__file__, distbelief.__file__

light = subprocess.run(
    [sys.executable, "-c",
     "import sys; from distbelief.api.client import Client; "
     "print(sorted(m for m in ('fastapi', 'uvicorn', 'distributed', 'dask', 'zarr') if m in sys.modules))"],
    check=True, capture_output=True, text=True,
).stdout.strip()
assert light == "[]", f"the client imported {light}"
print(f"wheel ok: {len(names)} files, top level {sorted(top)}")
PY
"$work/venv/bin/distbelief" --help >/dev/null
echo "console script ok"
