"""Forecast accuracy and cost on the real rate traces: QuantileForecaster vs seasonal naive.

Rolling-origin backtests (`forecasting.forecast.backtest.cross_validation`) with an hourly horizon
on ServeGen m-large (10-minute buckets) and NASA (10-minute and, in the full run, 1-minute
buckets). Accuracy figures (MAE of the median, under-provision rate at p90, coverage of
p99, pinball loss) do not depend on the machine. Times do, so they are reported next to
baselines measured in the same run: a forecaster fit against one plain squared-loss
HistGradientBoostingRegressor fit on as many rows (single thread), and each trace load
against a bare ``pandas.read_csv``/``read_json`` of the same file.

Usage: python -m benchmarks.forecast [--quick] [--json]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.ensemble import HistGradientBoostingRegressor
from threadpoolctl import threadpool_limits

from benchmarks.common import ROOT, parser, report
from forecasting.forecast.backtest import cross_validation, scores
from forecasting.data.history import load_file, rate_series
from forecasting.forecast.models import QuantileForecaster, SeasonalNaiveForecaster

TRACES = ROOT.parent / "shared" / "traces"


def _baseline_fit_s(rows: int, features: int) -> float:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, features))
    y = X[:, 0] + rng.normal(size=rows)
    with threadpool_limits(limits=1, user_api="openmp"):
        t0 = time.perf_counter()
        HistGradientBoostingRegressor(max_iter=80, early_stopping=False, random_state=0).fit(X, y)
        return time.perf_counter() - t0


def _load_times(quick: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for path in sorted(TRACES.glob("*")):
        if path.suffix not in (".csv", ".jsonl"):
            continue
        t0 = time.perf_counter()
        frame = load_file(path, bucket_s=60)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        if path.suffix == ".jsonl":
            pd.read_json(path, lines=True)
        else:
            pd.read_csv(path)
        plain = time.perf_counter() - t0
        out[path.name] = {"load_s": ours, "plain_pandas_s": plain, "ratio": ours / plain, "buckets": float(len(frame))}
    return out


def _cases(quick: bool) -> list[dict[str, Any]]:
    cases = [
        {"trace": "servegen_m_large_rate.csv", "bucket_s": 600, "h": 6, "n_windows": 24 if quick else 96, "step_size": 12, "refit": 6 if quick else 4},
        {"trace": "nasa_http_1995_per_minute.csv", "bucket_s": 600, "h": 6, "n_windows": 24 if quick else 96, "step_size": 36, "refit": 6 if quick else 4},
    ]
    if not quick:
        cases.append({"trace": "nasa_http_1995_per_minute.csv", "bucket_s": 60, "h": 60, "n_windows": 48, "step_size": 211, "refit": 4})
    return cases


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows: list[tuple[str, Any, str]] = []
    result: dict[str, Any] = {"quick": args.quick, "backtests": [], "loads": {}}
    for case in _cases(args.quick):
        y = rate_series(load_file(TRACES / case["trace"], bucket_s=case["bucket_s"]))
        label = f"{case['trace'].split('_')[0]}@{case['bucket_s']}s h={case['h']}"
        kw = dict(h=case["h"], n_windows=case["n_windows"], step_size=case["step_size"], refit=case["refit"])
        entry: dict[str, Any] = {**case, "models": {}}
        estimators = {
            "quantile": QuantileForecaster(bucket_s=case["bucket_s"], max_horizon=case["h"]),
            "seasonal_day": SeasonalNaiveForecaster(bucket_s=case["bucket_s"]),
            "seasonal_week": SeasonalNaiveForecaster(season_s=7 * 86400, bucket_s=case["bucket_s"]),
        }
        for name, est in estimators.items():
            t0 = time.perf_counter()
            cv = cross_validation(est, y, **kw)  # type: ignore[arg-type]
            elapsed = time.perf_counter() - t0
            s = scores(cv)
            s["q0.99_coverage"] = scores(cv, "q0.99")["coverage"]
            fits = -(-case["n_windows"] // case["refit"])
            s["fit_and_predict_s_per_fit"] = elapsed / fits
            entry["models"][name] = s
            rows.append((f"{label} {name} MAE", s["mae"], "req/s, of q0.5"))
            rows.append((f"{label} {name} under-provision@p90", s["under_provision_rate"], "share of buckets y > q0.9"))
            rows.append((f"{label} {name} coverage@p99", s["q0.99_coverage"], ""))
        q = entry["models"]["quantile"]
        fit_rows = QuantileForecaster(bucket_s=case["bucket_s"], max_horizon=case["h"]).fit(y).n_train_rows_
        base = _baseline_fit_s(fit_rows, 18)
        q["fit_vs_plain_hgb"] = q["fit_and_predict_s_per_fit"] / base
        entry["baseline_plain_hgb_fit_s"] = base
        rows.append((f"{label} quantile fit+predict", q["fit_and_predict_s_per_fit"], f"s per fit; {q['fit_vs_plain_hgb']:.2f}x one plain HGB fit ({base:.3f} s)"))
        result["backtests"].append(entry)
    loads = _load_times(args.quick)
    result["loads"] = loads
    for name, v in loads.items():
        rows.append((f"load {name}", v["load_s"], f"s; {v['ratio']:.2f}x plain pandas ({v['plain_pandas_s']:.3f} s)"))
    report("Forecast backtests (hourly horizon) and loader speed", rows, result, args.json)


if __name__ == "__main__":
    main()
