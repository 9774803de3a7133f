"""The on-disk format of a dataset: its group attributes (``_Meta``), format name and version.

Part of :mod:`storage._dataset` (split by concern: metadata, location, validation, readers, the class).
"""

from __future__ import annotations

import datetime as _dt
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

import numpy as np
import numpy.typing as npt

from distbelief.errors import StoreError

LabelKind = Literal["real", "binary", "classes"]
FloatArray = npt.NDArray[np.float64]

#: Value of the ``format`` group attribute that marks a zarr group as a distbelief dataset.
FORMAT_NAME = "distbelief.dataset"
#: Layout version written by this code for dense datasets; ``open`` refuses newer versions than
#: :data:`_READ_VERSION` (sparse datasets are written as version 2, so that older readers refuse them).
FORMAT_VERSION = 1
_READ_VERSION = 2
_LAYOUTS = ("dense", "csr")
_LABEL_KINDS = ("real", "binary", "classes")


class WriteOptions(TypedDict, total=False):
    """The keywords that every ``Dataset.from_*`` builder passes on to the write (see
    :meth:`Dataset.from_arrays <storage.Dataset.from_arrays>` for what they mean)."""

    portion_rows: int | None
    chunk_rows: int | None
    label_kind: LabelKind | None
    n_classes: int | None
    overwrite: bool
    storage_options: dict[str, Any] | None


# ------------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class _Meta:
    dataset_id: str
    n_rows: int
    n_features: int
    chunk_rows: int
    portion_rows: int
    label_kind: LabelKind
    n_classes: int | None
    created_at: str
    format_version: int = FORMAT_VERSION
    layout: str = "dense"  # or "csr" (storage/_sparse.py)
    #: Names of the columns of X when the dataset was built from a table (storage/_dataset_frames.py); for
    #: hashed features only the leading (numeric) ones: see ``encoding["hash_features"]``.
    feature_names: tuple[str, ...] | None = None
    #: How a table's columns were encoded (storage/_dataset_frames.py), or None.
    encoding: dict[str, Any] | None = None

    @classmethod
    def fresh(
        cls, n_rows: int, n_features: int, chunk_rows: int, portion_rows: int, kind: LabelKind, k: int | None
    ) -> _Meta:
        """The metadata of a dataset about to be written: a new id, created now."""
        return cls(
            dataset_id=uuid.uuid4().hex,
            n_rows=n_rows,
            n_features=n_features,
            chunk_rows=chunk_rows,
            portion_rows=portion_rows,
            label_kind=kind,
            n_classes=k,
            created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        )

    def to_attrs(self) -> dict[str, Any]:
        attrs = {"format": FORMAT_NAME, **asdict(self)}
        for optional in ("feature_names", "encoding"):  # not written when unset: older readers see no change
            if attrs[optional] is None:
                del attrs[optional]
        return attrs

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], where: str) -> _Meta:
        fmt = attrs.get("format")
        if fmt != FORMAT_NAME:
            raise StoreError(
                f"{where} holds a zarr group that is not a distbelief dataset (format attribute {fmt!r}); "
                "build a dataset there with Dataset.from_arrays / from_npz / from_csv, or open another path"
            )
        version = attrs.get("format_version")
        if not isinstance(version, int) or version > _READ_VERSION or version < 1:
            raise StoreError(
                f"{where} holds dataset format version {version!r}, but this distbelief reads versions "
                f"1 to {_READ_VERSION}; upgrade distbelief or rebuild the dataset"
            )
        try:
            meta = cls(
                dataset_id=str(attrs["dataset_id"]),
                n_rows=int(attrs["n_rows"]),
                n_features=int(attrs["n_features"]),
                chunk_rows=int(attrs["chunk_rows"]),
                portion_rows=int(attrs["portion_rows"]),
                label_kind=attrs["label_kind"],
                n_classes=None if attrs["n_classes"] is None else int(attrs["n_classes"]),
                created_at=str(attrs["created_at"]),
                format_version=version,
                layout=attrs.get("layout", "dense"),
                feature_names=_names(attrs.get("feature_names")),
                encoding=attrs.get("encoding"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{where}: dataset metadata is damaged ({exc!r}); rebuild the dataset") from exc
        if (
            meta.label_kind not in _LABEL_KINDS
            or meta.layout not in _LAYOUTS
            or min(meta.n_rows, meta.n_features, meta.chunk_rows) < 1
        ):
            raise StoreError(f"{where}: dataset metadata is damaged ({meta}); rebuild the dataset")
        return meta


def _names(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"feature_names must be a list of strings, got {value!r}")
    return tuple(value)
