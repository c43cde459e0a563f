"""`prewarm backtest --rollout-at`: prewarm's rollout against the timer-driven shift, on a real dense trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prewarm.cli import main


def backtest(traces_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, dict[str, Any]]:
    argv = ["backtest", str(traces_dir / "servegen_m_large_rate.csv"), "--limit-s", "21600", "--policies",
            "reactive,prewarm", "--json", *extra]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("  rollout_prewarm") for line in out)  # the readable rows
    return json.loads(out[-1])["policies"]


def test_prewarm_rollout_waits_for_capacity_the_timer_does_not(traces_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rows = backtest(traces_dir, capsys, "--rollout-at", "10800", "--rollout-pause", "300")
    pre, timer = rows["rollout_prewarm"], rows["rollout_timer"]
    for row in (pre, timer):
        assert {"cold_start_share", "gpu_hours_vs_reactive", "waited_during_shift"} <= set(row)
        assert row["completed_at_s"] is not None
        assert row["shift_window_s"] == pre["shift_window_s"]  # both scored on the same requests
    assert timer["waited_during_shift"] > 0  # the timer shifts onto canary replicas still loading
    assert pre["waited_during_shift"] <= 0.1 * timer["waited_during_shift"]
    assert pre["gpu_hours"] <= 1.1 * timer["gpu_hours"]
    # the ablation: the same planner sizing with the shift on the timer still waits; the gating removes it
    planned = rows["rollout_timer_planned"]
    assert planned["waited_during_shift"] > 0
    assert pre["waited_during_shift"] <= 0.1 * planned["waited_during_shift"]
    # the timer shifts on the clock; prewarm's shifts come no earlier, once the canary is ready
    t_shifts = [t for t, _ in timer["shifts"]]
    p_shifts = [t for t, _ in pre["shifts"]]
    assert [w for _, w in pre["shifts"]] == [w for _, w in timer["shifts"]] == [5, 25, 50, 100]
    assert all(p >= t for p, t in zip(p_shifts, t_shifts))


@pytest.mark.parametrize("extra, message", [
    (["--rollout-at", "100", "--rollout-steps", "50,25,100"], "steps out of order"),
    (["--rollout-at", "999999"], "outside the trace"),
    (["--rollout-at", "100", "--rollout-pause", "0"], "pause must be positive"),
])
def test_bad_rollout_scenarios_are_refused(traces_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                           message: str) -> None:
    argv = ["backtest", str(traces_dir / "servegen_m_large_rate.csv"), "--limit-s", "3600", "--policies", "reactive",
            *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
