"""Trace-replay speed: 14 days at 2,000 req/s through the scaling policies.

The ServeGen m-small rate trace (14 days, 10-minute windows) scaled to a 2,000 req/s mean
(the scaling is printed) is replayed by the fluid engine under each policy. Wall times
depend on the machine, so each is also given as a ratio to a baseline measured in the
same run: a bare Python loop over the same number of seconds doing the fluid queue's
arithmetic and nothing else (no policy, no replica bookkeeping).

The same policies are then replayed side by side (`prewarm backtest`'s `--jobs`, one process per
CPU by default), in the same run: the wall time against one after the other, and the check that
every figure is the same.

Usage: python benchmarks/simulator.py [--quick] [--json] [--policies reactive,prewarm] [--jobs N]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import ROOT, parser, report
from forecasting.parallel import cpus
from forecasting.sim.policies import POLICIES, make_policy
from forecasting.sim.scoring import run_backtest
from forecasting.sim.simulate import SimParams, build_workload, replay
from forecasting.data.traces import RateTrace, load_trace

TRACE = ROOT.parent / "shared" / "traces" / "servegen_m_small_rate.csv"


def _baseline_loop(counts: list[float]) -> float:
    t0 = time.perf_counter()
    backlog, cap, acc = 0.0, 1000.0, 0.0
    for c in counts:
        q = backlog + c
        served = q if q < cap else cap
        backlog = q - served
        acc += served
    return time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--policies", default="reactive,fixed_pool,keepalive,oracle,prewarm")
    p.add_argument("--jobs", type=int, default=cpus(), help="processes for the side-by-side replay (default: the CPUs)")
    args = p.parse_args()
    full = load_trace(TRACE)
    assert isinstance(full, RateTrace)
    days = 2 if args.quick else 14
    keep = full.window_start_s < days * 86400
    trace = RateTrace(full.window_start_s[keep], full.rate[keep], full.window_s, full.source, full.start_epoch)
    scale = 2000.0 / float(trace.rate.mean())
    params = SimParams(rate_scale=scale)
    t0 = time.perf_counter()
    work = build_workload(trace, params)
    build_s = time.perf_counter() - t0
    base_s = _baseline_loop(work.counts.tolist())
    rows: list[tuple[str, Any, str]] = [
        ("trace", f"{TRACE.name}, first {days} days", f"rate x{scale:.3f} -> mean 2000 req/s; {work.n_requests:.3g} requests"),
        ("engine", "fluid" if work.aggregated else "exact", "; ".join(work.notes)),
        ("build_s", build_s, "seeded Poisson arrivals per second"),
        ("baseline_loop_s", base_s, "bare Python loop over the seconds (same run)"),
    ]
    result: dict[str, Any] = {"days": days, "mean_rps": 2000.0, "rate_scale": scale, "build_s": build_s,
                              "baseline_loop_s": base_s, "policies": {}}
    total = build_s
    for name in [x for x in args.policies.split(",") if x]:
        if name not in POLICIES:
            raise SystemExit(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        t0 = time.perf_counter()
        run = replay(work, make_policy(name), params)
        wall = time.perf_counter() - t0
        total += wall
        result["policies"][name] = {"wall_s": wall, "vs_baseline_loop": wall / base_s, "gpu_hours": run.gpu_s / 3600,
                                    "cold_start_share": float(run.weight[run.wait > 0.5].sum() / run.weight.sum())
                                    if run.weight is not None else float(np.mean(run.wait > 0.5))}
        rows.append((f"{name}_s", wall, f"{wall / base_s:.1f}x the baseline loop"))
    rows.append(("total_s", total, "all policies, one after the other (target: < 180 s for 14 days)"))
    result["total_s"] = total
    names = [x for x in args.policies.split(",") if x]
    t0 = time.perf_counter()
    side = run_backtest(trace, params, names, jobs=args.jobs)["result"]["rows"]
    side_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    serial = run_backtest(trace, params, names)["result"]["rows"]
    serial_s = time.perf_counter() - t0
    same = json.dumps(side, default=float) == json.dumps(serial, default=float)
    rows.append(("side_by_side_s", side_s, f"{args.jobs} processes: {serial_s / side_s:.2f}x faster than one after the "
                                           f"other ({serial_s:.1f} s, same run); figures {'the same' if same else 'DIFFER'}"))
    result |= {"jobs": args.jobs, "side_by_side_s": side_s, "one_after_the_other_s": serial_s,
               "side_by_side_speedup": serial_s / side_s, "same_figures": same}
    report("trace replay speed", rows, result, args.json)


if __name__ == "__main__":
    main()
