"""Slow clients cannot hold the server's connections (issue 27): a connection that does not complete its
request headers in ``header_timeout_seconds`` is closed, and connections beyond ``max_connections`` are
refused at once, while normal requests are answered all along. Every socket is on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from distributed import Client as DaskClient

from tests.api.conftest import live_server

HEADER_TIMEOUT = 1.0


def _open(url: str, n: int, partial: bytes = b"") -> list[socket.socket]:
    parts = urlsplit(url)
    socks = []
    for _ in range(n):
        sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
        if partial:
            sock.sendall(partial)
        socks.append(sock)
    return socks


def _closed_by_server(sock: socket.socket, within: float) -> tuple[bool, bytes]:
    """Whether the server closes ``sock`` within ``within`` seconds, and what it sent before."""
    sock.settimeout(within)
    got = b""
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got
    return False, got


@contextlib.contextmanager
def _closing(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_idle_and_half_sent_connections_are_closed_while_requests_are_answered(
    tmp_path: Path, session_client: DaskClient
) -> None:
    with live_server(tmp_path, session_client, header_timeout_seconds=HEADER_TIMEOUT) as url:
        opened = time.monotonic()
        idle = _open(url, 25)
        half = _open(url, 25, b"GET /api/health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        with _closing(idle + half):
            assert httpx.get(url + "/api/health", timeout=10).status_code == 200
            for sock in idle + half:
                closed, got = _closed_by_server(sock, HEADER_TIMEOUT + 5 - (time.monotonic() - opened))
                assert closed, "a connection without complete headers was kept open"
                assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:100]
            assert time.monotonic() - opened < HEADER_TIMEOUT + 5
            # A keep-alive connection still works for its next request.
            with httpx.Client(base_url=url, timeout=10) as http:
                assert http.get("/api/health").status_code == 200
                time.sleep(0.2)
                assert http.get("/api/health").status_code == 200


def test_connections_beyond_the_cap_are_refused_at_once(tmp_path: Path, session_client: DaskClient) -> None:
    cap = 10
    with live_server(tmp_path, session_client, header_timeout_seconds=3.0, max_connections=cap) as url:
        with _closing(_open(url, cap)):
            time.sleep(0.2)  # the server has taken them all
            with _closing(_open(url, 5)) as extra:
                for sock in extra:
                    closed, got = _closed_by_server(sock, 2.0)
                    assert closed and got.startswith(b"HTTP/1.1 503"), got[:100]
        # The held ones are gone: the server answers again.
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/api/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not answer once the connections closed"
            time.sleep(0.1)


@pytest.mark.parametrize("asked", [1, 1000, 10**9])
def test_the_connection_cap_leaves_half_the_descriptors(asked: int) -> None:
    import resource

    from distbelief.api._server import connection_budget

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 1 <= connection_budget(asked) <= min(asked, max(1, soft // 2))
