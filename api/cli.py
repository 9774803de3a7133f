"""The ``distbelief`` command line: ``serve``, ``submit``, ``status`` and ``demo``.

``distbelief demo`` starts the embedded service (a local Dask cluster, a temporary zarr store, the REST API
on 127.0.0.1), uploads the handwritten digits through the API, runs a Sandblaster L-BFGS job and a Downpour
Adagrad job through it with progress bars, and prints a comparison table (with SciPy's L-BFGS-B in one
process as the reference) and the dashboard URL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

DEFAULT_URL = "http://127.0.0.1:8000"


def _settings(args: argparse.Namespace, **extra: Any) -> Any:
    from distbelief.api.settings import Settings

    overrides = {
        k: getattr(args, k)
        for k in ("host", "port", "store", "scheduler")
        if getattr(args, k, None) is not None
    }
    overrides.update(extra)
    return Settings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from distbelief.api.main import create_app

    settings = _settings(args)
    app = create_app(settings)  # refuses a non-loopback host without a token
    print(
        f"distbelief: serving on http://{settings.host}:{settings.port}/ (store {settings.store})", flush=True
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _client(args: argparse.Namespace) -> Any:
    from distbelief.api.client import Client

    return Client(args.url, token=os.environ.get("DISTBELIEF_API_TOKEN") or None)


def _submit(args: argparse.Namespace) -> int:
    with open(args.job, encoding="utf-8") as fh:
        try:
            spec = json.load(fh)
        except json.JSONDecodeError as exc:
            print(f"distbelief: {args.job} is not valid JSON: {exc}", file=sys.stderr)
            return 2
    with _client(args) as client:
        job = client.submit(spec)
        print(f"submitted job {job['id']} ({job['algorithm']} on {job['dataset']})", flush=True)
        if not args.wait:
            return 0
        job = client.wait(job["id"])
    _print_job(job)
    return 0 if job["status"] == "succeeded" else 1


def _print_job(job: dict[str, Any]) -> None:
    print(json.dumps(job, indent=2, sort_keys=True))


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.id:
            _print_job(client.job(args.id))
            return 0
        jobs = client.jobs()
    if not jobs:
        print("no jobs")
        return 0
    print(
        f"{'id':16}  {'status':9}  {'algorithm':17}  {'dataset':16}  {'iter':>6}  {'objective':>12}  created"
    )
    for j in jobs:
        latest = j.get("latest") or {}
        value = latest.get("objective", latest.get("loss"))
        shown = f"{value:12.6g}" if isinstance(value, float) else f"{'':12}"
        print(
            f"{j['id']:16}  {j['status']:9}  {j['algorithm']:17}  {j['dataset'][:16]:16}  "
            f"{j['iterations']:6d}  {shown}  {j['created_at'][:19]}"
        )
    return 0


# ------------------------------------------------------------------------------------------------ demo


def _demo(args: argparse.Namespace) -> int:
    import numpy as np
    import scipy.optimize
    from threadpoolctl import threadpool_limits

    from distbelief import models
    from distbelief.api._server import BackgroundServer
    from distbelief.api.client import Client
    from distbelief.api.main import create_app
    from distbelief.storage import digits_dataset

    with tempfile.TemporaryDirectory(prefix="distbelief-digits-") as tmp:
        X_tr, y_tr = digits_dataset(f"{tmp}/train", subset="train").read_all()
        X_te, y_te = digits_dataset(f"{tmp}/test", subset="test").read_all()
    spec = {"kind": "softmax", "n_features": X_tr.shape[1], "n_classes": 10}
    model = models.from_spec(spec)
    l2 = args.l2
    print(
        f"digits: {X_tr.shape[0]} training and {X_te.shape[0]} held-out rows x {X_tr.shape[1]} features, "
        f"10 classes; softmax with {model.n_params} parameters, l2={l2:g}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="distbelief-demo-") as tmp:
        settings = _settings(args, store=args.store or tmp, host="127.0.0.1", port=0, api_token=None)
        where = (
            f"the Dask scheduler at {settings.scheduler}"
            if settings.scheduler
            else "an embedded Dask cluster"
        )
        print(f"starting the service on {where} ...", flush=True)
        server = BackgroundServer(create_app(settings))
        url = server.start()
        try:
            with Client(url) as client:
                print(f"dashboard: {url}/  (REST API {url}/api, OpenAPI {url}/docs)", flush=True)
                client.upload_dataset("digits-train", X_tr, y_tr, overwrite=True)
                client.upload_dataset("digits-test", X_te, y_te, overwrite=True)
                # A first job pays for imports and first actors on fresh workers: keep it out of the table.
                warm = {"algorithm": "sandblaster-lbfgs", "dataset": "digits-train", "model": spec}
                warm_job = client.submit({**warm, "options": {"maxiter": 2}, "name": "demo: warm-up"})
                client.wait(warm_job["id"], progress=False)
                adagrad = {
                    "rule": "adagrad",
                    "lr": args.lr,
                    "replicas": 2,
                    "epochs": args.epochs,
                    "l2": l2,
                }
                runs: list[tuple[str, dict[str, Any]]] = [
                    ("Sandblaster L-BFGS", {"algorithm": "sandblaster-lbfgs", "options": {"l2": l2}}),
                    ("Downpour Adagrad", {"algorithm": "downpour-sgd", "options": adagrad}),
                ]
                rows = []
                for label, job in runs:
                    body = {
                        "model": spec,
                        "dataset": "digits-train",
                        "eval_dataset": "digits-test",
                        "name": f"demo: {label}",
                        **job,
                    }
                    record = client.wait(client.submit(body)["id"])
                    wall = _seconds(record.get("started_at"), record.get("finished_at"))
                    w = client.params(record["id"]) if record["status"] == "succeeded" else None
                    rows.append((label, record, wall, w))
            with threadpool_limits(1, user_api="blas"):
                start = time.perf_counter()
                ref = scipy.optimize.minimize(
                    lambda w: models.objective(model, w, X_tr, y_tr, l2=l2),
                    np.zeros(model.n_params),
                    jac=True,
                    method="L-BFGS-B",
                    options={"maxcor": 10},
                )
                scipy_wall = time.perf_counter() - start
            rows.append(
                (
                    "SciPy L-BFGS-B, 1 process",
                    {"status": "succeeded", "iterations": ref.nit},
                    scipy_wall,
                    ref.x,
                )
            )
            _print_table(rows, model, X_tr, y_tr, X_te, y_te, l2)
            print(f"\ndashboard: {url}/", flush=True)
            if args.keep:
                print("serving until Ctrl-C ...", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
        finally:
            server.stop()
    failed = [
        label
        for label, record, _, _ in rows
        if record["status"] != "succeeded" and "not available" not in str(record.get("message"))
    ]
    return 1 if failed else 0


def _seconds(start: str | None, end: str | None) -> float:
    """Seconds between two ISO timestamps of a job record (NaN if either is missing)."""
    import datetime as dt

    if not start or not end:
        return float("nan")
    return (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()


def _print_table(rows: list[Any], model: Any, X_tr: Any, y_tr: Any, X_te: Any, y_te: Any, l2: float) -> None:
    import numpy as np

    from distbelief import models

    print()
    titles = ("status", "iter/steps", "wall s", "F(w) train", "held-out acc")
    print("{:28} {:10} {:>10} {:>8} {:>12} {:>12}".format("method", *titles))
    for label, record, wall, w in rows:
        head = f"{label:28} {record['status']:10} {record.get('iterations', 0):10d} {wall:8.2f}"
        if w is None:
            print(f"{head}   {record.get('message') or ''}")
            continue
        f, _ = models.objective(model, w, X_tr, y_tr, l2=l2)
        print(f"{head} {f:12.6f} {float(np.mean(model.predict(w, X_te) == y_te)):12.4f}")


# ------------------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distbelief`` console script.

    Examples
    --------
    >>> main(["status", "--url", "http://127.0.0.1:8000"])   # doctest: +SKIP
    no jobs
    0
    """
    parser = argparse.ArgumentParser(prog="distbelief", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the REST API and dashboard (embedded cluster unless --scheduler)"
    )
    serve.add_argument("--host", help="address to listen on (default DISTBELIEF_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default DISTBELIEF_PORT or 8000)")
    serve.add_argument("--store", help="directory or fsspec URL of the store (default DISTBELIEF_STORE)")
    serve.add_argument("--scheduler", help="Dask scheduler address, e.g. tcp://host:8786 (default: embedded)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    serve.set_defaults(func=_serve)

    url_help = f"the service's URL (default DISTBELIEF_URL or {DEFAULT_URL}); token from DISTBELIEF_API_TOKEN"
    default_url = os.environ.get("DISTBELIEF_URL", DEFAULT_URL)
    submit = sub.add_parser("submit", help="submit a job from a JSON file (the body of POST /api/jobs)")
    submit.add_argument("job", help="path of the JOB.json file")
    submit.add_argument("--wait", action="store_true", help="wait for the job with a progress bar")
    submit.add_argument("--url", default=default_url, help=url_help)
    submit.set_defaults(func=_submit)

    status = sub.add_parser("status", help="list the jobs, or show one")
    status.add_argument("id", nargs="?", help="a job id (default: list every job)")
    status.add_argument("--url", default=default_url, help=url_help)
    status.set_defaults(func=_status)

    demo = sub.add_parser(
        "demo", help="run Sandblaster and Downpour on the digits through the embedded service"
    )
    demo.add_argument("--l2", type=float, default=1e-3, help="L2 regularization (default 1e-3)")
    demo.add_argument("--lr", type=float, default=0.1, help="Downpour Adagrad learning rate (default 0.1)")
    demo.add_argument("--epochs", type=int, default=20, help="Downpour epochs (default 20)")
    demo.add_argument("--scheduler", help="use this Dask scheduler instead of an embedded cluster")
    demo.add_argument("--store", help="keep the store here (default: a temporary directory)")
    demo.add_argument("--keep", action="store_true", help="keep serving the dashboard until Ctrl-C")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    from pydantic import ValidationError

    from distbelief.api.client import ApiError
    from distbelief.errors import DistbeliefError

    try:
        return int(args.func(args))
    except (ApiError, DistbeliefError) as exc:
        print(f"distbelief: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        print(f"distbelief: bad settings: {problems}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"distbelief: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
