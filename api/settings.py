"""The service's settings: one pydantic-settings object read from ``DISTBELIEF_*`` environment variables."""

from __future__ import annotations

import importlib.metadata
import secrets
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from distbelief.errors import InvalidOptionError
from distbelief.storage import is_loopback

__all__ = [
    "MIN_TOKEN_LENGTH",
    "Settings",
    "bearer_token",
    "check_exposure",
    "is_loopback",
    "tokens_equal",
    "version",
]

#: A shorter bearer token is refused: it could be guessed.
MIN_TOKEN_LENGTH = 16


class Settings(BaseSettings):
    """Everything the service reads from its environment (prefix ``DISTBELIEF_``).

    Attributes
    ----------
    store : str
        Directory or fsspec URL that holds datasets, job records, metrics, checkpoints and results
        (``DISTBELIEF_STORE``). Workers of an external cluster must see the same path.
    scheduler : str or None
        Address of a Dask scheduler (``tcp://host:8786``); ``None`` starts an embedded ``LocalCluster``.
    n_workers : int
        Workers of the embedded cluster.
    api_token : SecretStr or None
        Bearer token that guards every ``/api`` route but ``/api/health`` (``DISTBELIEF_API_TOKEN``).
        Required on any address but loopback.
    host, port : str, int
        Where ``distbelief serve`` listens.
    max_upload_bytes : int
        Largest dataset upload accepted (a larger body gets 413 before it is stored); also the most bytes
        the arrays of an uploaded ``.npz`` may hold once decompressed (checked from the archive's headers
        before anything is decompressed).
    max_body_bytes : int
        Largest body of any other request.
    header_timeout_seconds : float
        A connection whose request headers are not complete this long after it opened (or after the first
        byte of a further request on it) is closed (408): slow clients cannot hold connections open.
    max_connections : int
        Connections served at once; one more is refused at once (503). Lowered to half the process's
        file-descriptor limit if that is smaller, so the cluster's comms and the store keep the other half.
    max_concurrent_jobs : int
        Jobs that run at once; the others wait in the queue.
    max_queued_jobs : int
        Jobs that may wait; a submission beyond that gets 503.
    checkpoint_every : int
        Default of the Sandblaster option of that name for jobs: a job checkpoints every this many
        iterations, so it can resume after a restart of the server.
    metrics_flush_seconds : float
        A running job writes its metrics to the store at most this often (and once at the end).
    dask_dashboard_url : str or None
        Link to the Dask dashboard shown by the web dashboard (default: found from the scheduler).
    dask_dashboard_address : str or None
        Where the embedded cluster's Dask dashboard listens (``host:port``), or ``off``. Default: a free
        port on ``host`` when that is a loopback address, else off (the Dask dashboard has no
        authentication: it must not be where the token guards the API).
    max_params : int
        Largest model (parameters) a job may train; a bigger one is refused at submit with 422.
    max_layers : int
        Most entries of an MLP's ``layer_sizes`` (input, hidden and output layers).
    max_layer_width : int
        Widest layer (entry of ``layer_sizes``, feature or class count) a model may have.
    max_pass_flops : float
        Most floating-point operations one pass over a job's training data may take (about
        ``6 * n_rows * n_params``): a bound on the time of one iteration.
    job_memory_fraction : float
        A job is refused if one of its parameter-server shards or model replicas would need more than this
        fraction of the smallest worker's ``memory_limit``.
    register_schemes : list of str
        URL schemes of existing datasets that ``POST /api/datasets`` may register (remote object stores
        only: a local path outside the store is never accepted).

    Examples
    --------
    >>> Settings(store="/tmp/db", max_concurrent_jobs=4).max_concurrent_jobs
    4
    """

    model_config = SettingsConfigDict(env_prefix="DISTBELIEF_", extra="ignore")

    store: str = "~/.distbelief/store"
    scheduler: str | None = None
    n_workers: Annotated[int, Field(ge=1, le=64)] = 2
    api_token: SecretStr | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    max_upload_bytes: Annotated[int, Field(ge=1024)] = 256 * 2**20
    max_body_bytes: Annotated[int, Field(ge=1024)] = 2**20
    header_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 5.0
    max_connections: Annotated[int, Field(ge=1)] = 1000
    max_concurrent_jobs: Annotated[int, Field(ge=1, le=64)] = 2
    max_queued_jobs: Annotated[int, Field(ge=1)] = 1000
    checkpoint_every: Annotated[int, Field(ge=0)] = 20
    metrics_flush_seconds: Annotated[float, Field(gt=0)] = 1.0
    dask_dashboard_url: str | None = None
    dask_dashboard_address: str | None = None
    max_params: Annotated[int, Field(ge=1)] = 100_000_000
    max_layers: Annotated[int, Field(ge=2)] = 100
    max_layer_width: Annotated[int, Field(ge=2)] = 1_000_000
    max_pass_flops: Annotated[float, Field(gt=0)] = 1e13
    job_memory_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    register_schemes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["s3", "gs", "gcs", "abfs", "az"]
    )

    @field_validator("api_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"DISTBELIEF_API_TOKEN must be at least {MIN_TOKEN_LENGTH} characters; make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @field_validator("api_token", "scheduler", "dask_dashboard_url", "dask_dashboard_address", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # DISTBELIEF_API_TOKEN= (set but empty) must not count as a token, nor an empty address as one.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("register_schemes", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        # From the environment the list is a comma-separated string: "s3,gs".
        if isinstance(value, str):
            return [s.strip().lower() for s in value.split(",") if s.strip()]
        return value


def check_exposure(settings: Settings) -> None:
    """Refuse to serve on a non-loopback address without a bearer token.

    Raises
    ------
    distbelief.errors.InvalidOptionError
        If ``settings.host`` is reachable from other machines and no token is set.

    Examples
    --------
    >>> check_exposure(Settings(host="0.0.0.0"))
    Traceback (most recent call last):
    ...
    distbelief.errors.InvalidOptionError: refusing to listen on 0.0.0.0 without a token: ...
    """
    if settings.api_token is None and not is_loopback(settings.host):
        raise InvalidOptionError(
            f"refusing to listen on {settings.host} without a token: anyone who can reach it could run jobs. "
            "Set DISTBELIEF_API_TOKEN (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))') "
            "or listen on 127.0.0.1"
        )


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization`` header's value ``Bearer <token>`` (the scheme in any case, the
    token stripped, as FastAPI's ``HTTPBearer`` reads it), or None: the one parser of the service's routes
    (:func:`api.deps.require_token`) and of its fast path (``api._fastpath``).

    Examples
    --------
    >>> bearer_token("bearer  abc "), bearer_token("Basic abc"), bearer_token("Bearer"), bearer_token(None)
    ('abc', None, None, None)
    """
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def tokens_equal(given: str, expected: SecretStr) -> bool:
    """Compare a presented token with the configured one in constant time.

    Examples
    --------
    >>> tokens_equal("a" * 16, SecretStr("a" * 16)), tokens_equal("b", SecretStr("a" * 16))
    (True, False)
    """
    return secrets.compare_digest(given.encode("utf-8"), expected.get_secret_value().encode("utf-8"))


def version() -> str:
    """The installed version of distbelief.

    Examples
    --------
    >>> isinstance(version(), str)
    True
    """
    try:
        return importlib.metadata.version("distbelief")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
