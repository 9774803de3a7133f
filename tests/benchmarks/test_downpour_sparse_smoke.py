"""Smoke test of benchmarks/downpour_sparse.py (issue 29, item 5): a tiny run writes its JSON with the
one-process reference first, both Downpour rows and the verdicts; the reference's update is Adagrad's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from distributed import Client

from benchmarks import downpour_sparse


def test_quick_run_writes_every_row_with_its_target(client: Client, tmp_path: Path) -> None:
    result = downpour_sparse.main(["--quick", "--out", str(tmp_path)], client=client)
    saved = json.loads((tmp_path / "downpour_sparse_quick.json").read_text())
    assert [r["run"] for r in saved["rows"]] == [r["run"] for r in result["rows"]]
    ref, one, two = saved["rows"]
    assert ref["run"].startswith("one process") and ref["rows_over_one_process"] == 1.0
    assert one["run"] == "Downpour, 1 replica" and two["run"] == "Downpour, 2 replicas"
    for r in (one, two):
        assert r["rows_per_s"] > 0 and all(g["stop_reason"] == "epochs" for g in r["rounds"])
        assert all(g["communication"] == "sparse" for g in r["rounds"])
    assert isinstance(two["rows_target_met"], bool) and isinstance(two["objective_target_met"], bool)
    # One epoch of Adagrad from zero: the reference's mean loss falls below ln 2 (its value at w = 0); every
    # row's is finite (a Downpour row of the quick set once ended at 0.71, its replicas a few steps stale).
    assert ref["objective"] < np.log(2.0)
    assert all(np.isfinite(r["objective"]) for r in saved["rows"])


def test_the_reference_is_adagrad_on_the_touched_keys() -> None:
    rng = np.random.default_rng(0)
    X = sp.random_array((64, 30), density=0.2, random_state=rng, format="csr")
    y = (rng.random(64) < 0.5).astype(float)
    w, _ = downpour_sparse.sparse_adagrad_epoch(X, y, lr=0.3, batch=64, seed=0)
    # One batch of all rows: w = -lr * g / (|g| + eps) on every key the rows touch, 0 elsewhere.
    Xd = X.toarray()
    g = Xd.T @ (0.5 - y) / 64
    touched = np.abs(Xd).sum(axis=0) > 0
    want = np.where(touched, -0.3 * g / (np.abs(g) + 1e-8), 0.0)
    np.testing.assert_allclose(w[:-1], want, rtol=1e-12, atol=1e-15)
    gb = float(np.sum(0.5 - y) / 64)
    np.testing.assert_allclose(w[-1], -0.3 * gb / (abs(gb) + 1e-8), rtol=1e-12)
