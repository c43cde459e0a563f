"""One model replayed by both replays: how far the single-model engine and a one-model pool disagree.

Issue 17 asks for one simulator; there are still two (docs/simulator.md). This replays one
rate trace through the single-model engine (`forecasting.sim`, per second, the planner every
5 s, the HPA every 15 s) and through the pool replay (`forecasting.fleet.simulate`, one model,
per step of `--step` seconds, the fleet round and the pool's HPA once a step), with the same
charges (`forecasting.charges`), the same replica capacity and every load the same time
(`--cold-start`; no node bandwidth: `load_share` 0 in both), and prints each policy's
cold-start share and GPU-hours in both and their ratio. What is left between them is the
step: the pool sees a rise a step late.

Usage: python benchmarks/replays.py [TRACE] [--cold-start S] [--step S] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import ROOT, parser, report
from forecasting.data.traces import load_rates
from forecasting.fleet.catalog import Catalog, ModelCard, Tier
from forecasting.fleet.policies import FleetEnv, FleetPlanner, make_fleet_policy
from forecasting.fleet.simulate import simulate
from forecasting.fleet.traces import FleetTrace
from forecasting.sim.scoring import run_backtest
from forecasting.sim.workload import SimParams, build_workload

TRACE = ROOT.parent / "shared" / "traces" / "servegen_m_large_rate.csv"
MEM_GB = 16.0  # one replica's footprint: the pool's GB-hours over it are its GPU-hours


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", default=str(TRACE))
    p.add_argument("--cold-start", type=float, default=8.7)
    p.add_argument("--step", type=float, default=60.0, help="the pool replay's step (s)")
    args = p.parse_args()
    trace = load_rates(args.trace)
    params = SimParams(cold_start_s=args.cold_start, load_share=0.0, node_loads="shared")
    work = build_workload(trace, params)
    if not work.aggregated:
        raise SystemExit("the trace's rate is too low for the fluid engine: give a dense rate trace")
    per_step = int(args.step)
    steps = len(work.counts) // per_step
    counts = np.asarray(work.counts[:steps * per_step], dtype=np.float64).reshape(steps, per_step).sum(axis=1)
    cold = args.cold_start
    card = ModelCard("model", MEM_GB, capacity_rps=params.slots / work.mean_service_s,
                     ready_s={"default": {Tier.ASLEEP: cold, Tier.CACHED: cold, Tier.DISK: cold}})
    env = FleetEnv(catalog=Catalog((card,)), step_s=args.step, n_nodes=1_000, node_gpu_gb=8 * MEM_GB,
                   node_host_gb=1_024.0, load_share=0.0, seed=params.seed)
    pool_trace = FleetTrace(("model",), counts[:, None], args.step, args.trace, "one model")
    single = {r["policy"]: r for r in run_backtest(trace, params, policies=("reactive", "prewarm"))["result"]["rows"]}
    rows: list[tuple[str, Any, str]] = [("trace", Path(args.trace).name, f"{work.duration_s / 86_400:.1f} days, "
                                         f"cold start {cold:g} s, pool step {args.step:g} s")]
    result: dict[str, Any] = {"trace": args.trace, "cold_start_s": cold, "step_s": args.step, "policies": {}}
    for name, pool_name in (("reactive", "reactive"), ("prewarm", "fleet")):
        policy = FleetPlanner() if pool_name == "fleet" else make_fleet_policy(pool_name)
        score = simulate(pool_trace, policy, env)
        one = single[name]
        pool_gpu_h = score.warm_gb_h / MEM_GB
        entry = {"single_cold_share": one["cold_start_share"], "single_gpu_hours": one["gpu_hours"],
                 "pool_cold_share": score.cold_share, "pool_gpu_hours": pool_gpu_h,
                 "cold_share_ratio": score.cold_share / one["cold_start_share"] if one["cold_start_share"] else None,
                 "gpu_hours_ratio": pool_gpu_h / one["gpu_hours"]}
        result["policies"][name] = entry
        rows.append((name, f"{one['cold_start_share']:.4%} / {score.cold_share:.4%}",
                     f"cold share single / pool; GPU-hours {one['gpu_hours']:,.1f} / {pool_gpu_h:,.1f} "
                     f"({entry['gpu_hours_ratio']:.3f}x)"))
    report("one model, both replays", rows, result, args.json)


if __name__ == "__main__":
    main()
