"""scikit-learn estimators trained by distbelief's Sandblaster or Downpour on a Dask cluster.

:class:`LogisticRegression`, :class:`SoftmaxRegression`, :class:`LinearRegression` and
:class:`MLPClassifier` follow scikit-learn's conventions (``fit``/``predict``/``predict_proba``/``score``,
``coef_``, ``intercept_``, ``n_iter_``, ``get_params``/``set_params``, ``C``/``alpha`` with scikit-learn's
meaning, unpenalized intercepts), so they work in a ``Pipeline`` and ``GridSearchCV``; ``fit`` accepts numpy
arrays, pandas, Dask arrays and Dask DataFrames (written to zarr by the workers, never through this process)
and a ``storage.Dataset``; ``feature_names_in_`` holds string column names (of a DataFrame, or a dataset
built from a table), checked by ``predict`` as scikit-learn checks them. The linear estimators also
take ``scipy.sparse`` rows (any format, e.g. a ``HashingVectorizer``'s output) and Datasets of sparse rows,
fitted through Sandblaster's sparse pull/push path, and ``penalty="l1"`` / ``"elasticnet"`` (OWL-QN).
As in scikit-learn, ``fit`` takes ``sample_weight`` (and the linear classifiers ``class_weight``), the
estimators take ``warm_start``, ``random_state`` and ``verbose`` (a progress bar with the objective, INFO logs
on the ``distbelief.sklearn`` logger), and the classifiers have ``predict_log_proba``; ``callback=`` is
``sandblaster.minimize``'s (see ``_base`` for how per-row weights reach the replicas).

This is a package inside ``distbelief/`` rather than a top-level folder symlinked in like the others: a
top-level ``sklearn/`` folder would shadow scikit-learn itself whenever the repository root is on
``sys.path`` (pytest, a checkout).

Examples
--------
>>> from sklearn.datasets import load_breast_cancer
>>> from sklearn.pipeline import make_pipeline
>>> from sklearn.preprocessing import StandardScaler
>>> from distbelief.sklearn import LogisticRegression
>>> X, y = load_breast_cancer(return_X_y=True)
>>> pipe = make_pipeline(StandardScaler(), LogisticRegression(C=0.5)).fit(X, y)   # doctest: +SKIP
>>> pipe.score(X, y) > 0.95                                                       # doctest: +SKIP
True
"""

from ._estimators import (
    LinearRegression,
    LogisticRegression,
    MLPClassifier,
    SoftmaxRegression,
)
from ._from_model import from_model
from ._generic import ModelClassifier

__all__ = [
    "LinearRegression",
    "LogisticRegression",
    "MLPClassifier",
    "ModelClassifier",
    "SoftmaxRegression",
    "from_model",
]
