"""``/api/datasets``: upload (``.npz`` with ``X`` and ``y``, or CSV), register by URL, list, inspect, delete.

Names go through :func:`storage.resolve_name`, so no name can point outside the store; uploads are read
with ``allow_pickle=False`` and validated (shape, NaN/inf, labels) before anything is written, and a failed
upload leaves nothing behind. Registering by URL accepts remote object stores (``settings.register_schemes``)
or a location inside the store, never another local path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from typing import IO, Annotated, Any

import fsspec
from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from distbelief.api.deps import RunnerDep, SettingsDep
from distbelief.api.runner import JobRunner, UnknownDatasetError
from distbelief.api.schemas import NAME_DOC, NAME_SCHEMA, DatasetPublic, DatasetRegister, DatasetsPublic
from distbelief.errors import ConflictError, DatasetError, StoreError
from distbelief.storage import Dataset, resolve_name

from .._http import error_responses
from .._jobstore import JobStore
from .._uploads import check_npz_size

__all__ = ["router"]

router = APIRouter(prefix="/datasets", tags=["datasets"], responses=error_responses(401, 422, 503))

_Name = Annotated[str, Path(description=f"The dataset's name: {NAME_DOC}.", json_schema_extra=NAME_SCHEMA)]

_UPLOAD_HELP = (
    "send multipart/form-data with fields 'name' and 'file' (an .npz file holding arrays X and y, or a CSV "
    "file of numbers whose last column, or the column named by 'label_column', holds the labels), or JSON "
    '{"name": ..., "url": ...} to register an existing dataset'
)


_FORM_FIELDS = ("name", "file", "label_column", "overwrite")
# Parts a form may have before it is refused with 400 (a few more than the fields, so a form with an unknown
# field gets the 422 that names it).
_MAX_FORM_PARTS = 16
# The first bytes of a .npy file (numpy.lib.format.MAGIC_PREFIX).
_NPY_MAGIC = b"\x93NUMPY"


def _public(name: str, ds: Dataset, url: str | None, store: JobStore) -> DatasetPublic:
    # The other fields (shape, labels, portions, created_at) are the Dataset's attributes of those names.
    own = {f: getattr(ds, f) for f in DatasetPublic.model_fields.keys() - {"name", "source", "url"}}
    shown = None if url is None else store.shown(url)
    return DatasetPublic(name=name, source="upload" if url is None else "registered", url=shown, **own)


def _describe(runner: JobRunner, name: str) -> DatasetPublic:
    resolve_name("/", name)  # a bad name is a 422 that says what names may hold
    for attempt in range(3):
        url = runner.store.links().get(name)
        try:
            return _public(name, runner.open_dataset(name), url, runner.store)
        except UnknownDatasetError as exc:  # a dangling registration too
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
        except StoreError as exc:
            if url is not None:
                raise ConflictError(
                    f"dataset {name!r} is registered at {runner.store.shown(url)}, which cannot be read "
                    f"({exc}); register it again, or forget it (DELETE /api/datasets/{name})"
                ) from exc
            # Replaced or deleted while it was being read (both rename the folder first, so it is whole
            # again a moment later, or gone): look again rather than report it damaged.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _check_free(runner: JobRunner, name: str, overwrite: bool) -> None:
    """Refuse (409) to write ``name`` if it is taken, in use or being uploaded; hold ``datasets_lock``."""
    store = runner.store
    if store.is_being_written(name):
        raise ConflictError(
            f"another request is uploading a dataset named {name!r} right now; wait for it to finish, then "
            "choose another name or send overwrite=true"
        )
    exists = name in store.links() or Dataset.exists(resolve_name(store.datasets_root, name))
    if exists and not overwrite:
        raise ConflictError(
            f"a dataset named {name!r} exists already; choose another name, delete it first, or send "
            "overwrite=true"
        )
    users = runner.jobs_using(name)
    if exists and users:
        raise ConflictError(
            f"dataset {name!r} is used by queued or running job(s) {', '.join(users)}; wait for them or "
            "cancel them first"
        )


def _flag(value: Any, field: str) -> bool:
    text = str(value or "false").strip().lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise DatasetError(f"field {field!r} must be true or false, got {value!r}")
    return text in ("true", "1", "yes")


def _build(file: IO[bytes], filename: str, path: str, label_column: str | None, array_limit: int) -> Dataset:
    head = file.read(len(_NPY_MAGIC))
    file.seek(0)
    if head.startswith(_NPY_MAGIC):
        raise DatasetError(f"{filename or 'the file'!r} is a single .npy array; {_UPLOAD_HELP}")
    if filename.lower().endswith(".npz") or head.startswith(b"PK"):
        if label_column is not None:
            raise DatasetError("label_column applies to CSV files only; an .npz file holds X and y by name")
        # From the archive's headers, before anything is decompressed (a zip bomb gets 413 here).
        check_npz_size(file, array_limit, repr(filename or "the file"))
        return Dataset.from_npz(file, path=path)
    column: int | str = -1
    if label_column is not None:
        # An ASCII integer is a column index; anything else a header name ("¹".isdigit() is True, but int()
        # refuses it: found by schemathesis).
        column = int(label_column) if re.fullmatch(r"-?[0-9]+", label_column) else label_column
    return Dataset.from_csv(file, path=path, label_column=column)


def _upload(
    runner: JobRunner, name: str, file: IO[bytes], filename: str, label_column: str | None, overwrite: bool
) -> DatasetPublic:
    """Build the dataset aside, then install it under ``name`` in one rename.

    The name is claimed first, so of concurrent uploads under one name exactly one goes on (the others get
    409 at once), and checked again before the new copy goes in (a job may have taken up the old one).
    """
    store = runner.store
    with store.datasets_lock.exclusive():
        _check_free(runner, name, overwrite)
        store.reserve_name(name)
    staged = store.staging_url(name)
    try:
        _build(file, filename, staged, label_column, runner.settings.max_upload_bytes)
        with store.datasets_lock.exclusive():
            store.release_name(name)
            _check_free(runner, name, overwrite)
            store.install_dataset(name, staged)
            if overwrite:
                store.delete_link(name)
    except BaseException:
        store.discard_staged(staged)
        raise
    finally:
        store.release_name(name)
    return _public(name, Dataset.open(resolve_name(store.datasets_root, name)), None, store)


@router.post(
    "",
    response_model=DatasetPublic,
    status_code=status.HTTP_201_CREATED,
    responses=error_responses(400, 409, 413, 415, 422),
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["name", "file"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "description": NAME_DOC, **NAME_SCHEMA},
                            "file": {"type": "string", "format": "binary"},
                            "label_column": {"type": "string", "description": "CSV only: index or name"},
                            "overwrite": {"type": "boolean", "default": False},
                        },
                    }
                },
                "application/json": {"schema": DatasetRegister.model_json_schema()},
            },
            "required": True,
        },
        "responses": {
            "201": {
                "links": {
                    name: {"operationId": op, "parameters": {"name": "$response.body#/name"}}
                    for name, op in {
                        "GetDataset": "get_dataset_api_datasets__name__get",
                        "DeleteDataset": "delete_dataset_api_datasets__name__delete",
                    }.items()
                }
            }
        },
    },
)
async def create_dataset(request: Request, runner: RunnerDep, settings: SettingsDep) -> DatasetPublic:
    """Upload a dataset (multipart: ``name``, ``file``, optional ``label_column``, ``overwrite``), or
    register an existing one by URL (JSON ``{"name", "url"}``). Uploads over the size limit get 413."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        try:
            body = DatasetRegister.model_validate_json(await request.body())
        except ValidationError as exc:
            # The app's handler words these as for any other body (and malformed JSON as a 400).
            raise RequestValidationError(exc.errors(include_url=False)) from exc
        return await run_in_threadpool(_register, runner, settings.register_schemes, body)
    if content_type not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"content type {content_type!r}: {_UPLOAD_HELP}"
        )
    async with request.form(max_files=_MAX_FORM_PARTS, max_fields=_MAX_FORM_PARTS) as form:
        unknown = sorted(set(form.keys()) - set(_FORM_FIELDS))
        if unknown:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"unknown form field(s) {', '.join(map(repr, unknown[:10]))}; the fields are "
                f"{', '.join(_FORM_FIELDS)}",
            )
        if len(form.getlist("file")) > 1 or len(form.getlist("name")) > 1:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, f"send one 'name' and one 'file'; {_UPLOAD_HELP}"
            )
        name, file = form.get("name"), form.get("file")
        if not isinstance(name, str) or not name or not isinstance(file, UploadFile):
            missing = "file" if isinstance(name, str) and name else "name"
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, f"the field {missing!r} is missing; {_UPLOAD_HELP}"
            )
        label = form.get("label_column")
        label_column = label if isinstance(label, str) and label.strip() else None
        overwrite = _flag(form.get("overwrite"), "overwrite")
        resolve_name(runner.store.datasets_root, name)
        return await run_in_threadpool(
            _upload, runner, name, file.file, file.filename or "", label_column, overwrite
        )


# The fsspec backend of each remote scheme registration allows by default.
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs"}


def _check_backend(scheme: str, url: str) -> None:
    """Refuse (422) a URL whose fsspec backend is not installed, naming the package to install."""
    package = _BACKENDS.get(scheme)
    try:
        if package is not None and importlib.util.find_spec(package) is None:
            raise ImportError(package)
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        what = package or f"the fsspec backend of {scheme}://"
        raise DatasetError(
            f"cannot register {url!r}: the service cannot read {scheme}:// URLs, {what} is not installed; "
            f"install it on the server and its workers (pip install {package or '...'}), or upload the data "
            f"instead (multipart POST /api/datasets)" + ("" if package else f" ({exc})")
        ) from exc


def _register(runner: JobRunner, schemes: list[str], body: DatasetRegister) -> DatasetPublic:
    url = body.url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    inside = runner.store.contains(url)
    if not inside and scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes) or "none"
        raise DatasetError(
            f"cannot register {url!r}: the service only reads datasets inside its store or in remote object "
            f"stores ({allowed}); upload the data instead (multipart POST /api/datasets)"
        )
    if not inside:
        _check_backend(scheme, url)
    with runner.store.datasets_lock.exclusive():
        _check_free(runner, body.name, overwrite=False)
    try:
        ds = Dataset.open(url if not inside or "://" in url else runner.store.url(url))
    except StoreError as exc:
        raise DatasetError(f"cannot register {url!r}: {exc}") from exc
    with runner.store.datasets_lock.exclusive():
        _check_free(runner, body.name, overwrite=False)  # again: another request may have taken the name
        runner.store.save_link(body.name, ds.url)
    return _public(body.name, ds, ds.url, runner.store)


@router.get("", response_model=DatasetsPublic)
def list_datasets(runner: RunnerDep) -> DatasetsPublic:
    """Every dataset: uploaded ones and registered ones."""
    data = []
    for name in runner.dataset_names():
        # A registered URL that went away, or a dataset deleted since the names were listed, is skipped.
        with contextlib.suppress(DatasetError, StoreError, HTTPException):
            data.append(_describe(runner, name))
    return DatasetsPublic(data=data, count=len(data))


@router.get("/{name}", response_model=DatasetPublic, responses=error_responses(404, 409, 422))
def get_dataset(name: _Name, runner: RunnerDep) -> DatasetPublic:
    """One dataset's shape, labels and portions."""
    return _describe(runner, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(404, 409, 422))
def delete_dataset(name: _Name, runner: RunnerDep) -> Response:
    """Delete an uploaded dataset, or forget a registered one (its data stays where it is).

    409 while a queued or running job uses it, or while an upload under its name is in progress."""
    with runner.store.datasets_lock.exclusive():
        if name not in runner.store.links():
            _describe(runner, name)  # 404 if there is no such dataset
        # (a registration is forgotten whatever its URL holds now: one that dangles can be deleted too)
        users = runner.jobs_using(name)
        if users:
            raise ConflictError(
                f"dataset {name!r} is used by queued or running job(s) {', '.join(users)}; cancel them "
                "first (POST /api/jobs/{id}/cancel) or wait for them to finish"
            )
        if runner.store.is_being_written(name):
            raise ConflictError(
                f"an upload is replacing dataset {name!r} right now; wait for it to finish, then delete it"
            )
        if not runner.store.delete_link(name):
            runner.store.delete_dataset(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
