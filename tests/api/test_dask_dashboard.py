"""The Dask dashboard works from the service's own embedded cluster: ``GET /api/cluster`` reports its link
(which the web dashboard shows), and the page behind the link is Dask's dashboard (bokeh is a dependency)."""

from __future__ import annotations

from pathlib import Path

import httpx

from distbelief.api import BackgroundServer, Client, Settings, create_app


def test_the_embedded_cluster_reports_a_working_dask_dashboard_link(tmp_path: Path) -> None:
    app = create_app(Settings(store=str(tmp_path / "store"), n_workers=1, api_token=None))
    with BackgroundServer(app) as url, Client(url) as api:
        cluster = api.cluster()
        assert cluster["embedded"]
        link = cluster["dashboard_url"]
        assert link and link.startswith("http://127.0.0.1:") and link.endswith("/status"), link
        page = httpx.get(link, timeout=30, follow_redirects=True)
        assert page.status_code == 200
        # Dask's status page is a bokeh document; without bokeh the scheduler serves only a page that says
        # to install it.
        assert "Bokeh" in page.text and "pip install" not in page.text
        # The web dashboard shows that link: its script reads the cluster's dashboard_url.
        script = httpx.get(url + "/dashboard/app.js").text
        assert "setDaskLink(cluster.dashboard_url)" in script
