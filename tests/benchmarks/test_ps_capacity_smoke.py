"""Smoke test of benchmarks/ps_capacity.py (issue 30, item 4): a tiny grid writes its JSON with the
single-process reference, the fit, a prediction beside every measured row and the 10-shard table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import Client

from benchmarks import ps_capacity


def test_quick_run_writes_rows_fit_and_prediction(tmp_path: Path, client: Client) -> None:
    # On the session's cluster: the script's own would cost a cluster start.
    result = ps_capacity.main(["--quick", "--out", str(tmp_path)], client=client)
    saved = json.loads((tmp_path / "ps_capacity_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"], default=float))
    assert saved["one_process_steps_per_s"] > 0
    assert {(r["replicas"], r["shards"]) for r in saved["rows"]} >= {(1, 1), (4, 1), (4, 2)}
    for r in saved["rows"]:
        assert r["steps_per_s"] > 0 and r["pushes_per_s"] > 0 and r["shard_cpu_s"] > 0
        assert all(g["stop_reason"] == "time_limit" for g in r["rounds"])
        assert r["predicted_bound"] in ("replicas", "shard CPU", "shard network")
    assert saved["fit"]["c_msg"] >= 0 and saved["fit"]["c_byte"] >= 0
    assert [(t["replicas"], t["n"]) for t in saved["prediction"]] == [
        (r, n) for n in (1, 10) for r in ps_capacity.PREDICT_REPLICAS
    ]


def test_the_prediction_is_the_tightest_bound() -> None:
    cost = {"c_msg": 1e-3, "c_byte": 1e-9}
    few = ps_capacity.predict(replicas=2, shards=10, n_params=1000, step_s=0.01, comm_s=0.0, n=1, cost=cost)
    assert few["bound"] == "replicas" and few["steps_per_s"] == pytest.approx(200)
    many = ps_capacity.predict(
        replicas=10**5, shards=1, n_params=1000, step_s=0.01, comm_s=0.0, n=1, cost=cost
    )
    assert many["bound"] == "shard CPU" and many["steps_per_s"] == pytest.approx(1 / (1e-3 + 8e-6))
    big = ps_capacity.predict(
        replicas=10**5,
        shards=1,
        n_params=10**9,
        step_s=0.01,
        comm_s=0.0,
        n=1,
        cost={"c_msg": 0.0, "c_byte": 0.0},
    )
    assert big["bound"] == "shard network" and big["steps_per_s"] == pytest.approx(1.25e9 / 8e9)
    # Every push reaches every shard: more shards make smaller slices, not fewer messages.
    per_message = {"c_msg": 1e-3, "c_byte": 0.0}
    for shards in (1, 10):
        p = ps_capacity.predict(
            replicas=10**5, shards=shards, n_params=1000, step_s=0.01, comm_s=0.0, n=1, cost=per_message
        )
        assert p["bound"] == "shard CPU" and p["steps_per_s"] == pytest.approx(1000)


def test_the_fit_recovers_known_costs() -> None:
    rows = [
        {"shard_cpu_s": k * (2e-4 + 3e-9 * 8 * p), "pushes_per_s": k / 4.0, "wall_s": 4.0, "shards": 1,
         "n_params": p}
        for k, p in [(400, 1000), (100, 400_000), (250, 20_000)]
    ]  # fmt: skip
    fit = ps_capacity.fit_shard_cost(rows)
    assert fit["c_msg"] == pytest.approx(2e-4) and fit["c_byte"] == pytest.approx(3e-9)
