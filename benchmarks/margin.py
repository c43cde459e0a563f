"""The cold-start budget's margin along one replay: where the waits came, at what margin, and what the path cost.

The budget's integrator (`forecasting.calibration`) meets the budget on average; what it spends doing so
depends on the margin's path: where the waits come in episodes (a step no forecast shows), the margin is
wherever the calm hours have brought it when one lands, and it is lifted for days after. This replays the
prewarm policy alone (the single-model engine, default charges, as `prewarm backtest` reads the trace) and
prints each wait episode (waits no more than `--gap-s` apart): when it began and ended, its waits (and in
days of the budget: the budget's share of a day's requests at the trace's mean rate), the margin in force
when it began and the highest margin from then until the next episode (the lift it gave the margin). With
`--fixed M,...` it replays the feedback-off ablation (`prewarm_fixed_margin`) at those margins too, so the
path's cost reads against a margin held still: a fixed margin with fewer waits for fewer GPU-hours is what
the path spent on top of it (docs/operating.md).

Usage: python benchmarks/margin.py TRACE [--client NAME] [--cold-start S] [--limit-s S] [--fixed M,M] [--json]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import parser, report
from forecasting.data.traces import HistoryError, load_trace
from forecasting.fleet.traces import read_client_rates
from forecasting.sim.interface import Observation
from forecasting.sim.policies import Prewarm, PrewarmFixedMargin
from forecasting.sim.scoring import score
from forecasting.sim.simulate import replay
from forecasting.sim.workload import SimParams, build_workload
from prewarm.cli.backtest import _head  # `prewarm backtest --limit-s`: the first S seconds of a trace
from prewarm.core.settings import Settings


class TracedPrewarm(Prewarm):
    """The prewarm policy, keeping at each decision its time, the margin in force after it and the waits seen."""

    def start(self, env: Any) -> int:
        self.path: list[tuple[float, float, float]] = []
        return super().start(env)

    def decide(self, obs: Observation) -> int:
        want = super().decide(obs)
        margin = self.state.margin if self.state.margin is not None else self.params.margin_initial
        self.path.append((obs.now, float(margin), float(obs.waited)))
        return want


def episodes(path: np.ndarray, gap_s: float) -> list[dict[str, float]]:
    """The wait episodes of a path (rows: time, margin after the decision, waits seen at it): runs of decisions that
    saw waits, no more than `gap_s` apart. The margin an episode began at is the one in force before its first
    waits; its peak, the highest margin from its first waits until the next episode's (the waits of a bucket move
    the margin once the bucket is counted, a step or two after they were seen)."""
    out: list[dict[str, float]] = []
    hit = np.flatnonzero(path[:, 2] > 0)
    if hit.size == 0:
        return out
    starts = [0] + [i + 1 for i in range(hit.size - 1) if path[hit[i + 1], 0] - path[hit[i], 0] > gap_s]
    ends = starts[1:] + [hit.size]
    for a, b in zip(starts, ends):
        first, last = int(hit[a]), int(hit[b - 1])
        until = int(hit[b]) if b < hit.size else path.shape[0]
        before = float(path[first - 1, 1]) if first > 0 else math.nan
        out.append({"start_s": float(path[first, 0]), "end_s": float(path[last, 0]),
                    "waits": float(path[hit[a:b], 2].sum()), "margin_before": before,
                    "margin_peak": float(path[first:until, 1].max())})
    return out


def mean_margin(path: np.ndarray) -> float:
    """The margin's mean over the replay's time (each decision's margin held until the next)."""
    if path.shape[0] < 2:
        return float(path[0, 1]) if path.shape[0] else math.nan
    dt = np.diff(path[:, 0])
    return float(np.sum(path[:-1, 1] * dt) / np.sum(dt))


def _trace(args: Any) -> Any:
    if args.client:
        return read_client_rates(args.trace).client(args.client, args.limit_s)
    trace = load_trace(args.trace)
    return _head(trace, args.limit_s) if args.limit_s is not None else trace


def main(argv: list[str]) -> int:
    ap = parser(__doc__.strip().splitlines()[0])
    ap.add_argument("trace", help="a trace `prewarm backtest` reads (a per-client file with --client)")
    ap.add_argument("--client", help="one client of a per-client rate file")
    ap.add_argument("--cold-start", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, help="replay only the first S seconds")
    ap.add_argument("--gap-s", type=float, default=3600.0,
                    help="waits further apart than this are two episodes (default: the budget's calibration window)")
    ap.add_argument("--fixed", default="", help="comma-separated margins to replay the feedback-off ablation at")
    args = ap.parse_args(argv)
    try:
        fixed = [float(m) for m in args.fixed.split(",") if m.strip()]
    except ValueError:
        ap.error(f"--fixed takes margins separated by commas, not {args.fixed!r}")
    if any(m < 0 for m in fixed) or args.gap_s <= 0:
        ap.error("--fixed margins must be at least 0 and --gap-s above 0")
    if args.quick:
        args.limit_s = min(args.limit_s or 86400.0, 86400.0)
    try:
        trace = _trace(args)
    except HistoryError as exc:
        ap.error(str(exc))
    params = SimParams(cold_start_s=args.cold_start, seed=args.seed)
    planner = Settings.load().planner
    work = build_workload(trace, params)
    policy = TracedPrewarm(planner_settings=planner)
    s = score(replay(work, policy, params), work, params)
    path = np.asarray(policy.path, dtype=np.float64).reshape(-1, 3)
    mean = mean_margin(path)
    budget = policy.params.cold_start_budget
    day_budget = budget * work.n_requests / (work.duration_s / 86400.0) if work.duration_s > 0 else math.nan
    eps = episodes(path, args.gap_s)
    for e in eps:
        e["budget_days"] = e["waits"] / day_budget if day_budget > 0 else math.nan
    rows: list[tuple[str, Any, str]] = [
        ("prewarm: waited", s["cold_start_share"], f"the budget {budget:.4%}; {s['gpu_hours']:,.1f} GPU-hours"),
        ("prewarm: mean margin", mean, f"from {policy.params.margin_initial:g}; {len(eps)} wait episodes"),
    ]
    for e in eps:
        rows.append((f"episode at {e['start_s'] / 3600:.2f} h", e["waits"],
                     f"{e['budget_days']:.2f} days of the budget; margin {e['margin_before']:.2f} -> "
                     f"{e['margin_peak']:.2f}; to {e['end_s'] / 3600:.2f} h"))
    ablation: dict[str, dict[str, float]] = {}
    for m in fixed:  # the same workload (the same seeded arrivals), replayed as `prewarm backtest` replays a policy
        f = score(replay(work, PrewarmFixedMargin(margin=m, planner_settings=planner), params), work, params)
        ablation[f"{m:g}"] = {"share": f["cold_start_share"], "gpu_hours": f["gpu_hours"]}
        rows.append((f"fixed margin {m:g}: waited", f["cold_start_share"],
                     f"{f['gpu_hours']:,.1f} GPU-hours ({f['gpu_hours'] / s['gpu_hours']:.3f}x prewarm's)"))
    report(f"the cold-start budget's margin, {args.cold_start:g} s cold starts", rows,
           {"trace": work.source, "cold_start_s": args.cold_start, "seed": args.seed, "limit_s": args.limit_s,
            "cold_start_budget": budget, "share": s["cold_start_share"], "gpu_hours": s["gpu_hours"],
            "requests": work.n_requests, "mean_margin": mean, "episodes": eps, "fixed": ablation},
           args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
