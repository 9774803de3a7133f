"""Tables as they are stored: Parquet directories and globs, Dask DataFrames, categorical encoding."""

from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
from distributed import Client

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.storage import Dataset

pq = pytest.importorskip("pyarrow.parquet")
dd = pytest.importorskip("dask.dataframe")


def _frames(sizes: tuple[int, ...] = (7, 13, 1, 9), seed: int = 0) -> list[pd.DataFrame]:
    """Uneven files with a float, an int, a bool, a string and a categorical column, and 0/1 labels."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        # Some colors occur in one file only: the categories must be found across all of them.
        colors = np.array(["red", "green", "blue", f"only{i}"])[rng.integers(0, 4, n)]
        out.append(
            pd.DataFrame({
                "x": rng.normal(size=n),
                "k": rng.integers(-3, 3, n),
                "ok": rng.random(n) > 0.5,
                "color": pd.array(colors, dtype="string"),
                "size": pd.Categorical(rng.choice(["S", "M", "L"], n)),
                "t": rng.integers(0, 2, n),
            })
        )  # fmt: skip
    return out


def _write_dir(root: Path, frames: list[pd.DataFrame], *, row_group_size: int = 4) -> Path:
    root.mkdir()
    for i, f in enumerate(frames):
        # Several row groups a file, and names whose sorted order is the order of the frames.
        pq.write_table(
            __import__("pyarrow").Table.from_pandas(f, preserve_index=False),
            root / f"part-{i:02d}.parquet",
            row_group_size=row_group_size,
        )
    (root / "_SUCCESS").write_bytes(b"")  # written by Spark and Hadoop: not a data file
    return root


def _onehot_oracle(df: pd.DataFrame, cats: list[str]) -> tuple[np.ndarray, list[str]]:
    """pandas' one-hot encoding with sorted categories: the expected X and names."""
    parts = [df[["x", "k"]].to_numpy(float), df[["ok"]].to_numpy(float)]
    names = ["x", "k", "ok"]
    for c in cats:
        values = sorted(set(df[c].astype(str)))
        dummies = pd.get_dummies(pd.Categorical(df[c].astype(str), categories=values), dtype=float)
        parts.append(dummies.to_numpy())
        names += [f"{c}={v}" for v in values]
    return np.column_stack(parts), names


@pytest.mark.timeout(120)
def test_multi_file_directory_and_glob_local(tmp_path: Path) -> None:
    frames = _frames()
    root = _write_dir(tmp_path / "rows", frames)
    whole = pd.concat(frames, ignore_index=True)
    with dask.config.set(scheduler="sync"):
        globs = [str(root / "*.parquet"), str(root / "*"), str(root / "part-0[0-2].parquet")]
        for i, url in enumerate([str(root), *globs]):
            ds = Dataset.from_parquet(url, features=["x", "k"], label="t", path=tmp_path / f"ds{i}")
            expect = whole if i < 3 else pd.concat(frames[:3], ignore_index=True)
            X, y = ds.read_all()
            np.testing.assert_array_equal(X, expect[["x", "k"]].to_numpy(float))
            np.testing.assert_array_equal(y, expect["t"].to_numpy(float))
            assert ds.feature_names == ["x", "k"]
        # The docstring's kind of call: every column but the label, one of them a string column.
        with pytest.raises(DatasetError, match="column 'color' holds"):
            Dataset.from_parquet(str(root), label="t", path=tmp_path / "strings")


@pytest.mark.timeout(120)
def test_rows_are_counted_from_the_footers_not_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distbelief.storage import _dataset_frames

    root = _write_dir(tmp_path / "rows", _frames())
    parts, _ = _dataset_frames._parquet_parts(str(root), None)
    assert [p.n_rows for p in parts] and sum(p.n_rows for p in parts) == 30

    # Nothing reads data pages while the parts are listed.
    def no_reads(*a: object, **k: object) -> None:
        raise AssertionError("data read on the client")

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", no_reads)
    monkeypatch.setattr(pq.ParquetFile, "read", no_reads)
    assert sum(p.n_rows for p in _dataset_frames._parquet_parts(str(root), None)[0]) == 30


@pytest.mark.timeout(120)
def test_multi_file_directory_and_glob_in_memory_fs(tmp_path: Path) -> None:
    import fsspec
    import pyarrow as pa

    frames = _frames(seed=1)
    fs = fsspec.filesystem("memory")
    for i, f in enumerate(frames):
        with fs.open(f"/frames-test/rows/part-{i}.parquet", "wb") as out:
            pq.write_table(pa.Table.from_pandas(f, preserve_index=False), out, row_group_size=5)
    whole = pd.concat(frames, ignore_index=True)
    expect, names = _onehot_oracle(whole, ["color", "size"])
    # memory:// lives in this process only, so the read runs here (a real cluster would read s3:// etc.).
    with dask.config.set(scheduler="sync"):
        for i, url in enumerate(["memory://frames-test/rows", "memory://frames-test/rows/*.parquet"]):
            ds = Dataset.from_parquet(url, label="t", path=f"memory://frames-ds{i}", categorical="onehot")
            X, y = ds.read_all()
            np.testing.assert_array_equal(X, expect)
            np.testing.assert_array_equal(y, whole["t"].to_numpy(float))
            assert ds.feature_names == names
            assert Dataset.open(f"memory://frames-ds{i}").feature_names == names  # kept in the store


@pytest.mark.timeout(180)
def test_onehot_on_the_workers_matches_pandas(tmp_path: Path, client: Client) -> None:
    frames = _frames(sizes=(40, 25, 33))
    root = _write_dir(tmp_path / "rows", frames, row_group_size=10)
    whole = pd.concat(frames, ignore_index=True)
    expect, names = _onehot_oracle(whole, ["color", "size"])
    ds = Dataset.from_parquet(str(root), label="t", path=tmp_path / "ds", categorical="onehot", client=client)
    X, y = ds.read_all()
    np.testing.assert_array_equal(X, expect)
    np.testing.assert_array_equal(y, whole["t"].to_numpy(float))
    assert ds.feature_names == names and ds.label_kind == "binary"
    assert ds.metadata["encoding"]["categories"]["size"] == ["L", "M", "S"]  # sorted: deterministic
    # Bool columns alone need no option: 0/1.
    only = Dataset.from_parquet(str(root), features=["ok"], label="t", path=tmp_path / "b", client=client)
    np.testing.assert_array_equal(only.read_all()[0][:, 0], whole["ok"].to_numpy(float))


@pytest.mark.timeout(180)
def test_hashing_matches_scikit_learn_feature_hasher(tmp_path: Path, client: Client) -> None:
    from sklearn.feature_extraction import FeatureHasher

    frames = _frames(sizes=(50, 31, 19), seed=3)
    root = _write_dir(tmp_path / "rows", frames, row_group_size=16)
    whole = pd.concat(frames, ignore_index=True)
    for k, where in ((4, client), (12, None)):  # 16 columns: many collisions, some cancel (signs)
        with dask.config.set(scheduler="sync" if where is None else None):
            ds = Dataset.from_parquet(
                str(root / "*.parquet"), label="t", path=tmp_path / f"h{k}", hash_features=2**k, client=where
            )
        tokens = [[f"color={c}", f"size={s}"] for c, s in zip(whole["color"], whole["size"], strict=True)]
        hashed = FeatureHasher(n_features=2**k, input_type="string").transform(tokens).toarray()
        expect = np.column_stack([whole[["x", "k", "ok"]].to_numpy(float), hashed])
        X: Any
        X, y = ds.read_all()  # X: a csr_array
        assert ds.layout == "csr" and X.shape == (100, 3 + 2**k)
        np.testing.assert_array_equal(X.toarray(), expect)
        np.testing.assert_array_equal(y, whole["t"].to_numpy(float))
        assert ds.feature_names is not None
        assert ds.feature_names[:4] == ["x", "k", "ok", "hash[0]"] and len(ds.feature_names) == 3 + 2**k
        assert Dataset.open(tmp_path / f"h{k}").feature_names == ds.feature_names


@pytest.mark.timeout(120)
def test_errors_name_the_column(tmp_path: Path) -> None:
    frames = _frames(sizes=(6, 6))
    frames[1].loc[2, "x"] = np.nan
    frames[1]["color"] = frames[1]["color"].astype(object)
    frames[1].loc[4, "color"] = None
    root = _write_dir(tmp_path / "rows", frames)
    url = str(root)
    with dask.config.set(scheduler="sync"):
        with pytest.raises(DatasetError, match=r"column 'color' holds .*categorical='onehot'.*hash_features"):
            Dataset.from_parquet(url, features=["k", "color"], label="t", path=tmp_path / "a")
        with pytest.raises(DatasetError, match="column 'x' holds NaN"):
            Dataset.from_parquet(url, features=["x"], label="t", path=tmp_path / "a")
        with pytest.raises(DatasetError, match="column 'color' has a missing value"):
            Dataset.from_parquet(
                url, features=["color"], label="t", path=tmp_path / "a", categorical="onehot"
            )
        with pytest.raises(DatasetError, match="column 'color' has a missing value"):
            Dataset.from_parquet(url, features=["color"], label="t", path=tmp_path / "a", hash_features=8)
        with pytest.raises(DatasetError, match=r"column 'size' has more than max_categories=2 distinct"):
            Dataset.from_parquet(
                url, features=["size"], label="t", path=tmp_path / "a", categorical="onehot", max_categories=2
            )
        with pytest.raises(DatasetError, match="label column 'color' has dtype"):
            Dataset.from_parquet(url, features=["x"], label="color", path=tmp_path / "a")
        with pytest.raises(InvalidOptionError, match="hash_features must be a positive int"):
            Dataset.from_parquet(url, features=["k"], label="t", path=tmp_path / "a", hash_features=0)
        with pytest.raises(InvalidOptionError, match=r"unexpected options \['portion'\]"):
            Dataset.from_parquet(url, features=["k"], label="t", path=tmp_path / "a", portion=4)
        with pytest.raises(InvalidOptionError, match="categorical must be"):
            Dataset.from_parquet(url, features=["k"], label="t", path=tmp_path / "a", categorical="ordinal")  # type: ignore[arg-type]
        assert not (tmp_path / "a").exists()
        other = tmp_path / "other"
        other.mkdir()
        pd.DataFrame({"a": [1.0], "t": [0]}).to_parquet(other / "a.parquet")
        pd.DataFrame({"b": [1.0], "t": [0]}).to_parquet(other / "b.parquet")
        with pytest.raises(DatasetError, match=r"b\.parquet' has columns"):
            Dataset.from_parquet(str(other), label="t", path=tmp_path / "a")
        with pytest.raises(DatasetError, match="no files there"):
            Dataset.from_parquet(str(tmp_path / "nothing" / "*.parquet"), label="t", path=tmp_path / "a")


@pytest.mark.timeout(120)
def test_dask_dataframe_source(tmp_path: Path) -> None:
    frames = _frames(sizes=(11, 5, 16))
    whole = pd.concat(frames, ignore_index=True)
    df = dd.from_pandas(whole, npartitions=3)
    expect, names = _onehot_oracle(whole, ["color", "size"])
    with dask.config.set(scheduler="sync"):
        ds = Dataset.from_dask(df, "t", path=tmp_path / "a", categorical="onehot")
        np.testing.assert_array_equal(ds.read_all()[0], expect)
        assert ds.feature_names == names
        # y as a Series of the same frame.
        features = df.drop(columns=["t"])
        ds2 = Dataset.from_dask(features, df["t"], path=tmp_path / "b", categorical="onehot")
        np.testing.assert_array_equal(ds2.read_all()[0], expect)
        np.testing.assert_array_equal(ds2.read_all()[1], whole["t"].to_numpy(float))
        # A frame read from a multi-file directory (the case that broke to_dask_array(lengths=True)).
        root = _write_dir(tmp_path / "rows", frames)
        ds3 = Dataset.from_dask(dd.read_parquet(str(root)), "t", path=tmp_path / "c", features=["k"])
        np.testing.assert_array_equal(ds3.read_all()[0][:, 0], whole["k"].to_numpy(float))
        with pytest.raises(DatasetError, match="column 'color' holds"):
            Dataset.from_dask(df, "t", path=tmp_path / "d")
        # Hashed, from a DataFrame: the same columns as from the Parquet files.
        hashed = Dataset.from_dask(df, "t", path=tmp_path / "h", features=["x", "color"], hash_features=64)
        from_files = Dataset.from_parquet(
            str(root), features=["x", "color"], label="t", path=tmp_path / "hf", hash_features=64
        )
        rows: list[Any] = [hashed.read_all()[0], from_files.read_all()[0]]  # csr_arrays
        np.testing.assert_array_equal(rows[0].toarray(), rows[1].toarray())
        assert hashed.feature_names == from_files.feature_names
        with pytest.raises(DatasetError, match="already exists; pass overwrite=True"):
            Dataset.from_dask(df, "t", path=tmp_path / "a", categorical="onehot")
        again = Dataset.from_dask(df, "t", path=tmp_path / "a", features=["x"], overwrite=True)
        assert again.feature_names == ["x"]
        with pytest.raises(InvalidOptionError, match="Dask DataFrame X only"):
            Dataset.from_dask(da.ones((3, 2)), da.zeros(3), path=tmp_path / "d", categorical="onehot")


@pytest.mark.timeout(300)
def test_dask_dataframe_never_comes_to_the_client(tmp_path: Path, client: Client) -> None:
    import psutil

    # ~64 MB of float rows (plus a bool and a string column), made and written by the workers. The client
    # holds the graph and a few scalars a partition (measured: ~12 MB peak of Python allocations, mostly
    # the graph); the bounds are generous, the frame itself would break them.
    n, d = 400_000, 20
    X = da.random.default_rng(0).standard_normal((n, d), chunks=(25_000, d))
    df = dd.from_dask_array(X, columns=[f"f{j}" for j in range(d)])
    df = df.assign(up=df["f0"] > 0, side=(df["f1"] > 0).astype(str), t=(df["f2"] > 0).astype(int))
    size = n * d * 8
    Dataset.from_dask(
        df.head(100, compute=False), "t", path=tmp_path / "warm", categorical="onehot", client=client
    )
    gc.collect()
    rss = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    tracemalloc.start()
    try:
        ds = Dataset.from_dask(df, "t", path=tmp_path / "big", categorical="onehot", client=client)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    grown = psutil.Process().memory_info().rss - rss
    assert ds.n_rows == n and ds.n_features == d + 3 and ds.label_kind == "binary"
    assert ds.feature_names == [*(f"f{j}" for j in range(d)), "up", "side=False", "side=True"]
    assert peak < size / 4, f"the client allocated {peak / 1e6:.1f} MB for a {size / 1e6:.0f} MB frame"
    assert grown < size / 2, f"the client's RSS grew by {grown / 1e6:.1f} MB for a {size / 1e6:.0f} MB frame"
    assert time.monotonic() - t0 < 240
    rows, _ = ds.read_rows(n - 3, n)
    assert rows.shape == (3, d + 3) and set(rows[:, d]) <= {0.0, 1.0}
