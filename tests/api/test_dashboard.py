"""The dashboard in a real headless Chromium (Debian's, driven by Playwright): submit a job from the page and
watch its objective curve grow from the event stream."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from distributed import Client as DaskClient

from distbelief.api import Client
from distbelief.storage import load_digits
from tests.api.conftest import CHROMIUM_ARGS, TOKEN, live_server, require_chromium


def test_submit_from_the_page_and_watch_the_curve_grow(tmp_path: Path, client: DaskClient) -> None:
    from playwright.sync_api import sync_playwright

    # A newcomer's machine may have no browser: the test skips there with a reason (and fails on CI).
    chromium = require_chromium()
    with live_server(tmp_path / "store", client) as url, sync_playwright() as pw:
        with Client(url, TOKEN) as api:
            X, y = load_digits()
            api.upload_dataset("digits", X, y)
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            requested: list[str] = []
            page.on("request", lambda req: requested.append(req.url))
            page.goto(url + "/")

            # Without the token the page says what to do; with it, the form fills in from the API.
            page.wait_for_selector("#banner:not([hidden])")
            assert "token" in page.text_content("#banner")
            page.fill("#token-input", TOKEN)
            page.click("#token-form button")
            page.wait_for_selector("#f-dataset option[value=digits]", state="attached")
            page.wait_for_selector("#f-model-fields input[name=n_features]")
            assert page.input_value("#f-kind") == "softmax"
            assert page.input_value("#f-model-fields input[name=n_features]") == "64"
            assert page.input_value("#f-model-fields input[name=n_classes]") == "10"
            page.fill("input[name=name]", "from the browser")
            # A checkpoint every iteration and one-portion calls: the job lasts a few seconds, so the curve
            # can be seen growing even when a loaded machine renders slowly (and it converges only at 162).
            options = {"maxiter": 150, "gtol": 0, "ftol": 0, "l2": 0.001}
            options |= {"checkpoint_every": 1, "portions": 7, "push_every": 1}
            page.fill("#f-options", json.dumps(options))
            page.select_option("#f-eval", "digits")
            page.click("#f-submit")

            page.wait_for_url("**/#/jobs/*")
            job_id = page.url.rsplit("/", 1)[1]
            seen: list[int] = []
            status = ""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                counts = page.eval_on_selector_all("#chart-a polyline", "els => els.map(e => +e.dataset.n)")
                if counts and (not seen or counts[0] != seen[-1]):
                    seen.append(counts[0])
                status = page.text_content("#job-status") or ""
                if status in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.03)
            assert status == "succeeded", page.text_content("#job-message")
            page.wait_for_function("document.querySelector('#chart-a polyline').dataset.n === '151'")
            assert len(seen) >= 3 and seen == sorted(seen), seen  # it grew while the job ran
            assert page.text_content("#job-title") == "from the browser"
            # The gradient-norm chart (log scale) and the job's options are on the page too.
            assert page.eval_on_selector("#chart-b polyline", "e => +e.dataset.n") == 151
            assert "maxiter" in page.text_content("#options-table")
            assert "eval_accuracy" in page.text_content("#result-table")
            shot = tmp_path / "dashboard-job.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            page.goto(url + "/#/")
            row = page.wait_for_selector(f"#jobs-table tr[data-id='{job_id}'][data-status=succeeded]")
            assert row is not None
            page.goto(url + "/#/cluster")
            page.wait_for_selector("#workers-table tbody tr")
            assert len(page.query_selector_all("#workers-table tbody tr")) == 2
            if os.environ.get("DISTBELIEF_SCREENSHOTS"):
                page.screenshot(
                    path=os.path.join(os.environ["DISTBELIEF_SCREENSHOTS"], "dashboard-cluster.png")
                )
                shutil.copy(shot, os.environ["DISTBELIEF_SCREENSHOTS"])
            # A partitioned job (model parallelism): its replicas drawn as groups of partitions and workers.
            with Client(url, TOKEN) as api:
                spec = {"kind": "locally_connected_2d", "image_shape": [8, 8], "n_classes": 10}
                body = {"algorithm": "downpour-sgd", "dataset": "digits", "model": spec}
                body["options"] = {"partitions": 2, "replicas": 2, "max_steps": 4}
                mp = api.wait(api.submit(body)["id"], progress=False)
            assert mp["status"] == "succeeded", mp["message"]
            page.goto(url + f"/#/jobs/{mp['id']}")
            page.wait_for_selector("#placement:not([hidden]) #placement-table tbody tr")
            cells = page.eval_on_selector_all(
                "#placement-table tbody tr", "rows => rows.map(r => [r.dataset.replica, r.dataset.partition])"
            )
            assert cells == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]
            workers = [w["worker"] for g in mp["placement"] for w in g["partitions"]]
            assert all(w and w in page.text_content("#placement-table") for w in workers)
            assert errors == []
            # Nothing is fetched from anywhere but the service itself (no CDN).
            assert all(u.startswith(url) or u.startswith("data:") for u in requested), requested
        finally:
            browser.close()
