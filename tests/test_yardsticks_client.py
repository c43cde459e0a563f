"""`benchmarks/yardsticks.py --client`: one tenant of a fleet trace through the single-model yardsticks.

The README's "where prewarm does not win" reads single tenants of m-large's per-client file curve by curve;
this is how they are replayed, so it must take the one client named, as a rate trace, and every policy's curve."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import yardsticks

CLIENTS = Path(__file__).parent / "fixtures" / "fleet" / "client_rates.csv"


def _run(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["yardsticks.py", *args])
    yardsticks.main()


def test_one_client_is_replayed_alone_with_every_policys_curve(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _run(monkeypatch, str(CLIENTS), "--client", "client-periodic", "--quick", "--json")
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["trace"].startswith(f"{CLIENTS}:client-periodic")
    swept = {pt["policy"] for pt in out["points"]}
    assert swept == {"reactive", "reactive_sized", "fixed_pool", "prewarm_fixed_margin", "prewarm", "oracle"}
    assert len([pt for pt in out["points"] if pt["policy"] == "reactive_sized"]) > 1  # a curve, not a point
    assert set(out["at_equal_cold_start_share"]["policies"]) >= {"reactive", "reactive_sized"}


def test_a_client_not_in_the_trace_or_a_trace_without_clients_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(monkeypatch, str(CLIENTS), "--client", "nope", "--quick")
    assert "no model 'nope'" in capsys.readouterr().err
    rates = tmp_path / "rates.csv"  # one model's rates: there is no client to pick
    rates.write_text("window_start_s,rate_req_per_s\n0,1.0\n600,2.0\n")
    with pytest.raises(SystemExit):
        _run(monkeypatch, str(rates), "--client", "x", "--quick")
    assert "is not a fleet trace" in capsys.readouterr().err
