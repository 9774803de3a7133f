"""Smoke run of benchmarks/monitor_cost.py (``--quick``, embedded cluster), so the script cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import monitor_cost


@pytest.mark.timeout(300)
def test_quick_run_counts_and_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "monitor_cost.json"
    result = monitor_cost.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["counted"] == result["counted"]
    counted = result["counted"]
    # Every L-BFGS iteration runs shard ops and at least one replica work call; the workers counted them.
    assert counted["iterations"] > 0 and counted["ops_per_iteration"] >= 1
    assert counted["work_calls_per_iteration"] >= 1
    assert 0 < result["micro"]["op_counter_update_ns"] < 10_000
    assert 0 < result["micro"]["estimated_fraction"] < 0.01  # the page's aim: well under 1% an iteration
    assert result["scrape"]["reads"] > 0
    assert set(result["ab"]["median_ms"]) == {"off", "on", "on+scrape"}
    assert "shard ops" in capsys.readouterr().out
