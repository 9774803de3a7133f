"""Smoke test of benchmarks/hashed_text.py (issue 26, item 1): a small run writes scikit-learn's rows first
and ours with its objective against theirs."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import hashed_text


def test_quick_run_writes_the_rows_and_the_verdict(tmp_path: Path) -> None:
    hashed_text.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "hashed_text_quick.json").read_text())
    runs = [r["run"] for r in saved["rows"]]
    assert runs[0].startswith("scikit-learn lbfgs, all columns") and runs[-1].startswith("distbelief")
    assert saved["rows"][0]["seconds_over_sklearn"] == 1.0
    assert saved["rows"][-1]["objective_target_met"] is True
