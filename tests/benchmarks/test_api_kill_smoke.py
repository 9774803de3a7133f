"""benchmarks/api_kill.py's ``--quick`` run: the service killed with SIGKILL mid-job, started again, and the
job resumed from a shard checkpoint to its exact end (on the session's cluster; writes to a tmp path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import Client

from benchmarks import api_kill


@pytest.mark.timeout(400)
def test_api_kill_quick_run(client: Client, tmp_path: Path) -> None:
    out = tmp_path / "kill.json"
    assert client.scheduler is not None
    result = api_kill.main(["--quick", "--out", str(out)], scheduler=client.scheduler.address)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    total = result["reference"]["steps"]
    assert result["reference"]["status"] == "succeeded" and total > 0
    (kill,) = result["kills"]
    # Killed mid-run (not before its first step, not after its last), resumed once from a checkpoint at or
    # before the kill, and ended at its epochs with the reference's steps exactly.
    assert 0.5 * total <= kill["steps_at_kill"] < total, kill
    assert kill["restarts"] == 1 and 0 <= kill["resumed_from"] <= kill["steps_at_kill"], kill
    assert kill["status"] == "succeeded" and kill["stop_reason"] == "epochs" and kill["steps"] == total, kill
    assert kill["lost_share"] == round(kill["lost_steps"] / total, 4)
    assert result["target"]["met"] == (result["worst_lost_share"] <= api_kill.TARGET_LOST_SHARE)
