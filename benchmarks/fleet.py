"""Planning at fleet scale: one `fleet_round` over 10, 100 and 1,000 models against the interval.

Each fleet is generated in the Azure Functions shape (`forecasting.fleet.synthetic`: timers,
Poisson HTTP functions with a daily cycle, bursty sessions, rare ones) with a day of
1-minute history; the catalog gives every model a footprint; nodes hold 40% of them. A
round is timed twice: the first (every dense model's forecaster is fitted) and a steady
one once every dense forecaster is fitted (no refit due: they only predict), and the
worst round in between (at most ``max_refits`` fits each). Figures reported:
models planned per second, the round's duration against the planning interval, and, as the
same-run baseline, what today's per-model planning would cost: one `QuantileForecaster`
fit per model per round (measured on a sample of the fleet's models, times the fleet).

Usage: python -m benchmarks.fleet [--quick] [--json]
       python -m benchmarks.fleet --write-azure DIR [--apps 150 --days 5 --seed 1]
         (writes the synthetic Azure Functions days the README's second fleet backtest reads)
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.common import parser, report
from forecasting.fleet.catalog import default_catalog
from forecasting.fleet.planner import FleetNode, FleetParams
from forecasting.fleet.round import RoundParams, RoundState, default_forecaster, fleet_round
from forecasting.fleet.synthetic import azure_function_days

INTERVAL_S = 60.0


def _fleet(n: int, seed: int) -> np.ndarray:
    day = azure_function_days(n_apps=n, days=1, seed=seed)[0]
    minutes = [str(m) for m in range(1, 1441)]
    per_app = day.groupby("HashApp", sort=True)[minutes].sum()
    return per_app.to_numpy(np.float64).T.copy()  # [1440, n]


def _one(n: int, sample: int) -> dict[str, Any]:
    counts = _fleet(n, seed=n)
    names = tuple(f"model-{i:04d}" for i in range(counts.shape[1]))
    catalog = default_catalog(names)
    node_gb = 640.0
    n_nodes = max(1, math.ceil(0.4 * catalog.total_gb() / node_gb))
    nodes = tuple(FleetNode(f"node-{k}", gpu_gb=node_gb, host_gb=1024.0) for k in range(n_nodes))
    params = RoundParams(bucket_s=60.0, dense_rps=0.1, max_dense=16,
                         fleet=FleetParams(step_s=60.0, budget_gb=0.3 * catalog.total_gb()))
    now = 1440 * 60.0
    with threadpool_limits(limits=1, user_api="openmp"):
        t0 = time.perf_counter()
        first, state = fleet_round(counts, catalog, nodes, now=now, params=params, state=RoundState())
        first_s = time.perf_counter() - t0
        worst_s = first_s
        steady_s, steady = first_s, first
        for k in range(1, 12):  # rounds until every dense forecaster is fitted (at most max_refits a round)
            t0 = time.perf_counter()
            steady, state = fleet_round(counts, catalog, nodes, now=now + k * INTERVAL_S, params=params, state=state)
            steady_s = time.perf_counter() - t0
            worst_s = max(worst_s, steady_s)
            if steady.refits == 0:
                break
        # baseline: one QuantileForecaster fit per model per round, as per-model planning does today
        import pandas as pd

        idx = pd.Index(np.arange(counts.shape[0], dtype=float) * 60.0, name="ts")
        picks = np.linspace(0, counts.shape[1] - 1, num=min(sample, counts.shape[1])).astype(int)
        t0 = time.perf_counter()
        for i in picks:
            default_forecaster(0.9, 60.0, 15).fit(pd.Series(counts[:, i] / 60.0, index=idx))
        per_fit = (time.perf_counter() - t0) / picks.size
    warm = sum(len(v) for v in steady.plan.gpu.values())
    return {
        "models": counts.shape[1], "nodes": n_nodes, "dense": len(first.dense), "refits_first": first.refits,
        "refits_steady": steady.refits, "first_round_s": first_s, "steady_round_s": steady_s,
        "models_per_s": counts.shape[1] / steady_s, "steady_share_of_interval": steady_s / INTERVAL_S,
        "first_share_of_interval": first_s / INTERVAL_S, "worst_round_s": worst_s,
        "worst_share_of_interval": worst_s / INTERVAL_S, "per_model_fit_s": per_fit,
        "per_model_baseline_round_s": per_fit * counts.shape[1],
        "speedup_vs_per_model": per_fit * counts.shape[1] / steady_s, "gpu_replicas": warm,
        "gpu_gb": steady.plan.gpu_gb, "asleep": len(steady.plan.asleep),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--write-azure", metavar="DIR", help="write synthetic Azure Functions days to DIR and exit")
    p.add_argument("--apps", type=int, default=150)
    p.add_argument("--days", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if args.write_azure:
        from pathlib import Path

        out = Path(args.write_azure)
        out.mkdir(parents=True, exist_ok=True)
        for d, frame in enumerate(azure_function_days(args.apps, args.days, seed=args.seed)):
            frame.to_csv(out / f"d{d + 1:02d}.csv", index=False)
        print(f"{args.days} days of {args.apps} apps written to {out}")
        return
    sizes = (10, 100, 1000)
    sample = 3 if args.quick else 8
    results = {str(n): _one(n, sample) for n in sizes}
    rows: list[tuple[str, Any, str]] = []
    for n, r in results.items():
        rows += [
            (f"{n} models: steady round s", r["steady_round_s"], f"{r['steady_share_of_interval']:.2%} of the {INTERVAL_S:.0f} s interval"),
            (f"{n} models: first round s", r["first_round_s"], f"{r['refits_first']} dense forecasters fitted ({r['first_share_of_interval']:.1%})"),
            (f"{n} models: worst round s", r["worst_round_s"], f"{r['worst_share_of_interval']:.1%} of the interval ({r['dense']} dense, fitted over rounds)"),
            (f"{n} models: models planned/s", r["models_per_s"], "steady round"),
            (f"{n} models: per-model refit round s (baseline)", r["per_model_baseline_round_s"],
             f"{r['per_model_fit_s'] * 1e3:.0f} ms/fit x {n}; fleet round {r['speedup_vs_per_model']:.0f}x faster"),
        ]
    report("fleet planning at scale (2 cores, single-threaded boosting)", rows,
           {"interval_s": INTERVAL_S, "results": results}, args.json)


if __name__ == "__main__":
    main()
