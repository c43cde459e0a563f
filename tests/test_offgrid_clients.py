"""`benchmarks/offgrid_clients.py`: a per-client rate file with every client's steps moved off the window grid.

The fleet's off-grid figures (README) come from it, so it must keep each client's rates and their order,
move the boundaries off the 600 s grid, move them differently per client, and write what the fleet
backtest reads."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

import numpy as np

from benchmarks.offgrid_clients import main, offgrid_clients
from forecasting.fleet.traces import FleetTrace, read_client_rates


def _rates() -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(5)
    return {f"c{k}": {i * 600: float(r) for i in range(48) if (r := rng.integers(0, 4)) > 0} for k in range(3)}


def _trace(rates: dict[str, dict[int, float]]) -> FleetTrace:
    counts = np.zeros((48, len(rates)))
    for k, per in enumerate(rates.values()):
        for s, r in per.items():
            counts[s // 600, k] = r * 600.0
    return FleetTrace(tuple(rates), counts, 600.0, "synthetic", "client_rates")


def test_each_client_keeps_its_rates_in_order_with_its_steps_off_the_grid() -> None:
    rates = _rates()
    trace = _trace(rates)
    out = list(offgrid_clients(trace, seed=1))
    moved = set()
    for client, rows in groupby(out, key=lambda r: r[0]):
        rows_ = list(rows)
        starts = [s for _, s, _ in rows_]
        assert starts == sorted(starts) and all(s % 60 == 0 for s in starts)
        # the rates of consecutive windows with traffic, in order (a window keeps >= 120 s: +-40% each side)
        runs = [rate for rate, _ in groupby(r for _, _, r in rows_)]
        want = [rate for rate, _ in groupby(rates[client][s] for s in sorted(rates[client]))]
        assert runs == want
        changes = [b[1] for a, b in zip(rows_, rows_[1:]) if a[2] != b[2] or b[1] - a[1] > 60]
        moved.add(tuple(changes))
        assert any(s % 600 for s in changes), f"{client}: every step still on the 600 s grid"
    assert len(moved) == 3  # each client's boundaries moved its own way
    assert out == list(offgrid_clients(trace, seed=1)) != list(offgrid_clients(trace, seed=2))


def test_the_fleet_backtest_reads_the_variant(tmp_path: Path) -> None:
    src = tmp_path / "clients.csv"
    src.write_text("client,window_start_s,rate_req_per_s,cv\n" + "".join(
        f"{c},{s},{r},1.0\n" for c, per in _rates().items() for s, r in sorted(per.items())))
    dst = tmp_path / "offgrid.csv"
    assert main([str(src), str(dst), "3"]) == 0
    trace = read_client_rates(dst)
    assert trace.names == ("c0", "c1", "c2") and trace.step_s == 60.0
    original = read_client_rates(src)
    # same rates, boundaries moved by at most 40% of a window: the totals differ by the moved edges only
    assert np.allclose(trace.counts.sum(axis=0), original.counts.sum(axis=0), rtol=0.25)
    assert main([str(src)]) == 2
