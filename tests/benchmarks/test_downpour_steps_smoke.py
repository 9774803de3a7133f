"""Smoke test of benchmarks/downpour_steps.py (issue 30): a tiny run writes its JSON with every row, the
single-process reference among them, and a verdict on each target."""

from __future__ import annotations

import json
from pathlib import Path

from distributed import Client

from benchmarks import downpour_steps


def test_quick_run_writes_every_row_with_its_target(client: Client, tmp_path: Path) -> None:
    # On the session's cluster: the script's own would cost a cluster start.
    result = downpour_steps.main(["--quick", "--out", str(tmp_path)], client=client)
    saved = json.loads((tmp_path / "downpour_steps_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {r["run"]: r for r in saved["rows"]}
    assert {"kernel", "numpy, one process", "Downpour, 1 replica, n=10", "Downpour, 2 replicas, n=10"} <= set(
        rows
    )
    assert rows["numpy, one process"]["over_one_process"] == 1.0
    for name in ("Downpour, 1 replica, n=10", "Downpour, 2 replicas, n=10"):
        r = rows[name]
        assert r["steps"] > 0 and all(g["stop_reason"] == "time_limit" for g in r["rounds"])
        assert isinstance(r["target_met"], bool) and isinstance(r["overrun_target_met"], bool)
        assert r["returned_after_s"] >= saved["time_limit"]
