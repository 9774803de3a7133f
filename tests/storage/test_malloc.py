"""``reuse_freed_memory``: a Dask worker's allocator stops mapping fresh pages for every temporary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from distributed import Client

from distbelief import downpour, models
from distbelief.storage import reuse_freed_memory

# Minor page faults while allocating, touching and freeing a 1 MiB array 200 times: with Dask's
# MALLOC_TRIM_THRESHOLD_ each one is a fresh mmap (256 faults); with the heap reused, none after the first.
PROBE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from distbelief.storage import reuse_freed_memory

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(200):
            a = np.empty(1 << 17)
            a.fill(1.0)
            del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults()
    untuned = faults()
    applied = reuse_freed_memory()
    faults()
    print(untuned, faults(), applied)
    """
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def test_the_heap_is_reused_under_dasks_trim_threshold() -> None:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    untuned, tuned, applied = out.stdout.split()
    assert applied == "True"
    assert int(untuned) >= 200 * 200  # every array mapped afresh: 256 pages each
    assert int(tuned) < 200  # the same block reused: no page faults per array


def test_it_is_idempotent() -> None:
    assert reuse_freed_memory() is reuse_freed_memory()


def _tuned() -> bool:
    from distbelief.storage import _malloc

    return bool(_malloc._applied)


def _forget() -> None:
    # Earlier tests' replicas set the allocator already: forget it, so that only this run's replicas count.
    from distbelief.storage import _malloc

    _malloc._applied = None


def test_downpour_replicas_set_their_workers_allocator(client: Client) -> None:
    import numpy as np

    X = np.random.default_rng(0).normal(size=(64, 3))
    y = (X[:, 0] > 0).astype(float)
    client.run(_forget)
    assert not any(client.run(_tuned).values())
    res = downpour.train(models.Logistic(3), (X, y), replicas=2, lr=0.1, epochs=1, client=client)
    assert res.success, res.message
    assert all(client.run(_tuned).values())
