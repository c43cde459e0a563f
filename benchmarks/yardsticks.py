"""The single-model yardsticks: every policy's curve on a trace, read at prewarm's default cold-start share.

For one rate or request trace and one cold start, it sweeps `reactive` (HPA target),
`reactive_sized` (the planner's sizing margin, no forecast), `fixed_pool` (pool percent) and
`prewarm_fixed_margin` (the planner with its budget's feedback off, over its fixed margin)
over their knobs, runs `prewarm` at its default (or over its cold-start budget with
`--prewarm-curve`; its 14-day replay is the slow one) and the oracle, all on the same
seeded arrivals with the simulator's default charges (docs/simulator.md), and prints each
policy's GPU-hours vs reactive interpolated on its curve at prewarm's default cold-start
share. These are ratios of the same run; nothing here depends on the machine's speed.

A fleet trace (per-client rates) runs the fleet backtest instead, at the planner's fine bucket as
`prewarm backtest` does: every fleet policy, the sleep-enabled baselines included, their curves
and `at_equal` (the planner's point read on each curve).

`--client NAME` replays one model of a fleet trace alone (a tenant of a per-client file, its rate per
window with zeros where it sent nothing) through the single-model yardsticks: is prewarm dominated on
that tenant, curve by curve.

Usage: python benchmarks/yardsticks.py TRACE [--cold-start 8.7] [--days 7] [--few] [--quick] [--json] [--out F.json]
       [--row LABEL] [--plot F.png] [--prewarm-curve] [--client NAME]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import ROOT, parser
from forecasting.data.traces import HistoryError, load_trace
from forecasting.fleet.traces import is_fleet_trace, load_fleet
from forecasting.sim.scoring import SWEEP_KNOBS, run_sweep
from forecasting.sim.simulate import SimParams

TRACE = ROOT.parent / "shared" / "traces" / "servegen_m_small_rate.csv"


def readme_row(label: str, out: dict[str, Any]) -> str:
    """The README's row: prewarm's default point, the baselines read at its share, their defaults, the starts,
    and prewarm with its feedback off (`prewarm_fixed_margin`) read at its share."""
    default = {pt["policy"]: pt for pt in out["points"] if pt["default"]}
    at = out["at_equal_cold_start_share"]["policies"]
    pw, rs, r = default["prewarm"], default["reactive_sized"], default["reactive"]
    x = lambda v: "—" if v is None else f"{v:.3f}×"  # noqa: E731
    return (f"| {label} | {pw['cold_start_share']:.4%} | **{pw['gpu_hours_vs_reactive']:.3f}×** | "
            f"{x(at.get('reactive_sized'))} | {x(at.get('reactive'))} | "
            f"{rs['cold_start_share']:.4%}, {rs['gpu_hours_vs_reactive']:.3f}× | {r['cold_start_share']:.4%} | "
            f"{pw['starts']:,} / {rs['starts']:,} / {r['starts']:,} | {x(at.get('prewarm_fixed_margin'))} |")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", default=str(TRACE))
    p.add_argument("--cold-start", type=float, default=8.7)
    p.add_argument("--days", type=float, default=0.0, help="replay only the first N days (0: all)")
    p.add_argument("--snapshot-ratio", type=float, default=None, metavar="R",
                   help="credit the node snapshot: a node's transfers after its first take R of the time, at once "
                        "(0.34 measured on an H200; default: not credited, as the published rows)")
    p.add_argument("--prewarm-curve", action="store_true", help="sweep prewarm over its cold-start budget too")
    p.add_argument("--keepalive", action="store_true", help="add keep-alive at its default (a slow replay)")
    p.add_argument("--few", action="store_true", help="fewer settings of the costly curves (the ablation's, the pool's); "
                   "the baselines' curves stay whole")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--row", metavar="LABEL", help="also print the README's table row for this run, labelled LABEL")
    p.add_argument("--plot", metavar="OUT.png", help="also draw every policy's curve (cold share against GPU or GB·h)")
    p.add_argument("--client", metavar="NAME", help="with a fleet trace: replay this one model (a client of a per-client "
                   "file) alone, as a rate trace, through the single-model yardsticks instead of the fleet backtest")
    args = p.parse_args()
    from prewarm.cli.backtest import _head

    trace: Any
    fleet = is_fleet_trace(args.trace)  # reads the file's head: once
    if fleet and not args.client:
        return _fleet(args)
    if args.client and not fleet:
        p.error(f"--client {args.client!r}: {args.trace} is not a fleet trace (per-client rates, a request log)")
    try:
        trace = load_fleet([args.trace]).client(args.client) if args.client else load_trace(args.trace)
    except HistoryError as exc:
        p.error(str(exc))
    days = 0.25 if args.quick else args.days
    if days:
        trace = _head(trace, days * 86400.0)
    knobs = {k: SWEEP_KNOBS[k] for k in ("reactive", "reactive_sized", "fixed_pool", "prewarm_fixed_margin")}
    if args.few:  # a loaded machine: the ablation (a planner replay per setting) every other setting, the pool at its
        # default; the baselines' curves stay whole (cheap replays; thinned, a missing target moved every reading)
        name, v, d = knobs["prewarm_fixed_margin"]
        knobs["prewarm_fixed_margin"] = (name, tuple(sorted({*v[::2], d})), d)
        knobs["fixed_pool"] = (knobs["fixed_pool"][0], (knobs["fixed_pool"][2],), knobs["fixed_pool"][2])
    name, values, default = SWEEP_KNOBS["prewarm"]
    knobs["prewarm"] = (name, values if args.prewarm_curve else (default,), default)
    policies = ["reactive", "reactive_sized", "fixed_pool", "prewarm_fixed_margin", "prewarm", "oracle"]
    if args.keepalive:
        kname, _, kdefault = SWEEP_KNOBS["keepalive"]
        knobs["keepalive"] = (kname, (kdefault,), kdefault)
        policies.insert(3, "keepalive")
    sim = SimParams(cold_start_s=args.cold_start, snapshot_ratio=args.snapshot_ratio)
    out = run_sweep(trace, sim, policies, knobs=knobs)
    eq = out["at_equal_cold_start_share"]
    credit = "" if args.snapshot_ratio is None else f", snapshot credited at {args.snapshot_ratio:g}"
    print(f"{out['trace']}, cold start {args.cold_start:g} s (CV 0.3, charges on{credit}): reactive {out['reactive_gpu_hours']:.1f} GPU-h")
    for pt in out["points"]:
        knob = f"{pt['knob']}={pt['value']:g}" if pt["knob"] else "-"
        print(f"  {pt['policy']:<20} {knob:<24} {pt['gpu_hours_vs_reactive']:.3f}x  cold {pt['cold_start_share']:.4%}  "
              f"starts {pt['starts']}{'  (default)' if pt['default'] else ''}")
    share = eq["cold_start_share"]
    print(f"at prewarm's default cold-start share ({share:.4%}):" if share is not None else "no prewarm point")
    for k, v in eq["policies"].items():
        print(f"  {k:<20} {'outside its curve' if v is None else f'{v:.3f}x reactive'}")
    if (fs := out["foresight"]) is not None:
        got = "" if fs["captured"] is None else f"; prewarm gets {fs['captured']:.0%} of the oracle's saving"
        print(f"foresight: the oracle (cold {fs['oracle_cold_start_share']:.4%}) {fs['oracle']:.3f}x reactive, "
              f"{fs['oracle_vs_reactive_sized']:.3f}x reactive_sized at prewarm's share; prewarm "
              f"{fs['prewarm_vs_reactive_sized']:.3f}x{got}")
    if args.row:
        print(readme_row(args.row, out))
    if args.plot:
        from forecasting.sim.report import plot_sweep

        title = f"{Path(out['trace']).name}, cold start {args.cold_start:g} s\ncold-start share vs GPU-hours (stars: defaults)"
        print(f"plot written to {plot_sweep(out, args.plot, title=title)}")
    text = json.dumps(out | {"cold_start_s": args.cold_start, "days": days or None}, default=float)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)


def _fleet(args: Any) -> None:
    """A fleet trace: every fleet policy (the sleep-enabled baselines too), curves, and `at_equal`."""
    from dataclasses import replace

    from forecasting.fleet.backtest import FleetSetup, resample, run_fleet_backtest
    from forecasting.fleet.report import print_fleet
    from forecasting.parallel import cpus
    from prewarm.core.settings import Settings

    trace = resample(load_fleet([args.trace]), 60.0)
    days = 2.0 if args.quick else args.days
    if days:
        trace = replace(trace, counts=trace.counts[: int(days * 86400 / trace.step_s)],
                        source=f"{trace.source} (first {days:g} days)")
    knobs = None
    if args.few:
        knobs = {"keepalive": (60.0, 300.0, 600.0, 3600.0), "keepalive_sleep": (60.0, 300.0, 600.0, 3600.0),
                 "hybrid_histogram": (75.0, 95.0, 99.0), "hybrid_histogram_sleep": (75.0, 95.0, 99.0),
                 "fleet": (0.5, 1.0, 1.5)}
    step = float(Settings.load().planner.fine_bucket_s)  # the live round's resolution, as `prewarm backtest`
    out = run_fleet_backtest(trace, setup=FleetSetup(step_s=step), knobs=knobs, jobs=cpus(),
                             progress=lambda s: print(f"  replay {s}", file=sys.stderr, flush=True))
    print_fleet(out)
    if args.plot:
        from forecasting.fleet.report import plot_curves

        print(f"plot written to {plot_curves(out, args.plot)}")
    text = json.dumps(out, default=float)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)


if __name__ == "__main__":
    main()
