"""benchmarks/sizing.py: a quick run (a small checkpoint measured on the embedded cluster), and the sizing
table of docs/operations.md is the script's output for the saved results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sizing

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_quick_run_writes_a_row_per_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sizing.json"
    result = sizing.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [r["n_params"] for r in result["rows"]] == [10**7, 10**8, 10**9]
    figures = result["figures"]
    assert figures["lbfgs_vectors_per_shard"] == 26  # 2m + 6 at m = 10, as the admission check budgets
    assert figures["checkpoint_gb_s"] > 0 and figures["shard_op_gb_s"] > 1
    for row in result["rows"]:
        # A worker's shard, replica (or partition) and process fit the share the table allows.
        assert row["worker_bytes"] <= sizing.WORKER_SHARE * row["worker_memory"]
        assert row["lbfgs_bytes_per_shard"] <= figures["shard_memory_fraction"] * row["worker_memory"]
        assert row["lbfgs_shards"] >= 2 and row["workers"] == row["lbfgs_shards"]
    assert "| 1e+09 |" in capsys.readouterr().out


def test_the_operations_page_shows_the_saved_table() -> None:
    saved = json.loads((ROOT / "benchmarks" / "results" / "sizing.json").read_text())
    assert not saved["quick"]
    assert sizing.markdown(saved["rows"]) in (ROOT / "docs" / "operations.md").read_text()
