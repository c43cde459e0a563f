"""The end of `prewarm up`: what happened, what a reactive policy would have paid on the
same replay (from the simulator), and the plots.

The measured side comes from the replay's own answers and the registry; the comparison
replays the same arrivals through `forecasting`'s simulator under `reactive` and `prewarm`
with the replica model calibrated on this run (measured cold start, measured service
time), so the two columns differ only by policy. It says so in the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from rich.console import Console
from rich.table import Table

from forecasting.sim.report import plot as plot_policies
from forecasting.sim.scoring import run_backtest
from forecasting.sim.simulate import SimParams
from forecasting.data.traces import RequestTrace, TraceFormat
from prewarm.core.settings import PlannerSettings, Settings
from prewarm.registry.replicas import ReplicaRegistry
from workers.up.supervisor import Supervisor
from workers.up.traffic import TrafficStats

from workers.up import vllm as up_vllm
from workers.up.workload import Timeline, UpOptions, Workload


class UpRun(Protocol):
    """What the report reads of a finished run (`workers.up.run.UpRun`)."""

    settings: Settings
    opts: UpOptions
    console: Console
    run_dir: Path
    sup: Supervisor
    registry: ReplicaRegistry
    timeline: Timeline
    stats: TrafficStats
    warm_s: float
    total_s: float

    @property
    def warm_cost(self) -> float: ...


def _plot_timeline(run: UpRun, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = run.timeline
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8))
    ax1.plot(tl.t, tl.rps, color="0.6", lw=0.8, label="requests sent (req/s)")
    ax1.set_xlabel("time since start (s)")
    ax1.set_ylabel("requests/s")
    axr = ax1.twinx()
    axr.step(tl.t, tl.serving, where="post", label="ready serving", lw=1.2)
    axr.step(tl.t, tl.loading, where="post", label="loading/warming", lw=1.0)
    axr.step(tl.t, tl.warm, where="post", label="warm pool", lw=1.0)
    axr.set_ylabel("replicas")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = axr.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax1.set_title("prewarm up: traffic and replicas (measured)")
    lat = np.sort(np.asarray(run.stats.latencies))
    if lat.size:
        ax2.plot(lat, np.arange(1, lat.size + 1) / lat.size, lw=1.2)
    ax2.set_xscale("log")
    ax2.axvline(0.5, color="k", ls=":", lw=0.8)
    ax2.set_xlabel("latency through the gateway (s)")
    ax2.set_ylabel("CDF")
    ax2.set_title("request latency CDF (dotted: 0.5 s, the cold-start-hit threshold)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _planner_settings(base: PlannerSettings, env: dict[str, str]) -> PlannerSettings:
    """The planner settings the run's processes read: `base` overridden by the run's PREWARM_PLANNER_*."""
    prefix = "PREWARM_PLANNER_"
    over: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):].lower()
        field = PlannerSettings.model_fields.get(name)
        if field is None:
            continue
        try:
            over[name] = json.loads(value) if value[:1] in "[{" else value
        except ValueError:
            over[name] = value
    return PlannerSettings.model_validate(base.model_dump() | over)


def _simulate(run: UpRun, wl: Workload, cold_start_s: float) -> tuple[dict[str, Any], Any]:
    """Replay the same arrivals in the simulator: replicas of the declared capacity, the measured cold start."""
    capacity = run.settings.planner.capacity_rps
    env_capacity = run.sup.env.get("PREWARM_PLANNER_CAPACITY_RPS")
    if env_capacity:
        capacity = float(env_capacity)
    # the planner sizes a replica by the requests in flight that saturate it (gateway.replica_concurrency);
    # each of those slots then serves capacity / slots requests a second
    slots = int(run.sup.env.get("PREWARM_GATEWAY_REPLICA_CONCURRENCY") or run.settings.gateway.replica_concurrency)
    params = SimParams(
        slots=slots, cold_start_s=cold_start_s,
        prefill_base_s=slots / capacity, prefill_tokens_per_s=1e12, decode_tokens_per_s=1e12,
        mean_context_tokens=0.0, mean_generated_tokens=0.0,
    )
    trace = RequestTrace(t=np.asarray(wl.arrivals, dtype=np.float64), context_tokens=None, generated_tokens=None,
                         source=wl.description, start_epoch=0.0, format=TraceFormat.REQUEST_CSV)
    # the run's own planner settings (the demo's), not the defaults: the simulated column is what ran
    planner = _planner_settings(run.settings.planner, run.sup.env)
    out = run_backtest(trace, params, policies=("reactive", "prewarm"),
                       policy_kwargs={"prewarm": {"planner_settings": planner}})
    return out["result"], out


def report(run: UpRun, wl: Workload) -> dict[str, Any]:
    s = run.stats
    plots = run.run_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    cold = run.registry.load_time_p95("demo") or run.settings.planner.default_cold_start_s
    started = sum(1 for _, e in run.registry.events(count=100_000) if e.get("to") == "pending")
    measured = {
        "requests": s.sent,
        "answered_2xx": s.ok,
        "status_503": s.statuses.get(503, 0),
        "errors": sum(s.errors.values()),
        "latency_p50_s": s.percentile(50),
        "latency_p99_s": s.percentile(99),
        "cold_start_share": s.waits_over / max(1, s.ok),
        "warm_cost_ratio": run.warm_cost,
        "replica_seconds": run.total_s,
        "replicas_started": started,
        "cold_start_p95_s": cold,
    }
    sim, full = _simulate(run, wl, cold)
    timeline_png = _plot_timeline(run, plots / "timeline.png")
    sim_png = plot_policies(full["work"], full["runs"], plots / "simulated_policies.png",
                            title="same arrivals, simulated: reactive vs prewarm")
    result = {"workload": wl.description, "engine": run.opts.engine, "measured": measured, "simulated": sim,
              "plots": [str(timeline_png), str(sim_png)]}
    if run.opts.engine == "vllm":
        result.update(up_vllm.report_fields(run.settings, run.registry, "demo"))
    (run.run_dir / "report.json").write_text(json.dumps(result, indent=2, default=str))

    table = Table(title="prewarm up — report")
    table.add_column("")
    table.add_column("this run (measured)", justify="right")
    table.add_column("prewarm (simulated)", justify="right")
    table.add_column("reactive (simulated)", justify="right")
    pw, re = sim["policies"]["prewarm"], sim["policies"]["reactive"]
    table.add_row("requests", str(s.sent), f"{sim['params']['requests']:.0f}", f"{sim['params']['requests']:.0f}")
    table.add_row("p50 latency / TTFT", f"{measured['latency_p50_s']:.3f} s", f"{pw['ttft_p50_s']:.3f} s", f"{re['ttft_p50_s']:.3f} s")
    table.add_row("p99 latency / TTFT", f"{measured['latency_p99_s']:.3f} s", f"{pw['ttft_p99_s']:.3f} s", f"{re['ttft_p99_s']:.3f} s")
    table.add_row("slower than 0.5 s (sim: waited > 0.5 s)", f"{measured['cold_start_share']:.2%}", f"{pw['cold_start_share']:.2%}",
                  f"{re['cold_start_share']:.2%}")
    table.add_row("warm cost ratio", f"{measured['warm_cost_ratio']:.1%}", f"{pw.get('warm_cost_ratio', 0):.1%}",
                  f"{re.get('warm_cost_ratio', 0):.1%}")
    table.add_row("replica-seconds", f"{measured['replica_seconds']:.0f}", f"{pw['gpu_hours'] * 3600:.0f}",
                  f"{re['gpu_hours'] * 3600:.0f}")
    table.add_row("non-2xx / errors", f"{s.sent - s.ok - measured['errors']} / {measured['errors']}", "-", "-")
    run.console.print(table)
    run.console.print(
        f"simulated on the same arrivals with this run's planner settings: cold start {cold:.1f} s (this run's "
        f"measured p95), {sim['params']['slots']} requests at a time per replica for "
        f"{sim['params']['prefill_base_s']:.2f} s each (the declared capacity, PREWARM_PLANNER_CAPACITY_RPS)"
    )
    if result.get("engine") == "vllm":
        ratio = result.get("warm_validate_over_server_start")
        run.console.print(
            f"engine vllm: time to a validated replica per tier {result['time_to_validated_s']}; vLLM's own start "
            f"{result['engine_server_start_s']}, warmup + validation {result['engine_warm_validate_s']}"
            + (f" ({ratio:.1%} of the start)" if ratio is not None else ""))
    run.console.print(f"plots: {timeline_png}, {sim_png}\nreport: {run.run_dir / 'report.json'}")
    return result
