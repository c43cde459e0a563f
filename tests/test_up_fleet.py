"""`prewarm up --models 3` end to end: three models of different sizes under a fleet budget, then nothing left."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.test_up import PREWARM, _env, _wait_gone


@pytest.mark.slow
def test_up_with_three_models_plans_a_fleet_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [PREWARM, "up", "--models", "3", "--duration", "40", "--no-flower", "--out", str(out)],
        env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all processes stopped" in proc.stdout
    reports = list(out.glob("run-*/fleet-report.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    models = report["models"]
    assert set(models) == {"fleet0", "fleet1", "fleet2"}
    assert models["fleet0"]["mem_mb"] > models["fleet1"]["mem_mb"]  # different sizes
    assert sum(m["mem_mb"] for m in models.values()) > report["budget_mb"]  # the budget cannot hold them all
    for m in models.values():
        assert m["ok"] == m["sent"] > 0, models  # the gateway held requests for cold models; none was lost
    assert report["dense_rounds"]["fleet0"] > 0, report["dense_rounds"]  # the steady model: sized by the count planner
    assert [r["policy"] for r in report["simulated"]] == ["keepalive", "hybrid_histogram", "fleet", "oracle"]
    # the fidelity check: the fleet planner replayed on the same arrivals against what the run held and made wait
    fid = report["sim_vs_measured"]
    assert set(fid["by_model"]) == set(models)
    assert fid["gpu_mb_seconds_measured"] > 0 and fid["gpu_mb_seconds_simulated"] > 0
    assert fid["gpu_mb_seconds_measured"] == pytest.approx(sum(m["gpu_mb_seconds_measured"]
                                                              for m in fid["by_model"].values()))
    assert fid["waited_measured"] == sum(m["waited_measured"] for m in fid["by_model"].values())
    assert "fidelity: GPU MB·s ratio" in proc.stdout
    assert "tier" in proc.stdout
    assert _wait_gone(str(tmp_path)) == []
