"""scikit-learn estimators trained by Sandblaster (L-BFGS, CG, GD) or Downpour on a Dask cluster."""

from __future__ import annotations

import functools
import numbers
import warnings
from typing import Any

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets

# scikit-learn's own feature-name check (what validate_data runs), used on a Dask frame's names without
# reading its rows; there is no public function for it.
from sklearn.utils.validation import (
    _check_feature_names,  # noqa: PLC2701
    check_is_fitted,
    validate_data,
)

from distbelief import models
from distbelief.errors import DatasetError, InvalidOptionError
from distbelief.storage import Dataset
from distbelief.storage.internal import resolve_client

from ._base import (
    WeightColumn,
    check_alpha,
    check_callback,
    check_common,
    check_verbose,
    clone_keeping_client,
    dask_weights,
    fit_model,
    fit_store,
    frame_as_array,
    frame_weights,
    is_dask_array,
    is_dask_frame,
    map_rows,
    names_of,
    picklable_state,
    row_weights,
    weighted_data,
)

__all__ = ["LinearRegression", "LogisticRegression", "MLPClassifier", "SoftmaxRegression"]

FloatArray = NDArray[np.float64]

_ACTIVATIONS = {"relu": "relu", "tanh": "tanh", "logistic": "sigmoid"}


class _Distbelief(BaseEstimator):
    """Fitting machinery shared by the estimators (private)."""

    _classifier = False
    #: Whether ``fit`` and ``predict`` take ``scipy.sparse`` rows (the linear models: their data term has a
    #: sparse kernel and their parameters follow the columns, so Sandblaster pulls and pushes by keys).
    _accept_sparse = False
    # set by subclasses' __init__ (declared for mypy)
    solver: str
    max_iter: int
    tol: float
    client: Any
    store: Any
    penalty: str | None
    warm_start: bool
    verbose: int
    callback: Any
    random_state: Any
    downpour_options: dict[str, Any] | None
    #: Only the linear classifiers take ``class_weight`` (a parameter of their ``__init__``).
    class_weight: Any = None
    n_iter_: Any  # set by fit

    def _keep_params(self, values: dict[str, Any]) -> None:
        """Store every argument of ``__init__`` (``values``: its ``locals()``) as the attribute of its name,
        and nothing else: scikit-learn's rule for an estimator's constructor."""
        for name in self._get_param_names():
            setattr(self, name, values[name])

    def __sklearn_clone__(self) -> Any:
        return clone_keeping_client(self)

    def __getstate__(self) -> dict[str, Any]:
        return picklable_state(super().__getstate__())

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = self._accept_sparse
        return tags

    # ------------------------------------------------------------------------------------------ data

    def _rows_and_labels(
        self, X: Any, y: Any, store: str, weights: tuple[Any, Any]
    ) -> tuple[Dataset | tuple[FloatArray, FloatArray], int]:
        name = type(self).__name__
        if isinstance(X, Dataset):
            if y is not None:
                raise DatasetError(
                    f"{name}.fit(dataset) takes the labels from the dataset; call fit(dataset) without y"
                )
            self.n_features_in_ = X.n_features
            self._dataset_feature_names(X)
            if self._classifier:
                if X.label_kind == "real" or X.n_classes is None:
                    raise DatasetError(
                        f"{name} needs class labels, but the dataset at {X.url} has real labels; build it "
                        "with label_kind='binary' or 'classes'"
                    )
                self.classes_ = np.arange(X.n_classes)
            return X, X.n_rows
        if is_dask_frame(X) or is_dask_frame(y):
            return self._frame_data(X, y, store, *weights)
        if is_dask_array(X) or is_dask_array(y):
            return self._dask_data(X, y, store, *weights)
        if y is None:
            raise ValueError(
                f"{name} requires y to be passed, but the target y is None; pass the labels, or a "
                "storage.Dataset as X"
            )
        X_arr, y_arr = validate_data(
            self,
            X,
            y,
            dtype=np.float64,
            y_numeric=not self._classifier,
            accept_sparse="csr" if self._accept_sparse else False,
        )
        if self._classifier:
            check_classification_targets(y_arr)
            self.classes_, y_enc = np.unique(y_arr, return_inverse=True)
            y_arr = y_enc.astype(np.float64)
        rows = _csr(X_arr) if sp.issparse(X_arr) else np.ascontiguousarray(X_arr)
        return (rows, np.asarray(y_arr, dtype=np.float64)), X_arr.shape[0]

    def _data(
        self, X: Any, y: Any, store: str, sample_weight: Any = None, class_weight: Any = None
    ) -> tuple[Dataset | tuple[FloatArray, FloatArray], int]:
        """The training rows as a Dataset or checked arrays (labels encoded 0..K-1), and N; a classifier's
        data must hold at least two classes.

        Dask input with ``sample_weight`` / ``class_weight`` is written with every row's weight as the last
        column (:meth:`_row_weights` then says so); other rows get their weights from :meth:`_row_weights`.
        """
        self._weighted_rows = False
        data, n = self._rows_and_labels(X, y, store, (sample_weight, class_weight))
        if self._classifier and len(self.classes_) < 2:
            raise DatasetError(
                f"{type(self).__name__} needs samples of at least 2 classes in the data, but the data "
                f"contains only one class: {self.classes_[0]!r}"
            )
        return data, n

    def _dask_data(
        self, X: Any, y: Any, store: str, sample_weight: Any = None, class_weight: Any = None
    ) -> tuple[Dataset, int]:
        import dask.array as da

        from distbelief.storage.internal import dataset_from_dask

        name = type(self).__name__
        # The estimator's cluster, not the process's default scheduler: the rows are read where they live.
        client = resolve_client(self.client)
        if not (is_dask_array(X) and is_dask_array(y)):
            raise DatasetError(f"{name}.fit: pass X and y both as Dask arrays (or both as numpy arrays)")
        if X.ndim != 2 or y.ndim != 1:
            raise DatasetError(
                f"{name}.fit: X must be 2-D and y 1-D, got X.ndim={X.ndim} and y.ndim={y.ndim}"
            )
        if self._classifier:
            classes = np.asarray(client.compute(da.unique(y), sync=True))
            check_classification_targets(classes)
            self.classes_ = classes
            y = y.map_blocks(lambda b: np.searchsorted(classes, b).astype(np.float64), dtype=np.float64)
        self.n_features_in_ = int(X.shape[1])
        _check_feature_names(self, X, reset=True)  # none: drops those of an earlier fit
        if sample_weight is not None or (class_weight is not None and self._classifier):
            found = self.classes_ if self._classifier else None
            X = dask_weights(
                X, y if self._classifier else None, sample_weight, class_weight, found, client, name
            )
            self._weighted_rows = True
        ds = dataset_from_dask(X, y, path=f"{store}/data", overwrite=True, client=client)
        return ds, ds.n_rows

    def _dataset_feature_names(self, ds: Dataset) -> None:
        """``feature_names_in_`` from a dataset's :attr:`~storage.Dataset.feature_names` (one built from a
        table), or none.

        A sparse dataset (hashed columns) has none: its rows are predicted from ``scipy.sparse`` rows, which
        have no column names to check, and ``2**20`` names would only cost memory.
        """
        names = ds.feature_names
        if names is not None and ds.layout == "dense":
            self.feature_names_in_ = np.asarray(names, dtype=object)
        elif hasattr(self, "feature_names_in_"):
            del self.feature_names_in_

    def _frame_data(
        self, X: Any, y: Any, store: str, sample_weight: Any = None, class_weight: Any = None
    ) -> tuple[Dataset, int]:
        """A Dask DataFrame ``X`` and Series ``y`` written as a dataset by the workers (never through this
        process), with ``feature_names_in_`` from ``X``'s columns (scikit-learn's rule: all strings).

        Bool columns become 0/1 in place (a dataset built from a table would put them after the numbers,
        and the coefficients must follow ``X``'s order); string and categorical columns are refused with
        what to do (:meth:`storage.Dataset.from_dask` encodes them).
        """
        import dask.dataframe as dd
        import pandas as pd

        from distbelief.storage.internal import dataset_from_frame

        name = type(self).__name__
        if not isinstance(X, dd.DataFrame) or not isinstance(y, dd.Series):
            raise DatasetError(
                f"{name}.fit: with Dask DataFrames pass X as a dask.dataframe.DataFrame and y as a "
                f"dask.dataframe.Series aligned with it (e.g. df[features], df[label]), got X "
                f"{type(X).__name__} and y {type(y).__name__}; or pass both as Dask arrays "
                "(X.to_dask_array(lengths=True))"
            )
        if X.npartitions != y.npartitions and not (X.known_divisions and y.known_divisions):
            # Dask would shuffle both by their index to line them up, and fail if it cannot.
            raise DatasetError(
                f"{name}.fit: X and y must be aligned: X has {X.npartitions} partitions and y "
                f"{y.npartitions}, and their index divisions are unknown; take both from one frame "
                "(df[features], df[label])"
            )
        client = resolve_client(self.client)
        _check_feature_names(self, names_of(X), reset=True)
        frame_as_array(X, f"{name}.fit")  # refuses a column that is not numbers, saying what to do
        bools = {c: np.float64 for c, dt in X.dtypes.items() if pd.api.types.is_bool_dtype(dt)}
        X = X.astype(bools) if bools else X
        # The dataset's columns are named by str(c) (scikit-learn's names, if any, are already these).
        X = (
            X.rename(columns={c: str(c) for c in X.columns})
            if any(not isinstance(c, str) for c in X.columns)
            else X
        )
        if not (pd.api.types.is_numeric_dtype(y.dtype) or self._classifier) or pd.api.types.is_complex_dtype(
            y.dtype
        ):
            raise DatasetError(f"{name}.fit: y must hold real numbers, got dtype {y.dtype}")
        missing = y.isna().sum()
        if self._classifier:
            found, n_missing = client.compute([y.dropna().unique(), missing], sync=True)
            _refuse_missing(name, int(n_missing))
            classes = np.unique(np.asarray(found))
            check_classification_targets(classes)
            self.classes_ = classes
            y = y.map_partitions(_class_index, classes, meta=(y.name, np.float64))
        else:
            _refuse_missing(name, int(client.compute(missing, sync=True)))
        self.n_features_in_ = len(X.columns)
        try:
            if sample_weight is not None or (class_weight is not None and self._classifier):
                label = "__label__"
                while label in X.columns:
                    label += "_"
                frame, column = frame_weights(
                    X.assign(**{label: y}), label, sample_weight, class_weight,
                    self.classes_ if self._classifier else None, client, name,
                )  # fmt: skip
                features = [*map(str, X.columns), column]
                ds = dataset_from_frame(
                    frame, label, features=features, path=f"{store}/data", overwrite=True, client=client
                )
                self._weighted_rows = True
            else:
                ds = dataset_from_frame(X, y, path=f"{store}/data", overwrite=True, client=client)
        except DatasetError as exc:
            if str(exc).startswith("label column"):  # y itself has none missing: X has rows that y has not
                raise DatasetError(
                    f"{name}.fit: y has a missing or infinite label for a row of X (the rows of X and y are "
                    f"matched by their index: a row of X whose index y has not gets none): {exc}"
                ) from exc
            raise
        except InvalidOptionError:  # a ValueError that says what is wrong already
            raise
        except ValueError as exc:  # dask: the partitions of X and y do not line up
            raise DatasetError(
                f"{name}.fit: X and y must be aligned (the same index and partitions, as df[features] and "
                f"df[label] of one frame are): {exc}"
            ) from exc
        return ds, ds.n_rows

    def _is_lazy(self, X: Any) -> bool:
        """Whether ``X`` is a Dask array or DataFrame (predicted by :meth:`_lazy`); then the estimator must
        be fitted."""
        if is_dask_array(X) or is_dask_frame(X):
            check_is_fitted(self)
            return True
        return False

    def _lazy(self, X: Any, method: str, out_cols: int | None, dtype: Any) -> Any:
        """``self.<method>`` of every row block of a Dask array or DataFrame ``X`` on the workers (a lazy
        Dask array), after checking ``X``'s column names here as scikit-learn does."""
        _check_feature_names(self, names_of(X), reset=False)
        if is_dask_frame(X):
            X = frame_as_array(X, f"{type(self).__name__}.{method}")
        if X.ndim != 2:
            raise DatasetError(f"{type(self).__name__}.{method}: X must be 2-D, got shape {X.shape}")
        return map_rows(X, functools.partial(_unnamed_rows, getattr(self, method)), out_cols, dtype)

    def _rows(self, X: Any) -> Any:
        """``X`` checked against the fitted features: float64 rows, CSR for sparse input."""
        check_is_fitted(self)
        out = validate_data(
            self, X, dtype=np.float64, reset=False, accept_sparse="csr" if self._accept_sparse else False
        )
        return _csr(out) if sp.issparse(out) else out

    def fit(self, X: Any, y: Any = None, sample_weight: Any = None) -> Any:
        """Fit on ``X`` (numpy, pandas, Dask array or DataFrame, ``storage.Dataset``; the linear models also
        ``scipy.sparse``) and labels or targets ``y``.

        Parameters
        ----------
        X, y
            The rows and their labels (``y`` is None for a ``storage.Dataset``, which holds its labels). A
            Dask DataFrame ``X`` takes a Dask Series ``y`` aligned with it; the workers write both to the
            fit's store. String column names become ``feature_names_in_``.
        sample_weight : array_like of shape (n_samples,) or float, optional
            Every row's weight in the objective (multiplied by its class's ``class_weight``, if the
            estimator has one). For Dask rows a Dask array (Dask arrays ``X``) or a Dask Series aligned
            with ``X`` (a Dask DataFrame), joined to the rows on the workers; not for a ``storage.Dataset``,
            nor with Downpour's ``eval_data``. :class:`ModelClassifier` needs a model whose
            ``loss_and_grad`` takes a ``sample_weight`` keyword (the built-in ones do).

        Returns
        -------
        self
        """
        name = type(self).__name__
        self._check_options(name, sample_weight)
        seed = self._seed()
        verbose = check_verbose(self.verbose, name)
        check_callback(self.callback, name)
        with fit_store(self.store) as store:
            data, n = self._data(X, y, store, sample_weight, self.class_weight)
            model, terms = self._model(n, seed)
            weights = self._row_weights(sample_weight, data, self.class_weight)
            data, wrap = weighted_data(data, weights, name, downpour_options=self.downpour_options)
            x0 = self._warm_x0(model, terms.pop("x0", None))
            w, nit, result = fit_model(
                wrap(model), data, **terms, solver=self.solver, max_iter=int(self.max_iter),
                tol=float(self.tol), client=self.client, store=store, x0=x0, seed=seed or 0,
                downpour_options=self.downpour_options, name=name, verbose=verbose, callback=self.callback,
            )  # fmt: skip
        return self._fitted(model, w, nit, result)

    def _check_options(self, name: str, sample_weight: Any) -> None:  # pragma: no cover - overridden
        """Raise :class:`InvalidOptionError` for an option of this estimator that is wrong, saying what to
        pass (before anything is read or stored)."""
        raise NotImplementedError

    def _model(self, n: int, seed: int | None) -> tuple[Any, dict[str, Any]]:  # pragma: no cover
        """The model to fit on ``n`` rows and ``fit_model``'s terms for it (``l2``, ``free``; ``l1``, ``x0``
        when not 0 / None)."""
        raise NotImplementedError

    def _fitted(self, model: Any, w: FloatArray, nit: int, result: Any) -> Any:
        """Set what a fit sets (``model_``, ``w_``, ``result_``, ``n_iter_``, :meth:`_set_coef`'s); return
        ``self``."""
        self.model_, self.w_, self.result_ = model, w, result
        # The linear classifiers' n_iter_ is an array of one count, as scikit-learn's.
        self.n_iter_ = np.array([nit], dtype=np.int32) if isinstance(self, _LinearClassifier) else nit
        self._set_coef(model, w)
        return self

    def _set_coef(self, model: Any, w: FloatArray) -> None:
        """The estimator's own fitted attributes (``coef_``, ...) from ``w`` (none by default)."""

    def _warm_x0(self, model: models.Model, x0: FloatArray | None) -> FloatArray | None:
        """The previous fit's parameters with ``warm_start`` (if there was one), else ``x0``.

        The previous model must be the same (same features, classes and layout), else there is nothing
        to start from: an error says so rather than a silent cold start.
        """
        warm = self.warm_start
        if not isinstance(warm, bool | np.bool_):
            raise InvalidOptionError(f"{type(self).__name__}: warm_start must be True or False, got {warm!r}")
        previous = getattr(self, "model_", None)
        if not warm or previous is None:
            return x0
        if previous is not model and (previous != model or previous.n_params != model.n_params):
            raise InvalidOptionError(
                f"{type(self).__name__}: warm_start=True, but the previous fit was {previous!r} and this "
                f"data needs {model!r} (other features, classes or options); set warm_start=False, or fit "
                "data with the same features and classes"
            )
        return np.array(self.w_, dtype=np.float64)

    def _seed(self) -> int | None:
        """``random_state`` as a seed: None, an int, or drawn from a numpy ``RandomState``."""
        rs = self.random_state
        if rs is None:
            return None
        if isinstance(rs, numbers.Integral) and not isinstance(rs, bool) and int(rs) >= 0:
            return int(rs)
        if isinstance(rs, np.random.RandomState):
            return int(rs.randint(0, 2**31 - 1))
        raise InvalidOptionError(
            f"{type(self).__name__}: random_state must be None, an int >= 0 or a numpy RandomState, got "
            f"{rs!r}"
        )

    def _row_weights(
        self, sample_weight: Any, data: Any, class_weight: Any = None
    ) -> FloatArray | WeightColumn | None:
        """Every training row's weight (``sample_weight`` times ``class_weight``), or None for neither.

        ``data`` is what :meth:`_data` returned; per-row weights need its rows in memory (a tuple), or Dask
        input, whose dataset :meth:`_data` wrote with the weights (then a :class:`WeightColumn`).
        """
        if sample_weight is None and class_weight is None:
            return None
        if getattr(self, "_weighted_rows", False):
            return WeightColumn()
        name = type(self).__name__
        if not isinstance(data, tuple):
            weighted_data(data, np.ones(1), name)  # raises, saying what to do
        y = data[1]
        classes = getattr(self, "classes_", None) if self._classifier else None
        return row_weights(sample_weight, class_weight, classes, y, name)


class _ModelProba(ClassifierMixin, _Distbelief):
    """A classifier whose probabilities are its model's ``predict_proba`` (MLPClassifier, ModelClassifier)."""

    _classifier = True

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities ``model_.predict_proba(w_, X)``, shape (n, n_classes), columns in the order
        of ``classes_`` (:class:`ModelClassifier`: only if its model has ``predict_proba``)."""
        if self._is_lazy(X):
            return self._lazy(X, "predict_proba", len(self.classes_), np.float64)
        rows = self._rows(X)
        method = getattr(self.model_, "predict_proba", None)
        if not callable(method):
            raise AttributeError(f"{type(self.model_).__name__} has no predict_proba")
        return np.asarray(method(self.w_, rows), dtype=np.float64)

    def predict_log_proba(self, X: Any) -> Any:
        """``log(predict_proba(X))``."""
        if self._is_lazy(X):
            return self._lazy(X, "predict_log_proba", len(self.classes_), np.float64)
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))


def _refuse_missing(name: str, n_missing: int) -> None:
    if n_missing:
        raise DatasetError(
            f"{name}.fit: y has {n_missing} missing labels; drop those rows first (keep = y.notna(); "
            "X[keep], y[keep])"
        )


def _class_index(labels: Any, classes: NDArray[Any]) -> Any:
    """The labels of one partition as indices into ``classes`` (float64; runs on a worker)."""
    import pandas as pd

    index = np.searchsorted(classes, labels.to_numpy()).astype(np.float64)
    return pd.Series(index, index=labels.index, name=labels.name)


def _unnamed_rows(method: Any, block: FloatArray) -> Any:
    """``method(block)`` on a worker: the block is a numpy array, whose column names were checked on the
    client, so scikit-learn's warning that it has none is not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="X does not have valid feature names")
        return method(block)


def _csr(X: Any) -> sp.csr_array:
    """Checked sparse rows as a ``csr_array`` in canonical form (sorted indices, no duplicates).

    Duplicates are summed and indices sorted in a copy, never in the caller's matrix.
    """
    out = sp.csr_array(X)
    if not out.has_canonical_format:
        out = out.copy()
        out.sum_duplicates()
    return out


def _free_linear(model: models.LeastSquares | models.Logistic | models.Softmax) -> list[tuple[int, int]]:
    """The intercept range of a built-in linear model (empty without an intercept)."""
    if not model.fit_intercept:
        return []
    k = model.n_classes if isinstance(model, models.Softmax) else 1
    return [(model.n_params - k, model.n_params)]


class _LinearClassifier(ClassifierMixin, _Distbelief):
    """Shared by LogisticRegression and SoftmaxRegression."""

    _classifier = True
    _always_softmax = False
    _accept_sparse = True
    C: float
    fit_intercept: bool

    def __init__(
        self,
        penalty: str | None = "l2",
        *,
        C: float = 1.0,
        l1_ratio: float | None = None,
        fit_intercept: bool = True,
        class_weight: dict[Any, float] | str | None = None,
        solver: str = "lbfgs",
        max_iter: int = 100,
        tol: float = 1e-4,
        random_state: Any = None,
        warm_start: bool = False,
        verbose: int = 0,
        callback: Any = None,
        client: Any = None,
        store: str | None = None,
        downpour_options: dict[str, Any] | None = None,
    ) -> None:
        self._keep_params(locals())

    def _check_options(self, name: str, sample_weight: Any) -> None:
        check_common(self.solver, self.penalty, self.max_iter, self.tol, name)
        if not isinstance(self.C, numbers.Real) or isinstance(self.C, bool) or not self.C > 0:
            raise InvalidOptionError(
                f"{name}: C must be a number > 0 (inverse regularization), got {self.C!r}"
            )
        self._l1_ratio()

    def _model(self, n: int, seed: int | None) -> tuple[models.Logistic | models.Softmax, dict[str, Any]]:
        k = len(self.classes_)
        d = int(self.n_features_in_)
        fit_intercept = bool(self.fit_intercept)
        model: models.Logistic | models.Softmax
        if k == 2 and not self._always_softmax:
            model = models.Logistic(d, fit_intercept=fit_intercept)
        else:
            model = models.Softmax(d, k, fit_intercept=fit_intercept)
        # scikit-learn: C * sum loss + r ||coef||_1 + ((1 - r) / 2) ||coef||^2 (r = 0 for "l2", 1 for
        # "l1", l1_ratio for "elasticnet"), i.e. divided by C N: (1/N) sum loss + (r / (C N)) ||coef||_1
        # + ((1 - r) / (2 C N)) ||coef||^2. The intercept is in neither term.
        scale = 0.0 if self.penalty is None else 1.0 / (float(self.C) * n)
        ratio = self._l1_ratio()
        return model, {"l2": (1.0 - ratio) * scale, "l1": ratio * scale, "free": _free_linear(model)}

    def _l1_ratio(self) -> float:
        """The share ``r`` of the penalty that is L1: 0 for "l2" and None, 1 for "l1", ``l1_ratio`` for
        "elasticnet" (a number in [0, 1], required there, as in scikit-learn)."""
        r = self.l1_ratio
        if self.penalty == "l1":
            return 1.0
        if self.penalty != "elasticnet":
            if r is not None and not (isinstance(r, numbers.Real) and float(r) == 0.0):
                # scikit-learn >= 1.8 reads l1_ratio without penalty; ignoring it would fit another model.
                raise InvalidOptionError(
                    f"{type(self).__name__}: l1_ratio={r!r} is used with penalty='elasticnet' (or "
                    f"penalty='l1' for l1_ratio=1), not with penalty={self.penalty!r}"
                )
            return 0.0
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0.0 <= float(r) <= 1.0:
            raise InvalidOptionError(
                f"{type(self).__name__}: penalty='elasticnet' needs l1_ratio, a number in [0, 1] (0: L2, "
                f"1: L1), got {r!r}"
            )
        return float(r)

    def _set_coef(self, model: models.Logistic | models.Softmax, w: FloatArray) -> None:
        d = model.n_features
        if isinstance(model, models.Logistic):
            self.coef_ = w[:d].reshape(1, d).copy()
            self.intercept_ = np.array([w[d] if model.fit_intercept else 0.0])
        else:
            k = model.n_classes
            self.coef_ = w[: d * k].reshape(d, k).T.copy()
            self.intercept_ = w[d * k :].copy() if model.fit_intercept else np.zeros(k)

    def _scores(self, X: Any) -> FloatArray:
        out: FloatArray = np.asarray(X @ self.coef_.T) + self.intercept_
        return out[:, 0] if out.shape[1] == 1 else out

    def decision_function(self, X: Any) -> Any:
        """Logits, shape (n, n_classes); for two classes shape (n,), the logit of ``classes_[1]`` against
        ``classes_[0]`` (scikit-learn's convention)."""
        if self._is_lazy(X):
            cols = None if len(self.classes_) == 2 else len(self.classes_)
            return self._lazy(X, "decision_function", cols, np.float64)
        z = self._scores(self._rows(X))
        return z[:, 1] - z[:, 0] if z.ndim == 2 and z.shape[1] == 2 else z

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities, shape (n, n_classes), columns in the order of ``classes_``."""
        if self._is_lazy(X):
            return self._lazy(X, "predict_proba", len(self.classes_), np.float64)
        z = self._scores(self._rows(X))
        if z.ndim == 1:
            from scipy.special import expit

            p = expit(z)
            return np.column_stack([1.0 - p, p])
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        out: FloatArray = e / e.sum(axis=1, keepdims=True)
        return out

    def predict_log_proba(self, X: Any) -> Any:
        """Log class probabilities, shape (n, n_classes), computed stably (no ``log`` of a rounded 0)."""
        if self._is_lazy(X):
            return self._lazy(X, "predict_log_proba", len(self.classes_), np.float64)
        z = self._scores(self._rows(X))
        if z.ndim == 1:  # log sigmoid(-z), log sigmoid(z)
            out: FloatArray = -np.logaddexp(0.0, np.column_stack([z, -z]))
            return out
        from scipy.special import log_softmax

        return log_softmax(z, axis=1)

    def predict(self, X: Any) -> Any:
        """The most probable class of every row (labels from ``classes_``)."""
        if self._is_lazy(X):
            return self._lazy(X, "predict", None, self.classes_.dtype)
        z = self._scores(self._rows(X))
        index = (z > 0).astype(np.intp) if z.ndim == 1 else np.argmax(z, axis=1)
        return self.classes_[index]


class LogisticRegression(_LinearClassifier):
    """Logistic regression (binary, or multinomial for more classes) fitted on a Dask cluster.

    scikit-learn's meaning of every shared option: it minimizes
    ``C * sum_i loss_i + r ||coef||_1 + ((1 - r) / 2) ||coef||^2`` (intercept not penalized; ``r`` is 0
    for ``penalty="l2"``, 1 for ``"l1"``, ``l1_ratio`` for ``"elasticnet"``), which distbelief solves as
    ``F(w) = (1/N) sum_i loss_i + l1 ||w||_1 + (l2/2) ||w||^2`` with ``l1 = r / (C N)``,
    ``l2 = (1 - r) / (C N)`` and the intercept left out of both terms; an L1 term is minimized by OWL-QN.
    Two classes use :class:`models.Logistic`, more use :class:`models.Softmax`. ``X`` may be
    ``scipy.sparse`` (any format; fitted through the sparse pull/push path).

    Parameters
    ----------
    penalty : {"l2", "l1", "elasticnet", None}
        The penalty on ``coef_``; ``"l1"`` and ``"elasticnet"`` run OWL-QN (``solver="lbfgs"`` only).
    C : float
        Inverse regularization strength (> 0).
    l1_ratio : float, optional
        The elastic net's L1 share in [0, 1] (``penalty="elasticnet"`` only, as scikit-learn's).
    fit_intercept : bool
        Learn an (unpenalized) intercept.
    class_weight : dict, "balanced" or None
        Per-class weights, as scikit-learn's: ``{label: weight}`` (a class left out weighs 1) or
        ``"balanced"`` (``n_samples / (n_classes * counts)``, with ``sample_weight`` weighted counts).
        Every row's weight is its ``sample_weight`` times its class's weight; the objective becomes
        ``C * sum_i s_i loss_i + penalty`` (solved as ``(1/N) sum_i s_i loss_i + ...``). Any rows but a
        ``storage.Dataset`` (for Dask rows the ``"balanced"`` counts are computed on the workers).
    solver : {"lbfgs", "cg", "gd", "downpour"}
        Sandblaster's L-BFGS, CG or gradient descent, or Downpour SGD (``max_iter`` epochs).
    max_iter : int
        Iterations (epochs for Downpour).
    tol : float
        Stop when ``max|grad F| <= tol`` (as scikit-learn's lbfgs).
    random_state : int, numpy RandomState or None
        Seed of the solver's randomness (Downpour's; Sandblaster's methods are deterministic).
    warm_start : bool
        Start from the previous fit's ``coef_`` / ``intercept_`` (same features and classes), else from 0.
    verbose : int
        0: quiet. 1 or more: a progress bar (tqdm) showing the objective once a fit has run 2 s, and a
        log line per iteration at INFO on the ``distbelief.sklearn`` logger (the fit's start and end are
        logged at INFO in any case).
    callback : callable, optional
        Called after every iteration with ``minimize``'s ``sandblaster.IterationRecord`` (Downpour:
        ``downpour.Progress``); raising ``StopIteration`` stops the fit.
    client : distributed.Client, str or None
        The cluster: a client, a scheduler address, or None (the default Dask client, else an embedded
        ``LocalCluster`` shared by the fits of this process). With None, rows in memory whose gradient
        costs milliseconds (nonzeros times parameters per feature up to ``2e7``, fewer than 131,072
        parameters) are fitted in this process with the same method (``minimize(local=True)``): no
        cluster is started for them.
    store : str, optional
        Directory or URL for the fit's data and checkpoints (default: a temporary directory); must be
        reachable by the workers of a remote cluster.
    downpour_options : dict, optional
        Extra keyword arguments of ``downpour.train`` (``lr``, ``batch_size``, ``replicas``, ...).

    Attributes
    ----------
    classes_, coef_, intercept_, n_iter_, n_features_in_
        As in scikit-learn. ``coef_`` has shape (1, n_features) for two classes, else (n_classes,
        n_features).
    feature_names_in_
        The column names, when ``X`` had string ones (pandas or Dask DataFrame), or a dense dataset built
        from a table (its :attr:`storage.Dataset.feature_names`: one-hot columns as ``"column=value"``);
        ``predict`` on a DataFrame with other names or order raises, as in scikit-learn.
    model_, w_, result_
        The distbelief model, its flat parameters and the solver's result.

    Examples
    --------
    >>> from sklearn.datasets import load_breast_cancer
    >>> X, y = load_breast_cancer(return_X_y=True)
    >>> clf = LogisticRegression(C=1.0).fit(X, y)      # doctest: +SKIP
    >>> clf.score(X, y) > 0.9                           # doctest: +SKIP
    True

    Weighted rows, a progress bar for long fits, and a callback that sees every iteration:

    >>> seen = []
    >>> clf = LogisticRegression(class_weight="balanced", verbose=1, callback=seen.append)   # doctest: +SKIP
    >>> clf.fit(X, y, sample_weight=np.where(y == 1, 2.0, 1.0))                            # doctest: +SKIP
    >>> seen[-1].objective, clf.predict_log_proba(X[:1])                                   # doctest: +SKIP

    Sparse rows, and an L1 penalty (a sparse ``coef_``):

    >>> import scipy.sparse as sp
    >>> lasso = LogisticRegression(penalty="l1", C=0.1).fit(sp.csr_array(X), y)   # doctest: +SKIP
    >>> int((lasso.coef_ != 0).sum()) < 30                                         # doctest: +SKIP
    True
    """


class SoftmaxRegression(_LinearClassifier):
    """Multinomial (softmax) logistic regression, for any number of classes >= 2, on a Dask cluster.

    Like :class:`LogisticRegression` (same options and objective) but always :class:`models.Softmax`: two
    classes get two coefficient rows (``coef_`` of shape (n_classes, n_features)).

    Examples
    --------
    >>> from sklearn.datasets import load_iris
    >>> X, y = load_iris(return_X_y=True)
    >>> SoftmaxRegression(C=10.0).fit(X, y).coef_.shape   # doctest: +SKIP
    (3, 4)
    """

    _always_softmax = True


class LinearRegression(RegressorMixin, _Distbelief):
    """Least squares (ridge with ``alpha > 0``) fitted on a Dask cluster by an iterative solver.

    ``alpha`` has scikit-learn's ``Ridge`` meaning: minimize ``||y - X coef - b||^2 + alpha ||coef||^2``,
    solved as ``F(w) = (1/N) sum_i 0.5 r_i^2 + (l2/2)||w||^2`` with ``l2 = alpha / N`` and the intercept
    unpenalized. ``alpha=0`` (default) is ordinary least squares, as scikit-learn's ``LinearRegression``.
    ``X`` may be ``scipy.sparse`` (any format; fitted through the sparse pull/push path).

    Parameters
    ----------
    alpha : float
        L2 strength (>= 0), as ``sklearn.linear_model.Ridge``.
    fit_intercept, solver, max_iter, tol, random_state, warm_start
        As in :class:`LogisticRegression` (``penalty`` is always ``"l2"``).
    verbose, callback, client, store, downpour_options
        As in :class:`LogisticRegression`.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.arange(20.0).reshape(10, 2); y = X @ [1.0, 2.0] + 3.0
    >>> LinearRegression().fit(X, y).predict(X[:2])   # doctest: +SKIP
    array([ 5., 11.])
    """

    _accept_sparse = True

    def __init__(
        self,
        *,
        alpha: float = 0.0,
        fit_intercept: bool = True,
        solver: str = "lbfgs",
        max_iter: int = 1000,
        tol: float = 1e-6,
        random_state: Any = None,
        warm_start: bool = False,
        verbose: int = 0,
        callback: Any = None,
        client: Any = None,
        store: str | None = None,
        downpour_options: dict[str, Any] | None = None,
    ) -> None:
        self._keep_params(locals())

    def _check_options(self, name: str, sample_weight: Any) -> None:
        check_common(self.solver, "l2", self.max_iter, self.tol, name)
        check_alpha(self.alpha, name)

    def _model(self, n: int, seed: int | None) -> tuple[models.LeastSquares, dict[str, Any]]:
        model = models.LeastSquares(int(self.n_features_in_), fit_intercept=bool(self.fit_intercept))
        return model, {"l2": float(self.alpha) / n, "free": _free_linear(model)}

    def _set_coef(self, model: models.LeastSquares, w: FloatArray) -> None:
        d = model.n_features
        self.coef_: FloatArray = w[:d].copy()
        self.intercept_: float = float(w[d]) if model.fit_intercept else 0.0

    def predict(self, X: Any) -> Any:
        """Predicted targets ``X @ coef_ + intercept_``."""
        if self._is_lazy(X):
            return self._lazy(X, "predict", None, np.float64)
        out: FloatArray = np.asarray(self._rows(X) @ self.coef_) + self.intercept_
        return out


class MLPClassifier(_ModelProba):
    """Multilayer perceptron classifier (softmax output) fitted on a Dask cluster.

    ``alpha`` has scikit-learn's meaning: the loss is ``mean cross-entropy + (alpha / (2 N)) ||W||^2`` over
    the weights (biases unpenalized), solved as ``F`` with ``l2 = alpha / N`` and the biases left out.
    Two classes use a 2-unit softmax output (scikit-learn uses one logistic unit: the same family).

    Parameters
    ----------
    hidden_layer_sizes : tuple of int
        Units of each hidden layer.
    activation : {"relu", "tanh", "logistic"}
        Hidden activation (``"identity"`` is not available).
    alpha : float
        L2 strength on the weights (>= 0).
    solver : {"lbfgs", "cg", "gd", "downpour"}
        As in :class:`LogisticRegression` (default L-BFGS, unlike scikit-learn's adam).
    max_iter, tol, warm_start, verbose, callback, client, store, downpour_options
        As in :class:`LogisticRegression` (``warm_start``: from the previous ``coefs_`` /
        ``intercepts_``).
    random_state : int, numpy RandomState or None
        Seed of the initial weights.

    Attributes
    ----------
    coefs_, intercepts_ : list of ndarray
        Weights (n_in, n_out) and biases of every layer, as scikit-learn.

    Examples
    --------
    >>> from sklearn.datasets import load_digits
    >>> X, y = load_digits(return_X_y=True)
    >>> clf = MLPClassifier(hidden_layer_sizes=(16,), random_state=0).fit(X / 16, y)  # doctest: +SKIP
    >>> clf.score(X / 16, y) > 0.9                                                    # doctest: +SKIP
    True
    """

    def __init__(
        self,
        hidden_layer_sizes: tuple[int, ...] = (100,),
        activation: str = "relu",
        *,
        alpha: float = 1e-4,
        solver: str = "lbfgs",
        max_iter: int = 200,
        tol: float = 1e-4,
        random_state: Any = None,
        warm_start: bool = False,
        verbose: int = 0,
        callback: Any = None,
        client: Any = None,
        store: str | None = None,
        downpour_options: dict[str, Any] | None = None,
    ) -> None:
        self._keep_params(locals())

    def _hidden(self) -> list[int]:
        sizes = self.hidden_layer_sizes
        if isinstance(sizes, numbers.Integral):
            sizes = (int(sizes),)
        try:
            hidden = [int(s) for s in sizes]
            ok = all(int(s) == s and s >= 1 for s in sizes)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidOptionError(
                f"MLPClassifier: hidden_layer_sizes must be a tuple of ints >= 1, e.g. (100,), got {sizes!r}"
            )
        return hidden

    def _check_options(self, name: str, sample_weight: Any) -> None:
        check_common(self.solver, "l2", self.max_iter, self.tol, name)
        if self.activation not in _ACTIVATIONS:
            raise InvalidOptionError(
                f"{name}: activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}"
            )
        check_alpha(self.alpha, name)
        self._hidden()

    def _model(self, n: int, seed: int | None) -> tuple[models.MLP, dict[str, Any]]:
        sizes = [int(self.n_features_in_), *self._hidden(), len(self.classes_)]
        model = models.MLP(sizes, activation=_ACTIVATIONS[self.activation])
        # The biases (unpenalized) where the model's own layout puts them: unpack the parameters' indices.
        biases = [b for _, b in model.unpack(np.arange(model.n_params, dtype=np.float64))]
        free = [(int(b[0]), int(b[-1]) + 1) for b in biases]
        return model, {"l2": float(self.alpha) / n, "free": free, "x0": model.init_params(seed)}

    def _set_coef(self, model: models.MLP, w: FloatArray) -> None:
        layers = model.unpack(w)
        self.coefs_ = [W.copy() for W, _ in layers]
        self.intercepts_ = [b.copy() for _, b in layers]
        self.n_layers_ = len(model.layer_sizes)
        self.n_outputs_ = model.layer_sizes[-1]

    def predict(self, X: Any) -> Any:
        """The most probable class of every row (labels from ``classes_``)."""
        if self._is_lazy(X):
            return self._lazy(X, "predict", None, self.classes_.dtype)
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]
