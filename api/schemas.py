"""Request and response bodies of the REST API: ``*Create`` models come in, ``*Public`` models go out.

Bounds here are the first line against absurd input (a billion replicas, ``history=0``, ``lr=-1``); the
algorithms check their options again when a job is submitted, so a job that is accepted can start.

Examples
--------
>>> job = JobCreate.model_validate({
...     "algorithm": "sandblaster-lbfgs", "dataset": "digits",
...     "model": {"kind": "softmax", "n_features": 64, "n_classes": 10}, "options": {"maxiter": 50}})
>>> job.options
{'maxiter': 50}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distbelief import downpour, models, sandblaster
from distbelief.options import REST_MAX_ACTORS, rest_model
from distbelief.storage import resolve_name
from distbelief.storage.internal import DATASET_NAME_PATTERN, DATASET_NAME_RULE

__all__ = [
    "ALGORITHMS",
    "DATASET_NAME_PATTERN",
    "FINAL_STATUSES",
    "JOB_STATUSES",
    "MAX_PARTITIONS",
    "MAX_REPLICAS",
    "MAX_SHARDS",
    "NAME_DOC",
    "NAME_SCHEMA",
    "ActorPublic",
    "Algorithm",
    "ClusterPublic",
    "CompressionOptions",
    "DatasetPublic",
    "DatasetRegister",
    "DatasetsPublic",
    "DownpourJobOptions",
    "ErrorItem",
    "ErrorPublic",
    "HealthPublic",
    "JobCreate",
    "JobPublic",
    "JobStatus",
    "JobsPublic",
    "MetricsPublic",
    "ModelKindPublic",
    "ModelsPublic",
    "PartitionPublic",
    "ReplicaPlacementPublic",
    "SandblasterJobOptions",
    "WorkerPublic",
    "options_json_schema",
]

Algorithm = Literal[
    "sandblaster-lbfgs", "sandblaster-cg", "sandblaster-gd", "sandblaster-owlqn", "downpour-sgd"
]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})

#: More replicas, shards or partitions than this is a typo, not a plan: each is a Dask actor with state.
MAX_REPLICAS = MAX_SHARDS = MAX_PARTITIONS = REST_MAX_ACTORS

_Finite = Annotated[float, Field(allow_inf_nan=False)]

#: The rule of :func:`storage.resolve_name` for dataset names, for the OpenAPI schema (the validators below
#: apply the rule itself, with messages that say what to fix).
NAME_DOC = DATASET_NAME_RULE
NAME_SCHEMA: dict[str, Any] = {"pattern": DATASET_NAME_PATTERN, "minLength": 1, "maxLength": 128}
#: A registered URL holds no control characters (a NUL byte cannot be in any path).
URL_PATTERN = r"^[^\x00-\x1f\x7f]+$"


class _Options(BaseModel):
    # Strict: "history": true or "maxiter": "50" is a mistake to report, not to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)


#: Options of ``sandblaster-*`` jobs: those of :class:`sandblaster.SandblasterOptions` declared ``rest=True``,
#: each optional (unset ones take :func:`sandblaster.minimize`'s defaults).
SandblasterJobOptions: type[_Options] = rest_model(
    sandblaster.SandblasterOptions,
    "SandblasterJobOptions",
    base=_Options,
    doc="Options of ``sandblaster-*`` jobs (see :func:`sandblaster.minimize`); unset ones take its defaults.",
)


#: Largest ``compression.tau`` accepted: the threshold is in units of the mini-batch mean gradient, so a
#: larger one would never send anything.
MAX_TAU = 1e6
_TAU_DOC = (
    "Threshold and quantum of Strom's compressed pushes, in units of the mini-batch mean gradient (> 0): "
    "a replica sends only the entries of its residual with |r| >= tau, as +tau or -tau"
)


class CompressionOptions(_Options):
    """``compression`` of a ``downpour-sgd`` job: :class:`downpour.Compression` as JSON, ``{"tau": ...}``.

    Examples
    --------
    >>> CompressionOptions(tau=0.05).model_dump()
    {'tau': 0.05}
    """

    tau: Annotated[_Finite, Field(gt=0, le=MAX_TAU, description=_TAU_DOC)]


class _DownpourRules(_Options):
    """The rules between ``downpour-sgd`` options that JSON adds to :class:`downpour.DownpourOptions`."""

    @field_validator("compression", mode="before", check_fields=False)
    @classmethod
    def _compression_object(cls, value: Any) -> Any:
        # A bare number is the likely mistake (downpour.Compression(tau) takes its threshold by name).
        if value is not None and not isinstance(value, dict | CompressionOptions):
            raise ValueError(
                f'give an object {{"tau": <threshold > 0>}} (Strom 2015 compressed pushes) or null, got '
                f"{_short(value)}"
            )
        return value

    @model_validator(mode="after")
    def _stops(self) -> _DownpourRules:
        if all(getattr(self, name) is None for name in ("epochs", "max_steps", "time_limit")):
            raise ValueError("a downpour-sgd job needs a limit: set epochs, max_steps or time_limit")
        return self


#: The options whose JSON form is an object, and its model.
_OBJECT_OPTIONS: dict[str, type[_Options]] = {"compression": CompressionOptions}

#: Options of ``downpour-sgd`` jobs: those of :class:`downpour.DownpourOptions` declared ``rest=True``, each
#: optional (unset ones take :func:`downpour.train`'s defaults); ``compression`` as ``{"tau": ...}``.
DownpourJobOptions: type[_Options] = rest_model(
    downpour.DownpourOptions,
    "DownpourJobOptions",
    base=_DownpourRules,
    types_=_OBJECT_OPTIONS,
    doc="Options of ``downpour-sgd`` jobs (see :func:`downpour.train`); unset ones take its defaults.\n\n"
    "A job must stop by itself: set at least one of ``epochs``, ``max_steps`` and ``time_limit``.",
)


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``#/$defs/...`` reference replaced by its definition (OpenAPI resolves a
    ``$ref`` against the whole document, where a model's own ``$defs`` are not)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(dict(defs[ref.removeprefix("#/$defs/")]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return dict(walk(schema))


def options_json_schema() -> dict[str, Any]:
    """The JSON schema of a job's ``options`` for the OpenAPI: Sandblaster's or Downpour's, every option
    with its type and limits (which of the two applies depends on ``algorithm``).

    Examples
    --------
    >>> downpour = options_json_schema()["anyOf"][1]
    >>> downpour["title"], downpour["properties"]["max_coalesce"]["anyOf"][0]["minimum"]
    ('DownpourJobOptions', 0)
    """
    return {
        "anyOf": [_inline_refs(SandblasterJobOptions.model_json_schema()),
                  _inline_refs(DownpourJobOptions.model_json_schema())],
        "description": "The algorithm's options: those of SandblasterJobOptions for the sandblaster-* "
        "algorithms, of DownpourJobOptions for downpour-sgd.",
    }  # fmt: skip


def _check_name(name: str) -> str:
    # resolve_name is the one rule for dataset names (no separators, no "..", a safe alphabet); its
    # DatasetError is a ValueError, so pydantic reports its message as it is.
    resolve_name("/", name)
    return name


#: Problems (or unknown option names) listed in one error message; the rest are counted.
_LISTED = 10


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class JobCreate(BaseModel):
    """Body of ``POST /api/jobs``.

    Examples
    --------
    >>> JobCreate.model_validate({"algorithm": "sandblaster-gd", "dataset": "d",
    ...     "model": {"kind": "logistic", "n_features": 3}}).model.kind
    'logistic'
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "algorithm": "sandblaster-lbfgs",
                    "dataset": "digits",
                    "model": {"kind": "softmax", "n_features": 64, "n_classes": 10},
                    "options": {"maxiter": 20, "l2": 1e-4},
                    "name": "digits, L-BFGS",
                }
            ]
        },
    )

    algorithm: Algorithm = Field(description="Which optimizer runs the job.")
    model: models.ModelSpec = Field(description='A built-in model by spec, e.g. {"kind": "softmax", ...}.')
    dataset: str = Field(
        description=f"Name of the training dataset (see GET /api/datasets): {NAME_DOC}.",
        json_schema_extra=NAME_SCHEMA,
    )
    eval_dataset: str | None = Field(
        None,
        description=f"Name of a held-out dataset (optional): {NAME_DOC}.",
        json_schema_extra={"anyOf": [{"type": "string", **NAME_SCHEMA}, {"type": "null"}]},
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The algorithm's options.",
        json_schema_extra=lambda schema: schema.update(options_json_schema()),
    )
    name: Annotated[str, Field(max_length=200)] | None = Field(None, description="A label for people.")

    @field_validator("model", mode="before")
    @classmethod
    def _model_spec(cls, value: Any) -> Any:
        # models.from_spec gives messages that name the bad field and the valid choices.
        return models.from_spec(value).spec

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _dataset_name(cls, value: str | None) -> str | None:
        return None if value is None else _check_name(value)

    @model_validator(mode="after")
    def _options_of_algorithm(self) -> JobCreate:
        schema: type[_Options] = (
            DownpourJobOptions if self.algorithm == "downpour-sgd" else SandblasterJobOptions
        )
        try:
            parsed = schema.model_validate(self.options)
        except ValidationError as exc:
            problems, unknown = [], []
            for err in exc.errors(include_url=False):
                field = ".".join(str(p) for p in err["loc"])
                msg = str(err["msg"]).removeprefix("Value error, ")
                if err["type"] == "extra_forbidden" and len(err["loc"]) > 1:
                    # A key inside an object option (compression): name that object's own keys.
                    option = str(err["loc"][0])
                    keys = ", ".join(sorted(getattr(_OBJECT_OPTIONS.get(option), "model_fields", {})))
                    problems.append(f"unknown key {field!r}; option {option!r} takes: {keys}")
                elif err["type"] == "extra_forbidden":
                    unknown.append(field)
                elif not field:
                    problems.append(msg)
                elif err["type"] == "value_error":
                    problems.append(f"option {field!r}: {msg}")
                else:
                    problems.append(f"option {field!r}: {msg}, got {_short(err.get('input'))}")
            if unknown:
                # One message however many there are: 60,000 unknown keys must not make a 21 MB response.
                named = ", ".join(_short(k) for k in unknown[:_LISTED])
                more = f" and {len(unknown) - _LISTED} more" if len(unknown) > _LISTED else ""
                valid = ", ".join(sorted(schema.model_fields))
                word = "option" if len(unknown) == 1 else "options"
                text = f"unknown {word} {named}{more} for {self.algorithm}; valid options: {valid}"
                problems.insert(0, text)
            shown = problems[:_LISTED]
            if len(problems) > _LISTED:
                shown.append(f"and {len(problems) - _LISTED} more problems")
            raise ValueError("; ".join(shown)) from None
        self.options = parsed.model_dump(exclude_none=True)
        if "partitions" in self.options:
            self.options = _check_partitions(self.algorithm, self.model.model_dump(), self.options)
        return self


def _check_partitions(algorithm: str, spec: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """Validate ``options["partitions"]`` against the model and the algorithm (a ValueError says why)."""
    partitions = int(options["partitions"])
    if partitions == 1:
        return {k: v for k, v in options.items() if k != "partitions"}  # today's path: nothing to pass
    model = models.from_spec(spec)
    models.partition_plan(model, 1)  # refuses a model kind without a partitioned form, saying which have one
    most = models.max_partitions(model)
    if partitions > most:
        raise ValueError(
            f"option 'partitions': this {spec['kind']} model can be split into at most {most} partitions "
            f"(its narrowest layer, or shortest map, has {most} units or rows), got {partitions}; use fewer "
            "partitions or a larger model"
        )
    if algorithm == "downpour-sgd":
        from distbelief.downpour.internal import check_partitioned_options

        check_partitioned_options(partitions, options)
    return options


class PartitionPublic(BaseModel):
    """One partition of a model replica: where it runs and (once it has run) what it did."""

    partition: int
    worker: str | None = Field(None, description="Address of the Dask worker that holds it.")
    steps: int | None = None
    messages: int | None = Field(None, description="Messages it sent to the replica's other partitions.")
    bytes: int | None = Field(None, description="Bytes of those messages.")
    param_bytes: int | None = Field(None, description="Bytes of its slice of the parameters.")


class ReplicaPlacementPublic(BaseModel):
    """A model replica as a group of partitions (model parallelism; ``partitions`` option)."""

    replica: int
    partitions: list[PartitionPublic]


class JobPublic(BaseModel):
    """A job as the API shows it."""

    id: str
    name: str | None = None
    algorithm: Algorithm
    model: dict[str, Any]
    dataset: str
    eval_dataset: str | None = None
    options: dict[str, Any]
    status: JobStatus
    message: str | None = Field(None, description="Why it failed or stopped, or what happened on restart.")
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    iterations: int = Field(0, description="Iterations (Sandblaster) or steps (Downpour) done so far.")
    max_iterations: int | None = Field(None, description="The limit set by the options, if any.")
    latest: dict[str, float | None] = Field(default_factory=dict, description="The last metrics row.")
    result: dict[str, Any] | None = None
    checkpoint_iteration: int | None = None
    resumed_from: int | None = None
    restarts: int = 0
    cancel_requested: bool = False
    placement: list[ReplicaPlacementPublic] | None = Field(
        None,
        description="Jobs with partitions > 1: every replica as its group of partitions and their workers "
        "(live while running, with each partition's steps and traffic once finished).",
    )


class JobsPublic(BaseModel):
    """A page of jobs, newest first."""

    data: list[JobPublic]
    count: int = Field(description="Jobs matching the filter, on all pages.")


class MetricsPublic(BaseModel):
    """A job's metrics, one column per metric (``null`` where a value is missing)."""

    job_id: str
    dim: str
    columns: dict[str, list[float | None]]


class DatasetRegister(BaseModel):
    """Body of ``POST /api/datasets`` (JSON) that registers an existing dataset by URL."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description=f"The dataset's name: {NAME_DOC}.", json_schema_extra=NAME_SCHEMA)
    url: Annotated[
        str,
        Field(
            min_length=1,
            max_length=2000,
            pattern=URL_PATTERN,
            description="A remote object store URL (see DISTBELIEF_REGISTER_SCHEMES) or a path in the store.",
        ),
    ]

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)


class DatasetPublic(BaseModel):
    """A dataset as the API shows it."""

    name: str
    source: Literal["upload", "registered"]
    url: str | None = Field(None, description="The registered URL (uploads live in the store).")
    n_rows: int
    n_features: int
    label_kind: str
    n_classes: int | None
    n_portions: int
    portion_rows: int
    created_at: str


class DatasetsPublic(BaseModel):
    """Every dataset."""

    data: list[DatasetPublic]
    count: int


class ModelKindPublic(BaseModel):
    """One built-in model kind and the JSON schema of its spec."""

    kind: str
    json_schema: dict[str, Any] = Field(alias="schema", serialization_alias="schema")

    model_config = ConfigDict(populate_by_name=True)


class ModelsPublic(BaseModel):
    """The model catalogue."""

    data: list[ModelKindPublic]


class ActorPublic(BaseModel):
    """A parameter-server shard, a model replica or a partition of one (a Dask actor)."""

    key: str
    kind: Literal["shard", "replica", "partition"]
    worker: str | None
    state: str
    job_id: str | None
    replica: int | None = Field(None, description="Partitions: the replica it belongs to.")
    partition: int | None = Field(None, description="Partitions: its number within the replica.")


class WorkerPublic(BaseModel):
    """A Dask worker."""

    address: str
    name: str
    nthreads: int
    memory_limit: int | None
    actors: int


class ClusterPublic(BaseModel):
    """The Dask cluster and what the jobs have placed on it."""

    scheduler: str
    embedded: bool
    dashboard_url: str | None
    workers: list[WorkerPublic]
    actors: list[ActorPublic]
    running_jobs: list[str]
    queued_jobs: int
    max_concurrent_jobs: int


class HealthPublic(BaseModel):
    """Liveness of the service (no token needed, so it says little)."""

    status: Literal["ok"]
    version: str


class ErrorItem(BaseModel):
    """One problem of a request that failed validation."""

    loc: list[str | int] = Field(description="Where: ['body', 'options', 'maxiter'], ['query', 'limit'], ...")
    msg: str = Field(description="What is wrong and what to do.")


class ErrorPublic(BaseModel):
    """The body of every 4xx and 5xx response."""

    detail: str = Field(description="What went wrong and what to do about it.")
    errors: list[ErrorItem] | None = Field(
        None, description="422 from validation only: each problem on its own (at most the first 20)."
    )
