"""``sandblaster.minimize(local=True)``: the same methods in this process (an InProcessSpace on the rows in
memory), against SciPy and against a cluster run; and the options that have no meaning there."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import scipy.sparse as sp
from distributed import Client

from distbelief import models, sandblaster
from distbelief.errors import InvalidOptionError
from distbelief.storage import Dataset, train_test_split_digits
from tests.sandblaster._reference import minimize_cg_reference, minimize_gd_reference
from tests.sandblaster.conftest import Problem


def test_lbfgs_matches_scipy_and_a_cluster_run(client: Client, logistic_digits: Problem) -> None:
    p = logistic_digits
    local = sandblaster.minimize(p.model, (p.X, p.y), x0=p.x0, l2=p.l2, local=True)
    ref = p.scipy()
    assert local.success and local.stats["local"] is True and local.store == ""
    assert local.nit == ref.nit and local.fun == pytest.approx(ref.fun, rel=1e-10)
    on_cluster = sandblaster.minimize(p.model, (p.X, p.y), x0=p.x0, l2=p.l2, client=client)
    assert on_cluster.nit == local.nit and on_cluster.fun == pytest.approx(local.fun, rel=1e-12)
    np.testing.assert_allclose(on_cluster.x, local.x, rtol=1e-8, atol=1e-10)
    assert local.history.sizes["iteration"] == local.nit + 1


@pytest.mark.parametrize("method", ["cg", "gd"])
def test_cg_and_gd_reach_scipys_objective(logistic_digits: Problem, method: Literal["cg", "gd"]) -> None:
    p = logistic_digits
    res = sandblaster.minimize(p.model, (p.X, p.y), x0=p.x0, l2=p.l2, method=method, local=True, maxiter=5000)
    assert res.success, res.message
    assert res.fun == pytest.approx(p.scipy().fun, rel=1e-5)  # both stopped at max|g| <= 1e-5


def test_owlqn_on_sparse_rows_and_the_callback() -> None:
    rng = np.random.default_rng(0)
    X = sp.random_array((300, 40), density=0.1, random_state=rng, format="csr")
    y = (X @ rng.normal(size=40) > 0).astype(float)
    model = models.Logistic(40)
    seen: list[int] = []
    res = sandblaster.minimize(
        model, (X, y), method="owlqn", l1=0.01, l1_exclude=[(40, 41)], local=True,
        callback=lambda rec: seen.append(rec.iteration),
    )  # fmt: skip
    assert res.success and 0 < np.count_nonzero(res.x[:40]) < 40
    assert seen == list(range(1, res.nit + 1))
    # The L1 term counts in F: the objective at x plus l1 * |w| over the penalized parameters.
    f, _ = models.objective(model, res.x, X, y)
    assert res.fun == pytest.approx(f + 0.01 * np.abs(res.x[:40]).sum(), rel=1e-12)

    def stop(rec: Any) -> None:
        if rec.iteration == 3:
            raise StopIteration

    stopped = sandblaster.minimize(model, (X, y), method="owlqn", l1=0.01, local=True, callback=stop)
    assert not stopped.success and stopped.nit == 3 and "callback" in stopped.message


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"replicas": 2}, "replicas=2 has no meaning with local=True"),
        ({"shards": 2}, "shards=2 has no meaning"),
        ({"partitions": 2}, "partitions=2 has no meaning"),
        ({"checkpoint_every": 1}, "checkpoint_every=1 has no meaning"),
        ({"local": "yes"}, "local='yes' is invalid: expected True or False"),
        ({"store": "somewhere"}, "no client= or store="),
    ],
)
def test_options_of_the_cluster_are_refused(options: dict[str, Any], match: str) -> None:
    X, y, _, _ = train_test_split_digits(seed=0)
    kw: dict[str, Any] = {"local": True, **options}
    with pytest.raises(InvalidOptionError, match=match):
        sandblaster.minimize(models.Softmax(64, 10), (X, y), **kw)


def test_a_client_or_a_dataset_is_refused(client: Client, tmp_path: Path) -> None:
    X, y, _, _ = train_test_split_digits(seed=0)
    with pytest.raises(InvalidOptionError, match="no client="):
        sandblaster.minimize(models.Softmax(64, 10), (X, y), local=True, client=client)
    ds = Dataset.from_arrays(X, y, path=tmp_path / "d", label_kind="classes", n_classes=10)
    with pytest.raises(InvalidOptionError, match=r"give data as \(X, y\) arrays"):
        sandblaster.minimize(models.Softmax(64, 10), ds, local=True)


def test_restart_every_and_maxls_reach_cg(logistic_digits: Problem) -> None:
    # The numpy oracle restarted every iteration (beta = 0: steepest descent with CG's line search), with
    # the same cap on line-search evaluations; plain CG takes another path.
    p = logistic_digits
    kw: dict[str, Any] = {"x0": p.x0, "l2": p.l2, "method": "cg", "local": True, "maxiter": 15}
    ref = minimize_cg_reference(p.fun_and_grad, p.x0, restart_every=1, maxls=30, maxiter=15)
    restarted = sandblaster.minimize(p.model, (p.X, p.y), restart_every=1, maxls=30, **kw)
    assert restarted.nit == ref.nit == 15
    np.testing.assert_allclose(restarted.x, ref.x, rtol=1e-9, atol=1e-12)
    plain = sandblaster.minimize(p.model, (p.X, p.y), maxls=30, **kw)
    assert np.abs(plain.x - restarted.x).max() > 1e-3


def test_step_and_maxls_reach_gradient_descent(logistic_digits: Problem) -> None:
    p = logistic_digits
    kw: dict[str, Any] = {"x0": p.x0, "l2": p.l2, "method": "gd", "local": True}
    # A first trial step of 1e3 needs ~10 halvings: the oracle with the same step and cap, step for step.
    ref = minimize_gd_reference(p.fun_and_grad, p.x0, step=1e3, max_evals=12, maxiter=5)
    res = sandblaster.minimize(p.model, (p.X, p.y), step=1e3, maxls=12, maxiter=5, **kw)
    assert (res.nit, res.nfev) == (ref.nit, ref.nfev)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-9, atol=1e-12)
    assert res.nfev > sandblaster.minimize(p.model, (p.X, p.y), maxls=12, maxiter=5, **kw).nfev
    # Capped at 2 evaluations, the first search cannot shrink 1e3 far enough: a line search failure.
    capped = sandblaster.minimize(p.model, (p.X, p.y), step=1e3, maxls=2, **kw)
    assert (capped.success, capped.status, capped.nit) == (False, 2, 0), capped.message
    assert "line search" in capped.message
