"""Dask DataFrames through the estimators: written by the workers (the client's memory stays flat), column
names kept as ``feature_names_in_`` and checked on prediction as scikit-learn checks them."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import sklearn.linear_model as sk
from distributed import Client
from sklearn.datasets import load_breast_cancer, load_iris
from sklearn.preprocessing import StandardScaler

from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.sklearn import LinearRegression, LogisticRegression, MLPClassifier
from distbelief.storage import Dataset

dd = pytest.importorskip("dask.dataframe")
da = pytest.importorskip("dask.array")

NO_NAMES = "X does not have valid feature names"

# Short fits: what is tested is the data's path and the names, not the optimum.
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@pytest.fixture(scope="module")
def cancer() -> tuple[pd.DataFrame, pd.Series]:
    data = load_breast_cancer(as_frame=True)
    X = pd.DataFrame(StandardScaler().fit_transform(data.data), columns=data.data.columns)
    return X, pd.Series(np.array(["benign", "malignant"])[1 - data.target], name="diagnosis")


def test_dask_dataframe_fits_as_pandas_and_keeps_the_names(cancer: tuple[pd.DataFrame, pd.Series]) -> None:
    X, y = cancer
    Xd, yd = dd.from_pandas(X, npartitions=3), dd.from_pandas(y, npartitions=3)
    ours = LogisticRegression(tol=1e-10, max_iter=1000).fit(Xd, yd)
    ref = sk.LogisticRegression(tol=1e-10, max_iter=1000).fit(X, y)
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-5)
    np.testing.assert_array_equal(ours.classes_, ref.classes_)
    np.testing.assert_array_equal(ours.feature_names_in_, ref.feature_names_in_)
    assert ours.feature_names_in_.dtype == object and ours.n_features_in_ == 30
    # Predicting a Dask DataFrame is lazy (a Dask array computed on the workers), pandas as scikit-learn.
    lazy = ours.predict(Xd)
    assert isinstance(lazy, da.Array)
    np.testing.assert_array_equal(lazy.compute(), ref.predict(X))
    np.testing.assert_allclose(ours.predict_proba(Xd).compute(), ref.predict_proba(X), atol=1e-6)
    np.testing.assert_array_equal(ours.predict(X), ref.predict(X))


@pytest.mark.parametrize(
    "other",
    [
        lambda X: X[X.columns[::-1]],  # the same names, another order
        lambda X: X.rename(columns={X.columns[0]: "other"}),  # another name
        lambda X: X.iloc[:, :-1],  # a column fewer
    ],
)
def test_other_columns_raise_as_in_scikit_learn(
    cancer: tuple[pd.DataFrame, pd.Series], other: object
) -> None:
    X, y = cancer
    ours = LogisticRegression(max_iter=5).fit(
        dd.from_pandas(X, npartitions=2), dd.from_pandas(y, npartitions=2)
    )
    ref = sk.LogisticRegression(max_iter=5).fit(X, y)
    bad = other(X)  # type: ignore[operator]
    with pytest.raises(ValueError, match="feature names should match") as theirs:
        ref.predict(bad)
    with pytest.raises(ValueError, match="feature names should match") as mine:
        ours.predict(bad)
    assert str(mine.value) == str(theirs.value)
    with pytest.raises(ValueError, match="feature names should match"):  # checked here, before any task
        ours.predict(dd.from_pandas(bad, npartitions=2))


def test_unnamed_rows_warn_as_in_scikit_learn(cancer: tuple[pd.DataFrame, pd.Series]) -> None:
    X, y = cancer
    ours = LogisticRegression(max_iter=5).fit(
        dd.from_pandas(X, npartitions=2), dd.from_pandas(y, npartitions=2)
    )
    ref = sk.LogisticRegression(max_iter=5).fit(X, y)
    for est in (ref, ours):
        with pytest.warns(UserWarning, match=NO_NAMES):
            est.predict(X.to_numpy())
    with pytest.warns(UserWarning, match=NO_NAMES):
        ours.predict(da.from_array(X.to_numpy(), chunks=200))
    unnamed = LogisticRegression(max_iter=5).fit(X.to_numpy(), y)
    with pytest.warns(UserWarning, match="X has feature names, but LogisticRegression was fitted without"):
        unnamed.predict(dd.from_pandas(X, npartitions=2))


def test_refit_without_names_drops_them(cancer: tuple[pd.DataFrame, pd.Series]) -> None:
    X, y = cancer
    est = LogisticRegression(max_iter=5).fit(
        dd.from_pandas(X, npartitions=2), dd.from_pandas(y, npartitions=2)
    )
    assert hasattr(est, "feature_names_in_")
    est.fit(da.from_array(X.to_numpy(), chunks=200), da.from_array(y.to_numpy(), chunks=200))
    assert not hasattr(est, "feature_names_in_")


def test_bool_and_integer_columns_keep_their_order() -> None:
    rng = np.random.default_rng(0)
    n = 300
    frame = pd.DataFrame({
        "flag": rng.random(n) > 0.5, "a": rng.normal(size=n), "k": rng.integers(0, 5, n),
    })  # fmt: skip
    target = 2.0 * frame["flag"] - frame["a"] + 0.5 * frame["k"] + 1.0
    ours = LinearRegression(tol=1e-10).fit(
        dd.from_pandas(frame, npartitions=2), dd.from_pandas(target, npartitions=2)
    )
    np.testing.assert_array_equal(ours.feature_names_in_, ["flag", "a", "k"])
    np.testing.assert_allclose(ours.coef_, [2.0, -1.0, 0.5], atol=1e-6)
    np.testing.assert_allclose(ours.predict(frame), target, atol=1e-6)
    # Integer column names are not feature names (scikit-learn's rule: strings only).
    numbered = frame.astype(float).set_axis([0, 1, 2], axis=1)
    plain = LinearRegression(tol=1e-10).fit(
        dd.from_pandas(numbered, npartitions=2), dd.from_pandas(target, npartitions=2)
    )
    assert not hasattr(plain, "feature_names_in_")
    np.testing.assert_allclose(plain.coef_, ours.coef_, atol=1e-6)


def test_mlp_on_a_dask_dataframe() -> None:
    X, y = load_iris(return_X_y=True, as_frame=True)
    X = (X - X.mean()) / X.std()
    clf = MLPClassifier(hidden_layer_sizes=(8,), random_state=0, max_iter=300)
    clf.fit(dd.from_pandas(X, npartitions=2), dd.from_pandas(y, npartitions=2))
    assert list(clf.feature_names_in_) == list(X.columns)
    assert (clf.predict(dd.from_pandas(X, npartitions=2)).compute() == y.to_numpy()).mean() > 0.9


def test_datasets_from_tables_give_their_encoded_names(tmp_path: Path) -> None:
    frame = pd.DataFrame({
        "x": np.linspace(-1, 1, 40), "color": ["red", "blue", "green", "red"] * 10, "t": [0, 1] * 20,
    })  # fmt: skip
    df = dd.from_pandas(frame, npartitions=2)
    onehot = Dataset.from_dask(df, "t", path=tmp_path / "onehot", categorical="onehot")
    clf = LogisticRegression(max_iter=20).fit(onehot)
    names = ["x", "color=blue", "color=green", "color=red"]
    np.testing.assert_array_equal(clf.feature_names_in_, names)
    encoded = pd.DataFrame(onehot.read_all()[0], columns=names)
    clf.predict(encoded)  # the encoded columns, by name
    with pytest.raises(ValueError, match="feature names should match"):
        clf.predict(frame[["x", "color"]].assign(color=0.0))
    # Hashed columns are sparse: predicted from scipy.sparse rows, which have no names to check.
    hashed = Dataset.from_dask(df, "t", path=tmp_path / "hashed", hash_features=2**6)
    clf.fit(hashed)
    assert not hasattr(clf, "feature_names_in_") and clf.n_features_in_ == 1 + 2**6


@pytest.mark.parametrize(
    ("X", "y", "match"),
    [
        (
            pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]}),
            np.array([0, 1, 0, 1]),
            "pass X as a dask.dataframe.DataFrame and y as a dask.dataframe.Series",
        ),
        (
            pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0], "city": ["a", "b", "a", "b"]}),
            pd.Series([0, 1, 0, 1]),
            r"column 'city' of X holds .* values, not numbers; encode it on the workers with "
            r"Dataset.from_dask\(X, y, path=..., categorical='onehot'\)",
        ),
        (
            pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]}),
            pd.Series([0, 1, None, 1]),
            r"y has 1 missing labels; drop those rows first",
        ),
        (
            pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]}),
            pd.DataFrame({"t": [0, 1, 0, 1]}),
            "y as a dask.dataframe.Series",
        ),
    ],
)
def test_bad_dask_frames_say_what_to_do(X: pd.DataFrame, y: object, match: str) -> None:
    Xd = dd.from_pandas(X, npartitions=2)
    yd = dd.from_pandas(y, npartitions=2) if isinstance(y, pd.Series | pd.DataFrame) else y
    with pytest.raises(DatasetError, match=match):
        LogisticRegression().fit(Xd, yd)


@pytest.mark.parametrize("class_weight", [None, "balanced", {"malignant": 3.0}])
def test_weights_of_dask_input_as_in_memory(
    cancer: tuple[pd.DataFrame, pd.Series], class_weight: object
) -> None:
    # The weights are joined to the rows on the workers as their last column: the same objective as rows in
    # memory (checked against scikit-learn to 1e-6 in test_weights).
    X, y = cancer
    s = np.random.default_rng(0).uniform(0.0, 3.0, len(y))
    opts = dict(class_weight=class_weight, tol=1e-10, max_iter=1000)
    ref = LogisticRegression(**opts).fit(X, y, sample_weight=s)  # type: ignore[arg-type]
    Xd, yd = dd.from_pandas(X, npartitions=3), dd.from_pandas(y, npartitions=3)
    sd = dd.from_pandas(pd.Series(s, index=X.index), npartitions=3)
    frame = LogisticRegression(**opts).fit(Xd, yd, sample_weight=sd)  # type: ignore[arg-type]
    np.testing.assert_allclose(frame.coef_, ref.coef_, atol=1e-6)
    assert frame.n_features_in_ == 30 and list(frame.feature_names_in_) == list(X.columns)
    arrays = LogisticRegression(**opts).fit(  # type: ignore[arg-type]
        da.from_array(X.to_numpy(), chunks=(100, 30)), da.from_array(y.to_numpy(), chunks=150),
        sample_weight=da.from_array(s, chunks=70),  # other chunks than X's
    )  # fmt: skip
    np.testing.assert_allclose(arrays.coef_, ref.coef_, atol=1e-6)
    if class_weight is not None:  # class weights alone
        alone = LogisticRegression(**opts).fit(Xd, yd)  # type: ignore[arg-type]
        np.testing.assert_allclose(alone.coef_, LogisticRegression(**opts).fit(X, y).coef_, atol=1e-6)  # type: ignore[arg-type]


def test_weights_of_a_dask_regression() -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 3))
    y = X @ [1.0, -2.0, 0.5] + rng.normal(size=300)
    s = rng.uniform(0.0, 2.0, 300)
    ref = sk.LinearRegression().fit(X, y, sample_weight=s)
    for weights in (da.from_array(s, chunks=100), s):  # a Dask array, or numpy weights of Dask rows
        ours = LinearRegression(tol=1e-10).fit(
            da.from_array(X, chunks=(100, 3)), da.from_array(y, chunks=100), sample_weight=weights
        )
        np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-6)
    frame = dd.from_pandas(pd.DataFrame(X, columns=["a", "b", "c"]), npartitions=2)
    scaled = LinearRegression(tol=1e-10).fit(
        frame, dd.from_pandas(pd.Series(y), npartitions=2), sample_weight=2.0
    )
    np.testing.assert_allclose(scaled.coef_, sk.LinearRegression().fit(X, y).coef_, atol=1e-6)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        (np.array([1.0, -1.0, 1.0, 1.0]), "sample_weight must be >= 0"),
        (np.array([1.0, np.nan, 1.0, 1.0]), "sample_weight must be finite"),
        (np.zeros(4), "sample_weight is zero for every row"),
        (np.ones(3), r"sample_weight must have shape \(4,\)"),
    ],
)
def test_bad_dask_weights_say_what_to_do(weights: np.ndarray, match: str) -> None:
    X, y = np.eye(4), np.array([0, 1, 0, 1])
    with pytest.raises(InvalidOptionError, match=match):
        LogisticRegression().fit(
            da.from_array(X, chunks=2),
            da.from_array(y, chunks=2),
            sample_weight=da.from_array(weights, chunks=2),
        )
    if len(weights) == 4:
        frame = dd.from_pandas(pd.DataFrame(X, columns=list("abcd")), npartitions=2)
        with pytest.raises(InvalidOptionError, match=match):
            LogisticRegression().fit(
                frame,
                dd.from_pandas(pd.Series(y), npartitions=2),
                sample_weight=dd.from_pandas(pd.Series(weights), npartitions=2),
            )


def test_numpy_weights_of_a_dask_frame_say_what_to_do() -> None:
    frame = dd.from_pandas(pd.DataFrame({"a": [0.0, 1.0, 2.0, 3.0]}), npartitions=2)
    labels = dd.from_pandas(pd.Series([0, 1, 0, 1]), npartitions=2)
    with pytest.raises(InvalidOptionError, match=r"sample_weight must be a Dask Series aligned with it"):
        LogisticRegression().fit(frame, labels, sample_weight=np.ones(4))


def test_a_dataset_still_cannot_take_weights(tmp_path: Path) -> None:
    ds = Dataset.from_arrays(np.eye(4), [0, 1, 0, 1], path=tmp_path / "d")
    with pytest.raises(InvalidOptionError, match=r"need the rows in memory.*X.compute"):
        LogisticRegression().fit(ds, sample_weight=np.ones(4))


def test_unaligned_frames_say_what_to_do() -> None:
    X, y = pd.DataFrame({"a": np.arange(40.0)}), pd.Series(np.arange(40) % 2)
    Xd = dd.from_pandas(X, npartitions=2).clear_divisions()
    with pytest.raises(
        DatasetError, match="X has 2 partitions and y 3, and their index divisions are unknown"
    ):
        LogisticRegression().fit(Xd, dd.from_pandas(y, npartitions=3).clear_divisions())
    with pytest.raises(DatasetError, match="y has a missing or infinite label for a row of X"):
        LogisticRegression().fit(dd.from_pandas(X, npartitions=2), dd.from_pandas(y.iloc[:30], npartitions=2))


def test_regressor_needs_numbers_in_y() -> None:
    Xd = dd.from_pandas(pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0]}), npartitions=2)
    yd = dd.from_pandas(pd.Series(["a", "b", "c", "d"]), npartitions=2)
    with pytest.raises(DatasetError, match="y must hold real numbers"):
        LinearRegression().fit(Xd, yd)


def test_predict_names_a_string_column_of_a_dask_frame(cancer: tuple[pd.DataFrame, pd.Series]) -> None:
    X, y = cancer
    est = LogisticRegression(max_iter=5).fit(X.iloc[:, :2], y)
    bad = dd.from_pandas(X.iloc[:, :2].astype({X.columns[1]: str}), npartitions=2)
    with pytest.raises(DatasetError, match=f"column {X.columns[1]!r} of X holds"):
        est.predict(bad)


def test_a_big_frame_never_passes_through_the_client(client: Client) -> None:
    # A frame made on the workers (~122 MiB): before, fit pulled it into this process (a 305 MiB frame cost
    # +708 MiB). What this process allocates during the fit (the scheduler runs here too) must stay small.
    rows, cols = 1_000_000, 16
    Xd = da.random.RandomState(0).random_sample((rows, cols), chunks=(rows // 8, cols))
    frame = dd.from_dask_array(Xd, columns=[f"f{i}" for i in range(cols)])
    labels = (frame["f0"] + frame["f1"] > 1.0).astype("int64")
    size = rows * cols * 8
    gc.collect()
    tracemalloc.start()
    try:
        est = LogisticRegression(max_iter=2, client=client).fit(frame, labels)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"client peak {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB frame")
    assert est.n_features_in_ == cols and len(est.feature_names_in_) == cols
    assert peak < size / 4, f"the client allocated {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB frame"
