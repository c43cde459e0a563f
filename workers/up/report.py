"""The end of `prewarm up`: what happened, what a reactive policy would have paid on the
same replay (from the simulator), and the plots.

The measured side comes from the replay's own answers and the registry; the comparison
replays the same arrivals through `forecasting`'s simulator under `reactive` and `prewarm`
with the replica model calibrated on this run (its measured cold starts and actuation
delays, the declared capacity), so the two columns differ only by policy. It says so in
the output. The simulated `prewarm` column is also a fidelity check of the simulator
against this measured run (`workers.up.fidelity`): `sim_vs_measured` in `report.json`.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import redis
from rich.console import Console
from rich.table import Table

from forecasting.sim.report import plot as plot_policies
from forecasting.sim.scoring import run_backtest
from forecasting.sim.simulate import SimParams
from forecasting.data.traces import RequestTrace, TraceFormat
from prewarm.core.settings import PlannerSettings, Settings
from prewarm.registry.replicas import ReplicaRegistry
from workers.up.fidelity import (Measured, counted_since, gateway_waits_over, judge, measure, planner_view,
                                 replica_seconds, request_services, service_s, summary)
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
    replay_t0: float  # the replay's start on the timeline
    replay_epoch: float  # and on the wall clock
    history_epoch: float  # the epoch the workload's history offsets are from (the replay's planned start)
    stack_epoch: float  # when the planner (and the rest of the stack) started

    client: "redis.Redis[str]"
    gateway_url: str
    nodes: tuple[str, ...]  # the run's node agents

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


def _simulate(run: UpRun, wl: Workload, got: Measured,
              default_cold_s: float) -> tuple[dict[str, Any], dict[str, Any], SimParams, float, float]:
    """Replay the same arrivals in the simulator: this run's measured cold starts (each start draws one of
    them), its mean actuation delay (decision to registration) and its measured service time; with a
    history, the history too (its requests held for the time they were counted with) and the planner
    stepping from when the live one started. Returns the result, the replay, its params, the epoch the
    simulator's clock starts at (its first request) and the replay's start on that clock (scored after it)."""
    # the planner sizes a replica by the requests in flight that saturate it (gateway.replica_concurrency)
    slots = int(run.sup.env.get("PREWARM_GATEWAY_REPLICA_CONCURRENCY") or run.settings.gateway.replica_concurrency)
    # each replayed request holds its slot for its own measured latency (on a shared CPU answer times swing with
    # load, and the gateway's peak in flight with them), so the simulated gateway counts the requests in flight
    # the real one counted; one not answered, the mean latency of those that did not wait (or the declared
    # capacity's slots / capacity s when nothing was answered)
    capacity = float(run.sup.env.get("PREWARM_PLANNER_CAPACITY_RPS") or run.settings.planner.capacity_rps)
    service = service_s(run.stats.latencies, SimParams.wait_threshold_s) or slots / capacity
    measured_delay = float(np.mean(got.actuation_delays_s)) if got.actuation_delays_s else None
    # the run's pool: its agents' replica slots (one vLLM server per node); the live placement drops the rest
    per_node = int(run.sup.env.get("PREWARM_AGENT_REPLICA_SLOTS") or run.settings.agent.replica_slots)
    params = SimParams(
        max_replicas=per_node * len(run.nodes),
        slots=slots, cold_start_s=float(np.mean(got.cold_starts_s)) if got.cold_starts_s else default_cold_s,
        cold_starts_s=got.cold_starts_s,
        # the measured starts already ran beside each other on this machine: no further load-bandwidth charge
        load_share=0.0,
        # the live executor's scale-down retires ready replicas only: a load in progress runs to ready
        cancel_loads=False,
        actuation_delay_s=measured_delay if measured_delay is not None else SimParams.actuation_delay_s,
        # a request's service is its "generated tokens" at 1000 tokens/s: each keeps the time it was counted with
        prefill_base_s=0.0, prefill_tokens_per_s=1e12, decode_tokens_per_s=1000.0,
        mean_context_tokens=0.0, mean_generated_tokens=0.0,
    )
    # the simulator's clock starts at the first counted bucket (where the live history begins), on the wall
    # clock's epoch: the planner's calendar (batch jobs' cron, the daily profile) sees the times the run saw
    hist = run.history_epoch + wl.history
    win = run.replay_epoch + np.asarray(wl.arrivals, dtype=np.float64)
    t = np.concatenate([hist, win])
    epoch0 = float(t.min())  # the simulator counts time from the first request
    t = t - epoch0
    svc = np.concatenate([np.full(hist.size, run.opts.history_service_s),
                          request_services(wl.arrivals, run.stats.offsets, run.stats.latencies, service)])
    trace = RequestTrace(t=t, context_tokens=np.zeros(t.size), generated_tokens=svc * 1000.0,
                         source=wl.description, start_epoch=epoch0, format=TraceFormat.REQUEST_CSV)
    # the run's own planner settings (the demo's), not the defaults: the simulated column is what ran
    planner = _planner_settings(run.settings.planner, run.sup.env)
    after = max(0.0, run.replay_epoch - epoch0)
    # the live planner's first step: when it fitted its profile (refit hourly), else when the stack started
    first_step = planner_view(run.client, "demo")["first_step_epoch"] or run.stack_epoch
    plan_from = max(0.0, float(first_step) - epoch0) if hist.size else 0.0
    out = run_backtest(trace, params, policies=("reactive", "prewarm"), score_after_s=after,
                       policy_kwargs={"prewarm": {"planner_settings": planner, "plan_from_s": plan_from,
                                                  "model_name": "demo"}})  # the run's batch job names its model
    return out["result"], out, params, epoch0, after


def _mean_service(work: Any, after_s: float) -> float:
    """The mean service time of the replayed requests (those arriving after `after_s`) in the simulator."""
    if work.service is None or work.arrivals is None or not (work.arrivals >= after_s).any():
        return float("nan")
    return float(work.service[work.arrivals >= after_s].mean())


def _waited(run: Any, work: Any, params: SimParams, after_s: float) -> int:
    """Requests of a simulated run arriving after `after_s` that waited longer than the threshold for a start."""
    late = run.wait > params.wait_threshold_s
    if run.weight is not None:
        parts = run.wait.size // work.counts.size
        keep = np.tile(np.arange(work.counts.size) >= int(after_s), parts)
        return int(round(float(run.weight[late & keep].sum())))
    return int((late & (work.arrivals >= after_s)).sum())


def report(run: UpRun, wl: Workload) -> dict[str, Any]:
    s = run.stats
    plots = run.run_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    cold = run.registry.load_time_p95("demo") or run.settings.planner.default_cold_start_s
    started = sum(1 for _, e in run.registry.events(count=100_000) if e.get("to") == "pending")
    measured: dict[str, Any] = {
        "requests": s.sent,
        "answered_2xx": s.ok,
        "status_503": s.statuses.get(503, 0),
        "errors": sum(s.errors.values()),
        "statuses": {str(k): v for k, v in sorted(s.statuses.items())},
        "error_kinds": dict(s.errors),
        "latency_p50_s": s.percentile(50),
        "latency_p99_s": s.percentile(99),
        "cold_start_share": s.waits_over / max(1, s.ok),
        "warm_cost_ratio": run.warm_cost,
        "replica_seconds": run.total_s,
        "replicas_started": started,
        "cold_start_p95_s": cold,
    }
    got = measure(run.client, "demo", run.registry.events(count=100_000))
    measured["cold_starts"] = summary(got.cold_starts_s)
    measured["actuation_delay"] = summary(got.actuation_delays_s)
    sim, full, params, epoch0, after = _simulate(run, wl, got, cold)
    work, pw_run = full["work"], full["runs"]["prewarm"]
    tl = run.timeline
    live = [a + b + c for a, b, c in zip(tl.serving, tl.loading, tl.warm)]
    # the simulator's scored span [after, duration) on its clock, on the wall clock and on the run's timeline
    start, end = epoch0 + after, epoch0 + work.duration_s
    on_timeline = run.replay_t0 - run.replay_epoch
    measured_rs = replica_seconds(tl.t, live, start + on_timeline, end + on_timeline)
    with urllib.request.urlopen(run.gateway_url + "/metrics", timeout=10) as resp:
        waited = gateway_waits_over(resp.read().decode(), "demo", params.wait_threshold_s)
    measured["waited_for_start"] = waited
    fidelity = judge(measured_rs, sim["policies"]["prewarm"]["gpu_hours"] * 3600, waited,
                     _waited(pw_run, work, params, after))
    timeline_png = _plot_timeline(run, plots / "timeline.png")
    sim_png = plot_policies(full["work"], full["runs"], plots / "simulated_policies.png",
                            title="same arrivals, simulated: reactive vs prewarm")
    result = {"workload": wl.description, "engine": run.opts.engine, "measured": measured, "simulated": sim, "sim_vs_measured": fidelity,
              "planner": planner_view(run.client, "demo"), "history_epoch": run.history_epoch,
              "counted_by_gateway": counted_since(run.client, "demo", start, end, run.history_epoch + wl.history),
              "plots": [str(timeline_png), str(sim_png)]}
    if run.opts.engine == "vllm":
        result.update(up_vllm.report_fields(run.settings, run.registry, "demo"))
    watch = getattr(run, "rollout", None)
    if watch is not None:
        ro = result["rollout"] = watch.result()
        run.console.print(f"rollout {ro['stable']} -> {ro['canary']}: {ro['outcome']} {ro['reason']}; waited during "
                          f"the shift: {ro['waited_during_shift']}, errors: {ro['errors_during_shift']}")
    (run.run_dir / "report.json").write_text(json.dumps(result, indent=2, default=str))

    table = Table(title="prewarm up — report")
    table.add_column("")
    table.add_column("this run (measured)", justify="right")
    table.add_column("prewarm (simulated)", justify="right")
    table.add_column("reactive (simulated)", justify="right")
    pw, re = sim["policies"]["prewarm"], sim["policies"]["reactive"]
    table.add_row("requests", str(s.sent), str(len(wl.arrivals)), str(len(wl.arrivals)))  # the replay's (history apart)
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
        f"measured p95), {sim['params']['slots']} requests at a time per replica, each for its own measured latency "
        f"(mean {_mean_service(full['work'], after):.3f} s)"
    )
    _print_fidelity(run.console, fidelity, measured)
    if result.get("engine") == "vllm":
        ratio = result.get("warm_validate_over_server_start")
        run.console.print(
            f"engine vllm: time to a validated replica per tier {result['time_to_validated_s']}; vLLM's own start "
            f"{result['engine_server_start_s']}, warmup + validation {result['engine_warm_validate_s']}"
            + (f" ({ratio:.1%} of the start)" if ratio is not None else ""))
    run.console.print(f"plots: {timeline_png}, {sim_png}\nreport: {run.run_dir / 'report.json'}")
    return result


def _print_fidelity(console: Console, f: dict[str, Any], measured: dict[str, Any]) -> None:
    """The fidelity check: the simulated prewarm row against this run, both figures and the gap."""
    table = Table(title="fidelity: simulated prewarm vs this run (same arrivals, same planner)")
    for col in ("", "measured", "simulated", "gap", "bar", "within"):
        table.add_column(col, justify="right")
    rs_gap = f["replica_seconds_ratio"] - 1.0
    table.add_row("replica-seconds (replay window)", f"{f['replica_seconds_measured']:.0f}",
                  f"{f['replica_seconds_simulated']:.0f}", f"{rs_gap:+.1%}", "±10%",
                  "yes" if f["replica_seconds_within"] else "NO")
    table.add_row("requests held > 0.5 s for a start", str(f["waited_measured"]), str(f["waited_simulated"]),
                  f"{f['waited_simulated'] - f['waited_measured']:+d}", f"±{f['waited_slack']:.0f}",
                  "yes" if f["waited_within"] else "NO")
    console.print(table)
    cs, ad = measured["cold_starts"], measured["actuation_delay"]
    console.print(
        f"simulator given: {cs['n']} measured cold starts (mean {cs.get('mean_s', float('nan')):.1f} s, "
        f"p95 {cs.get('p95_s', float('nan')):.1f} s) and the mean of {ad['n']} measured actuation delays "
        f"(decision to registration: {ad.get('mean_s', float('nan')):.2f} s, p95 {ad.get('p95_s', float('nan')):.2f} s)"
    )
