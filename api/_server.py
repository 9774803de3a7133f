"""uvicorn, guarded against slow clients, and a server in a background thread on a socket bound before it
starts (so port 0 works).

uvicorn times out idle keep-alive connections, but not a connection that never finishes its request headers:
20,600 such connections once took every file descriptor of the process, and a running job failed with
"Too many open files". :func:`service_config` serves with :class:`GuardedHttpToolsProtocol` (or
:class:`GuardedH11Protocol`), which closes a connection whose headers are not complete
``settings.header_timeout_seconds`` after its first byte (or its opening), and refuses connections beyond
``settings.max_connections`` at once (503), keeping the rest of the descriptors for the cluster's comms and
the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from distbelief.api.settings import Settings
from distbelief.errors import ClusterError

__all__ = [
    "BackgroundServer",
    "GuardedH11Protocol",
    "GuardedHttpToolsProtocol",
    "ServiceConfig",
    "connection_budget",
    "service_config",
]

log = logging.getLogger("distbelief.api")


def _plain_response(status: bytes, body: bytes, *extra: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written straight to a transport."""
    head = [b"HTTP/1.1 " + status, b"content-type: text/plain; charset=utf-8", b"connection: close", *extra]
    head.append(b"content-length: " + str(len(body)).encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


_TIMED_OUT = _plain_response(b"408 Request Timeout", b"the request headers took too long to arrive")
_BUSY = _plain_response(
    b"503 Service Unavailable", b"too many open connections; try again in a moment", b"retry-after: 1"
)


class _Guard:
    """Header deadline and connection cap, mixed into a uvicorn HTTP protocol (see the module's doc).

    A deadline is armed when a connection opens, and when the first byte of a further request on it arrives;
    it is disarmed once the request's headers are complete (uvicorn then starts a new request cycle).
    """

    # Set by uvicorn's protocols.
    transport: asyncio.Transport
    cycle: Any
    connections: set[Any]
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs.get("config", args[0] if args else None)
        self._header_timeout = float(getattr(config, "header_timeout", 5.0))
        self._max_connections: int | None = getattr(config, "max_connections", None)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._max_connections is not None and len(self.connections) >= self._max_connections:
            self._refused = True
            self.transport = transport  # type: ignore[assignment]  # (uvloop's is no asyncio.Transport)
            with contextlib.suppress(Exception):
                self.transport.write(_BUSY)
            self.transport.close()
            return
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._refused:
            super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        before = self.cycle
        if self._header_timer is None and (before is None or before.response_complete):
            self._arm()  # the first bytes of a new request
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:
            self._disarm()  # its headers are complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            with contextlib.suppress(Exception):
                self.transport.write(_TIMED_OUT)
            self.transport.close()


class GuardedH11Protocol(_Guard, H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap."""


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol with a header deadline and a connection cap."""

    _DEFAULT_PROTOCOL: type[asyncio.Protocol] = GuardedHttpToolsProtocol
except ImportError:  # httptools is optional: h11 then
    GuardedHttpToolsProtocol = GuardedH11Protocol  # type: ignore[misc,assignment]
    _DEFAULT_PROTOCOL = GuardedH11Protocol


def connection_budget(max_connections: int) -> int:
    """``max_connections``, lowered to half the process's file-descriptor limit if that is smaller: the other
    half stays for the Dask comms, the store and the jobs.

    Examples
    --------
    >>> 1 <= connection_budget(10**9) < 10**9
    True
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return max_connections
    return max(1, min(max_connections, soft // 2))


class ServiceConfig(uvicorn.Config):
    """A ``uvicorn.Config`` that carries the guards' settings (see :func:`service_config`)."""

    def __init__(self, app: Any, *, header_timeout: float, max_connections: int, **kwargs: Any) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        kwargs.setdefault("http", _DEFAULT_PROTOCOL)
        super().__init__(app, **kwargs)


def service_config(app: Any, settings: Settings | None = None, **kwargs: Any) -> ServiceConfig:
    """The uvicorn configuration the service runs with: ``kwargs`` (host, port, log_level, ...) and the
    guards of ``settings`` (default: the app's own, ``app.state.settings``).

    Examples
    --------
    >>> config = service_config(app, Settings(header_timeout_seconds=2), port=8000)   # doctest: +SKIP
    >>> uvicorn.Server(config).run()                                                   # doctest: +SKIP
    """
    if settings is None:
        state = getattr(app, "state", None)
        settings = getattr(state, "settings", None) or Settings()
    budget = connection_budget(settings.max_connections)
    if budget < settings.max_connections:
        log.warning(
            "serving at most %d connections (DISTBELIEF_MAX_CONNECTIONS=%d, but the process may open only "
            "%d files; raise it with ulimit -n)",
            budget,
            settings.max_connections,
            budget * 2,
        )
    return ServiceConfig(
        app, header_timeout=settings.header_timeout_seconds, max_connections=budget, **kwargs
    )


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
        config = service_config(
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
