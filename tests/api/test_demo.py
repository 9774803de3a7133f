"""``distbelief demo`` (the README's first command) runs both jobs through the REST API, prints a table."""

from __future__ import annotations

import re

import pytest
from distributed import Client as DaskClient

from distbelief.api.cli import main


def test_demo_runs_both_jobs_through_the_api(client: DaskClient, capsys: pytest.CaptureFixture[str]) -> None:
    # On the session's cluster (--scheduler) rather than an embedded one, to keep the test quick.
    assert main(["demo", "--no-keep", "--scheduler", client.scheduler.address]) == 0
    out = capsys.readouterr().out
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", out)
    rows = {
        m.group(1).strip(): m.groups()[1:]
        for m in re.finditer(r"^(.{28}) (\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    }
    ours, scipy_row = rows["Sandblaster L-BFGS"], rows["SciPy L-BFGS-B, 1 process"]
    assert ours[0] == scipy_row[0] == "succeeded"
    # The oracle: SciPy's L-BFGS-B reaches the same objective (6 printed decimals) and accuracy.
    assert float(ours[3]) == pytest.approx(float(scipy_row[3]), abs=2e-6)
    assert float(ours[4]) == pytest.approx(float(scipy_row[4]), abs=0.01)
    downpour = rows["Downpour Adagrad"]
    assert downpour[0] == "succeeded" and int(downpour[1]) > 0
    assert float(downpour[3]) < 2.302  # below F(0) = log(10): it learned something


def test_demo_keeps_serving_until_ctrl_c_unless_no_keep(capsys: pytest.CaptureFixture[str]) -> None:
    from distbelief.api import cli

    parser = cli._parser()
    assert parser.parse_args(["demo"]).keep is True
    assert parser.parse_args(["demo", "--no-keep"]).keep is False
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            raise KeyboardInterrupt

    cli.serve_until_interrupted("http://127.0.0.1:1234", sleep=sleep)
    assert len(slept) == 3  # it kept waiting until the (simulated) Ctrl-C
    out = capsys.readouterr().out
    assert "serving the dashboard at http://127.0.0.1:1234/ until Ctrl-C" in out and "--no-keep" in out
