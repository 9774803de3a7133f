"""``/api/datasets``: upload (``.npz`` with ``X`` and ``y``, or CSV), register by URL, list, inspect, delete.

Names go through :func:`storage.resolve_name`, so no name can point outside the store; uploads are read
with ``allow_pickle=False`` and validated (shape, NaN/inf, labels) before anything is written, and a failed
upload leaves nothing behind. Registering by URL accepts remote object stores (``settings.register_schemes``)
or a location inside the store, never another local path.
"""

from __future__ import annotations

import contextlib
from typing import IO, Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from distbelief.api.deps import RunnerDep, SettingsDep
from distbelief.api.runner import JobRunner, UnknownDatasetError
from distbelief.api.schemas import DatasetPublic, DatasetRegister, DatasetsPublic
from distbelief.errors import DatasetError, StoreError
from distbelief.storage import Dataset, resolve_name

__all__ = ["router"]

router = APIRouter(prefix="/datasets", tags=["datasets"])

_UPLOAD_HELP = (
    "send multipart/form-data with fields 'name' and 'file' (an .npz file holding arrays X and y, or a CSV "
    "file of numbers whose last column, or the column named by 'label_column', holds the labels), or JSON "
    '{"name": ..., "url": ...} to register an existing dataset'
)


def _public(name: str, ds: Dataset, url: str | None) -> DatasetPublic:
    return DatasetPublic(
        name=name,
        source="registered" if url is not None else "upload",
        url=url,
        n_rows=ds.n_rows,
        n_features=ds.n_features,
        label_kind=ds.label_kind,
        n_classes=ds.n_classes,
        n_portions=ds.n_portions,
        portion_rows=ds.portion_rows,
        created_at=ds.created_at,
    )


def _describe(runner: JobRunner, name: str) -> DatasetPublic:
    resolve_name("/", name)  # a bad name is a 422 that says what names may hold
    url = runner.store.links().get(name)
    try:
        ds = runner.open_dataset(name)
    except UnknownDatasetError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    return _public(name, ds, url)


def _check_free(runner: JobRunner, name: str, overwrite: bool) -> None:
    exists = name in runner.store.links() or Dataset.exists(resolve_name(runner.store.datasets_root, name))
    if exists and not overwrite:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"a dataset named {name!r} exists already; choose another name, delete it first, or send "
            "overwrite=true",
        )
    users = runner.jobs_using(name)
    if exists and users:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"dataset {name!r} is used by queued or running job(s) {', '.join(users)}; wait for them or "
            "cancel them first",
        )


def _flag(value: Any, field: str) -> bool:
    text = str(value or "false").strip().lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise DatasetError(f"field {field!r} must be true or false, got {value!r}")
    return text in ("true", "1", "yes")


def _build(file: IO[bytes], filename: str, path: str, label_column: str | None, overwrite: bool) -> Dataset:
    head = file.read(4)
    file.seek(0)
    if filename.lower().endswith(".npz") or head.startswith(b"PK"):
        if label_column is not None:
            raise DatasetError("label_column applies to CSV files only; an .npz file holds X and y by name")
        return Dataset.from_npz(file, path=path, overwrite=overwrite)
    if filename.lower().endswith((".csv", ".txt")) or not head.startswith(b"\x93NUMPY"):
        column: int | str = -1
        if label_column is not None:
            column = int(label_column) if label_column.lstrip("-").isdigit() else label_column
        return Dataset.from_csv(file, path=path, label_column=column, overwrite=overwrite)
    raise DatasetError(f"{filename!r} is a single .npy array; {_UPLOAD_HELP}")


@router.post(
    "",
    response_model=DatasetPublic,
    status_code=status.HTTP_201_CREATED,
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["name", "file"],
                        "properties": {
                            "name": {"type": "string"},
                            "file": {"type": "string", "format": "binary"},
                            "label_column": {"type": "string", "description": "CSV only: index or name"},
                            "overwrite": {"type": "boolean", "default": False},
                        },
                    }
                },
                "application/json": {"schema": DatasetRegister.model_json_schema()},
            },
            "required": True,
        }
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
    async with request.form(max_files=1, max_fields=8) as form:
        name, file = form.get("name"), form.get("file")
        if not isinstance(name, str) or not name:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, f"the field 'name' is missing; {_UPLOAD_HELP}"
            )
        if not isinstance(file, UploadFile):
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, f"the field 'file' is missing; {_UPLOAD_HELP}"
            )
        label = form.get("label_column")
        label_column = label if isinstance(label, str) and label.strip() else None
        overwrite = _flag(form.get("overwrite"), "overwrite")
        path = resolve_name(runner.store.datasets_root, name)
        _check_free(runner, name, overwrite)
        filename = file.filename or ""
        ds = await run_in_threadpool(_build, file.file, filename, path, label_column, overwrite)
    if overwrite:
        with contextlib.suppress(Exception):
            runner.store.delete_link(name)
    return _public(name, ds, None)


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
    _check_free(runner, body.name, overwrite=False)
    try:
        ds = Dataset.open(url if not inside or "://" in url else runner.store.url(url))
    except StoreError as exc:
        raise DatasetError(f"cannot register {url!r}: {exc}") from exc
    runner.store.save_link(body.name, ds.url)
    return _public(body.name, ds, ds.url)


@router.get("", response_model=DatasetsPublic)
def list_datasets(runner: RunnerDep) -> DatasetsPublic:
    """Every dataset: uploaded ones and registered ones."""
    data = []
    for name in runner.dataset_names():
        with contextlib.suppress(DatasetError, StoreError):  # a registered URL that went away is skipped
            data.append(_describe(runner, name))
    return DatasetsPublic(data=data, count=len(data))


@router.get("/{name}", response_model=DatasetPublic)
def get_dataset(name: str, runner: RunnerDep) -> DatasetPublic:
    """One dataset's shape, labels and portions."""
    return _describe(runner, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_dataset(name: str, runner: RunnerDep) -> Response:
    """Delete an uploaded dataset, or forget a registered one (its data stays where it is)."""
    _describe(runner, name)
    users = runner.jobs_using(name)
    if users:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"dataset {name!r} is used by queued or running job(s) {', '.join(users)}; cancel them first",
        )
    if not runner.store.delete_link(name):
        runner.store.delete_dataset(name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
