"""Smoke test of benchmarks/small_fits.py (issue 25, item 3): a short run writes every row, scikit-learn's
first, and a verdict on the no-client rows."""

from __future__ import annotations

import json
from pathlib import Path

from distributed import Client

from benchmarks import small_fits


def test_quick_run_writes_every_row_with_its_target(tmp_path: Path, client: Client) -> None:
    # On the session's cluster: the script's own would cost a cluster start.
    result = small_fits.main(["--quick", "--out", str(tmp_path)], client=client)
    saved = json.loads((tmp_path / "small_fits_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    for data in ("breast_cancer", "digits"):
        rows = [r for r in saved["rows"] if r["data"] == data]
        assert [r["run"].split(",")[0].split(" ")[0] for r in rows] == [
            "scikit-learn",
            "distbelief",
            "distbelief",
        ]
        assert rows[0]["extra_ms_over_sklearn"] == 0.0
        assert isinstance(rows[1]["target_met"], bool) and "target_met" not in rows[2]
        # The same problem and method: the same iteration count as scikit-learn's lbfgs, or close.
        assert abs(rows[1]["n_iter"] - rows[0]["n_iter"]) <= 0.2 * rows[0]["n_iter"] + 2
