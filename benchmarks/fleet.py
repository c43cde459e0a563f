"""Planning at fleet scale: one `fleet_round` over 10, 100 and 1,000 models against the interval.

Each fleet is generated in the Azure Functions shape (`forecasting.fleet.synthetic`: timers,
Poisson HTTP functions with a daily cycle, bursty sessions, rare ones) with a day of
1-minute history; the catalog gives every model a footprint; nodes hold 40% of them. The
dense models (the busiest, `dense_models`) are sized by the count planner's `step`, on fine
counters made from their minutes (10 s buckets, 0.5 s per request). A round is timed twice:
the first (the arrival estimator built from the day, every dense model's profile learned)
and a steady one (the estimator carried, fed the last minute; no profile due). Figures
reported: models planned per second, the round's duration against the planning interval,
and, as the same-run baseline, what planning every model alone costs: one `step` per model
per round (measured on a sample of the fleet's models, times the fleet).

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
from forecasting.fleet.round import RoundParams, RoundState, dense_models, fleet_round
from forecasting.fleet.synthetic import azure_function_days
from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec

INTERVAL_S = 60.0
SERVICE_S = 0.5  # seconds per request: the busy time of the fine counters made from the minutes


def _fleet(n: int, seed: int) -> np.ndarray:
    day = azure_function_days(n_apps=n, days=1, seed=seed)[0]
    minutes = [str(m) for m in range(1, 1441)]
    per_app = day.groupby("HashApp", sort=True)[minutes].sum()
    return per_app.to_numpy(np.float64).T.copy()  # [1440, n]


def _inputs(name: str, per_minute: np.ndarray, now: float, profile_due: bool) -> StepInputs:
    """A model's step inputs as the live loop builds them, its fine counters made from its minutes."""
    p = PlannerParams()
    fine = np.repeat(per_minute / 6.0, 6)
    start = now - fine.size * p.fine_bucket_s
    observed = observed_from_counts(start, p.fine_bucket_s, fine, np.ceil(fine * SERVICE_S / p.fine_bucket_s) + 1,
                                    fine * SERVICE_S, np.zeros(fine.size))
    history = (now - per_minute.size * 60.0, 60.0, per_minute / 60.0) if profile_due else None
    return StepInputs(ModelSpec(name=name, revision="r", slots=8), now, observed, ReplicaCounts(ready=1), p,
                      profile_history=history)


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
    dense = dense_models(counts, catalog, params)
    column = {name: j for j, name in enumerate(names)}
    with threadpool_limits(limits=1, user_api="openmp"):
        t0 = time.perf_counter()
        steps = {m: (_inputs(m, counts[:, column[m]], now, True), PlannerState()) for m in dense}
        first, state = fleet_round(counts, catalog, nodes, now=now, params=params, state=RoundState(), dense=steps)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        later = now + INTERVAL_S
        history = np.vstack([counts[1:], counts[:1]])  # the day moved on by a minute
        steps = {m: (_inputs(m, history[:, column[m]], later, False), first.states[m]) for m in dense}
        steady, state = fleet_round(history, catalog, nodes, now=later, params=params, state=state, dense=steps)
        steady_s = time.perf_counter() - t0
        # baseline: every model planned alone, one step per model per round (its profile learned already)
        picks = np.linspace(0, counts.shape[1] - 1, num=min(sample, counts.shape[1])).astype(int)
        alone = {int(i): step(_inputs(names[i], counts[:, i], now, True), PlannerState())[1] for i in picks}
        t0 = time.perf_counter()
        for i in picks:
            step(_inputs(names[i], history[:, i], later, False), alone[int(i)])
        per_step = (time.perf_counter() - t0) / picks.size
    warm = sum(len(v) for v in steady.plan.gpu.values())
    return {
        "models": counts.shape[1], "nodes": n_nodes, "dense": len(dense), "first_round_s": first_s,
        "steady_round_s": steady_s, "models_per_s": counts.shape[1] / steady_s,
        "steady_share_of_interval": steady_s / INTERVAL_S, "first_share_of_interval": first_s / INTERVAL_S,
        "per_model_step_s": per_step, "per_model_baseline_round_s": per_step * counts.shape[1],
        "speedup_vs_per_model": per_step * counts.shape[1] / steady_s, "gpu_replicas": warm,
        "gpu_gb": steady.plan.gpu_gb, "asleep": len(steady.plan.asleep),
        "dense_replicas": {m: int(v) for m, v in steady.replicas.items()},
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
            (f"{n} models: first round s", r["first_round_s"], f"estimator built, {r['dense']} dense profiles learned ({r['first_share_of_interval']:.1%})"),
            (f"{n} models: models planned/s", r["models_per_s"], f"steady round ({r['dense']} dense, sized by the count planner)"),
            (f"{n} models: every model planned alone, round s (baseline)", r["per_model_baseline_round_s"],
             f"{r['per_model_step_s'] * 1e3:.1f} ms/step x {n}; fleet round {r['speedup_vs_per_model']:.0f}x faster"),
        ]
    report("fleet planning at scale (2 cores)", rows,
           {"interval_s": INTERVAL_S, "results": results}, args.json)


if __name__ == "__main__":
    main()
