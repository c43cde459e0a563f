"""`prewarm backtest`: replay a trace through the scaling policies and score them.

A request or rate trace runs the single-model policies (`forecasting.sim`), `--sweep` runs
each over its knob, and a fleet trace runs the fleet policies (`forecasting.fleet`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from prewarm.core.settings import Settings


def add_parser(sub: Any) -> None:
    """Register `backtest` on the CLI's subparsers."""
    p = sub.add_parser("backtest", help="replay a trace through the scaling policies and score them (TTFT, cold starts, GPU-hours)")
    p.add_argument("trace", nargs="+", help="a trace file (Azure CSV, Mooncake JSONL, ServeGen or NASA rates); "
                   "a fleet trace (per-client rates, Azure Functions days in order, a request log) runs the fleet backtest")
    p.add_argument("--policies", default=None, help="comma-separated policies (default: every policy of the mode; "
                   "the ablation prewarm_fixed_margin only when named)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--plot", metavar="OUT.png", help="write traffic vs replicas and TTFT CDFs")
    p.add_argument("--time-scale", type=float, default=1.0, help="compress time by X (rates x X)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate by Y")
    p.add_argument("--cold-start", type=float, default=None, help="cold start seconds (default: planner default_cold_start_s)")
    p.add_argument("--cold-start-cv", type=float, default=None,
                   help="lognormal cold starts with this CV (default 0.3; 0: every start takes --cold-start)")
    _charge_args(p)
    p.add_argument("--slots", type=int, default=8, help="concurrent requests per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-s", type=float, default=None, metavar="S",
                   help="replay only the first S seconds of the trace (say so when quoting figures)")
    p.add_argument("--sweep", metavar="OUT.png", nargs="?", const="sweep.png",
                   help="run each policy over its knob (reactive target, reactive_sized queue_beta, pool percent, "
                        "keep-alive, prewarm cold-start budget) and draw GPU-hours against cold-start hits, one curve "
                        "per policy (default file: sweep.png)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="replays run side by side in N processes (default: the CPUs this process may use); the "
                        "figures are the same with any N")
    p.add_argument("--score-after", type=float, default=0.0, metavar="S",
                   help="score only requests (and GPU time) after S seconds: a warm-up excluded for every policy")
    g = p.add_argument_group("rollout scenario (a canary rollout in the middle of the trace)")
    g.add_argument("--rollout-at", type=float, default=None, metavar="S",
                   help="add rows rollout_prewarm and rollout_timer: a rollout starting S seconds into the trace")
    g.add_argument("--rollout-steps", default="5,25,50,100", help="canary weights in percent (default 5,25,50,100)")
    g.add_argument("--rollout-pause", type=float, default=600.0, metavar="S", help="seconds per step (default 600)")
    _fleet_args(p)
    p.set_defaults(handler=run)


def _charge_args(p: argparse.ArgumentParser) -> None:
    """What the simulator charges (docs/simulator.md): each a default these flags change."""
    from forecasting.sim.workload import NODE_LOADS, SimParams

    d = SimParams()
    g = p.add_argument_group("what the replay charges (defaults: docs/simulator.md)")
    g.add_argument("--cold-starts", type=_floats, default=None, metavar="S,S,...",
                   help="measured cold starts (s): each start draws one of them instead of the lognormal")
    g.add_argument("--actuation-delay", type=float, default=None, metavar="S",
                   help=f"seconds from a decision to its action: dispatch beat, queue, agent (default {d.actuation_delay_s:g})")
    g.add_argument("--planner-cold-start", choices=["running", "exact"], default=None,
                   help="what the planner knows of cold starts: the running p95 of those seen (default) or the exact p95")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help=f"GPUs per node; a node's concurrent loads use one load bandwidth (default {d.gpus_per_node})")
    g.add_argument("--node-loads", choices=NODE_LOADS, default=None,
                   help="a node's concurrent weight transfers: one after another, as prewarm's runtime fills the "
                        "node snapshot once (default), or all at once at a share of the bandwidth (an engine "
                        "without it)")
    g.add_argument("--snapshot-ratio", type=float, default=None, metavar="R",
                   help="credit the node snapshot (ordered loads): once a node's first transfer is done, later ones "
                        "copy from it at once in R of the time (0.34 measured on an H200; default: not credited)")
    g.add_argument("--load-share", type=float, default=None,
                   help=f"the share of a cold start that is weight transfer, shared on a node (default {d.load_share:g})")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="the pool's capacity in replicas: a policy's wish beyond it is not placed (default: unbounded)")
    g.add_argument("--ideal", action="store_true",
                   help="charge nothing: constant cold starts, no actuation delay, no shared bandwidth, exact p95 "
                        "(the old yardstick, to compare)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of seconds: {text!r}") from None


def fleet_charges(args: argparse.Namespace) -> dict[str, Any]:
    """The charge flags both replays take (`--actuation-delay`, `--cold-start-cv`, `--load-share`, `--ideal`), for
    the pool's."""
    kw: dict[str, Any] = {"actuation_s": 0.0, "cold_start_cv": 0.0, "load_share": 0.0} if args.ideal else {}
    given = {"actuation_s": args.actuation_delay, "cold_start_cv": args.cold_start_cv, "load_share": args.load_share}
    return kw | {k: float(v) for k, v in given.items() if v is not None}


def sim_params(args: argparse.Namespace, settings: Settings) -> Any:
    """The replay's `SimParams` from the flags: every charge a default unless a flag (or --ideal) changes it."""
    from forecasting.sim.workload import SimParams

    kw: dict[str, Any] = {}
    if args.ideal:
        kw |= {"cold_start_cv": 0.0, "actuation_delay_s": 0.0, "load_share": 0.0, "planner_cold_start": "exact"}
    for flag, name in (("cold_start_cv", "cold_start_cv"), ("cold_starts", "cold_starts_s"),
                       ("actuation_delay", "actuation_delay_s"), ("planner_cold_start", "planner_cold_start"),
                       ("gpus_per_node", "gpus_per_node"), ("node_loads", "node_loads"), ("load_share", "load_share"),
                       ("max_replicas", "max_replicas"), ("snapshot_ratio", "snapshot_ratio")):
        if getattr(args, flag) is not None:
            kw[name] = getattr(args, flag)
    return SimParams(
        slots=args.slots, seed=args.seed, time_scale=args.time_scale, rate_scale=args.rate_scale,
        cold_start_s=args.cold_start if args.cold_start is not None else settings.planner.default_cold_start_s, **kw)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet backtest (many models on one GPU pool)")
    g.add_argument("--fleet", action="store_true", help="read the trace as a fleet (implied by a fleet format)")
    g.add_argument("--time-column", help="request log: the column of arrival times (e.g. gmt_create)")
    g.add_argument("--model-column", help="request log: the column naming the model (e.g. checkpoint_model_version_id)")
    g.add_argument("--unit", choices=["app", "function"], default="app", help="Azure Functions: a model per app or function")
    g.add_argument("--step", type=float, default=None, metavar="S",
                   help="the pool replay's step in seconds: each policy decides once a step (default: the planner's "
                        "fine bucket, PREWARM_PLANNER_FINE_BUCKET_S, 10 s: the counters the live round sizes its dense "
                        "models on, every 5 s; 60 replays six times faster and sees a burst up to a minute late)")
    g.add_argument("--catalog", help="a JSON model catalog (default: footprints from a stable hash of the name)")
    g.add_argument("--nodes", type=int, default=0, help="GPU nodes (default: enough for --capacity-share of all models)")
    g.add_argument("--node-gpu-gb", type=float, default=640.0)
    g.add_argument("--node-host-gb", type=float, default=1024.0)
    g.add_argument("--capacity-share", type=float, default=0.4, help="fleet GPU memory as a share of all models' footprints")
    g.add_argument("--top", type=int, default=0, help="keep only the N models with the most requests")
    g.add_argument("--no-curve", action="store_true", help="skip the knob sweeps (the curve)")
    g.add_argument("--even-counts", action="store_true",
                   help="rate traces: spread each window's mean evenly instead of seeded Poisson counts per step")
    g.add_argument("--sleep-share", type=float, default=0.75,
                   help="share of host memory sleeping models may hold (planner and sleep baselines alike)")
    g.add_argument("--sleep-gbps", type=float, default=1.75,
                   help="GB/s of the copy that puts a model to sleep (its GPU memory is held meanwhile)")


def _cmd_fleet_backtest(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from forecasting.fleet.backtest import FleetSetup, run_fleet_backtest
    from forecasting.fleet.catalog import load_catalog
    from forecasting.fleet.policies import FLEET_POLICIES, fleet_policy_settings
    from forecasting.fleet.report import plot_curves, print_fleet
    from forecasting.fleet.traces import load_fleet
    from forecasting.data.traces import HistoryError

    step = float(settings.planner.fine_bucket_s) if args.step is None else args.step
    try:
        trace = load_fleet(args.trace, time_column=args.time_column, model_column=args.model_column,
                           step_s=step, unit=args.unit)
        if args.top:
            trace = trace.head(args.top)
        catalog = load_catalog(args.catalog, trace.names) if args.catalog else None
        setup = FleetSetup(n_nodes=args.nodes, node_gpu_gb=args.node_gpu_gb, node_host_gb=args.node_host_gb,
                           capacity_share=args.capacity_share, step_s=step,
                           score_after_s=args.score_after or 86_400.0, poisson=not args.even_counts,
                           seed=args.seed, sleep_share=args.sleep_share, sleep_gbps=args.sleep_gbps,
                           planner=fleet_policy_settings(settings.planner), **fleet_charges(args))
        policies = [p.strip() for p in (args.policies or ",".join(FLEET_POLICIES)).split(",") if p.strip()]
        out = run_fleet_backtest(trace, catalog=catalog, setup=setup, policies=policies, curve=not args.no_curve,
                                 progress=lambda s: print(f"  replay {s}", file=sys.stderr, flush=True),
                                 jobs=_jobs(args))
    except (HistoryError, ValueError, KeyError) as exc:
        print(f"prewarm backtest: {exc}", file=sys.stderr)
        return 2
    print_fleet(out)
    if args.plot:
        print(f"plot written to {plot_curves(out, args.plot)}")
    if args.json:
        print(json.dumps(out, default=float))
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    """`prewarm backtest`: one trace through the policies, a sweep, or a fleet trace through the fleet policies."""
    import json

    from forecasting.fleet.traces import is_fleet_trace

    if args.fleet or args.time_column or args.model_column or is_fleet_trace(args.trace[0]):
        return _cmd_fleet_backtest(args, settings)

    from forecasting.sim.report import print_table, progress_bar
    from forecasting.sim.policies import POLICIES
    from forecasting.sim.scoring import run_backtest
    from forecasting.data.traces import HistoryError, load_trace

    try:
        trace: object = load_trace(args.trace[0])
        if args.limit_s is not None:
            trace = _head(trace, args.limit_s)
        params = sim_params(args, settings)
        policies = [p.strip() for p in (args.policies or ",".join(POLICIES)).split(",") if p.strip()]
        if args.sweep:
            return _sweep(args, settings, trace, params, policies)
        with progress_bar() as progress:
            out = run_backtest(trace, params, policies, progress=progress, policy_kwargs=_planner_kwargs(settings),
                               score_after_s=args.score_after, jobs=_jobs(args))
        if args.rollout_at is not None:
            from forecasting.sim.rollout import add_rollout_rows

            add_rollout_rows(out, params, args.rollout_at, args.rollout_steps, args.rollout_pause, settings.planner)
    except (HistoryError, ValueError) as exc:
        print(f"prewarm backtest: {exc}", file=sys.stderr)
        return 2
    print_table({**out["result"], "policies": {k: v for k, v in out["result"]["policies"].items()
                                               if not k.startswith("rollout_")}})
    if args.rollout_at is not None:
        from forecasting.sim.rollout import print_rollout

        print_rollout(out["result"])
    if args.plot:
        from forecasting.sim.report import plot

        path = plot(out["work"], out["runs"], args.plot, title=out["result"]["trace"])
        print(f"plot written to {path}")
    if args.json:
        print(json.dumps(out["result"], default=float))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    """`--jobs`, or the CPUs this process may use."""
    from forecasting.parallel import check_jobs, cpus

    return cpus() if args.jobs is None else check_jobs(args.jobs)


def _planner_kwargs(settings: Settings) -> dict[str, dict[str, Any]]:
    """The planner settings the planner-based policies run with (prewarm, its feedback-off ablation, reactive_sized)."""
    return {name: {"planner_settings": settings.planner} for name in ("prewarm", "prewarm_fixed_margin", "reactive_sized")}


def _head(trace: object, seconds: float) -> object:
    """The first `seconds` of a trace (request or rate trace), with its source saying so."""
    from dataclasses import replace

    import numpy as np

    src = f"{getattr(trace, 'source', 'trace')} (first {seconds / 3600:g} h)"
    if hasattr(trace, "t"):
        t = np.asarray(trace.t)
        keep = t - t[0] < seconds
        ctx, gen = getattr(trace, "context_tokens", None), getattr(trace, "generated_tokens", None)
        return replace(trace, t=t[keep], source=src,  # type: ignore[type-var]
                       context_tokens=None if ctx is None else np.asarray(ctx)[keep],
                       generated_tokens=None if gen is None else np.asarray(gen)[keep])
    keep = np.asarray(trace.window_start_s) < seconds  # type: ignore[attr-defined]
    return replace(trace, window_start_s=np.asarray(trace.window_start_s)[keep],  # type: ignore[type-var, attr-defined]
                   rate=np.asarray(trace.rate)[keep], source=src)  # type: ignore[attr-defined]


def _sweep(args: argparse.Namespace, settings: Settings, trace: object, params: object, policies: list[str]) -> int:
    import json

    from forecasting.sim.report import plot_sweep, progress_bar
    from forecasting.sim.scoring import run_sweep

    with progress_bar() as progress:
        sweep = run_sweep(trace, params, policies,  # type: ignore[arg-type]
                          policy_kwargs=_planner_kwargs(settings), progress=progress, jobs=_jobs(args))
    print(f"{sweep['trace']}: GPU-hours vs reactive ({sweep['reactive_gpu_hours']:.2f} GPU-h) and cold-start hits")
    for pt in sweep["points"]:
        knob = f"{pt['knob']}={pt['value']:g}" if pt["knob"] else "-"
        print(f"  {pt['policy']:<14} {knob:<24} {pt['gpu_hours_vs_reactive']:.3f}x  {pt['cold_start_share']:.4%}  "
              f"p99 {pt['ttft_p99_s']:.3f} s  starts {pt['starts']}{'  (default)' if pt['default'] else ''}")
    eq = sweep["at_equal_cold_start_share"]
    if eq["cold_start_share"] is not None:
        print(f"at prewarm's default cold-start share ({eq['cold_start_share']:.4%}), GPU-hours vs reactive:")
        for name, v in eq["policies"].items():
            print(f"  {name:<14} {'outside its curve' if v is None else f'{v:.3f}x'}")
    path = plot_sweep(sweep, args.sweep)
    print(f"sweep plot written to {path}")
    if args.json:
        print(json.dumps(sweep, default=float))
    return 0
