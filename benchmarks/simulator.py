"""Trace-replay speed: 14 days at 2,000 req/s through the scaling policies.

The ServeGen m-small rate trace (14 days, 10-minute windows) scaled to a 2,000 req/s mean
(the scaling is printed) is replayed by the fluid engine under each policy. Wall times
depend on the machine, so each is also given as a ratio to a baseline measured in the
same run: a bare Python loop over the same number of seconds doing the fluid queue's
arithmetic and nothing else (no policy, no replica bookkeeping).

Usage: python benchmarks/simulator.py [--quick] [--json] [--policies reactive,prewarm]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import ROOT, parser, report
from forecasting.sim.policies import POLICIES, make_policy
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
    report("trace replay speed", rows, result, args.json)


if __name__ == "__main__":
    main()
