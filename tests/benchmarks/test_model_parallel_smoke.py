"""Smoke test of benchmarks/model_parallel.py on the session's cluster, so the script cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from distributed import LocalCluster

from benchmarks import model_parallel


def test_quick_run_writes_json_and_png_with_traffic_by_partitions(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    argv = [
        "--quick",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--skip-memory",
        "--n-sync",
        "2",
        "--out",
        str(tmp_path),
    ]
    result = model_parallel.main(argv, cluster=cluster)
    stored = json.loads((tmp_path / "model_parallel_quick.json").read_text())
    assert (tmp_path / "model_parallel_quick.png").stat().st_size > 0
    assert set(stored["timings"]) == {"small_lc", "large_lc", "small_lc2d", "large_lc2d", "mlp"}
    assert set(stored["in_process_ms"]) == set(stored["timings"]) and stored["n_sync"] == 2
    assert all(ms > 0 for ms in stored["in_process_ms"].values())  # the single-process numpy reference row
    for name, rows in result["timings"].items():
        assert [r["partitions"] for r in rows] == [1, 2, 4]
        assert rows[0]["messages_per_step"] == 0 and all(r["ms_per_batch"] > 0 for r in rows)
        # Every K beside the in-process reference, at the n_fetch = n_push asked for.
        assert all(r["in_process_ms"] == stored["in_process_ms"][name] for r in rows)
        assert all(r["n_fetch"] == r["n_push"] == 2 for r in rows)
        assert rows[1]["messages_per_step"] < rows[2]["messages_per_step"], name
    # The locally connected models exchange halos only; the MLP all-gathers every hidden layer.
    for lc in ("large_lc", "large_lc2d"):
        assert (
            result["timings"]["mlp"][2]["messages_per_step"] > result["timings"][lc][2]["messages_per_step"]
        )
