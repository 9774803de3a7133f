"""Dataset.from_dask (written by the workers), from_xarray and from_parquet."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
import xarray as xr
from distributed import Client

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.storage import Dataset


def test_from_dask_round_trip(tmp_path: Path, client: Client) -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(1000, 5))
    y = rng.integers(0, 3, 1000).astype(float)
    ds = Dataset.from_dask(
        da.from_array(X, chunks=(333, 5)), da.from_array(y, chunks=250), path=tmp_path / "d", chunk_rows=100,
        portion_rows=200, client=client,
    )  # fmt: skip
    assert (ds.n_rows, ds.n_features, ds.chunk_rows, ds.n_portions) == (1000, 5, 100, 5)
    assert (ds.label_kind, ds.n_classes) == ("classes", 3)
    Xr, yr = Dataset.open(tmp_path / "d").read_all()
    np.testing.assert_array_equal(Xr, X)
    np.testing.assert_array_equal(yr, y)


@pytest.mark.parametrize(
    ("y", "kind", "k"),
    [
        (np.array([0.0, 1.0] * 50), "binary", 2),
        (np.arange(100) % 4 + 0.0, "classes", 4),
        (np.arange(100) % 4 + 1.0, "real", None),  # integer targets not starting at 0: real, as from_arrays
        (np.linspace(-1, 1, 100), "real", None),
    ],
)
def test_from_dask_detects_labels_like_from_arrays(
    tmp_path: Path, y: np.ndarray, kind: str, k: int | None
) -> None:
    X = np.ones((100, 2))
    with dask.config.set(scheduler="sync"):
        ds = Dataset.from_dask(da.from_array(X, chunks=30), da.from_array(y, chunks=30), path=tmp_path / "d")
    ref = Dataset.from_arrays(X, y, path=tmp_path / "ref")
    assert (ds.label_kind, ds.n_classes) == (ref.label_kind, ref.n_classes) == (kind, k)


def test_from_dask_integer_targets_far_above_the_row_count_stay_real_without_a_huge_count(
    tmp_path: Path,
) -> None:
    # Integer-valued regression targets (prices, ids) must not make the label check count every value
    # 0..max on the workers: 1e10 would need an 80 GB bincount. Classes 0..max cannot all occur in 4 rows.
    y = np.array([0.0, 3.0, 1.0, 1e10])
    with dask.config.set(scheduler="sync"):
        tracemalloc.start()
        try:
            ds = Dataset.from_dask(da.ones((4, 2), chunks=2), da.from_array(y, chunks=2), path=tmp_path / "d")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        ref = Dataset.from_arrays(np.ones((4, 2)), y, path=tmp_path / "ref")
        assert (ds.label_kind, ds.n_classes) == (ref.label_kind, ref.n_classes) == ("real", None)
        assert peak < 50e6
        forced = Dataset.from_dask(
            da.ones((4, 2), chunks=2), da.from_array(np.array([0.0, 1.0, 1.0, 9.0]), chunks=2),
            path=tmp_path / "c", label_kind="classes",
        )  # fmt: skip
        assert (forced.label_kind, forced.n_classes) == ("classes", 10)


def test_from_dask_bad_input(tmp_path: Path) -> None:
    X = np.ones((10, 2))
    X[7, 1] = np.nan
    with dask.config.set(scheduler="sync"):
        with pytest.raises(DatasetError, match="row 7, column 1"):
            Dataset.from_dask(da.from_array(X, chunks=3), da.zeros(10, chunks=3), path=tmp_path / "nan")
        assert not (tmp_path / "nan").exists()  # nothing is left behind
        with pytest.raises(DatasetError, match="10 rows but y has 9"):
            Dataset.from_dask(da.ones((10, 2)), da.zeros(9), path=tmp_path / "a")
        with pytest.raises(DatasetError, match=r"must be a dask\.array\.Array"):
            Dataset.from_dask(np.ones((10, 2)), da.zeros(10), path=tmp_path / "a")
        with pytest.raises(DatasetError, match="must be 2-D"):
            Dataset.from_dask(da.ones(10), da.zeros(10), path=tmp_path / "a")
        unknown = da.ones((10, 2), chunks=5)
        unknown = unknown[unknown[:, 0] > 0]
        with pytest.raises(DatasetError, match="compute_chunk_sizes"):
            Dataset.from_dask(unknown, da.zeros(10), path=tmp_path / "a")
        with pytest.raises(DatasetError, match="real numbers"):
            Dataset.from_dask(da.from_array(np.array([["a", "b"]])), da.zeros(1), path=tmp_path / "a")
        with pytest.raises(DatasetError, match="label_kind='binary' needs integer labels"):
            Dataset.from_dask(
                da.ones((3, 2)), da.from_array([0.5, 1.0, 0.0]), path=tmp_path / "a", label_kind="binary"
            )
        Dataset.from_dask(da.ones((3, 2)), da.zeros(3), path=tmp_path / "exists")
        with pytest.raises(DatasetError, match="overwrite=True"):
            Dataset.from_dask(da.ones((3, 2)), da.zeros(3), path=tmp_path / "exists")
        # A DataFrame's encoding options, or a misspelled one, with arrays: refused, nothing written.
        with pytest.raises(InvalidOptionError, match=r"\['categorical'\]: they apply to a Dask DataFrame"):
            Dataset.from_dask(da.ones((3, 2)), da.zeros(3), path=tmp_path / "b", categorical="onehot")
        with pytest.raises(TypeError, match="portion_row"):
            Dataset.from_dask(da.ones((3, 2)), da.zeros(3), path=tmp_path / "b", portion_row=2)
        assert not (tmp_path / "b").exists()


def test_from_dask_never_holds_the_rows_in_the_client(tmp_path: Path, client: Client) -> None:
    # 96 MB of rows, generated and written by the workers; the client's Python allocations stay tiny.
    n, d = 400_000, 30
    X = da.random.default_rng(0).standard_normal((n, d), chunks=(20_000, d))
    y = (X[:, 0] > 0).astype(np.float64)
    size = n * d * 8
    tracemalloc.start()
    try:
        ds = Dataset.from_dask(X, y, path=tmp_path / "big", client=client)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ds.n_rows == n and ds.label_kind == "binary"
    assert peak < size / 5, f"the client allocated {peak / 1e6:.1f} MB writing a {size / 1e6:.0f} MB dataset"
    rows, labels = ds.read_rows(n - 5, n)
    assert rows.shape == (5, d) and set(np.unique(labels)) <= {0.0, 1.0}


def test_from_xarray(tmp_path: Path, client: Client) -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=50), rng.normal(size=50)
    t = (a > 0).astype(int)
    xds = xr.Dataset({"a": ("row", a), "b": ("row", b), "t": ("row", t)})
    ds = Dataset.from_xarray(xds, features=["a", "b"], label="t", path=tmp_path / "np")
    X, y = ds.read_all()
    np.testing.assert_array_equal(X, np.column_stack([a, b]))
    np.testing.assert_array_equal(y, t)
    lazy = xds.chunk({"row": 20})
    ds2 = Dataset.from_xarray(lazy, features=["a", "b"], label="t", path=tmp_path / "lazy", client=client)
    np.testing.assert_array_equal(ds2.read_all()[0], X)
    wide = xr.Dataset({"X": (("row", "feature"), np.column_stack([a, b])), "t": ("row", t)})
    np.testing.assert_array_equal(
        Dataset.from_xarray(wide, features="X", label="t", path=tmp_path / "wide").read_all()[0], X
    )
    with pytest.raises(DatasetError, match="no variable 'c'"):
        Dataset.from_xarray(xds, features=["a", "c"], label="t", path=tmp_path / "bad")
    with pytest.raises(DatasetError, match="no variable 'u'"):
        Dataset.from_xarray(xds, features=["a"], label="u", path=tmp_path / "bad")
    with pytest.raises(DatasetError, match=r"needs an xarray\.Dataset"):
        Dataset.from_xarray({"a": a}, features=["a"], label="t", path=tmp_path / "bad")
    with pytest.raises(DatasetError, match="'t' is the label; drop it from features"):
        Dataset.from_xarray(xds, features=["a", "t"], label="t", path=tmp_path / "bad")


def _table(n: int = 40) -> tuple[np.ndarray, np.ndarray, object]:
    pa = pytest.importorskip("pyarrow")
    rng = np.random.default_rng(2)
    X = rng.normal(size=(n, 3))
    y = (X[:, 0] > 0).astype(float)
    return X, y, pa.table({"f0": X[:, 0], "f1": X[:, 1], "f2": X[:, 2], "label": y})


def test_from_parquet_local(tmp_path: Path) -> None:
    X, y, table = _table()
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "rows.parquet")
    with dask.config.set(scheduler="sync"):
        ds = Dataset.from_parquet(str(tmp_path / "rows.parquet"), label="label", path=tmp_path / "ds")
        Xr, yr = ds.read_all()
        np.testing.assert_array_equal(Xr, X)
        np.testing.assert_array_equal(yr, y)
        two = Dataset.from_parquet(
            str(tmp_path / "rows.parquet"), features=["f2", "f0"], label="label", path=tmp_path / "ds2"
        )
        np.testing.assert_array_equal(two.read_all()[0], X[:, [2, 0]])
        with pytest.raises(DatasetError, match="no column 'nope'"):
            Dataset.from_parquet(str(tmp_path / "rows.parquet"), label="nope", path=tmp_path / "bad")
        # The label among the features would be learned from itself.
        with pytest.raises(DatasetError, match="'label' is the label; drop it from features"):
            Dataset.from_parquet(
                str(tmp_path / "rows.parquet"), features=["f0", "label"], label="label", path=tmp_path / "bad"
            )
        with pytest.raises(DatasetError, match="features must list at least one column"):
            Dataset.from_parquet(
                str(tmp_path / "rows.parquet"), features=[], label="label", path=tmp_path / "bad"
            )
        assert not (tmp_path / "bad").exists()
        (tmp_path / "junk.parquet").write_bytes(b"not parquet")
        with pytest.raises(DatasetError, match="cannot read"):
            Dataset.from_parquet(str(tmp_path / "junk.parquet"), label="label", path=tmp_path / "bad")


def test_from_parquet_fsspec_url(tmp_path: Path) -> None:
    X, y, table = _table()
    import fsspec
    import pyarrow.parquet as pq

    fs = fsspec.filesystem("memory")
    with fs.open("/estim-test/rows.parquet", "wb") as f:
        pq.write_table(table, f)
    # memory:// lives in this process only, so the read runs here (a real cluster would read s3:// etc.).
    with dask.config.set(scheduler="sync"):
        ds = Dataset.from_parquet("memory://estim-test/rows.parquet", label="label", path="memory://estim-ds")
    Xr, yr = ds.read_all()
    np.testing.assert_array_equal(Xr, X)
    np.testing.assert_array_equal(yr, y)
