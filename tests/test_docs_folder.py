"""docs/ keeps up with the code: every setting and every route is documented, and links stay inside."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distbelief.api import Settings, create_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    name: (ROOT / "docs" / name).read_text()
    for name in ("architecture.md", "api.md", "operations.md", "data-science.md")
}
#: The Python blocks of the data scientists' page, each run as a script (they start the embedded cluster).
SCRIPTS = re.findall(r"```python\n(.*?)```", DOCS["data-science.md"], re.S)


def test_operations_documents_every_setting() -> None:
    for field in Settings.model_fields:
        assert f"`DISTBELIEF_{field.upper()}`" in DOCS["operations.md"], field


def test_api_documents_every_route() -> None:
    spec = create_app(Settings(store="/nonexistent")).openapi()
    routes = {
        (method.upper(), re.sub(r"\{[^}]+\}", "{}", path))
        for path, operations in spec["paths"].items()
        for method in operations
    }
    assert len(routes) >= 14
    documented = {
        (m.group(1), re.sub(r"\{[^}]+\}", "{}", m.group(2)))
        for m in re.finditer(r"`(GET|POST|DELETE|PUT) (/api[^`?\[ ]*)", DOCS["api.md"])
    }
    assert routes <= documented, routes - documented


def test_links_stay_inside_the_repository() -> None:
    for name, text in DOCS.items():
        for link in re.findall(r"\]\(([^)]+)\)", text):
            assert "://" not in link and (ROOT / "docs" / link.split("#")[0]).is_file(), (name, link)
        assert "DESIGN.md" not in text and "../shared" not in text


@pytest.mark.parametrize("index", range(len(SCRIPTS)))
def test_the_data_science_page_runs_as_written(index: int, tmp_path: Path) -> None:
    script = SCRIPTS[index]
    if "import jax" in script and importlib.util.find_spec("jax") is None:
        pytest.skip('needs JAX: pip install "distbelief[jax]"')
    path = tmp_path / f"block{index}.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()  # every block prints what it shows


def test_the_data_science_page_has_its_sections() -> None:
    assert len(SCRIPTS) >= 5
    for topic in ("Estimators", "Sparse", "Parquet", "JAX", "Saving and loading"):
        assert topic in DOCS["data-science.md"], topic
