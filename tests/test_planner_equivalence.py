"""The backtest replays what ships, closed loop: one trace through the live system and through the simulator.

Live path (`prewarm up --trace T --history H --duration D`): the trace's first H seconds
(two days and a morning, a daily shape with rates that step every ten minutes) are counted
into Redis by the gateway's own counting code at their past times, as a gateway that had
been running would have; then the real stack starts (gateway, two node agents with their
torch runtimes, the planner worker, exactly one beat) and the next D seconds are sent as
real requests through the real gateway. The planner reads only the counters the gateway
recorded, the real `forecast_and_plan` task plans, the executor dispatches, the agents
load, warm, validate and register. From its first step the planner has two days of history:
its daily profile is fitted and its phase calibration has scored origins.

Simulator path (the run's report): the same arrivals (history and replay, on the same
epoch) under the `prewarm` policy with the run's planner settings, stepping from when the
live planner started, given the run's measured cold starts, actuation delay and service time.

What "equal" means here, and why: the two paths cannot emit identical scale events, since a
real cold start, a real beat and real latencies on a shared CPU are not those of any
replay, and each decision feeds back into the next. (The pure step given identical inputs
is `forecasting.planner.step` in both paths by construction.) Equal is:
- the inputs: the gateway counted every replayed request, and the daily profile the live
  planner learned from the gateway's counters is the one learned from the trace's own
  arrivals (up to the one coarse bucket its first step may see more or less);
- the outcome: the simulated replica-seconds over the replay within 10% of the measured,
  and its requests that waited for a start within max(3, 20%) of the measured (issue 16's
  fidelity bar, `workers.up.fidelity`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prewarm.core.settings import PlannerSettings
from forecasting.forecast.nowcast import DAY_S, fit_profile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two days of history counted and simulated, a replay

PREWARM = str(Path(sys.executable).with_name("prewarm"))
HISTORY_S = 2 * DAY_S + 43 * 600.0 - 30.0  # two days, then a morning: the replay has a rate step 30 s in
REPLAY_S = 150.0
STEP_S = 600.0  # the trace's rates step every ten minutes (ServeGen publishes its rates that way)


def _rate(t: np.ndarray) -> np.ndarray:
    """A daily shape (low at night, high by day), held constant over each ten-minute step."""
    step = np.floor(t / STEP_S) * STEP_S
    day = np.mod(step, DAY_S) / DAY_S
    return 0.2 + 1.4 * (0.5 - 0.5 * np.cos(2 * np.pi * day))


def _trace(path: Path) -> np.ndarray:
    """Seeded Poisson arrivals at `_rate`."""
    rng = np.random.default_rng(3)
    end = HISTORY_S + REPLAY_S + 60
    sec = np.arange(end)
    n = rng.poisson(_rate(sec))
    t = np.sort(np.repeat(sec, n) + rng.random(int(n.sum())))
    with path.open("w") as fh:
        for x in t:
            fh.write(json.dumps({"timestamp": int(round(x * 1000)), "input_length": 16, "output_length": 8,
                                 "hash_ids": []}) + "\n")
    return t


def test_live_closed_loop_and_simulator_agree(tmp_path: Path) -> None:
    t = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_RUNTIME_MODELS_DIR"] = str(tmp_path / "models")
    proc = subprocess.Popen(
        [PREWARM, "up", "--trace", str(tmp_path / "trace.jsonl"), "--history", str(HISTORY_S),
         "--duration", str(REPLAY_S), "--max-rps", "100", "--no-flower", "--out", str(out)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:  # out of time: Ctrl-C stops the run and everything it started
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-4000:] + stderr[-3000:]
    report = json.loads(next(out.glob("run-*/report.json")).read_text())
    rel = t - t[0]  # `prewarm up` counts the trace from its first request
    replayed = int(((rel >= HISTORY_S) & (rel < HISTORY_S + REPLAY_S)).sum())
    assert f"history: {int((rel < HISTORY_S).sum())} requests counted" in stdout

    # the inputs: every replayed request went through the gateway and was counted by it
    assert report["measured"]["requests"] == replayed
    assert report["measured"]["answered_2xx"] == replayed, report["measured"]
    assert report["counted_by_gateway"] == replayed
    # the live planner's daily profile is the one the trace's own arrivals give
    live = report["planner"]
    assert live["profile"] is not None, live
    epoch0, first_step = live["history_start_epoch"], live["first_step_epoch"]
    past = report["history_epoch"] + rel[rel < HISTORY_S] - HISTORY_S  # when each history request was counted
    edges = np.arange(epoch0, np.floor(first_step / 60.0) * 60.0 + 1e-9, 60.0)  # the complete buckets it read
    params = PlannerSettings()  # the live planner's declared season and profile bins (its defaults here)
    expected = fit_profile(np.histogram(past, bins=edges)[0] / 60.0, epoch0, 60.0, bin_s=params.profile_bin_s,
                           season_s=params.season_s)
    assert expected is not None
    got = np.asarray(live["profile"]["values"])
    assert got.shape == (len(expected.values),)
    assert np.max(np.abs(got - np.asarray(expected.values))) <= 0.01, (got[:6], expected.values[:6])

    # the outcome: the simulator on the same arrivals matches the closed loop
    f = report["sim_vs_measured"]
    assert abs(f["replica_seconds_ratio"] - 1.0) <= 0.10, f
    assert abs(f["waited_simulated"] - f["waited_measured"]) <= max(3, 0.2 * f["waited_measured"]), f
    assert report["simulated"]["policies"]["prewarm"]["planner_modes"], report["simulated"]["policies"]["prewarm"]
