"""Smoke test of benchmarks/scale.py on tiny sizes, so the script cannot rot (the 1e8 run is its own)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import scale


def test_the_ctr_set_is_hashed_power_law_rows_of_about_forty_features() -> None:
    X, y = scale.hashed_csr(2000, 12)
    assert X.shape == (2000, 4096) and y.shape == (2000,)
    per_row = np.diff(X.indptr)
    assert per_row.max() == scale.NNZ_PER_ROW and per_row.mean() > 35  # collisions add up, rarely
    counts = np.sort(np.bincount(X.indices, minlength=4096))[::-1]
    assert counts[0] > 20 * np.median(counts)  # a few features in most rows, a long tail
    assert 0.2 < y.mean() < 0.8
    X2, y2 = scale.hashed_csr(2000, 12)
    assert (X != X2).nnz == 0 and np.array_equal(y, y2)


def test_quick_run_writes_json_and_png_with_both_methods_and_both_modes(tmp_path: Path) -> None:
    merged = tmp_path / "merged.json"
    result = scale.main(["--quick", "--sizes", "10", "--out", str(tmp_path), "--merge-into", str(merged)])
    saved = json.loads((tmp_path / "scale_quick.json").read_text())
    assert (tmp_path / "scale_quick.png").stat().st_size > 0
    rows = {(r["method"], r.get("communication")): r for r in saved["rows"]}
    sparse, dense = rows["distbelief", "sparse"], rows["distbelief", "dense"]
    theirs = rows["scipy L-BFGS-B", None]
    for ours in (sparse, dense):
        assert ours["status"] == theirs["status"] == "ok", (ours["status"], theirs["status"])
        assert ours["nit"] == theirs["nit"] == 2
        assert ours["fun"] == pytest.approx(theirs["fun"], rel=1e-6)  # same objective, same algorithm
        assert {"coordinator"} < set(ours["processes"]) and len(ours["processes"]) == 3
        assert all(p["rss_peak_sampled"] > 10 * 2**20 for p in ours["processes"].values())
        assert ours["shard_op_seconds"]  # where the shards' time went
        assert ours["history_dtype"] == "float64"  # "auto": a tiny model's history fits
    # Measured (keys included): dense pulls x whole at every fetch; sparse sends per shard whichever of
    # keys and the whole slice is smaller, so it never moves more per message.
    assert dense["pull_bytes_per_eval"] == dense["dense_pull_bytes_per_eval_model"]
    assert sparse["bytes_per_eval"] <= 1.05 * dense["bytes_per_eval"]
    assert sparse["fun"] == pytest.approx(dense["fun"], rel=1e-12)
    ops = {(r["op"], r["where"]) for r in result["spill_ops"]}
    assert ("axpy", "spilled") in ops and ("axpy", "ram") in ops
    # Merging: rows keep their run's command; a second run of the same size replaces them.
    first = json.loads(merged.read_text())
    assert len(first["rows"]) == 3 and all(r["run_argv"] for r in first["rows"])
    again = scale.merge_runs(merged, {**result, "rows": result["rows"][:1]})
    assert len(again["rows"]) == 1 and merged.with_suffix(".png").stat().st_size > 0


def test_scipy_out_of_memory_is_recorded_not_fatal() -> None:
    X, y = scale.hashed_csr(500, 10)
    row = scale.run_scipy(X, y, maxiter=2, memory_gb=0.05, timeout=60)
    assert row["status"] != "ok"


def test_the_history_dtype_is_passed_on_and_bad_ones_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.parse([]).history_dtype == "auto"
    assert scale.parse(["--history-dtype", "float32"]).history_dtype == "float32"
    with pytest.raises(SystemExit):
        scale.parse(["--history-dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
