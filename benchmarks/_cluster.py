"""The cluster a benchmark runs on: two single-threaded worker processes on this machine, started for the
run, or the test suite's session cluster when its smoke test hands over a client (a cluster start costs
seconds of the suite).

Examples
--------
>>> with two_workers(given="the suite's client") as client:
...     client
"the suite's client"
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from distributed import Client, LocalCluster

__all__ = ["two_workers"]


@contextlib.contextmanager
def two_workers(given: Any = None, *, direct_to_workers: bool = False) -> Iterator[Any]:
    """``given`` as it is, or the client of a 2-worker, 1-thread LocalCluster on 127.0.0.1 (closed after)."""
    if given is not None:
        yield given
        return
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
        ) as cluster,
        Client(cluster, direct_to_workers=direct_to_workers) as client,
    ):
        yield client
