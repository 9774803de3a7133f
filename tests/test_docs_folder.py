"""docs/ keeps up with the code: every setting and every route is documented, links stay inside, `pip install`
installs this checkout and every `distbelief` command named exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from distbelief.api import Settings, create_app
from tests._scripts import Outcome, run_blocks, unguarded

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


def _needs_missing_jax(script: str) -> bool:
    return "import jax" in script and importlib.util.find_spec("jax") is None


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Outcome]:
    """Every block that can run here, in turn in one interpreter (tests/_scripts.py says why)."""
    runnable = [i for i, script in enumerate(SCRIPTS) if not _needs_missing_jax(script)]
    outcomes = run_blocks([SCRIPTS[i] for i in runnable], tmp_path_factory.mktemp("data-science"))
    return dict(zip(runnable, outcomes, strict=True))


@pytest.mark.parametrize("index", range(len(SCRIPTS)))
def test_the_data_science_page_runs_as_written(index: int, ran: dict[int, Outcome]) -> None:
    if _needs_missing_jax(SCRIPTS[index]):
        pytest.skip('needs JAX: pip install "distbelief[jax]"')
    outcome = ran[index]
    assert outcome.ok, outcome.stderr[-3000:]
    assert outcome.stdout.strip()  # every block prints what it shows


def test_every_block_has_the_main_guard() -> None:
    # The blocks start the embedded cluster, whose worker processes import the script.
    assert unguarded(SCRIPTS) == []


def test_the_data_science_page_has_its_sections() -> None:
    assert len(SCRIPTS) >= 5
    for topic in ("Estimators", "Sparse", "Parquet", "JAX", "Saving and loading"):
        assert topic in DOCS["data-science.md"], topic


SHELL_BLOCKS = [
    (name, block)
    for name, text in {**DOCS, "README.md": (ROOT / "README.md").read_text()}.items()
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```$", text, re.M | re.S)
]


def test_pip_install_commands_name_this_checkout() -> None:
    # docs/operations.md said `pip install ./distbelief`: from a checkout's root, ./distbelief is the
    # package folder (no pyproject.toml there), and pip fails.
    targets = [
        (name, m.group(1))
        for name, block in SHELL_BLOCKS
        for m in re.finditer(r"\bpip install ((?:\"[^\"]*\"|'[^']*'|\S)+)", re.sub(r"(?m)#.*$", "", block))
    ]
    assert any(name == "operations.md" for name, _ in targets)
    for name, target in targets:
        path = re.sub(r"\[[^\]]*\]$", "", target.strip("\"'"))  # ".[test]" -> "."
        assert (ROOT / path / "pyproject.toml").is_file(), (name, f"pip install {target}")


def test_cli_commands_in_the_docs_exist() -> None:
    from distbelief.api.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    commands = set(sub.choices)  # type: ignore[arg-type]
    texts = {**DOCS, "README.md": (ROOT / "README.md").read_text()}
    # as code: `distbelief X ...` in the text, or a command line of a shell block
    named = {
        (name, m.group(1))
        for name, text in texts.items()
        for m in re.finditer(r"`distbelief ([a-z]+)\b", text)
    }
    named |= {
        (name, m.group(1))
        for name, block in SHELL_BLOCKS
        for m in re.finditer(r"^distbelief ([a-z]+)\b", block, re.M)
    }
    unknown = {(name, c) for name, c in named if c not in commands}
    assert not unknown, unknown
    assert {"cancel", "delete", "metrics", "params"} <= commands
