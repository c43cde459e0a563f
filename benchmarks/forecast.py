"""Forecast accuracy where the planner uses it: at the lead, against persistence and seasonal-naive.

The planner sizes replicas for the demand over the next lead (the cold-start p95 plus a
margin: 18.7 s by default, two 10-second buckets), so that is the horizon scored here, on
the signal the planner forecasts in predictive mode: requests in flight per fine bucket
(built from each trace exactly as the simulator feeds the planner). Rolling origins: at
each origin the planner's forecaster (`forecasting.forecast.nowcast.forecast_peak`, with
the seasonal profile relearned every hour from the coarse history before the origin, as
the planner does) sees only the buckets before it, and its median and planning quantile
(p90) of the peak over the next lead are scored against what came. Baselines from the
same origins: persistence (the last bucket) and seasonal-naive (the same buckets one day
earlier, where a day of history exists). Figures: MAE of the median, its ratio to each
baseline's (< 1: better), and the coverage of the planning quantile (nominal 0.90).
Accuracy does not depend on the machine; the time per forecast does, and is given next to
a baseline measured in the same run (a `numpy.quantile` over the same window).

Usage: python benchmarks/forecast.py [--quick] [--json]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, parser, report  # noqa: E402
from forecasting.data.traces import load_trace  # noqa: E402
from forecasting.forecast.nowcast import DAY_S, fit_profile, forecast_peak, lead_buckets  # noqa: E402
from forecasting.planner import PlannerParams, lead_of  # noqa: E402
from forecasting.sim.simulate import SimParams, build_workload  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
CASES = (
    ("servegen_m_large_rate.csv", "ServeGen m-large"),
    ("servegen_m_small_rate.csv", "ServeGen m-small"),
    ("nasa_http_1995_per_minute.csv", "NASA"),
    ("azure_llm_2023_code.csv", "Azure code"),
    ("mooncake_2024_conversation.jsonl", "Mooncake"),
)


def _signals(path: Path, days: float | None) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(in flight per fine bucket, req/s per coarse bucket, epoch of t=0, bucket_s) as the planner is fed."""
    p = PlannerParams()
    work = build_workload(load_trace(path), SimParams())
    fb, cb = int(p.fine_bucket_s), int(p.bucket_s)
    counts = work.counts if days is None else work.counts[: int(days * DAY_S)]
    busy = work.busy if work.busy is not None else work.counts * work.mean_service_s
    busy = busy[: counts.size]
    nf, nc = counts.size // fb, counts.size // cb
    inflight = busy[: nf * fb].reshape(nf, fb).sum(axis=1) / fb
    rates = counts[: nc * cb].reshape(nc, cb).sum(axis=1) / cb
    return inflight, rates, work.start_epoch, float(fb)


def evaluate(y: np.ndarray, rates: np.ndarray, epoch: float, fb: float, *, every: int) -> dict[str, Any]:
    p = PlannerParams()
    h = lead_buckets(lead_of(p, None), fb)
    window = int(p.score_window_s // fb)
    level = int(p.level_s // fb)
    season = int(round(p.season_s / fb))
    keep = window + h + level + 2 + season
    per_coarse = int(p.bucket_s // fb)
    profile, profile_at = None, -math.inf
    med, up, truth, pers, snaive = [], [], [], [], []
    methods: dict[str, int] = {}
    elapsed = 0.0
    for o in range(min(window, y.size // 4) + h + 12, y.size - h, every):
        now_s = (o + 1) * fb
        if now_s - profile_at >= p.profile_refit_s:
            nc = min(rates.size, o // per_coarse)
            lc = max(0, nc - int(p.history_s // p.bucket_s))
            profile = fit_profile(rates[lc:nc], epoch + lc * p.bucket_s, p.bucket_s, bin_s=p.profile_bin_s,
                                  season_s=p.season_s)
            profile_at = now_s
        lo = max(0, o + 1 - keep)
        t0 = time.perf_counter()
        fc = forecast_peak(y[lo:o + 1], epoch + lo * fb, fb, horizon=h, quantile=p.quantile, window=window,
                           level_buckets=level, profile=profile, season_s=p.season_s)
        elapsed += time.perf_counter() - t0
        methods[fc.method] = methods.get(fc.method, 0) + 1
        target = float(y[o + 1:o + 1 + h].max())
        med.append(fc.median)
        up.append(fc.upper)
        truth.append(target)
        pers.append(float(y[o]))
        snaive.append(float(y[o + 1 - season:o + 1 - season + h].max()) if o + 1 - season >= 0 else math.nan)
    t, m, u = np.asarray(truth), np.asarray(med), np.asarray(up)
    ps, sn = np.asarray(pers), np.asarray(snaive)
    has_season = ~np.isnan(sn)
    mae = float(np.mean(np.abs(t - m)))
    out: dict[str, Any] = {
        "origins": int(t.size), "lead_buckets": h, "bucket_s": fb, "mean_demand": float(t.mean()),
        "mae_median": mae, "mae_persistence": float(np.mean(np.abs(t - ps))),
        "coverage_p90": float(np.mean(t <= u + 1e-9)), "methods": methods,
        "forecast_s": elapsed / max(1, t.size),
    }
    out["mae_vs_persistence"] = mae / out["mae_persistence"] if out["mae_persistence"] > 0 else None
    if has_season.any():
        out["mae_seasonal_naive"] = float(np.mean(np.abs(t[has_season] - sn[has_season])))
        mae_s = float(np.mean(np.abs(t[has_season] - m[has_season])))
        out["mae_vs_seasonal_naive"] = mae_s / out["mae_seasonal_naive"] if out["mae_seasonal_naive"] > 0 else None
    else:
        out["mae_seasonal_naive"] = out["mae_vs_seasonal_naive"] = None
    out["relative_mae"] = mae / float(t.mean()) if t.mean() > 0 else None
    return out


def _baseline_s(window: int) -> float:
    x = np.random.default_rng(0).random(window)
    t0 = time.perf_counter()
    for _ in range(200):
        np.quantile(x, [0.5, 0.9])
    return (time.perf_counter() - t0) / 200


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows: list[tuple[str, Any, str]] = []
    result: dict[str, Any] = {"quick": args.quick, "cases": {}}
    base = _baseline_s(int(PlannerParams().score_window_s // PlannerParams().fine_bucket_s))
    for file, label in CASES:
        long = file.startswith(("servegen", "nasa"))
        days = (3.0 if args.quick else (14.0 if file.startswith("nasa") else None)) if long else None
        every = (30 if args.quick else 6) if long else 1
        y, rates, epoch, fb = _signals(TRACES / file, days)
        r = evaluate(y, rates, epoch, fb, every=every)
        r["days"] = days
        r["forecast_vs_numpy_quantile"] = r["forecast_s"] / base
        result["cases"][label] = r
        vs_sn = "-" if r["mae_vs_seasonal_naive"] is None else f"{r['mae_vs_seasonal_naive']:.2f}x"
        rows.append((f"{label}: MAE of the median at the lead", r["mae_median"],
                     f"in flight; {r['mae_vs_persistence']:.2f}x persistence ({r['mae_persistence']:.3g}), "
                     f"{vs_sn} seasonal-naive; relative {r['relative_mae']:.1%}"))
        rows.append((f"{label}: coverage of p90 at the lead", r["coverage_p90"],
                     f"nominal 0.90; {r['origins']} origins; methods {r['methods']}"))
        rows.append((f"{label}: time per forecast", r["forecast_s"],
                     f"s; {r['forecast_vs_numpy_quantile']:.1f}x one numpy quantile of the window ({base:.2e} s)"))
    report("Forecasts at the planner's lead horizon", rows, result, args.json)


if __name__ == "__main__":
    main()
