"""The ``distbelief`` command line.

``distbelief demo`` runs the main job on the embedded default: a local Dask cluster and a local zarr store.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import numpy as np
    import scipy.optimize
    from distributed import Client, LocalCluster

    import models
    import sandblaster
    from storage import digits_dataset, load_digits

    X, y = load_digits()
    model = models.Softmax(X.shape[1], 10)
    l2 = args.l2
    print(
        f"digits: {X.shape[0]} rows x {X.shape[1]} features, 10 classes; "
        f"softmax with {model.n_params} parameters"
    )
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, host="127.0.0.1") as cluster,
        Client(cluster, direct_to_workers=True) as client,
        tempfile.TemporaryDirectory(prefix="distbelief-demo-") as store,
    ):
        data = digits_dataset(f"{store}/digits")
        x0 = np.zeros(model.n_params)
        sandblaster.minimize(model, data, x0=x0, l2=l2, client=client, store=f"{store}/warmup", maxiter=2)
        start = time.perf_counter()
        res = sandblaster.minimize(model, data, x0=x0, l2=l2, client=client, store=f"{store}/run")
        ours = time.perf_counter() - start

        def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
            return models.objective(model, w, X, y, l2=l2)

        start = time.perf_counter()
        ref = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", options={"maxcor": 10})
        theirs = time.perf_counter() - start
    print(f"Sandblaster L-BFGS on {res.stats['shards']} shard(s), {res.stats['replicas']} replicas:")
    print(f"  {res}")
    print(f"  wall {ours:.3f} s, accuracy {model.accuracy(res.x, X, y):.4f}")
    print(f"scipy L-BFGS-B in one process: fun={ref.fun:.10g}, nit={ref.nit}, wall {theirs:.3f} s")
    print(f"relative difference of the objectives: {abs(res.fun - ref.fun) / abs(ref.fun):.2e}")
    return 0 if res.success else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distbelief`` console script."""
    parser = argparse.ArgumentParser(prog="distbelief", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on an embedded local Dask cluster and zarr store")
    demo.add_argument("--l2", type=float, default=1e-3, help="L2 regularization (default 1e-3)")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
