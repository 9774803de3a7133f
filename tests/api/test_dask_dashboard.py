"""The Dask dashboard works from the service's own embedded cluster: ``GET /api/cluster`` reports its link
(which the web dashboard shows), and the page behind the link is Dask's dashboard (bokeh is a dependency)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from pydantic import SecretStr

from distbelief.api import BackgroundServer, Client, Settings, create_app
from distbelief.api.main import dask_dashboard_address


def _listening_hosts(port: int) -> set[str]:
    """The addresses this process listens on at ``port`` (the embedded scheduler lives in it)."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_the_embedded_cluster_reports_a_working_dask_dashboard_link(tmp_path: Path) -> None:
    app = create_app(Settings(store=str(tmp_path / "store"), n_workers=1, api_token=None))
    with BackgroundServer(app) as url, Client(url) as api:
        cluster = api.cluster()
        assert cluster["embedded"]
        link = cluster["dashboard_url"]
        assert link and link.startswith("http://127.0.0.1:") and link.endswith("/status"), link
        # Only where the API listens (loopback): it has no authentication.
        hosts = _listening_hosts(int(urlsplit(link).port or 0))
        assert hosts and all(ipaddress.ip_address(h).is_loopback for h in hosts), hosts
        page = httpx.get(link, timeout=30, follow_redirects=True)
        assert page.status_code == 200
        # Dask's status page is a bokeh document; without bokeh the scheduler serves only a page that says
        # to install it.
        assert "Bokeh" in page.text and "pip install" not in page.text
        # The web dashboard shows that link: its script reads the cluster's dashboard_url.
        script = httpx.get(url + "/dashboard/app.js").text
        assert "setDaskLink(cluster.dashboard_url)" in script


@pytest.mark.parametrize(
    ("host", "configured", "expected"),
    [
        ("127.0.0.1", None, "127.0.0.1:0"),
        ("localhost", None, "127.0.0.1:0"),
        ("::1", None, "[::1]:0"),
        ("0.0.0.0", None, None),  # no authentication on it: not where the token guards the API
        ("192.168.1.5", None, None),
        ("0.0.0.0", "0.0.0.0:8787", "0.0.0.0:8787"),  # configured: as asked
        ("127.0.0.1", "off", None),
    ],
)
def test_the_dask_dashboard_binds_where_the_api_does_or_is_off(
    host: str, configured: str | None, expected: str | None
) -> None:
    settings = Settings(host=host, api_token=SecretStr("t" * 16), dask_dashboard_address=configured)
    assert dask_dashboard_address(settings) == expected
