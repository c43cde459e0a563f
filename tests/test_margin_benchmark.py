"""`benchmarks/margin.py`: the cold-start budget's margin along a replay, its wait episodes and the fixed-margin ablation.

The docs' reading of where the integrator's path costs (docs/operating.md, "a gain that falls as the evidence
grows") rests on it: the episodes must be found where the waits are, with the margin in force before them and the
lift they gave it, and their waits must be the replay's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.margin import episodes, main, mean_margin


def test_waits_further_apart_than_the_gap_are_two_episodes() -> None:
    # (time, margin after the decision, waits seen at it)
    path = np.array([[0, 6, 0], [10, 5, 0], [20, 5, 3], [30, 7, 2], [40, 9, 0], [100, 8, 0], [110, 8, 4],
                     [120, 10, 0], [130, 9, 0]], dtype=np.float64)
    one, two = episodes(path, 1000.0), episodes(path, 50.0)
    assert len(one) == 1 and one[0] == {"start_s": 20.0, "end_s": 110.0, "waits": 9.0, "margin_before": 5.0,
                                        "margin_peak": 10.0}
    assert [(e["start_s"], e["waits"], e["margin_before"], e["margin_peak"]) for e in two] == \
        [(20.0, 5.0, 5.0, 9.0), (110.0, 4.0, 8.0, 10.0)]  # each peak read until the next episode
    assert episodes(path[:2], 50.0) == []
    assert mean_margin(path[:3]) == pytest.approx(5.5)  # 6 for 10 s, 5 for 10 s


def test_an_unforecast_step_is_an_episode_that_lifts_the_margin(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # six hours at 10 req/s, with a step to 60 req/s at 4 h that no history shows
    src = tmp_path / "rates.csv"
    rows = [f"{s},{60.0 if 4 * 3600 <= s < 4.5 * 3600 else 10.0}\n" for s in range(0, 6 * 3600, 600)]
    src.write_text("window_start_s,rate_req_per_s\n" + "".join(rows))
    assert main([str(src), "--cold-start", "60", "--fixed", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["requests"] == pytest.approx(10.0 * 6 * 3600 + 50.0 * 1800, rel=0.01)
    eps = out["episodes"]
    assert eps and 4 * 3600 <= eps[0]["start_s"] < 4 * 3600 + 300, eps  # the waits come with the step
    assert eps[0]["margin_peak"] > eps[0]["margin_before"]  # and the integrator lifted the margin
    # the episodes hold the replay's waits (counted by the engine as it served them)
    assert sum(e["waits"] for e in eps) == pytest.approx(out["share"] * out["requests"], rel=0.05)
    assert set(out["fixed"]) == {"6"} and out["fixed"]["6"]["gpu_hours"] > 0


def test_a_bad_list_of_margins_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none.csv"), "--fixed", "six"])
    assert "--fixed takes margins separated by commas, not 'six'" in capsys.readouterr().err
