"""``api.client.Client``: the Python client of the REST API (httpx); :meth:`Client.wait` shows progress.

Examples
--------
>>> from distbelief.api.client import Client
>>> from distbelief.storage import load_digits
>>> X, y = load_digits()
>>> with Client("http://127.0.0.1:8000") as c:                                      # doctest: +SKIP
...     c.upload_dataset("digits", X, y)
...     job = c.submit({"algorithm": "sandblaster-lbfgs", "dataset": "digits",
...                     "model": {"kind": "softmax", "n_features": 64, "n_classes": 10},
...                     "options": {"l2": 1e-3}})
...     c.wait(job["id"])["status"], c.params(job["id"]).shape
('succeeded', (650,))
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import numpy as np
import numpy.typing as npt

from distbelief.errors import DistbeliefError, InvalidOptionError

if TYPE_CHECKING:  # xarray (and pandas under it) load in Client.metrics only: `distbelief status` stays quick
    import xarray as xr

__all__ = ["ApiError", "Client"]

FINAL = ("succeeded", "failed", "cancelled")


class ApiError(DistbeliefError):
    """The server refused a request; ``detail`` is its message, ``status_code`` the HTTP status.

    Examples
    --------
    >>> err = ApiError(422, "option 'history': Input should be greater than or equal to 1, got 0")
    >>> err.status_code, str(err)
    (422, "HTTP 422: option 'history': Input should be greater than or equal to 1, got 0")
    """

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class Client(contextlib.AbstractContextManager["Client"]):
    """Talks to a distbelief service (a context manager: :meth:`close` on exit).

    Parameters
    ----------
    base_url : str
        Where the service listens, e.g. ``"http://127.0.0.1:8000"``.
    token : str, optional
        The bearer token (``DISTBELIEF_API_TOKEN`` of the server).
    timeout : float
        Seconds to wait for one HTTP response.
    transport : httpx.BaseTransport, optional
        A custom transport (tests).

    Examples
    --------
    >>> c = Client("http://127.0.0.1:8000", token="...")   # doctest: +SKIP
    >>> [j["status"] for j in c.jobs()]                     # doctest: +SKIP
    ['succeeded']
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ApiError(response.status_code, _detail(response))
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        # Every answer of the service is a JSON object.
        body: dict[str, Any] = self._request(method, path, **kwargs).json()
        return body

    # -- datasets -----------------------------------------------------------------------------------
    def upload_dataset(
        self, name: str, X: npt.ArrayLike, y: npt.ArrayLike, *, overwrite: bool = False
    ) -> dict[str, Any]:
        """Upload ``X`` and ``y`` as the dataset ``name`` (sent as an ``.npz`` file).

        Examples
        --------
        >>> c.upload_dataset("tiny", [[0.0, 1.0], [1.0, 0.0]], [0, 1])["n_rows"]   # doctest: +SKIP
        2
        """
        buf = io.BytesIO()
        np.savez(buf, X=np.asarray(X, dtype=np.float64), y=np.asarray(y, dtype=np.float64))
        return self.upload_file(name, buf.getvalue(), filename=f"{name}.npz", overwrite=overwrite)

    def upload_file(
        self,
        name: str,
        content: bytes,
        *,
        filename: str,
        label_column: str | int | None = None,
        overwrite: bool = False,
    ) -> dict[str, Any]:
        """Upload an ``.npz`` (arrays ``X``, ``y``) or CSV file's bytes as the dataset ``name``.

        Examples
        --------
        >>> csv = b"a,b,y\\n1,2,0\\n3,4,1\\n"
        >>> c.upload_file("t", csv, filename="t.csv", label_column="y")["n_rows"]  # doctest: +SKIP
        2
        """
        data = {"name": name, "overwrite": "true" if overwrite else "false"}
        if label_column is not None:
            data["label_column"] = str(label_column)
        return self._json("POST", "/api/datasets", data=data, files={"file": (filename, content)})

    def register_dataset(self, name: str, url: str) -> dict[str, Any]:
        """Register an existing dataset (in the server's store, or a remote object store) as ``name``."""
        return self._json("POST", "/api/datasets", json={"name": name, "url": url})

    def datasets(self) -> list[dict[str, Any]]:
        """Every dataset the server has."""
        return list(self._json("GET", "/api/datasets")["data"])

    def dataset(self, name: str) -> dict[str, Any]:
        """One dataset."""
        return self._json("GET", f"/api/datasets/{_segment(name, 'dataset name')}")

    def delete_dataset(self, name: str) -> None:
        """Delete an uploaded dataset (or forget a registered one)."""
        self._request("DELETE", f"/api/datasets/{_segment(name, 'dataset name')}")

    # -- jobs ---------------------------------------------------------------------------------------
    def submit(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Submit a job: ``{"algorithm", "dataset", "model", "options", ...}`` as for ``POST /api/jobs``.

        An option given as an options object of the Python API (``downpour.Compression(tau=0.01)``) is sent
        as its JSON form (``{"tau": 0.01}``), so ``options`` can be the keyword arguments of
        ``downpour.train`` as they are.

        Examples
        --------
        >>> c.submit({"algorithm": "sandblaster-gd", "dataset": "tiny",
        ...           "model": {"kind": "logistic", "n_features": 2}})["status"]   # doctest: +SKIP
        'queued'
        >>> c.submit({"algorithm": "downpour-sgd", "dataset": "tiny",
        ...           "model": {"kind": "logistic", "n_features": 2},
        ...           "options": {"epochs": 2, "fuse": False, "max_coalesce": 4,
        ...                       "compression": downpour.Compression(tau=0.05)}})   # doctest: +SKIP
        """
        body = dict(spec)
        if isinstance(body.get("options"), Mapping):
            body["options"] = {k: _json_option(v) for k, v in body["options"].items()}
        return self._json("POST", "/api/jobs", json=body)

    def jobs(self, *, status: str | None = None, limit: int = 1000, offset: int = 0) -> list[dict[str, Any]]:
        """Jobs, newest first (optionally only those with ``status``)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status is not None:
            params["status"] = status
        return list(self._json("GET", "/api/jobs", params=params)["data"])

    def job(self, job_id: str) -> dict[str, Any]:
        """One job's record."""
        return self._json("GET", _job(job_id))

    def wait(
        self, job_id: str, timeout: float | None = None, *, progress: bool = True, poll: float = 0.25
    ) -> dict[str, Any]:
        """Wait until the job has finished and return its record, with a progress bar on stderr.

        Raises
        ------
        TimeoutError
            The job has not finished within ``timeout`` seconds (it goes on running).
        """
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        record = self.job(job_id)
        label = f"{record['algorithm']} {job_id[:8]}"
        with tqdm(
            total=record.get("max_iterations"), desc=label, unit="it", disable=not progress, leave=True
        ) as bar:
            while True:
                done = int(record.get("iterations") or 0)
                if done != bar.n:
                    bar.update(done - bar.n)
                latest = record.get("latest") or {}
                value = latest.get("objective")
                bar.set_postfix_str(
                    f"{record['status']}" + (f", F(w) {value:.6g}" if value is not None else ""),
                    refresh=False,
                )
                if record["status"] in FINAL:
                    bar.refresh()
                    return record
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} is still {record['status']} after {timeout} s")
                time.sleep(poll)
                record = self.job(job_id)

    def metrics_columns(self, job_id: str) -> dict[str, Any]:
        """The job's metrics as the service sends them: ``{"dim", "columns": {name: [value or None, ...]}}``
        (the first column indexes the rows); no xarray needed.

        Examples
        --------
        >>> c.metrics_columns(job_id)["columns"]["objective"][-1]   # doctest: +SKIP
        0.2639
        """
        return self._json("GET", f"{_job(job_id)}/metrics")

    def metrics_csv(self, job_id: str) -> str:
        """The job's metrics as CSV text: a header of metric names, then one row per iteration or step."""
        path = f"{_job(job_id)}/metrics"
        return self._request("GET", path, params={"format": "csv"}).text

    def metrics(self, job_id: str) -> xr.Dataset:
        """The job's metrics as an ``xarray.Dataset`` (one variable per metric, indexed by iteration/step).

        Examples
        --------
        >>> c.metrics(job_id).objective.values[-1]   # doctest: +SKIP
        0.2639
        """
        body = self.metrics_columns(job_id)
        return _metrics_dataset(body["dim"], body["columns"])

    def params(self, job_id: str) -> np.ndarray:
        """The parameters the job ended with."""
        data, _ = self.params_file(job_id)
        return np.asarray(np.load(io.BytesIO(data), allow_pickle=False))

    def params_file(self, job_id: str) -> tuple[bytes, str | None]:
        """The parameters the job ended with as the bytes of a ``.npy`` file, and how the job ended (a failed
        job that saved parameters serves them too).

        Examples
        --------
        >>> data, status = c.params_file(job_id)   # doctest: +SKIP
        >>> status, np.load(io.BytesIO(data)).shape   # doctest: +SKIP
        ('succeeded', (650,))
        """
        response = self._request("GET", f"{_job(job_id)}/params")
        return response.content, response.headers.get("X-Job-Status")

    def estimator(self, job_id: str, **params: Any) -> Any:
        """A finished job as a fitted scikit-learn estimator (``distbelief.sklearn``), ready to predict.

        :func:`distbelief.sklearn.from_model` of the job's model spec and parameters (classes
        ``0..n_classes-1``); ``params`` are estimator options (``client=``, ``C=``, ...) for refitting.

        Raises
        ------
        ApiError
            The job has not succeeded (409) or does not exist (404).

        Examples
        --------
        >>> est = c.estimator(job_id)             # doctest: +SKIP
        >>> est.predict(X[:3]), est.score(X, y)   # doctest: +SKIP
        (array([0, 1, 2]), 0.99)
        """
        from distbelief.sklearn import from_model

        record = self.job(job_id)
        if record.get("status") != "succeeded":
            raise ApiError(
                409,
                f"job {job_id} is {record.get('status')}, not succeeded: only a finished job has parameters "
                "to build an estimator from; wait for it (Client.wait) or pick a succeeded job",
            )
        nit = int((record.get("result") or {}).get("nit") or record.get("iterations") or 0)
        return from_model(record["model"], self.params(job_id), n_iter=nit, **params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running job."""
        return self._json("POST", f"{_job(job_id)}/cancel")

    def delete(self, job_id: str) -> None:
        """Delete a finished job and what it stored."""
        self._request("DELETE", _job(job_id))

    def events(self, job_id: str) -> Iterator[tuple[str, Any]]:
        """Follow the job's server-sent events: ``(event, data)`` pairs until it has finished."""
        import json

        with self._http.stream("GET", f"{_job(job_id)}/events", timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise ApiError(response.status_code, _detail(response))
            event, data = "message", []
            for line in response.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    yield event, json.loads("\n".join(data))
                    event, data = "message", []

    # -- service ------------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """The built-in model kinds and their spec schemas."""
        return list(self._json("GET", "/api/models")["data"])

    def cluster(self) -> dict[str, Any]:
        """Scheduler, workers, shards and replicas."""
        return self._json("GET", "/api/cluster")

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "version": ...}``."""
        return self._json("GET", "/api/health")


def _metrics_dataset(dim: str, columns: Mapping[str, list[float | None]]) -> xr.Dataset:
    """Metrics as the service sends them, one list per column (the first indexes the rows; null is a missing
    value), as an ``xarray.Dataset`` with one variable per metric.

    Examples
    --------
    >>> ds = _metrics_dataset("iteration", {"iteration": [0, 1], "objective": [2.0, None]})
    >>> ds.objective.values.tolist(), ds.iteration.values.tolist()
    ([2.0, nan], [0, 1])
    """
    import xarray as xr  # here only: the client's other calls (and `distbelief status`) do without it

    (_, index), *metrics = columns.items()
    return xr.Dataset(
        {name: (dim, np.array(values, dtype=np.float64)) for name, values in metrics},
        coords={dim: np.asarray(index, dtype=np.int64)},
    )


def _json_option(value: Any) -> Any:
    """An option value as JSON: an options dataclass (``downpour.Compression``) as the dict of its fields.

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Compression:
    ...     tau: float
    >>> _json_option(Compression(tau=0.5)), _json_option(3)
    ({'tau': 0.5}, 3)
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _job(job_id: str) -> str:
    """The path of a job's routes."""
    return f"/api/jobs/{_segment(job_id, 'job id')}"


def _segment(value: str, what: str) -> str:
    """``value`` as one escaped path segment: a job id or dataset name never reaches another route
    (``"../datasets/digits"`` as a job id would have made ``delete`` delete a dataset).

    Examples
    --------
    >>> _segment("../datasets/d", "job id")
    '..%2Fdatasets%2Fd'
    """
    text = str(value)
    if text in ("", ".", ".."):
        raise InvalidOptionError(f"{what} {text!r} is not valid; pass the {what} the server gave")
    return quote(text, safe="")


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else str(detail)
    return str(body)
