"""The backtests' replays side by side (`forecasting.parallel`): the same figures in any number of processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from forecasting.data.traces import RateTrace
from forecasting.fleet.backtest import FleetSetup, run_fleet_backtest
from forecasting.fleet.traces import load_fleet
from forecasting.parallel import check_jobs, run_all
from forecasting.sim.scoring import run_backtest, run_sweep
from forecasting.sim.simulate import SimParams
from prewarm.cli import main

FIX = Path(__file__).parent / "fixtures" / "fleet"
AZURE = [FIX / "azure_functions_d01.csv", FIX / "azure_functions_d02.csv"]


def _pid_and_square(shared: int, item: int) -> tuple[int, int]:
    if item < 0:
        raise ValueError(f"item {item} is negative")
    return os.getpid(), shared + item * item


def test_run_all_keeps_the_order_of_the_items_and_uses_other_processes() -> None:
    items = list(range(12))
    serial = run_all(_pid_and_square, 100, items)
    done: list[int] = []
    side = run_all(_pid_and_square, 100, items, jobs=3, done=done.append)
    assert [v for _, v in side] == [v for _, v in serial] == [100 + i * i for i in items]
    assert {p for p, _ in serial} == {os.getpid()}
    assert os.getpid() not in {p for p, _ in side}
    assert sorted(done) == items


def test_a_failing_replay_raises_in_the_caller_with_its_message() -> None:
    with pytest.raises(ValueError, match="item -1 is negative"):
        run_all(_pid_and_square, 0, [1, 2, -1, 3], jobs=2)


def test_jobs_below_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--jobs must be at least 1, got 0"):
        check_jobs(0)


def test_the_fleet_backtest_gives_the_same_figures_in_two_processes() -> None:
    tr = load_fleet(AZURE)
    setup = FleetSetup(capacity_share=0.5, score_after_s=86_400)
    kw = dict(policies=("keepalive_sleep", "reactive", "fleet"), knobs={"keepalive_sleep": (60.0, 600.0), "fleet": (0.5,)},
              hpa_targets=(0.5,), cold_start_budgets=(0.01,))
    one = run_fleet_backtest(tr, setup=setup, **kw)  # type: ignore[arg-type]
    told: list[str] = []
    two = run_fleet_backtest(tr, setup=setup, jobs=2, progress=told.append, **kw)  # type: ignore[arg-type]
    assert json.dumps(one, default=float) == json.dumps(two, default=float)
    assert len(one["curves"]["fleet"]) == 1 + 1 and len(one["curves"]["keepalive_sleep"]) == 2 + 1
    assert len(told) == 4 + 3 + 2 and "fleet: done" in told  # the defaults (hybrid_histogram's too), the curves


def test_the_sweep_gives_the_same_points_in_two_processes() -> None:
    rng = np.random.default_rng(5)
    tr = RateTrace(window_start_s=np.arange(0, 7200.0, 300.0), rate=rng.uniform(2.0, 12.0, 24), window_s=300.0,
                   source="small")
    knobs: dict[str, tuple[str, tuple[float, ...], float]] = {
        "reactive": ("target", (0.5, 0.7), 0.7), "prewarm": ("cold_start_budget", (0.01, 0.001), 0.001)}
    one = run_sweep(tr, SimParams(), ("reactive", "prewarm", "oracle"), knobs=knobs)
    two = run_sweep(tr, SimParams(), ("reactive", "prewarm", "oracle"), knobs=knobs, jobs=2)
    assert json.dumps(one, default=float) == json.dumps(two, default=float)
    assert len(two["points"]) == 2 + 2 + 1


def test_the_cli_refuses_jobs_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["backtest", *map(str, AZURE), "--jobs", "0", "--no-curve"])
    assert rc == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_the_backtest_gives_the_same_rows_in_two_processes() -> None:
    rng = np.random.default_rng(7)
    tr = RateTrace(window_start_s=np.arange(0, 7200.0, 300.0), rate=rng.uniform(2.0, 12.0, 24), window_s=300.0,
                   source="small")
    policies = ("reactive", "reactive_sized", "prewarm", "oracle")
    one, two = (run_backtest(tr, SimParams(), policies, jobs=j) for j in (1, 2))
    strip = lambda out: {k: {f: v for f, v in s.items() if f != "replay_s"}  # noqa: E731  (wall time differs)
                         for k, s in out["result"]["policies"].items()}
    assert json.dumps(strip(one), default=float) == json.dumps(strip(two), default=float)
    assert json.dumps(one["result"]["rows"], default=float) == json.dumps(two["result"]["rows"], default=float)
    assert all(np.array_equal(one["runs"][p].live, two["runs"][p].live) for p in policies)
    assert two["result"]["policies"]["prewarm"]["cold_start_budget"] == 0.001
