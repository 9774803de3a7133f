"""A uvicorn server in a background thread, on a socket bound before it starts (so port 0 works)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from distbelief.errors import ClusterError

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread; ``start`` returns the base URL once it is up.

    Parameters
    ----------
    app : FastAPI
        The application (its lifespan runs in the server's thread).
    host : str
        Address to listen on (loopback by default).
    port : int
        Port; 0 picks a free one.
    log_level : str
        uvicorn's log level.

    Examples
    --------
    >>> from distbelief.api import create_app, Settings
    >>> with BackgroundServer(create_app(Settings(store="/tmp/s"))) as url:   # doctest: +SKIP
    ...     print(url)
    http://127.0.0.1:41237
    """

    def __init__(
        self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.log_level = log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self, timeout: float = 180.0) -> str:
        """Start serving; returns ``http://host:port`` once the app has started (its lifespan ran)."""
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
        # it every response waits ~40 ms for a delayed ACK (Nagle).
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level=self.log_level, lifespan="on", timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                sock.close()
                raise ClusterError(
                    "the service did not start (its log above says why); check the store path and the Dask "
                    "scheduler address"
                )
            time.sleep(0.05)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the server to exit (the app's lifespan closes its runner and cluster) and wait for it."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
