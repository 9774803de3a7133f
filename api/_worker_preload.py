"""A Dask worker preload of the CLI's embedded cluster: its worker processes ignore SIGINT.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: to ``distbelief serve`` (or
``demo``) and to the Dask worker processes it started. Each worker then died of its own KeyboardInterrupt and
printed two tracebacks (62 lines for a two-worker cluster), while the service was closing them anyway. With
this preload (``distributed.worker.preload``, set by the CLI only) the workers leave the signal to the
service, which closes its cluster as it stops.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["dask_setup"]


def dask_setup(worker: Any) -> None:
    """Ignore SIGINT in this worker's process (called by Dask as the worker starts).

    Examples
    --------
    >>> import threading
    >>> t = threading.Thread(target=dask_setup, args=(None,))  # off the main thread: nothing to do
    >>> t.start(); t.join()
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
