"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) render in a real headless Chromium with no network: every
request the pages make goes to the service on 127.0.0.1 (anything else is refused, as on a machine with no
internet access, and recorded so the test can say what it was)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from distributed import Client as DaskClient

from tests.api.conftest import CHROMIUM_ARGS, live_server, require_chromium


def test_docs_and_redoc_render_offline(tmp_path: Path, client: DaskClient) -> None:
    chromium = require_chromium()
    from playwright.sync_api import sync_playwright

    with live_server(tmp_path / "store", client) as url, sync_playwright() as pw:
        spec = httpx.get(url + "/openapi.json").json()
        operations = [op for path in spec["paths"].values() for op in path.values()]
        summaries = {op["summary"] for op in operations}
        assert "List Jobs" in summaries
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            outside: list[str] = []
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            def offline(route: Any) -> None:
                if route.request.url.startswith(url) or route.request.url.startswith("data:"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            page.route("**/*", offline)

            page.goto(url + "/docs")
            page.wait_for_selector(".opblock-summary", timeout=60_000)
            assert len(page.query_selector_all(".opblock")) == len(operations)
            assert "List Jobs" in (page.text_content(".swagger-ui") or "")

            page.goto(url + "/redoc")
            page.wait_for_selector("[data-section-id^='operation/']", state="attached", timeout=60_000)
            text = page.text_content("body") or ""
            assert all(s in text for s in summaries), summaries - {s for s in summaries if s in text}

            assert outside == [], f"the pages fetched from outside the service: {outside}"
            assert errors == []
        finally:
            browser.close()
