"""glibc's allocator set for a process that computes gradients: freed blocks are kept and reused.

Dask's nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (the config key
``distributed.nanny.pre-spawn-environ``) so that freed memory goes back to the operating system soon. Any
threshold set by hand also turns off glibc's *dynamic* mmap threshold, which would otherwise rise to the size
of the blocks a program frees. So in a Dask worker every allocation of 128 KiB or more -- a mini-batch's
activations and their gradients, 128 x 512 float64 = 512 KiB each -- is a fresh ``mmap`` whose pages fault
in zero-filled, and a ``munmap`` when freed. Measured here on the MLP of issue 30 (256-512-512-10, batches of
128, one BLAS thread): one ``loss_and_grad`` took 6.6-7.2 ms in a plain process, 9.8-10.1 ms with that
variable set, and 6.7-6.8 ms once :func:`reuse_freed_memory` had run; a Downpour replica's steps were that
much slower than its kernel.

:func:`reuse_freed_memory` raises both thresholds (``mallopt``): blocks up to
:data:`HEAP_BLOCK_LIMIT` come from the heap and are reused, and the heap's free top is returned to the system
only past :data:`KEEP_FREE_BYTES`. The replicas call it when they start on a worker (it works on a user's own
cluster too, where the environment is not ours to set); the cost is that a replica's process may keep up to
that much freed memory. Processes not using glibc (macOS, Windows, musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["HEAP_BLOCK_LIMIT", "KEEP_FREE_BYTES", "reuse_freed_memory"]

#: Allocations below this size are served from the heap (reusable) instead of fresh mmap'ed pages. Vectors of
#: big models (a 1e7-parameter vector is 80 MB) stay mmap'ed: they are allocated once, not per step.
HEAP_BLOCK_LIMIT = 64 << 20
#: Free memory at the top of the heap that is kept rather than returned to the system.
KEEP_FREE_BYTES = 256 << 20

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def reuse_freed_memory() -> bool:
    """Keep freed blocks for reuse in this process (glibc only); returns whether the allocator was set.

    Idempotent and cheap after the first call. See the module docstring for why and what it costs.

    Examples
    --------
    >>> reuse_freed_memory() in (True, False)
    True
    """
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt to speak of)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    heap_blocks = bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT))
    return heap_blocks and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES))
