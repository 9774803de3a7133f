"""The ``distbelief`` command line: ``serve``, ``submit``, ``status``, ``cancel``, ``delete``, ``metrics``,
``params``, ``datasets`` and ``demo``.

Every command that talks to a service reports a server that is down, a bad URL, a wrong token, a timeout or
an unknown job or dataset in one line that says what to do (in the CLI's own commands and flags, not the REST
API's), and exits with a non-zero code; ``--debug`` shows the traceback instead.

The module imports only the standard library: each command imports what it needs (httpx, numpy, uvicorn,
Dask) when it runs, so ``distbelief status`` starts without loading pandas, xarray or Dask.

``distbelief demo`` starts the embedded service (a local Dask cluster, a temporary zarr store, the REST API
on 127.0.0.1), uploads the handwritten digits through the API, runs a Sandblaster L-BFGS job and a Downpour
Adagrad job through it with progress bars, and prints a comparison table (with SciPy's L-BFGS-B in one
process as the reference) and the dashboard URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from distbelief.errors import InvalidOptionError

if TYPE_CHECKING:  # the models (numpy) load only in the commands that use them: `distbelief status` is quick
    from distbelief.models.internal import BuiltIn

__all__ = ["main"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0


def _settings(args: argparse.Namespace, **extra: Any) -> Any:
    from distbelief.api.settings import Settings

    overrides = {
        k: getattr(args, k)
        for k in ("host", "port", "store", "scheduler")
        if getattr(args, k, None) is not None
    }
    overrides.update(extra)
    return Settings(**overrides)


def _quiet_ctrl_c(settings: Any) -> contextlib.AbstractContextManager[Any]:
    """While the CLI runs its embedded service: let Ctrl-C stop it in one line. Its Dask worker processes
    (in the terminal's process group, so they get the SIGINT too) ignore the signal and are closed by the
    service instead of each printing tracebacks (see ``api/_worker_preload.py``). Nothing to do with
    ``--scheduler``: no worker is ours then."""
    if settings.scheduler is not None:
        return contextlib.nullcontext()
    import dask

    preload = list(dask.config.get("distributed.worker.preload", None) or [])
    if _WORKER_PRELOAD in preload:
        return contextlib.nullcontext()
    return dask.config.set({"distributed.worker.preload": [*preload, _WORKER_PRELOAD]})


_WORKER_PRELOAD = "distbelief.api._worker_preload"
# Loggers that report a shutdown step by step: quiet once Ctrl-C has asked for one.
_SHUTDOWN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "distributed", "distbelief")


def _silence_shutdown() -> None:
    """Keep the steps of a shutdown the user asked for off the terminal (errors still show)."""
    import logging

    for name in _SHUTDOWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from distbelief.api.main import create_app

    from ._server import service_config

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            _silence_shutdown()  # the one line is main()'s "interrupted"
            super().handle_exit(sig, frame)

    settings = _settings(args)
    app = create_app(settings)  # refuses a non-loopback host without a token
    _check_port(settings.host, settings.port)
    print(
        f"distbelief: serving on http://{settings.host}:{settings.port}/ (store {settings.store})", flush=True
    )
    config = service_config(app, settings, host=settings.host, port=settings.port, log_level=args.log_level)
    with _quiet_ctrl_c(settings):
        Server(config).run()
    return 0


def _check_url(url: str) -> str:
    """The service URL, or an :class:`InvalidOptionError` that says what a good one looks like."""
    import httpx

    fix = f"give the service's address like {DEFAULT_URL} (--url or DISTBELIEF_URL)"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise InvalidOptionError(f"{url!r} is not a valid URL ({exc}); {fix}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidOptionError(f"{url!r} is not an http:// or https:// URL with a host; {fix}")
    return url


def _check_port(host: str, port: int) -> None:
    """Fail in one line, before the cluster starts, if ``host:port`` cannot be listened on."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise InvalidOptionError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): stop what uses it, or pick another "
                "address with --host/--port (DISTBELIEF_HOST/DISTBELIEF_PORT)"
            ) from exc


def _client(args: argparse.Namespace) -> Any:
    from distbelief.api.client import Client

    url = _check_url(args.url)
    return Client(url, token=os.environ.get("DISTBELIEF_API_TOKEN") or None, timeout=args.timeout)


def explain(exc: BaseException, url: str, timeout: float) -> str | None:
    """One line that says what went wrong talking to the service at ``url``, and what to do; ``None`` if
    ``exc`` is not such a failure.

    Examples
    --------
    >>> import httpx
    >>> explain(httpx.ConnectError("Connection refused"), "http://127.0.0.1:8000", 30)
    'cannot reach the service at http://127.0.0.1:8000 (Connection refused): is it running? Start it with ...'
    """
    import httpx

    from distbelief.api.client import ApiError

    if isinstance(exc, ApiError) and exc.status_code == 401:
        return (
            f"the service at {url} refused the request (HTTP 401: {exc.detail}); set DISTBELIEF_API_TOKEN to "
            "the token the server was started with"
        )
    if isinstance(exc, ApiError):
        return f"the service at {url} refused the request: HTTP {exc.status_code}: {cli_terms(exc.detail)}"
    if isinstance(exc, httpx.TimeoutException):
        return (
            f"the service at {url} did not answer within {timeout:g} s; it may be busy or stuck: try again, "
            "give it longer with --timeout, or read the server's log"
        )
    if isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError | httpx.ReadError):
        reason = str(exc) or type(exc).__name__
        return (
            f"cannot reach the service at {url} ({reason}): is it running? Start it with `distbelief serve`, "
            "or point --url (or DISTBELIEF_URL) at where it runs"
        )
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"{url!r} is not a valid service URL ({exc}); give one like {DEFAULT_URL} (--url)"
    if isinstance(exc, httpx.HTTPError):
        return (
            f"talking to the service at {url} failed ({type(exc).__name__}: {exc}); try again or use --debug"
        )
    return None


_ID = r"(?:\{\{?[a-z_]+\}?\}|[^\s)/,;'\"`]+)"  # a job id or dataset name, or a placeholder: {id}, {{id}}
# What the service's messages tell an HTTP client to do, and the CLI's way of doing it (most specific first).
_CLI_TERMS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\bsend overwrite=true\b|\boverwrite=true\b", "pass --overwrite"),
        (rf"\bGET /api/jobs/({_ID})/params\b", r"distbelief params \1 -o FILE.npy"),
        (rf"\bPOST /api/jobs/({_ID})/cancel\b", r"distbelief cancel \1"),
        (rf"\bGET /api/jobs/({_ID})/metrics\b", r"distbelief metrics \1"),
        (rf"\bDELETE /api/jobs/({_ID})", r"distbelief delete \1"),
        (rf"\bGET /api/jobs/({_ID})", r"distbelief status \1"),
        (r"\bGET /api/jobs\b", "distbelief status"),
        (r"\bPOST /api/jobs\b", "distbelief submit JOB.json"),
        (rf"\bDELETE /api/datasets/({_ID})", r"distbelief datasets delete \1"),
        (rf"\bGET /api/datasets/({_ID})", r"distbelief datasets show \1"),
        (r"\bGET /api/datasets\b", "distbelief datasets list"),
        (r"\b(?:multipart )?POST /api/datasets\b", "distbelief datasets upload FILE"),
        (r"\{\{?(?:id|job_id)\}?\}", "ID"),
        (r"\{\{?name\}?\}", "NAME"),
    )
)


def cli_terms(message: str) -> str:
    """A message of the service with what it tells an HTTP client to do (``send overwrite=true``,
    ``GET /api/jobs``) said as the CLI's command or flag.

    Examples
    --------
    >>> cli_terms("a dataset named 'd' exists already; choose another name, or send overwrite=true")
    "a dataset named 'd' exists already; choose another name, or pass --overwrite"
    >>> cli_terms("no job with id 'x'; list the jobs with GET /api/jobs")
    "no job with id 'x'; list the jobs with distbelief status"
    >>> cli_terms("job 1f is running; cancel it first (POST /api/jobs/1f/cancel)")
    'job 1f is running; cancel it first (distbelief cancel 1f)'
    >>> cli_terms("cancel them first (POST /api/jobs/{{id}}/cancel)")
    'cancel them first (distbelief cancel ID)'
    """
    for pattern, replacement in _CLI_TERMS:
        message = pattern.sub(replacement, message)
    return message


def _submit(args: argparse.Namespace) -> int:
    try:
        with open(args.job, encoding="utf-8") as fh:
            spec = json.load(fh)
    except OSError as exc:
        raise InvalidOptionError(f"cannot read {args.job}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidOptionError(
            f"{args.job} is not valid JSON ({exc}); write the body of POST /api/jobs"
        ) from exc
    if not isinstance(spec, dict):
        raise InvalidOptionError(
            f"{args.job} holds {type(spec).__name__ if spec is not None else 'null'}, not a JSON object; "
            'write the body of POST /api/jobs: {"algorithm": ..., "dataset": ..., "model": {...}, ...}'
        )
    with _client(args) as client:
        job = client.submit(spec)
        print(f"submitted job {job['id']} ({job['algorithm']} on {job['dataset']})", flush=True)
        if not args.wait:
            return 0
        job = client.wait(job["id"])
    _print_job(job)
    return 0 if job["status"] == "succeeded" else 1


def _print_job(job: dict[str, Any]) -> None:
    if isinstance(job.get("message"), str):  # what it says to do, in the CLI's terms
        job = {**job, "message": cli_terms(job["message"])}
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
    # The same objective for every algorithm: F(w) on the training data (Downpour's running mini-batch loss is
    # in its metrics, not here).
    widths = (16, 9, 17, 16, -6, -12, None)
    print(_line(("id", "status", "algorithm", "dataset", "iter", "F(w) train", "created"), widths))
    for j in jobs:
        value = (j.get("result") or {}).get("objective", (j.get("latest") or {}).get("objective"))
        shown = f"{value:.6g}" if isinstance(value, float) else ""
        cells = (j["id"], j["status"], j["algorithm"], j["dataset"][:16], j["iterations"], shown)
        print(_line((*cells, j["created_at"][:19]), widths))
    return 0


def _line(cells: Sequence[Any], widths: Sequence[int | None], sep: str = "  ") -> str:
    """A line of a table: each cell padded to its width, right-aligned where the width is negative (numbers);
    a width of None leaves the cell as it is (the last column).

    Examples
    --------
    >>> _line(("id", 3, "2026-01-01"), (4, -3, None))
    'id      3  2026-01-01'
    """
    return sep.join(
        str(c) if w is None else f"{c:>{-w}}" if w < 0 else f"{c:<{w}}"
        for c, w in zip(cells, widths, strict=True)
    )


def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.id)
        if job["status"] == "cancelled":
            print(f"cancelled job {job['id']}")
            return 0
        if not args.wait:
            jid = job["id"]
            print(
                f"job {jid} is {job['status']}: it stops after its current iteration "
                f"(`distbelief status {jid}` shows when; `distbelief cancel --wait {jid}` waits for it)"
            )
            return 0
        job = client.wait(job["id"], progress=False)
    print(f"job {job['id']} ended {job['status']}" + (f": {job['message']}" if job.get("message") else ""))
    return 0 if job["status"] == "cancelled" else 1


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete(args.id)
    print(f"deleted job {args.id} and what it stored")
    return 0


def metrics_table(dim: str, columns: dict[str, list[float | None]]) -> str:
    """A job's metrics as a text table: one row per iteration or step, one column per metric.

    Examples
    --------
    >>> columns = {"iteration": [0, 1], "objective": [0.69, 0.25], "gnorm": [1.5, None]}
    >>> print(metrics_table("iteration", columns))
    iteration     objective         gnorm
            0          0.69           1.5
            1          0.25             -
    """
    names = list(columns)
    widths = [-max(len(name), 9 if j == 0 else 12) for j, name in enumerate(names)]
    lines = [_line(names, widths)]
    for row in zip(*columns.values(), strict=True):
        cells = ["-" if v is None else (f"{int(v)}" if j == 0 else f"{v:.6g}") for j, v in enumerate(row)]
        lines.append(_line(cells, widths))
    return "\n".join(lines)


def _metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.csv is None:
            body = client.metrics_columns(args.id)
            columns = body["columns"]
            if not columns or not next(iter(columns.values())):
                print(f"job {args.id} has no metrics yet")
            else:
                print(metrics_table(body["dim"], columns))
            return 0
        text = client.metrics_csv(args.id)
    rows = max(text.count("\n") - 1, 0)
    if args.csv == "-":
        sys.stdout.write(text)
        return 0
    _write_file(args.csv, text.encode("utf-8"))
    print(f"wrote {rows} rows of job {args.id}'s metrics to {args.csv}")
    return 0


def _params(args: argparse.Namespace) -> int:
    with _client(args) as client:
        content, status = client.params_file(args.id)
    _write_file(args.output, content)
    how = "" if status in (None, "succeeded") else f" (the job ended {status}: these are where it stopped)"
    print(f"wrote job {args.id}'s parameters to {args.output}{how}; numpy.load reads them")
    return 0


def _write_file(path: str, content: bytes) -> None:
    """Write ``content`` to ``path`` whole or not at all (a temporary file renamed into place)."""
    target = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(target), f".distbelief-{uuid.uuid4().hex}.part")
    try:
        # A new file, as mkstemp makes, but with the mode open() gives (the umask's), not mkstemp's 0600.
        fh = open(tmp, "xb")  # noqa: SIM115
    except OSError as exc:
        raise InvalidOptionError(
            f"cannot write {path}: {exc.strerror or exc}; pick a writable folder (-o/--csv)"
        ) from exc
    try:
        with fh:
            fh.write(content)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise InvalidOptionError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _datasets_upload(args: argparse.Namespace) -> int:
    from pathlib import Path

    path = Path(args.file)
    if path.suffix.lower() not in (".npz", ".csv"):
        raise InvalidOptionError(f"{args.file} is neither .npz (with arrays X and y) nor .csv: upload one")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise InvalidOptionError(f"cannot read {args.file}: {exc.strerror or exc}") from exc
    name = args.name or path.stem
    with _client(args) as client:
        ds = client.upload_file(
            name, content, filename=path.name, label_column=args.label_column, overwrite=args.overwrite
        )
    shape = f"{ds['n_rows']} rows x {ds['n_features']} features"
    print(f"uploaded {ds['name']}: {shape} ({ds['label_kind']} labels)")
    return 0


def _datasets_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        datasets = client.datasets()
    if not datasets:
        print("no datasets (add one with: distbelief datasets upload FILE)")
        return 0
    widths = (24, -9, -8, 13, 10, None)
    print(_line(("name", "rows", "features", "labels", "source", "created"), widths))
    for d in datasets:
        labels = d["label_kind"] + (f" ({d['n_classes']})" if d.get("n_classes") else "")
        cells = (d["name"][:24], d["n_rows"], d["n_features"], labels[:13], d["source"], d["created_at"][:19])
        print(_line(cells, widths))
    return 0


def _datasets_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.dataset(args.name), indent=2, sort_keys=True))
    return 0


def _datasets_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_dataset(args.name)
    print(f"deleted dataset {args.name}")
    return 0


# ------------------------------------------------------------------------------------------------ demo


def _demo(args: argparse.Namespace) -> int:
    import numpy as np
    import scipy.optimize
    from threadpoolctl import threadpool_limits

    from distbelief import models
    from distbelief.api.client import Client
    from distbelief.api.main import create_app
    from distbelief.storage import digits_dataset

    from ._server import BackgroundServer

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
        with _quiet_ctrl_c(settings):  # (the workers ignore Ctrl-C: the service stops them)
            server = BackgroundServer(create_app(settings))
            url = server.start()
            try:
                with Client(url) as client:
                    print(f"dashboard: {url}/  (REST API {url}/api, OpenAPI {url}/docs)", flush=True)
                    client.upload_dataset("digits-train", X_tr, y_tr, overwrite=True)
                    client.upload_dataset("digits-test", X_te, y_te, overwrite=True)
                    # A first job pays for imports and first actors on fresh workers: not in the table.
                    warm = {"algorithm": "sandblaster-lbfgs", "dataset": "digits-train", "model": spec}
                    warm_job = client.submit({**warm, "options": {"maxiter": 2}, "name": "demo: warm-up"})
                    client.wait(warm_job["id"], progress=False)
                    adagrad = demo_downpour_options(
                        lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, l2=l2
                    )
                    runs: list[tuple[str, dict[str, Any]]] = [
                        ("Sandblaster L-BFGS", {"algorithm": "sandblaster-lbfgs", "options": {"l2": l2}}),
                        ("Downpour Adagrad", {"algorithm": "downpour-sgd", "options": adagrad}),
                    ]
                    rows = []
                    for label, job in runs:
                        body = {**warm, "eval_dataset": "digits-test", "name": f"demo: {label}", **job}
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
                for label, record, _, _ in rows:
                    # A run's own warnings (a stalled step rule) would otherwise show on its job page only.
                    warning = str(record.get("message") or "").partition("; warning: ")[2]
                    if warning:
                        print(f"{label}: warning: {warning}", flush=True)
                print(f"\ndashboard: {url}/", flush=True)
                if args.keep:
                    serve_until_interrupted(url)  # returns on Ctrl-C
                    _silence_shutdown()  # the line it printed is the last one
            except KeyboardInterrupt:  # Ctrl-C before: main() says "interrupted", nothing else does
                _silence_shutdown()
                raise
            finally:
                server.stop()
    failed = [
        label
        for label, record, _, _ in rows
        if record["status"] != "succeeded" and "not available" not in str(record.get("message"))
    ]
    return 1 if failed else 0


#: The demo's Downpour defaults: digits softmax (1,438 rows), 2 replicas of Adagrad. They end within ~3% of
#: the batch optimum (held-out accuracy ~0.95, as L-BFGS) in ~1 s, with the gradient norm at 0.030-0.041 of
#: its start (24 runs, seeds 0-5), under the 0.05 of downpour's stall check. The earlier 0.1 x 20 epochs of
#: 32 rows stopped at ~0.31 with the objective flat and the gradient at 0.15: a StepRuleStallWarning in 6 of
#: 7 runs (issue 27); 300 epochs of 32-256 rows still ended at 0.04-0.06 of it on some seeds (the mini-batch
#: noise; a higher rate only raises it).
DEMO_LR = 0.3
DEMO_EPOCHS = 600
#: Mini-batches of 512 rows (of a replica's ~719): little gradient noise at the end.
DEMO_BATCH_SIZE = 512


def demo_downpour_options(
    *, lr: float = DEMO_LR, epochs: int = DEMO_EPOCHS, batch_size: int = DEMO_BATCH_SIZE, l2: float = 1e-3
) -> dict[str, Any]:
    """The options of the demo's Downpour job (``distbelief demo --lr --epochs --batch-size``).

    Examples
    --------
    >>> demo_downpour_options()
    {'rule': 'adagrad', 'lr': 0.3, 'replicas': 2, 'epochs': 600, 'batch_size': 512, 'l2': 0.001}
    """
    return {"rule": "adagrad", "lr": lr, "replicas": 2, "epochs": epochs, "batch_size": batch_size, "l2": l2}


def serve_until_interrupted(url: str, sleep: Callable[[float], None] = time.sleep) -> None:
    """Say that the service at ``url`` keeps serving, and wait for Ctrl-C.

    Examples
    --------
    >>> def ctrl_c(seconds: float) -> None:
    ...     raise KeyboardInterrupt
    >>> serve_until_interrupted("http://127.0.0.1:8000", sleep=ctrl_c)
    serving the dashboard at http://127.0.0.1:8000/ until Ctrl-C (distbelief demo --no-keep exits here)
    stopping the service ...
    """
    print(f"serving the dashboard at {url}/ until Ctrl-C (distbelief demo --no-keep exits here)", flush=True)
    try:
        while True:
            sleep(3600)
    except KeyboardInterrupt:
        print("stopping the service ...", flush=True)


def _seconds(start: str | None, end: str | None) -> float:
    """Seconds between two ISO timestamps of a job record (NaN if either is missing)."""
    import datetime as dt

    if not start or not end:
        return float("nan")
    return (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()


def _print_table(
    rows: list[Any], model: BuiltIn, X_tr: Any, y_tr: Any, X_te: Any, y_te: Any, l2: float
) -> None:
    import numpy as np

    from distbelief import models

    print()
    titles = ("method", "status", "iter/steps", "wall s", "F(w) train", "held-out acc")
    widths = (28, 10, -10, -8, -12, -12)
    print(_line(titles, widths, " "))
    for label, record, wall, w in rows:
        head = _line((label, record["status"], record.get("iterations", 0), f"{wall:.2f}"), widths[:4], " ")
        if w is None:
            print(f"{head}   {record.get('message') or ''}")
            continue
        f, _ = models.objective(model, w, X_tr, y_tr, l2=l2)
        print(f"{head} {f:12.6f} {float(np.mean(model.predict(w, X_te) == y_te)):12.4f}")


# ------------------------------------------------------------------------------------------------ main


def _client_options(parser: argparse.ArgumentParser) -> None:
    default_url = os.environ.get("DISTBELIEF_URL", DEFAULT_URL)
    parser.add_argument(
        "--url",
        default=default_url,
        help=f"the service's URL (default DISTBELIEF_URL or {DEFAULT_URL}); token from DISTBELIEF_API_TOKEN",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for each answer of the service (default {DEFAULT_TIMEOUT:g})",
    )


#: The positional arguments that several subcommands take, and their help.
_POSITIONALS = {
    "id": "the job's id (distbelief status lists them)",
    "name": "the dataset's name (distbelief datasets list lists them)",
    "file": "the .npz or .csv file",
}


def _parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command; the subcommands' copy must not reset the main one.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of failures"
    )
    parser = argparse.ArgumentParser(
        prog="distbelief", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of failures")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(
        group: Any, name: str, func: Callable[[argparse.Namespace], int], text: str, *args: str
    ) -> argparse.ArgumentParser:
        """A subcommand of the service's client: its positional ``args`` (of :data:`_POSITIONALS`), then
        ``--url`` and ``--timeout``."""
        cmd: argparse.ArgumentParser = group.add_parser(name, parents=[common], help=text)
        for arg in args:
            cmd.add_argument(arg, help=_POSITIONALS[arg])
        _client_options(cmd)
        cmd.set_defaults(func=func)
        return cmd

    serve = sub.add_parser(
        "serve", parents=[common], help="run the REST API and dashboard (embedded cluster unless --scheduler)"
    )
    serve.add_argument("--host", help="address to listen on (default DISTBELIEF_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default DISTBELIEF_PORT or 8000)")
    serve.add_argument("--store", help="directory or fsspec URL of the store (default DISTBELIEF_STORE)")
    serve.add_argument("--scheduler", help="Dask scheduler address, e.g. tcp://host:8786 (default: embedded)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    serve.set_defaults(func=_serve)

    submit = command(sub, "submit", _submit, "submit a job from a JSON file (the body of POST /api/jobs)")
    submit.add_argument("job", help="path of the JOB.json file")
    submit.add_argument("--wait", action="store_true", help="wait for the job with a progress bar")
    status = command(sub, "status", _status, "list the jobs, or show one")
    status.add_argument("id", nargs="?", help="a job id (default: list every job)")
    cancel = command(
        sub, "cancel", _cancel, "cancel a queued job, or stop a running one after its iteration", "id"
    )
    cancel.add_argument("--wait", action="store_true", help="wait until a running job has stopped")
    command(sub, "delete", _delete, "delete a finished job and what it stored", "id")
    metrics = command(
        sub, "metrics", _metrics, "show a job's metrics as a table, or write them as CSV (--csv)", "id"
    )
    metrics.add_argument("--csv", metavar="FILE", help="write a CSV file instead of the table (- for stdout)")
    params = command(
        sub, "params", _params, "save the parameters a finished job ended with as a .npy file", "id"
    )
    params.add_argument(
        "-o", "--output", required=True, metavar="FILE.npy", help="the file to write (numpy.load reads it)"
    )

    datasets = sub.add_parser("datasets", parents=[common], help="upload, list, show and delete datasets")
    dsub = datasets.add_subparsers(dest="datasets_command", required=True)
    upload = command(
        dsub, "upload", _datasets_upload, "upload an .npz (arrays X and y) or a CSV file as a dataset", "file"
    )
    upload.add_argument("--name", help="the dataset's name (default: the file's name without its suffix)")
    upload.add_argument(
        "--label-column", help="a CSV file's label column, by name or number (default: the last one)"
    )
    upload.add_argument("--overwrite", action="store_true", help="replace a dataset of the same name")
    command(dsub, "list", _datasets_list, "list the datasets")
    command(dsub, "show", _datasets_show, "show one dataset as JSON", "name")
    command(
        dsub, "delete", _datasets_delete, "delete an uploaded dataset, or forget a registered one", "name"
    )

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="run Sandblaster and Downpour on the digits through the embedded service, then keep serving "
        "its dashboard until Ctrl-C",
    )
    demo.add_argument("--l2", type=float, default=1e-3, help="L2 regularization (default 1e-3)")
    demo.add_argument(
        "--lr", type=float, default=DEMO_LR, help=f"Downpour Adagrad learning rate (default {DEMO_LR:g})"
    )
    demo.add_argument(
        "--epochs", type=int, default=DEMO_EPOCHS, help=f"Downpour epochs (default {DEMO_EPOCHS})"
    )
    demo.add_argument(
        "--batch-size",
        type=int,
        default=DEMO_BATCH_SIZE,
        help=f"Downpour mini-batch rows (default {DEMO_BATCH_SIZE})",
    )
    demo.add_argument("--scheduler", help="use this Dask scheduler instead of an embedded cluster")
    demo.add_argument("--store", help="keep the store here (default: a temporary directory)")
    demo.add_argument(
        "--keep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep serving the dashboard until Ctrl-C (default); --no-keep exits after the table",
    )
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distbelief`` console script; returns the exit code.

    Examples
    --------
    >>> main(["status", "--url", "http://127.0.0.1:9"])   # doctest: +SKIP
    distbelief: cannot reach the service at http://127.0.0.1:9 ([Errno 111] Connection refused): ...
    1
    """
    args = _parser().parse_args(argv)
    from distbelief.errors import DistbeliefError

    def fail(message: str, code: int = 1) -> int:
        print(f"distbelief: {message}", file=sys.stderr)
        return code

    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except InvalidOptionError as exc:  # a bad argument, file or setting: the usage exit code
        if args.debug:
            raise
        return fail(str(exc), 2)
    except Exception as exc:
        if args.debug:
            raise
        url = getattr(args, "url", None)
        explained = explain(exc, url, getattr(args, "timeout", DEFAULT_TIMEOUT)) if url else None
        if explained is not None:
            return fail(explained)
        if _is_validation_error(exc):
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                for e in exc.errors(include_url=False)  # type: ignore[attr-defined]
            )
            return fail(f"bad settings: {problems}", 2)
        if isinstance(exc, DistbeliefError | OSError | TimeoutError):
            return fail(str(exc) or type(exc).__name__)
        return fail(f"unexpected {type(exc).__name__}: {exc}; run again with --debug for the traceback", 3)


def _is_validation_error(exc: BaseException) -> bool:
    """Whether ``exc`` is pydantic's ``ValidationError`` (bad settings), without importing pydantic for
    commands that never load it."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError)


if __name__ == "__main__":
    sys.exit(main())
