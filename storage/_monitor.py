"""What the shards and replicas are doing, as Prometheus metrics over HTTP (issue 25, item 4).

A Dask actor's methods are not tasks: while a fit runs, the Dask dashboard shows the actors' tasks as done
and nothing processing. So each worker serves its actors' counters at ``/distbelief/metrics`` on its own
HTTP (dashboard) port, and the scheduler serves every worker's at ``/distbelief/metrics`` on the dashboard's
port (``client.dashboard_link`` with that path), labelled by worker. The format is Prometheus' text
exposition format: a Prometheus server scrapes it as it is, and a person reads it in a browser.

The counters are the ones the actors keep anyway (ops and their seconds, bytes moved, steps, portions); an
actor class lists its samples in a ``monitor()`` method, which the page calls on the worker's event loop
when it is read. Nothing is sent or computed while nobody reads the page: the cost during a run is that of
incrementing the counters (an op count is one dict update per op, ~0.1 us; see docs/operations.md for the
measured cost per L-BFGS iteration).

The routes are installed by the actors' constructors on their own worker (:func:`install_worker`), and on
the scheduler and every worker of a cluster when a front door first checks it (:func:`install_cluster`). A
worker that serves the page tells the scheduler so (in the scheduler's task metadata, under
:data:`METADATA_KEY`): the scheduler's page asks those workers only, never one without distbelief. (Not a
Dask worker plugin: a worker without distbelief could not unpickle it, and would fail to join the cluster.)

Examples
--------
>>> class Counter:
...     def monitor(self):
...         return [("distbelief_replica_steps_total", {"replica": "0"}, 3)]
>>> class Worker:  # the attributes read of a Dask worker
...     address = "tcp://127.0.0.1:1"
...     class state: actors = {"Counter-1": Counter()}
>>> print(render(worker_samples(Worker())), end="")
# HELP distbelief_replica_steps_total Mini-batch steps done (Downpour).
# TYPE distbelief_replica_steps_total counter
distbelief_replica_steps_total{actor="Counter-1",replica="0"} 3
# HELP distbelief_actors distbelief actors on the worker.
# TYPE distbelief_actors gauge
distbelief_actors 1
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from typing import Any

__all__ = [
    "HANDLER",
    "METADATA_KEY",
    "METRICS",
    "PATH",
    "Sample",
    "install_cluster",
    "install_scheduler",
    "install_worker",
    "render",
    "shard_samples",
    "worker_samples",
]

logger = logging.getLogger(__name__)

#: The HTTP path of the page, on every worker's and on the scheduler's HTTP port.
PATH = "/distbelief/metrics"
#: The worker's comm handler the scheduler's page calls (one message per worker and read).
HANDLER = "distbelief_monitor"
#: Key of the scheduler's task metadata under which the workers serving the page put their addresses.
METADATA_KEY = "distbelief-monitor"

#: One sample: metric name, labels, value.
Sample = tuple[str, dict[str, str], float]

#: Every metric: its type and help text (a metric not listed is exported as ``untyped``).
METRICS: dict[str, tuple[str, str]] = {
    "distbelief_shard_ops_total": ("counter", "Shard ops done, by kind (accumulate: gradient pushes taken)."),
    "distbelief_shard_op_seconds_total": ("counter", "Seconds spent in shard ops, by kind."),
    "distbelief_shard_params": ("gauge", "Parameters (elements of each vector) the shard owns."),
    "distbelief_shard_vectors": ("gauge", "Named vectors the shard holds."),
    "distbelief_shard_bytes": ("gauge", "Bytes of the shard's vectors, in RAM or spilled to local disk."),
    "distbelief_shard_spill_bytes_total": ("counter", "Bytes streamed to and from spilled vector files."),
    "distbelief_shard_version": ("gauge", "Downpour updates applied to the shard (its clock)."),
    "distbelief_shard_pushes_total": ("counter", "Downpour pushes applied."),
    "distbelief_replica_work_calls_total": ("counter", "Work calls answered (Sandblaster)."),
    "distbelief_replica_portions_total": ("counter", "Portions whose gradient was computed (Sandblaster)."),
    "distbelief_replica_steps_total": ("counter", "Mini-batch steps done (Downpour)."),
    "distbelief_replica_rows_total": ("counter", "Training rows whose gradient was computed."),
    "distbelief_replica_fetches_total": ("counter", "Parameter fetches from the shards."),
    "distbelief_replica_pushes_total": ("counter", "Gradient pushes to the shards (Downpour)."),
    "distbelief_replica_bytes_total": ("counter", "Bytes of parameters pulled and of gradients pushed."),
    "distbelief_replica_seconds_total": (
        "counter",
        "Seconds of gradient computation and of waiting for the shards.",
    ),
    "distbelief_partition_messages_total": ("counter", "Messages a model partition sent to its peers."),
    "distbelief_partition_bytes_total": ("counter", "Bytes a model partition sent to its peers."),
    "distbelief_actors": ("gauge", "distbelief actors on the worker."),
}


# ------------------------------------------------------------------------------------------- samples


def worker_samples(worker: Any) -> list[Sample]:
    """The samples of every actor on ``worker`` with a ``monitor()`` method, each labelled with its actor
    key, and the number of such actors (``distbelief_actors``). Runs on the worker's event loop: the
    compute threads may update the counters meanwhile, each read is of one number."""
    out: list[Sample] = []
    n = 0
    for key, actor in list(worker.state.actors.items()):
        monitor = getattr(actor, "monitor", None)
        if monitor is None:
            continue
        try:
            samples = monitor()
        except Exception:  # an actor half-built or closing: its counters are skipped, never the page
            logger.debug("monitor() of %s failed", key, exc_info=True)
            continue
        n += 1
        out += [(name, {"actor": str(key), **labels}, value) for name, labels, value in samples]
    out.append(("distbelief_actors", {}, n))
    return out


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(samples: Iterable[Sample]) -> str:
    """``samples`` in Prometheus' text exposition format (version 0.0.4), grouped by metric.

    Examples
    --------
    >>> print(render([("distbelief_shard_vectors", {"shard": "0"}, 4)]), end="")
    # HELP distbelief_shard_vectors Named vectors the shard holds.
    # TYPE distbelief_shard_vectors gauge
    distbelief_shard_vectors{shard="0"} 4
    """
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((labels, value))
    lines: list[str] = []
    for name, rows in by_name.items():
        kind, text = METRICS.get(name, ("untyped", name))
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in rows:
            inner = ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{inner}}} {_number(value)}" if inner else f"{name} {_number(value)}")
    return "".join(line + "\n" for line in lines)


# ------------------------------------------------------------------------------------------- routes


def _handler_class() -> type:
    from tornado import web

    class MetricsHandler(web.RequestHandler):
        """``GET`` the page of the server (worker or scheduler) given at ``initialize``."""

        def initialize(self, server: Any, scheduler: bool) -> None:
            self.server = server
            self.scheduler = scheduler

        async def get(self) -> None:
            if self.scheduler:
                samples = await _cluster_samples(self.server)
            else:
                samples = worker_samples(self.server)
            self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.write(render(samples))

    return MetricsHandler


def _add_route(server: Any, scheduler: bool) -> bool:
    """Add the page to ``server``'s HTTP application; False if it has none or has the page already."""
    app = getattr(server, "http_application", None)
    if app is None or getattr(server, "_distbelief_monitor", False):
        return False
    app.add_handlers(r".*", [(PATH, _handler_class(), {"server": server, "scheduler": scheduler})])
    server._distbelief_monitor = True
    return True


def install_worker(worker: Any = None) -> None:
    """Serve the page on ``worker``'s HTTP port and answer the scheduler's reads (:data:`HANDLER`); default:
    the worker running the caller. Does nothing outside a worker or when done already. Called by the
    constructors of the shard and replica actors, and on every worker by :func:`install_cluster`.

    Examples
    --------
    >>> install_worker()  # not on a Dask worker: nothing to do
    """
    from ._calls import current_worker

    worker = current_worker() if worker is None else worker
    if worker is not None and HANDLER not in worker.handlers:

        async def handle(comm: Any) -> list[Sample]:
            return worker_samples(worker)

        worker.handlers[HANDLER] = handle
        _announce(worker)
    _add_route(worker, scheduler=False)


async def _install_on(dask_worker: Any) -> None:
    """:func:`install_worker` for ``client.run``, which names the worker ``dask_worker`` (its functions run
    without the "current worker" that ``get_worker`` reads); returns once the scheduler knows the worker
    serves the page, so the scheduler's page lists it as soon as :func:`install_cluster` returns."""
    install_worker(dask_worker)
    await dask_worker.scheduler.set_metadata(keys=[METADATA_KEY, dask_worker.address], value=True)


def _announce(worker: Any) -> None:
    """Put ``worker``'s address in the scheduler's metadata (``set_metadata``: every scheduler has the
    handler), sent from the worker's event loop; never waited for, never raised: the page is a
    convenience."""

    async def send() -> None:
        await worker.scheduler.set_metadata(keys=[METADATA_KEY, worker.address], value=True)

    loop = getattr(worker.loop, "asyncio_loop", None)
    if loop is None or loop.is_closed():
        return
    sent = asyncio.run_coroutine_threadsafe(send(), loop)
    sent.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _cluster_samples(scheduler: Any) -> list[Sample]:
    """The samples of every worker that serves the page, labelled with its address."""
    known = scheduler.get_metadata(keys=[METADATA_KEY], default={})
    workers = [w for w in (known if isinstance(known, dict) else {}) if w in scheduler.workers]
    answers = (
        await scheduler.broadcast(msg={"op": HANDLER}, workers=workers, on_error="ignore") if workers else {}
    )
    out: list[Sample] = []
    for address, samples in sorted(answers.items()):
        if isinstance(samples, (list, tuple)):  # msgpack hands lists back as tuples
            out += [(name, {"worker": address, **labels}, value) for name, labels, value in samples]
    return out


def install_scheduler(dask_scheduler: Any) -> bool:
    """Serve every worker's samples at :data:`PATH` on ``dask_scheduler``'s HTTP (dashboard) port; for
    ``client.run_on_scheduler``. Returns whether the route was added now."""
    return _add_route(dask_scheduler, scheduler=True)


def install_cluster(client: Any) -> None:
    """Install the pages on the cluster of ``client``: its scheduler and every worker it has now (a worker
    that joins later serves its page from its first shard or replica on).

    Two round trips, once per cluster (the front doors call it when they first check a cluster's workers,
    so every worker has this version of distbelief). A scheduler that cannot import distbelief serves no
    page: logged, never raised, because the runs do not need it.

    Examples
    --------
    >>> install_cluster(client)                                          # doctest: +SKIP
    >>> link = client.dashboard_link.replace("/status", PATH)            # doctest: +SKIP
    >>> urllib.request.urlopen(link).read().decode().splitlines()[-1]    # doctest: +SKIP
    'distbelief_actors{worker="tcp://127.0.0.1:40139"} 0'
    """
    try:
        client.run_on_scheduler(install_scheduler)
        client.run(_install_on, on_error="return")
    except Exception as exc:  # the page is a convenience: a run goes on without it
        logger.warning("distbelief's metrics page could not be installed on the cluster: %r", exc)


# ------------------------------------------------------------------------------------------- actors


def shard_samples(core: Any) -> list[Sample]:
    """The samples of one :class:`~storage._shard.Shard`.

    Examples
    --------
    >>> import numpy as np
    >>> from distbelief.storage._shard import Shard
    >>> s = Shard(3, 0, 4); s.set("x", 0, 4, np.ones(4)); _ = s.run([("dot", "x", "x")])
    >>> [(n, l.get("kind"), v) for n, l, v in shard_samples(s)][:1]
    [('distbelief_shard_ops_total', 'dot', 1)]
    """
    shard = {"shard": str(core.index)}
    vs = core.vectors
    out: list[Sample] = [
        ("distbelief_shard_ops_total", {**shard, "kind": k}, n) for k, n in core.op_counts.items()
    ]
    seconds = core.op_seconds.items()
    out += [("distbelief_shard_op_seconds_total", {**shard, "kind": k}, s) for k, s in seconds]
    spilled = len(vs.spilled)
    out += [
        ("distbelief_shard_params", shard, core.size),
        ("distbelief_shard_vectors", shard, len(vs)),
        ("distbelief_shard_bytes", {**shard, "where": "ram"}, vs.ram_bytes),
        ("distbelief_shard_bytes", {**shard, "where": "disk"}, 8 * core.size * spilled),
        ("distbelief_shard_spill_bytes_total", {**shard, "direction": "read"}, vs.bytes_read),
        ("distbelief_shard_spill_bytes_total", {**shard, "direction": "written"}, vs.bytes_written),
        ("distbelief_shard_version", shard, core.version),
        ("distbelief_shard_pushes_total", shard, core.applied),
    ]
    return out
