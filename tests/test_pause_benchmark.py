"""`benchmarks/pauses.py`: the learned pause span on and off, client by client, with the clients chosen before any replay.

The figures on the bursty clients (docs/operating.md, "Built, off by default") come from it, so its rule must
pick what it says, it must replay each client as `prewarm backtest` reads a rate file, and on a tenant whose
pauses outlast the hour the span it learns must show in the waits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.pauses import chosen, main, returns_to_zero
from forecasting.fleet.traces import FleetTrace


def test_returns_to_zero_are_counted_after_the_first_window_with_traffic() -> None:
    assert returns_to_zero(np.array([0, 0, 5, 0, 3, 3, 0, 0, 1])) == 2
    assert returns_to_zero(np.array([0.0, 0.0])) == 0 and returns_to_zero(np.array([2.0, 2.0])) == 0


def test_the_rule_picks_busy_clients_with_returns_busiest_first() -> None:
    counts = np.zeros((10, 3))
    counts[:, 0] = 100.0  # dense: no return
    counts[::2, 1] = 50.0  # four returns, 250 requests
    counts[::2, 2] = 400.0  # four returns, 2,000 requests
    trace = FleetTrace(("dense", "small", "big"), counts, 600.0, "synthetic", "client_rates")
    assert chosen(trace, None, 100.0, 3) == ["big", "small"]
    assert chosen(trace, None, 500.0, 3) == ["big"] and chosen(trace, None, 100.0, 5) == []
    assert chosen(trace, ["dense"], 1e9, 99) == ["dense"]  # named clients are taken as named
    with pytest.raises(SystemExit, match="no client 'nope'"):
        chosen(trace, ["nope"], 0.0, 0)


def test_a_tenant_whose_pauses_outlast_the_hour_waits_less_with_the_learned_span(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 20 minutes at 30 req/s, then two hours without a request, for a day and a half: every return comes after
    # the hour an interruption is held, and the pauses before it say how long to hold
    src = tmp_path / "clients.csv"
    bursts = [s for s in range(0, 36 * 3600, 600) if s % 8400 < 1200]
    rows = [f"bursty,{s},30.0\n" for s in bursts] + [f"steady,{s},1.0\n" for s in range(0, 36 * 3600, 600)]
    src.write_text("client,window_start_s,rate_req_per_s\n" + "".join(rows))
    assert main([str(src), "--min-requests", "1000", "--min-returns", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["clients"]) == ["bursty"]  # the steady client has no return
    bursty = out["clients"]["bursty"]
    assert bursty["requests"] == pytest.approx(30.0 * 600 * len(bursts))  # the client's rates, zeros between
    off, on = bursty["off"], bursty["on"]
    # the returns the hour let go find replicas held (what the level over the learned span expects: a fraction
    # of a burst's need, so fewer waits, not none)
    assert on["share"] < 0.8 * off["share"], bursty
    assert out["waits"] == pytest.approx({k: bursty[k]["share"] * bursty["requests"] for k in ("off", "on")})
    assert out["gpu_hours"] == {k: bursty[k]["gpu_hours"] for k in ("off", "on")}
