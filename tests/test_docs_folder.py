"""docs/ keeps up with the code: every setting and every route is documented, and links stay inside."""

from __future__ import annotations

import re
from pathlib import Path

from distbelief.api import Settings, create_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = {name: (ROOT / "docs" / name).read_text() for name in ("architecture.md", "api.md", "operations.md")}


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
