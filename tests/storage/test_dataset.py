"""Tests of storage._dataset: zarr datasets split into portions, checked against the numpy input."""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import distbelief.storage._dataset as dsmod
from distbelief.errors import DatasetError, InvalidOptionError, StoreError
from distbelief.storage import _dataset_validation
from distbelief.storage._dataset import Dataset
from distbelief.storage._dataset_location import list_datasets, resolve_name
from distbelief.storage._dataset_meta import FORMAT_NAME


def _rng_data(n: int, d: int, seed: int = 0, labels: str = "real") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = rng.normal(size=n) if labels == "real" else rng.integers(0, 2, size=n).astype(float)
    return X, y


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64))


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ------------------------------------------------------------------------------ round trips and portions

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def datasets(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int | None, int | None]:
    n = draw(st.integers(1, 120))
    d = draw(st.integers(1, 6))
    X = draw(hnp.arrays(np.float64, (n, d), elements=finite))
    y = draw(hnp.arrays(np.float64, (n,), elements=finite))
    choice = draw(st.sampled_from(["default", "portion", "both"]))
    if choice == "default":
        return X, y, None, None
    chunk = draw(st.integers(1, n + 3))
    if choice == "portion":
        return X, y, chunk, None
    return X, y, chunk * draw(st.integers(1, 4)), chunk


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=datasets(), data=st.data())
def test_portions_partition_rows_and_round_trip_bit_for_bit(
    tmp_path: Path, case: tuple[np.ndarray, np.ndarray, int | None, int | None], data: st.DataObject
) -> None:
    X, y, portion_rows, chunk_rows = case
    n = X.shape[0]
    ds = Dataset.from_arrays(
        X,
        y,
        path=tmp_path / uuid.uuid4().hex,
        portion_rows=portion_rows,
        chunk_rows=chunk_rows,
        label_kind="real",
    )
    assert (ds.n_rows, ds.n_features) == X.shape
    if portion_rows is not None:
        assert ds.portion_rows == min(portion_rows, n)
    assert ds.portion_rows % ds.chunk_rows == 0 or ds.portion_rows == n

    # Bounds partition [0, n) into consecutive non-empty blocks of portion_rows (the last may be shorter).
    bounds = [ds.portion_bounds(i) for i in range(ds.n_portions)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b[1] == c[0] for b, c in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert all(s == ds.portion_rows for s in sizes[:-1]) and 0 < sizes[-1] <= ds.portion_rows

    # Both readers (direct chunk files and zarr's own) give the input back bit for bit.
    reopened = Dataset.open(ds.url)
    reopened._get_arrays()
    assert reopened._direct
    via_zarr = Dataset.open(ds.url)
    via_zarr._get_arrays()
    via_zarr._direct = False
    for reader in (ds, reopened, via_zarr):
        parts = [reader.read_portion(i) for i in range(reader.n_portions)]
        for Xp, yp in parts:
            assert Xp.dtype == np.float64 and Xp.flags.c_contiguous and yp.flags.c_contiguous
        assert _bits_equal(np.concatenate([p[0] for p in parts]), X)
        assert _bits_equal(np.concatenate([p[1] for p in parts]), y)
        start = data.draw(st.integers(0, n), label="start")
        stop = data.draw(st.integers(start, n), label="stop")
        Xr, yr = reader.read_rows(start, stop)
        assert _bits_equal(Xr, X[start:stop]) and _bits_equal(yr, y[start:stop])
        # portions_of_rows: exactly the portions whose bounds overlap [start, stop).
        expected = [i for i, (a, b) in enumerate(bounds) if a < stop and start < b and start < stop]
        assert list(reader.portions_of_rows(start, stop)) == expected
    assert _bits_equal(ds.read_labels(), y)


@pytest.mark.parametrize(
    ("n", "d", "chunk", "portion"),
    [
        (200_000, 500, 524, 2096),  # ~8 MiB portions, 96 of them
        (1797, 64, 256, 1024),  # small data: at least 1024 rows per portion
        (10_000_000, 10, 26214, 104856),  # capped at 8 MiB per portion
        (10, 2_000_000, 1, 1),  # a single row is over the cap: one row per portion
        (100, 1, 100, 100),  # fewer rows than the minimum: one portion
    ],
)
def test_default_layout(n: int, d: int, chunk: int, portion: int) -> None:
    assert _dataset_validation._layout(n, d, None, None) == (chunk, portion)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10**9), d=st.integers(1, 10**7))
def test_default_layout_properties(n: int, d: int) -> None:
    c, p = _dataset_validation._layout(n, d, None, None)
    assert 1 <= c <= p <= n
    assert p % c == 0 or p == n
    assert p * d * 8 <= 8 * 2**20 or p == 1
    if p < n and p * d * 8 <= 4 * 2**20:
        # Not capped by bytes, so it is at least the 1024-row minimum and gives at most ~64 portions.
        assert p >= 1024 - 3 and -(-n // p) <= 66


def test_with_portion_rows_and_open_portion_rows(tmp_path: Path) -> None:
    X, y = _rng_data(50, 3)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=20, chunk_rows=5)
    assert ds.n_portions == 3
    small = ds.with_portion_rows(5)
    assert small.n_portions == 10 and ds.n_portions == 3
    assert _bits_equal(np.concatenate([small.read_portion(i)[0] for i in range(10)]), X)
    assert Dataset.open(ds.url, portion_rows=10).n_portions == 5
    assert ds.with_portion_rows(1000).n_portions == 1
    with pytest.raises(InvalidOptionError, match="multiple"):
        ds.with_portion_rows(7)
    with pytest.raises(InvalidOptionError, match="multiple"):
        Dataset.open(ds.url, portion_rows=12)


def test_metadata_recorded_in_group_attrs(tmp_path: Path) -> None:
    X, y = _rng_data(30, 4, labels="binary")
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=10)
    attrs = zarr.open_group(str(tmp_path / "d"), mode="r").attrs.asdict()
    assert attrs["format"] == FORMAT_NAME and attrs["format_version"] == 1
    assert (attrs["n_rows"], attrs["n_features"], attrs["portion_rows"]) == (30, 4, 10)
    assert (attrs["label_kind"], attrs["n_classes"]) == ("binary", 2)
    assert str(attrs["created_at"]).endswith("+00:00")
    assert ds.metadata == attrs
    assert "n_portions=3" in repr(ds)


def test_non_float64_inputs_are_converted(tmp_path: Path) -> None:
    X = np.arange(24, dtype=np.int32).reshape(8, 3)
    y = np.array([True, False] * 4)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=3)
    Xr, yr = ds.read_all()
    np.testing.assert_array_equal(Xr, X.astype(np.float64))
    np.testing.assert_array_equal(yr, y.astype(np.float64))
    Xf = np.asfortranarray(np.random.default_rng(1).normal(size=(9, 2)).astype(np.float32))
    ds2 = Dataset.from_arrays(Xf, np.zeros(9), path=tmp_path / "f")
    assert _bits_equal(ds2.read_all()[0], Xf.astype(np.float64))
    ds3 = Dataset.from_arrays([[1, 2], [3, 4]], [[0], [1]], path=tmp_path / "lists")  # y as a column
    np.testing.assert_array_equal(ds3.read_labels(), [0.0, 1.0])


def test_large_finite_values_that_overflow_a_sum_are_accepted(tmp_path: Path) -> None:
    big = np.finfo(np.float64).max
    X = np.full((4, 3), big)
    ds = Dataset.from_arrays(X, np.zeros(4), path=tmp_path / "d")
    assert _bits_equal(ds.read_all()[0], X)


# ---------------------------------------------------------------------------------------------- pickling


def test_pickle_sends_only_location_and_metadata(tmp_path: Path) -> None:
    X, y = _rng_data(20_000, 10)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=5000)
    ds.read_portion(0)  # opened arrays must not travel either
    ds.read_labels()  # nor the labels the object keeps once read
    blob = pickle.dumps(ds)
    assert len(blob) < 1500
    clone = pickle.loads(blob)
    assert clone._arrays is None
    assert (clone.n_rows, clone.n_features, clone.portion_rows, clone.url) == (20_000, 10, 5000, ds.url)
    assert _bits_equal(clone.read_portion(3)[0], X[15_000:])
    assert clone.with_portion_rows(10_000).n_portions == 2


def test_labels_are_read_once_per_object_and_read_only(tmp_path: Path) -> None:
    """Every run's model check reads all labels: an object reads them once (~8 ms on 200,000 rows)."""
    X, y = _rng_data(3000, 4)
    y = (y > 0).astype(float)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", chunk_rows=500)
    first = ds.read_labels()
    assert _bits_equal(first, y)
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 5.0
    # Gone from the store, still known to the object that read them; a fresh object must read the store.
    fresh = Dataset.open(tmp_path / "d")
    for chunk in (tmp_path / "d" / "y").rglob("*"):
        if chunk.is_file() and chunk.name != "zarr.json":
            chunk.unlink()
    assert ds.read_labels() is first
    ds.check_model(SimpleNamespace(n_features=4, check_labels=lambda labels: None))
    assert not _bits_equal(fresh.read_labels(), y)


def test_model_check_reads_labels_a_block_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client checking a model never holds all labels of a big dataset: blocks of _CHECK_ROWS, none kept;
    an error says in which rows."""
    from distbelief.models import Logistic

    X, _ = _rng_data(1000, 2)
    y = np.zeros(1000)
    y[700] = 3.0
    monkeypatch.setattr(dsmod, "_CHECK_ROWS", 300)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", label_kind="real")
    seen: list[int] = []
    ds.check_model(SimpleNamespace(n_features=2, check_labels=lambda labels: seen.append(len(labels))))
    assert seen == [300, 300, 300, 100] and ds._labels is None
    with pytest.raises(DatasetError, match=r"expects binary labels 0 or 1.*\(in rows 600\.\.899\)"):
        ds.check_model(Logistic(2))


def test_unpickled_dataset_notices_replacement(tmp_path: Path) -> None:
    X, y = _rng_data(10, 2)
    blob = pickle.dumps(Dataset.from_arrays(X, y, path=tmp_path / "d"))
    Dataset.from_arrays(X + 1, y, path=tmp_path / "d", overwrite=True)
    with pytest.raises(StoreError, match="replaced"):
        pickle.loads(blob).read_portion(0)


def test_fsspec_url_round_trip_pickle_and_cleanup() -> None:
    root = f"memory://dsets-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    X, y = _rng_data(37, 3)
    ds = Dataset.from_arrays(X, y, path=f"{root}/a", portion_rows=10)
    assert ds.url == f"{root}/a" and not ds._loc.local
    clone = pickle.loads(pickle.dumps(ds))
    assert _bits_equal(np.concatenate([clone.read_portion(i)[0] for i in range(4)]), X)
    assert Dataset.exists(f"{root}/a") and list_datasets(root) == ["a"]
    with pytest.raises(DatasetError, match="already exists"):
        Dataset.from_arrays(X, y, path=f"{root}/a")
    Dataset.from_arrays(2 * X, y, path=f"{root}/a", overwrite=True)
    assert _bits_equal(Dataset.open(f"{root}/a").read_all()[0], 2 * X)
    with pytest.raises(DatasetError):
        Dataset.from_arrays(X, y[:-1], path=f"{root}/b")
    assert sorted(p.rpartition("/")[2] for p in fs.ls(root.replace("memory://", "/"), detail=False)) == ["a"]
    with pytest.raises(StoreError, match="no dataset"):
        Dataset.open(f"{root}/missing")
    assert resolve_name(root, "a") == f"{root}/a"
    assert Dataset.in_store(root, "a").n_rows == 37


# -------------------------------------------------------------------------------------------- bad input


def _nan_at(X: np.ndarray, i: int, j: int, v: float) -> np.ndarray:
    X = X.copy()
    X[i, j] = v
    return X


_X, _Y = _rng_data(12, 3)
_BAD_DATA: list[tuple[str, Any, Any, dict[str, Any], str]] = [
    ("nan in X", _nan_at(_X, 5, 2, np.nan), _Y, {}, r"1 non-finite values.*row 5, column 2"),
    ("inf in X", _nan_at(_X, 0, 0, np.inf), _Y, {}, "non-finite"),
    ("-inf in X", _nan_at(_X, 11, 1, -np.inf), _Y, {}, "non-finite"),
    ("nan in y", _X, np.where(np.arange(12) == 4, np.nan, _Y), {}, "non-finite labels.*row 4"),
    ("inf in y", _X, np.where(np.arange(12) == 0, np.inf, _Y), {}, "non-finite labels"),
    ("None label", _X, [*list(_Y[:-1]), None], {}, "non-finite labels"),
    ("short y", _X, _Y[:-1], {}, "12 rows but y has 11"),
    ("long y", _X, np.append(_Y, 1.0), {}, "12 rows but y has 13"),
    ("no rows", np.empty((0, 3)), np.empty(0), {}, "empty"),
    ("no features", np.empty((12, 0)), _Y, {}, "empty"),
    ("1-D X", _X[:, 0], _Y, {}, "2-D.*reshape"),
    ("3-D X", _X.reshape(12, 3, 1), _Y, {}, "2-D"),
    ("scalar X", 3.0, _Y, {}, "2-D"),
    ("2-D y", _X, np.ones((12, 2)), {}, "1-D"),
    ("string labels", _X, np.array(["cat", "dog"] * 6), {}, "numbers.*return_inverse"),
    ("numeric strings", _X, np.array(["1", "0"] * 6), {}, "numbers"),
    ("object labels", _X, np.array(["cat", 1.0] * 6, dtype=object), {}, "not numbers"),
    ("complex X", _X + 1j, _Y, {}, "complex"),
    ("string X", _X.astype(str), _Y, {}, "numbers"),
    ("binary needs 0/1", _X, np.arange(12.0) % 3, {"label_kind": "binary"}, "0 or 1.*row 2"),
    ("classes need integers", _X, np.full(12, 0.5), {"label_kind": "classes"}, "integer labels.*row 0"),
    ("classes not negative", _X, -np.ones(12), {"label_kind": "classes"}, "integer labels"),
    ("too few classes", _X, np.arange(12.0), {"n_classes": 5}, "n_classes=5"),
]


@pytest.mark.parametrize(
    ("X", "y", "options", "message"), [c[1:] for c in _BAD_DATA], ids=[c[0] for c in _BAD_DATA]
)
def test_bad_data_raises_and_writes_nothing(
    tmp_path: Path, X: Any, y: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        Dataset.from_arrays(X, y, path=tmp_path / "new" / "ds", **options)
    assert _tree(tmp_path) == []


@pytest.mark.parametrize(
    "options",
    [
        {"portion_rows": 0},
        {"portion_rows": -3},
        {"portion_rows": 2.5},
        {"portion_rows": True},
        {"chunk_rows": 0},
        {"portion_rows": 6, "chunk_rows": 4},
        {"portion_rows": 2, "chunk_rows": 4},
        {"label_kind": "ordinal"},
        {"n_classes": 1},
        {"n_classes": 3, "label_kind": "real"},
        {"n_classes": 3, "label_kind": "binary"},
        {"overwrite": "yes"},
        {"storage_options": {"anon": True}},
        {"path": ""},
        {"path": 3},
    ],
)
def test_bad_options_raise_invalid_option_and_write_nothing(tmp_path: Path, options: dict[str, Any]) -> None:
    X, y = _rng_data(12, 2, labels="binary")
    kwargs: dict[str, Any] = {"path": tmp_path / "new" / "ds", **options}
    with pytest.raises(InvalidOptionError):
        Dataset.from_arrays(X, y, **kwargs)
    assert _tree(tmp_path) == []


def test_existing_target_is_refused_unless_overwrite(tmp_path: Path) -> None:
    X, y = _rng_data(10, 2)
    Dataset.from_arrays(X, y, path=tmp_path / "d")
    before = _tree(tmp_path)
    with pytest.raises(DatasetError, match=r"already exists.*overwrite=True"):
        Dataset.from_arrays(X + 1, y, path=tmp_path / "d")
    assert _tree(tmp_path) == before
    assert _bits_equal(Dataset.open(tmp_path / "d").read_all()[0], X)
    ds = Dataset.from_arrays(X[:4] * 3, y[:4], path=tmp_path / "d", overwrite=True)
    assert ds.n_rows == 4 and _bits_equal(Dataset.open(tmp_path / "d").read_all()[0], X[:4] * 3)
    assert sorted(os.listdir(tmp_path)) == ["d"]  # no temporary or old copies left


def test_bad_data_with_overwrite_keeps_the_old_dataset(tmp_path: Path) -> None:
    X, y = _rng_data(10, 2)
    Dataset.from_arrays(X, y, path=tmp_path / "d")
    before = _tree(tmp_path)
    with pytest.raises(DatasetError):
        Dataset.from_arrays(_nan_at(X, 1, 1, np.nan), y, path=tmp_path / "d", overwrite=True)
    assert _tree(tmp_path) == before
    assert _bits_equal(Dataset.open(tmp_path / "d").read_all()[0], X)


def test_never_overwrites_something_that_is_not_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("precious")
    (tmp_path / "file").write_text("precious")
    X, y = _rng_data(5, 2)
    for target in ("home", "file"):
        with pytest.raises(DatasetError, match="not a distbelief dataset"):
            Dataset.from_arrays(X, y, path=tmp_path / target, overwrite=True)
    assert (tmp_path / "home" / "notes.txt").read_text() == "precious"
    assert _tree(tmp_path) == ["file", "home", "home/notes.txt"]


def test_empty_directory_target(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    X, y = _rng_data(5, 2)
    with pytest.raises(DatasetError, match="already exists"):
        Dataset.from_arrays(X, y, path=tmp_path / "d")
    assert Dataset.from_arrays(X, y, path=tmp_path / "d", overwrite=True).n_rows == 5


@pytest.mark.parametrize("error", [OSError("disk full"), RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_while_writing_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    real_write = dsmod._write_arrays

    def failing_write(group: zarr.Group, *args: Any) -> None:
        real_write(group, *args)  # write everything, then fail before the rename
        raise error

    monkeypatch.setattr(dsmod, "_write_arrays", failing_write)
    X, y = _rng_data(10, 2)
    expected = StoreError if isinstance(error, OSError) else type(error)
    with pytest.raises(expected):
        Dataset.from_arrays(X, y, path=tmp_path / "a" / "b" / "d")
    assert _tree(tmp_path) == []  # neither the temporary copy nor the parent directories are left


def test_failure_while_overwriting_keeps_the_old_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    X, y = _rng_data(10, 2)
    Dataset.from_arrays(X, y, path=tmp_path / "d")
    before = _tree(tmp_path)

    def failing_write(group: zarr.Group, *args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dsmod, "_write_arrays", failing_write)
    with pytest.raises(StoreError, match="disk full"):
        Dataset.from_arrays(X + 1, y, path=tmp_path / "d", overwrite=True)
    assert _tree(tmp_path) == before
    assert _bits_equal(Dataset.open(tmp_path / "d").read_all()[0], X)


# ------------------------------------------------------------------------------------------------ opening


def test_open_reports_missing_and_foreign_stores(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no dataset at"):
        Dataset.open(tmp_path / "nothing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    with pytest.raises(StoreError, match=r"Dataset\.from_arrays"):
        Dataset.open(tmp_path / "junk")
    zarr.create_group(str(tmp_path / "plain"), attributes={"hello": 1})
    with pytest.raises(StoreError, match="not a distbelief dataset"):
        Dataset.open(tmp_path / "plain")
    assert not Dataset.exists(tmp_path / "plain") and not Dataset.exists(tmp_path / "nothing")


def test_open_rejects_newer_format_and_damage(tmp_path: Path) -> None:
    X, y = _rng_data(10, 2)
    Dataset.from_arrays(X, y, path=tmp_path / "d")
    meta_file = tmp_path / "d" / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["attributes"]["format_version"] = 99
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="upgrade distbelief"):
        Dataset.open(tmp_path / "d")
    doc["attributes"]["format_version"] = 1
    doc["attributes"]["n_rows"] = 11
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="damaged"):
        Dataset.open(tmp_path / "d")
    del doc["attributes"]["label_kind"]
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="damaged"):
        Dataset.open(tmp_path / "d")


def test_open_accepts_file_urls_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    X, y = _rng_data(6, 2)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d")
    assert Dataset.open(f"file://{tmp_path}/d").url == ds.url == str(tmp_path / "d")
    monkeypatch.chdir(tmp_path)
    assert Dataset.open("d").url == str(tmp_path / "d")


def test_read_argument_checks(tmp_path: Path) -> None:
    X, y = _rng_data(10, 2)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", portion_rows=4)
    for i in (-1, 3, 1.0, True):
        with pytest.raises(InvalidOptionError, match="portion index"):
            ds.portion_bounds(i)  # type: ignore[arg-type]
    for start, stop in ((-1, 2), (3, 2), (0, 11)):
        with pytest.raises(InvalidOptionError, match="out of range"):
            ds.read_rows(start, stop)
    Xe, ye = ds.read_rows(4, 4)
    assert Xe.shape == (0, 2) and ye.shape == (0,)
    assert [i for i, _, _ in ds.iter_portions()] == [0, 1, 2]


# ------------------------------------------------------------------------------------------ file formats


def _csv_text(X: np.ndarray, y: np.ndarray, header: list[str] | None, label_at: int, sep: str = ",") -> str:
    table = np.insert(X, label_at, y, axis=1)
    lines = [sep.join(header)] if header else []
    lines += [sep.join(repr(float(v)) for v in row) for row in table]
    return "\n".join(lines) + "\n"


def test_csv_with_header_and_named_label(tmp_path: Path) -> None:
    X, y = _rng_data(25, 3, labels="binary")
    f = tmp_path / "a.csv"
    f.write_text(_csv_text(X, y, ["f0", "target", "f1", "f2"], label_at=1))
    ds = Dataset.from_csv(f, path=tmp_path / "d", label_column="target")
    Xr, yr = ds.read_all()
    assert _bits_equal(Xr, X) and _bits_equal(yr, y)  # repr() round-trips floats exactly
    assert ds.label_kind == "binary"
    ds2 = Dataset.from_csv(f, path=tmp_path / "d2", label_column=1)
    assert _bits_equal(ds2.read_all()[0], X)


def test_csv_without_header_default_last_column(tmp_path: Path) -> None:
    X, y = _rng_data(40, 2)
    f = tmp_path / "a.csv"
    f.write_text(_csv_text(X, y, None, label_at=2))
    ds = Dataset.from_csv(f, path=tmp_path / "d", portion_rows=16)
    assert ds.n_rows == 40 and ds.n_portions == 3
    oracle = np.loadtxt(f, delimiter=",")
    assert _bits_equal(ds.read_all()[0], oracle[:, :2]) and _bits_equal(ds.read_labels(), oracle[:, 2])
    ds0 = Dataset.from_csv(f, path=tmp_path / "d0", label_column=0, header=False)
    assert _bits_equal(ds0.read_labels(), oracle[:, 0])


def test_csv_numeric_header_forced_and_file_objects(tmp_path: Path) -> None:
    text = "1,2,3\n4,5,1\n7,8,0\n"
    ds = Dataset.from_csv(io.StringIO(text), path=tmp_path / "d", header=True)
    assert ds.n_rows == 2  # the first line was taken as column names
    ds_auto = Dataset.from_csv(io.BytesIO(text.encode()), path=tmp_path / "e")
    assert ds_auto.n_rows == 3
    semi = "\ufeffa;b;y\n1;2;0\n3;4;1\n"  # byte-order mark and another delimiter
    ds_semi = Dataset.from_csv(
        io.BytesIO(semi.encode()), path=tmp_path / "s", delimiter=";", label_column="y"
    )
    np.testing.assert_array_equal(ds_semi.read_all()[0], [[1, 2], [3, 4]])


@pytest.mark.parametrize(
    ("text", "options", "error", "message"),
    [
        ("", {}, DatasetError, "empty"),
        ("\n\n", {}, DatasetError, "empty"),
        ("a,b,y\n", {}, DatasetError, "empty"),
        ("1,2\n3\n", {}, DatasetError, "same number of fields|non-finite"),
        ("1,2,3\n4,5,6,7\n", {}, DatasetError, "same number of fields|CSV"),
        ("1,2,0\n3,x,1\n", {}, DatasetError, "number"),
        ("1,,0\n3,4,1\n", {}, DatasetError, "non-finite.*row 0"),
        ("1,2,0\n3,4,nan\n", {}, DatasetError, "non-finite labels"),
        ("1,2,0\n", {"label_column": "y"}, DatasetError, "no header"),
        ("a,b,y\n1,2,0\n", {"label_column": "z"}, DatasetError, "no column named 'z'"),
        ("1,2,0\n", {"label_column": 3}, DatasetError, "out of range"),
        ("1,2,0\n", {"label_column": -4}, DatasetError, "out of range"),
        ("7\n8\n", {}, DatasetError, "empty"),  # only a label column: no features
        ("1,2,0\n", {"header": "maybe"}, InvalidOptionError, "header"),
        ("1,2,0\n", {"label_column": 1.5}, InvalidOptionError, "label_column"),
        ("1,2,0\n", {"delimiter": ";;"}, InvalidOptionError, "delimiter"),
    ],
)
def test_bad_csv(tmp_path: Path, text: str, options: dict[str, Any], error: type, message: str) -> None:
    f = tmp_path / "in" / "a.csv"
    f.parent.mkdir()
    f.write_text(text)
    with pytest.raises(error, match=message):
        Dataset.from_csv(f, path=tmp_path / "out" / "d", **options)
    assert _tree(tmp_path) == ["in", "in/a.csv"]


def test_csv_existing_target_refused_before_reading(tmp_path: Path) -> None:
    X, y = _rng_data(4, 2)
    Dataset.from_arrays(X, y, path=tmp_path / "d")
    with pytest.raises(DatasetError, match="already exists"):
        Dataset.from_csv(tmp_path / "does-not-exist.csv", path=tmp_path / "d")


def test_npz_round_trip_and_keys(tmp_path: Path) -> None:
    X, y = _rng_data(30, 4)
    np.savez(tmp_path / "a.npz", X=X, y=y)
    np.savez_compressed(tmp_path / "b.npz", data=X, target=y)
    assert _bits_equal(Dataset.from_npz(tmp_path / "a.npz", path=tmp_path / "da").read_all()[0], X)
    db = Dataset.from_npz(tmp_path / "b.npz", path=tmp_path / "db", x_key="data", y_key="target")
    assert _bits_equal(db.read_labels(), y)
    with open(tmp_path / "a.npz", "rb") as fh:
        assert Dataset.from_npz(fh, path=tmp_path / "dc").n_rows == 30


def test_the_file_builders_pass_the_write_options_on_and_refuse_unknown_ones(tmp_path: Path) -> None:
    X, y = _rng_data(30, 4)
    np.savez(tmp_path / "a.npz", X=X, y=y)
    ds = Dataset.from_npz(tmp_path / "a.npz", path=tmp_path / "da", portion_rows=10, label_kind="real")
    assert (ds.portion_rows, ds.n_portions, ds.label_kind) == (10, 3, "real")
    with pytest.raises(TypeError, match=r"'portion_row'.*'portion_rows'"):
        Dataset.from_npz(tmp_path / "a.npz", path=tmp_path / "db", portion_row=10)  # type: ignore[call-arg]
    assert not (tmp_path / "db").exists()


def test_bad_npz(tmp_path: Path) -> None:
    X, y = _rng_data(5, 2)
    np.savez(tmp_path / "wrong_keys.npz", features=X, y=y)
    np.savez(tmp_path / "pickled.npz", X=X, y=np.array([{"a": 1}] * 5, dtype=object))
    np.save(tmp_path / "single.npy", X)
    (tmp_path / "junk.npz").write_bytes(b"not a zip file at all")
    cases = [
        ("wrong_keys.npz", r"no array named 'X' \(it holds \['features', 'y'\]\)"),
        ("pickled.npz", "npz"),
        ("single.npy", "from_npy"),
        ("junk.npz", "cannot read"),
        ("missing.npz", "cannot read"),
    ]
    before = _tree(tmp_path)
    for name, message in cases:
        with pytest.raises(DatasetError, match=message):
            Dataset.from_npz(tmp_path / name, path=tmp_path / "out")
    assert _tree(tmp_path) == before


def test_npy_round_trip_and_errors(tmp_path: Path) -> None:
    X, y = _rng_data(21, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    ds = Dataset.from_npy(tmp_path / "X.npy", tmp_path / "y.npy", path=tmp_path / "d", portion_rows=7)
    assert _bits_equal(ds.read_portion(2)[0], X[14:])
    np.savez(tmp_path / "both.npz", X=X, y=y)
    with pytest.raises(DatasetError, match="from_npz"):
        Dataset.from_npy(tmp_path / "both.npz", tmp_path / "y.npy", path=tmp_path / "e")
    np.save(tmp_path / "y_short.npy", y[:-1])
    with pytest.raises(DatasetError, match="21 rows but y has 20"):
        Dataset.from_npy(tmp_path / "X.npy", tmp_path / "y_short.npy", path=tmp_path / "e")
    assert not (tmp_path / "e").exists()


# --------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a", "digits-train", "run_1.v2", "A" * 128, "0"])
def test_resolve_name_accepts_plain_names(tmp_path: Path, name: str) -> None:
    assert resolve_name(tmp_path, name) == os.path.join(str(tmp_path), name)
    assert resolve_name("s3://bucket/store/", name) == f"s3://bucket/store/{name}"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty"),
        (".", "leave"),
        ("..", "leave"),
        ("../etc", "separator"),
        ("a/b", "separator"),
        ("a\\b", "separator"),
        ("/etc/passwd", "separator"),
        (".hidden", "not allowed"),
        ("-flag", "not allowed"),
        ("A" * 129, "not allowed"),
        ("has space", "not allowed"),
        ("c:evil", "not allowed"),
        ("naïve", "not allowed"),
        ("nul\x00byte", "not allowed"),
        ("trailing\n", "not allowed"),
        (5, "string"),
    ],
)
def test_resolve_name_rejects_escapes(tmp_path: Path, name: Any, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        resolve_name(tmp_path, name)
    with pytest.raises(DatasetError):
        Dataset.in_store(tmp_path, name)


def test_in_store_and_list_datasets(tmp_path: Path) -> None:
    X, y = _rng_data(8, 2)
    for name in ("b", "a"):
        Dataset.from_arrays(X, y, path=resolve_name(tmp_path, name))
    (tmp_path / ".a.tmp-123").mkdir()  # a leftover temporary copy
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x").write_text("not a dataset")
    assert list_datasets(tmp_path) == ["a", "b"]
    assert list_datasets(tmp_path / "missing") == []
    assert Dataset.in_store(tmp_path, "a").url == str(tmp_path / "a")
    with pytest.raises(StoreError):
        Dataset.in_store(tmp_path, "c")


# -------------------------------------------------------------------------------------------- labels


@pytest.mark.parametrize(
    ("y", "options", "kind", "k"),
    [
        ([0, 1, 1, 0], {}, "binary", 2),
        ([0, 0, 0, 0], {}, "binary", 2),
        ([1, 1, 1, 1], {}, "binary", 2),
        ([0, 1, 2, 2], {}, "classes", 3),
        ([3, 0, 2, 1], {}, "classes", 4),
        ([0, 1, 3, 3], {}, "real", None),  # class 2 never occurs: integers, but not 0..K-1
        ([1, 2, 3, 3], {}, "real", None),
        ([0, 0.5, 1, 1], {}, "real", None),
        ([-1, 1, 1, -1], {}, "real", None),
        ([0, 1, 1, 0], {"label_kind": "classes"}, "classes", 2),
        ([0, 1, 3, 3], {"label_kind": "classes"}, "classes", 4),
        ([0, 1, 2, 2], {"n_classes": 5}, "classes", 5),
        ([0, 1, 1, 0], {"label_kind": "real"}, "real", None),
        ([0, 1, 1, 0], {"label_kind": "binary", "n_classes": 2}, "binary", 2),
    ],
)
def test_label_kind_detection(
    tmp_path: Path, y: list[float], options: dict[str, Any], kind: str, k: int | None
) -> None:
    ds = Dataset.from_arrays(np.ones((4, 1)), y, path=tmp_path / "d", **options)
    assert (ds.label_kind, ds.n_classes) == (kind, k)
    reopened = pickle.loads(pickle.dumps(Dataset.open(tmp_path / "d")))
    assert (reopened.label_kind, reopened.n_classes) == (kind, k)


# -------------------------------------------------------------------------------------------- models


class _LabelChecker:
    """A stand-in model with its own label check (what models.Model provides)."""

    def __init__(self, n_features: int, error: Exception | None = None) -> None:
        self.n_features = n_features
        self.error = error
        self.seen: np.ndarray | None = None

    def check_labels(self, y: np.ndarray) -> None:
        self.seen = y
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def three_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Dataset]:
    root = tmp_path_factory.mktemp("sets")
    X = np.random.default_rng(0).normal(size=(30, 4))
    return {
        "binary": Dataset.from_arrays(X, np.arange(30) % 2, path=root / "binary"),
        "classes": Dataset.from_arrays(X, np.arange(30) % 10, path=root / "classes"),
        "real": Dataset.from_arrays(X, np.linspace(-1, 1, 30), path=root / "real"),
        "pair": Dataset.from_arrays(X, np.arange(30) % 2, path=root / "pair", label_kind="classes"),
    }


def test_check_model_features(three_sets: dict[str, Dataset]) -> None:
    ds = three_sets["binary"]
    ds.check_model(SimpleNamespace(n_features=4))
    ds.check_model(object())  # nothing to compare
    with pytest.raises(DatasetError, match=r"expects 5 features but the dataset has 4.*n_features=4"):
        ds.check_model(SimpleNamespace(n_features=5, label_kind="binary"))


def test_check_model_uses_check_labels(three_sets: dict[str, Dataset]) -> None:
    ds = three_sets["classes"]
    ok = _LabelChecker(4)
    ds.check_model(ok)
    assert ok.seen is not None and _bits_equal(ok.seen, np.arange(30) % 10)
    with pytest.raises(DatasetError, match="do not fit the model: labels must be 0/1"):
        ds.check_model(_LabelChecker(4, ValueError("labels must be 0/1")))
    own = DatasetError("model says no")
    with pytest.raises(DatasetError) as info:
        ds.check_model(_LabelChecker(4, own))
    assert info.value is own
    with pytest.raises(DatasetError, match="features"):
        ds.check_model(_LabelChecker(3))  # features are checked first, without reading labels


@pytest.mark.parametrize(
    ("dataset", "label_kind", "n_classes", "message"),
    [
        ("binary", "binary", None, None),
        ("pair", "binary", None, None),
        ("classes", "binary", None, "binary labels.*10 classes"),
        ("real", "binary", None, "binary labels.*real-valued"),
        ("classes", "classes", 10, None),
        ("classes", "classes", 12, None),
        ("classes", "classes", None, None),
        ("binary", "classes", 3, None),
        ("classes", "classes", 5, "10 classes.*n_classes=5.*n_classes=10"),
        ("real", "classes", 10, "real numbers"),
        ("real", "real", None, None),
        ("classes", "real", None, None),
    ],
)
def test_check_model_by_attributes(
    three_sets: dict[str, Dataset], dataset: str, label_kind: str, n_classes: int | None, message: str | None
) -> None:
    model = SimpleNamespace(n_features=4, label_kind=label_kind, n_classes=n_classes)
    if message is None:
        three_sets[dataset].check_model(model)
    else:
        with pytest.raises(DatasetError, match=message):
            three_sets[dataset].check_model(model)


def test_check_model_rejects_unknown_label_kind(three_sets: dict[str, Dataset]) -> None:
    with pytest.raises(InvalidOptionError, match="label_kind"):
        three_sets["real"].check_model(SimpleNamespace(n_features=4, label_kind="ordinal"))
