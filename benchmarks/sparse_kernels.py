"""The compiled CSR logistic kernel against scipy.sparse products, on a wide sparse problem.

Usage: ``python benchmarks/sparse_kernels.py [n_rows] [log2_features] [nnz_per_row] [repeats]``
(default 200,000 x 2**20 with 40 nonzeros a row, 9 repeats). Prints the median times of:

* ``Logistic.loss_and_grad`` on the CSR rows (one compiled pass over the nonzeros);
* scipy's ``X @ w`` and ``X.T @ r`` (the two products a two-pass gradient needs), each and together;
* the model's own fallback without numba (scipy products plus the numpy loss), for reference.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from distbelief.models import Logistic, _compiled


def median_ms(fn: Callable[[], object], repeats: int) -> str:
    """Median CPU time and wall time of ``fn`` in ms: on a shared machine the wall time mostly measures
    the other processes, the CPU time (this process, one thread) is the cost of the code."""
    fn()  # warm up (compiles the kernel on the first call)
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return f"cpu {1e3 * statistics.median(cpu):7.1f} ms   wall {1e3 * statistics.median(wall):7.1f} ms"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    d = 2 ** (int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 9
    rng = np.random.default_rng(0)
    # Hashed features: k distinct uniform columns a row, sorted (as a dataset stores them).
    indices = np.sort(rng.integers(0, d, size=(n, k)), axis=1).astype(np.int32).ravel()
    X = sp.csr_array((rng.normal(size=n * k), indices, np.arange(0, n * k + 1, k)), shape=(n, d))
    X.sum_duplicates()
    y = rng.integers(0, 2, size=n).astype(float)
    model = Logistic(d)
    w = rng.normal(scale=0.01, size=model.n_params)
    coef = w[:d]
    r = rng.normal(size=n)
    print(f"{n} x {d} CSR, {X.nnz} nonzeros ({X.nnz / n:.1f} a row), {repeats} repeats, medians:")
    kernel_ms = median_ms(lambda: model.loss_and_grad(w, X, y), repeats)
    xw_ms = median_ms(lambda: X @ coef, repeats)
    xtr_ms = median_ms(lambda: X.T @ r, repeats)
    both_ms = median_ms(lambda: (X @ coef, X.T @ r), repeats)
    real = _compiled.sparse_kernel
    _compiled.sparse_kernel = lambda kind: None  # type: ignore[assignment,return-value]
    try:
        fallback_ms = median_ms(lambda: model.loss_and_grad(w, X, y), repeats)
    finally:
        _compiled.sparse_kernel = real
    print(f"  compiled CSR logistic loss_and_grad   {kernel_ms}")
    print(f"  scipy X @ w                           {xw_ms}")
    print(f"  scipy X.T @ r                         {xtr_ms}")
    print(f"  scipy X @ w and X.T @ r               {both_ms}")
    print(f"  loss_and_grad without numba (scipy)   {fallback_ms}")


if __name__ == "__main__":
    main()
