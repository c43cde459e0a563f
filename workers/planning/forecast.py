"""`forecast_and_plan`: the loop that closes — gateway counters → forecast → plan → act.

Once per `planner.interval_s` (beat, planner queue), for every planned model, four steps,
one function each:
1. `history`: the gateway's fine counters of the model (requests, peak in flight, busy
   seconds per `planner.fine_bucket_s` bucket; complete buckets, and the busy time so far of
   the bucket in progress) over the span the planner reads, and, when the seasonal profile
   is due for a refit, the coarse request rate over `planner.history_s`
   (`forecasting.data.history`);
2. `inputs`: the pure planner's `StepInputs`, built with the same function the simulator
   uses (`forecasting.planner.observed_from_counts`), with the registry's replica counts
   (a warm replica still loading counts as warm), the nodes agents publish (none published:
   placement is left to the executor or the cluster) and the measured cold-start p95;
3. `plan`: `forecasting.planner.step(inputs, state)` — the one planner; its state (the
   learned profile, the mode) is carried in `keys.planner_state(model)` as JSON;
4. `act`: submit the events (deduplicated by id; dispatched when due) and hand the target
   to Kubernetes when enabled — or, with `planner.dry_run`, neither: only the record and
   the log say what would have been done.
The decision is written to `keys.last_forecast(model)` and to the metrics: the forecast,
its recent error, the planner's mode (`prewarm_planner_mode`), the warm cost.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from forecasting.data.history import counter_resolution, load_fine_counters, load_redis, rate_series
from forecasting.data.traces import HistoryError
from forecasting.planner import (
    MODES,
    Decision,
    Observed,
    PlannerParams,
    PlannerState,
    ReplicaCounts,
    StepInputs,
    lead_of,
    observed_from_counts,
    recent_span_s,
    refit_due,
    step,
    warm_cost,
)
from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, ModelSpec, ReplicaState, check_name
from prewarm.core.errors import InvalidPayload, PrewarmError
from prewarm.policy.sleep_tier import tier_absent
from workers.context import WorkerContext
from workers.planning.executor import live_counts, node_views, submit_events
from workers.planning.rollout import planned_revision
from workers.planning.nodes import measured_ready_p95, sleep_reports
from prewarm.registry.targets import schedule_fields
from workers.planning.kubernetes import actuator_for, apply_target, deployment_key, events_for_executor, \
    owns_replicas, publish_planned_revision, target_schedule, with_demand_floor

log = logging.getLogger("prewarm.planner.forecast")


@dataclass(frozen=True)
class ModelPlan:
    model: str
    status: str  # "planned", "dry_run"
    events: tuple[str, ...]  # ids of the events the decision holds
    new_events: tuple[str, ...]  # ids submitted for the first time
    dropped: int
    need_now: int
    mode: str = ""


def planned_models(ctx: WorkerContext) -> list[ModelSpec]:
    """`planner.models` (model@revision), else every model with a replica, at its latest revision."""
    cap = ctx.settings.planner.capacity_rps
    slots = ctx.settings.gateway.replica_concurrency  # requests in flight that saturate a replica
    specs: dict[str, ModelSpec] = {}
    for entry in ctx.settings.planner.models:
        name, sep, rev = entry.partition("@")
        if not sep:
            raise InvalidPayload(f"PREWARM_PLANNER_MODELS entries must be model@revision, got {entry!r}")
        specs[name] = ModelSpec(check_name(name, "model"), check_name(rev, "revision"), capacity_rps=cap, slots=slots)
    if not specs:
        for name in ctx.registry.models():
            reps = sorted(ctx.registry.replicas_of(name), key=lambda r: r.updated_at)
            if reps:
                specs[name] = ModelSpec(name, reps[-1].revision, capacity_rps=cap, slots=slots)
    # a rollout names the revision: its stable one while it runs, the canary once it completed
    return [replace(s, revision=planned_revision(ctx, s.name, s.revision)[0]) for s in specs.values()]


def load_planner_state(ctx: WorkerContext, model: str) -> PlannerState:
    try:
        return PlannerState.from_json(ctx.client.get(keys.planner_state(model)))
    except (KeyError, ValueError, TypeError):
        log.warning("planner state of %s is unreadable; starting afresh", model)
        return PlannerState()


def save_planner_state(ctx: WorkerContext, model: str, state: PlannerState) -> None:
    ctx.client.set(keys.planner_state(model), state.to_json())


def history(ctx: WorkerContext, model: str, state: PlannerState, params: PlannerParams, *, now: float,
            cold_start_p95_s: float | None) -> tuple[Observed, tuple[float, float, np.ndarray] | None]:
    """1. The fine counters the step reads (complete buckets, and the busy time so far of the bucket in progress:
    the gateway credits it at every flush, so the load now shows within a second), and the coarse rate when the
    profile is due for a refit."""
    fb = int(params.fine_bucket_s)
    end = math.floor(now / fb) * fb  # the start of the bucket in progress
    span = recent_span_s(state, params, lead_of(params, cold_start_p95_s))
    first = ctx.client.hget(keys.REQUESTS_FIRST, model)  # before it the gateway counted nothing
    start = end - math.ceil(span / fb) * fb
    if first is not None:
        start = max(start, math.floor(float(first) / fb) * fb)
    # the last bucket of each series is the one in progress: its busy time and peak so far
    first_start, requests, peak, busy, waited = load_fine_counters(ctx.client, model, start=min(start, end),
                                                                   end=end + fb, bucket_s=fb)
    observed = observed_from_counts(first_start, fb, requests[:-1], peak[:-1], busy[:-1], waited[:-1],
                                    (float(busy[-1]), now - end, float(peak[-1])))
    coarse = None
    if refit_due(state, now, params):
        cb = int(params.bucket_s)
        cend = math.floor(now / cb) * cb
        cstart = cend - int(params.history_s)
        if first is not None:
            cstart = max(cstart, math.floor(float(first) / cb) * cb)
        coarse = (float(cend), float(cb), np.zeros(0))
        if cstart < cend:
            try:
                frame = load_redis(ctx.client, model, resolution_s=counter_resolution(cb), start=cstart, end=cend)
                y = rate_series(frame, model, bucket_s=cb)  # summed from the recorded resolution
                coarse = (float(y.index[0]) if len(y) else float(cstart), float(cb), y.to_numpy(dtype=np.float64))
            except HistoryError as exc:
                log.info("no coarse history for %s yet: %s", model, exc)
    return observed, coarse


def inputs(ctx: WorkerContext, spec: ModelSpec, state: PlannerState, params: PlannerParams, *,
           now: float) -> StepInputs:
    """2. The step's inputs, as the simulator builds them (`observed_from_counts`)."""
    p95 = ctx.registry.load_time_p95(spec.name, spec.revision)  # the lead of this revision, on its slowest class
    if p95 is None:  # a revision not measured yet: its model's other revisions (their weights are alike), else the default
        p95 = ctx.registry.load_time_p95(spec.name)
    observed, coarse = history(ctx, spec.name, state, params, now=now, cold_start_p95_s=p95)
    reps = ctx.registry.replicas_of(spec.name)
    counts = live_counts(r for r in reps if r.revision == spec.revision and r.state in LIVE_STATES)
    # in a cluster the scheduler places pods; else the nodes agents publish (none: the executor places)
    cluster = owns_replicas(ctx.settings.kubernetes)
    nodes = None if cluster else node_views(ctx) or None
    # a parked replica's wake, the slowest node class measured (it may be woken on any node)
    wakes = measured_ready_p95(ctx, spec.name, "asleep") if counts["asleep"] else {}
    # parking puts ready replicas to sleep where they are: the tier is absent if their engines there say so
    ready_on = {r.node for r in reps if r.revision == spec.revision and r.state is ReplicaState.READY}
    sleeps = cluster or not tier_absent(sleep_reports(ctx, sorted(ready_on)).values(), spec.name)
    # a cluster's pods are one Deployment: the warm pool is among them, not told apart (`ReplicaCounts.pooled`)
    return StepInputs(spec, now, observed, ReplicaCounts(**counts, pooled=cluster), params, p95, coarse, nodes,
                      max(wakes.values()) if wakes else None, sleeps)


def schedule_of(ctx: WorkerContext, spec: ModelSpec, decision: Decision, *, now: float) -> list[tuple[float, int]]:
    """The cluster target schedule: now, then the steps already known; fresh unmet demand floors it at one
    in a cluster (scale from zero)."""
    schedule = target_schedule(decision, now)
    if owns_replicas(ctx.settings.kubernetes):
        last = ctx.client.hget(keys.demand(spec.name), "last")
        schedule = with_demand_floor(schedule, float(last) if last else None, now)
    return schedule


def act(ctx: WorkerContext, spec: ModelSpec, decision: Decision, schedule: list[tuple[float, int]]) -> list[str]:
    """4. Carry the decision out — unless dry-run, which never acts (no event, no Kubernetes patch).

    With a cluster, Kubernetes starts and stops the pods: only HOLDs reach the executor
    (`events_for_executor`), and the target goes to the Deployment's one owner."""
    if planned_revision(ctx, spec.name, spec.revision)[1]:  # a running rollout splits the target and scales
        return []
    if ctx.settings.planner.dry_run:
        for ev in decision.events:
            log.info("dry run: would submit %s", ev.to_payload())
        return []
    new = submit_events(ctx, events_for_executor(ctx.settings.kubernetes, decision.events))
    if ctx.settings.kubernetes.enabled:  # no rollout: the revision planned has the model's whole target
        publish_planned_revision(ctx, spec.name, spec.revision, schedule, now=schedule[0][0])
        _apply_to_cluster(ctx, spec.name, schedule[0][1], revision=spec.revision)
    return new


def _report(ctx: WorkerContext, spec: ModelSpec, inp: StepInputs, decision: Decision, new: list[str],
            status: str, schedule: list[tuple[float, int]]) -> None:
    """The decision in the metrics and in `keys.last_forecast` (what alerts and `prewarm up` read)."""
    m, fc, obs = ctx.metrics, decision.forecast, inp.observed
    m.forecast_requests.labels(spec.name, "0.5").set(fc.median)
    m.forecast_requests.labels(spec.name, f"{inp.params.quantile:g}").set(fc.upper)
    m.forecast_timestamp.labels(spec.name).set(inp.now)
    if obs.requests.size:
        m.actual_requests.labels(spec.name).set(float(obs.requests[-1]) / obs.bucket_s)
    if fc.error is not None:
        m.forecast_error.labels(spec.name).set(fc.error)
    for mode in MODES:
        m.planner_mode.labels(spec.name, mode).set(1.0 if mode == decision.mode else 0.0)
    live = inp.replicas.live + inp.replicas.warm
    m.warmup_cost_ratio.labels(spec.name).set(warm_cost(live, decision.need_next))
    for d in decision.dropped:
        m.dropped_events.labels(spec.name, "budget" if "budget" in d.reason.lower() else "other").inc()
    record: dict[str, Any] = {
        "status": status, "at": repr(inp.now), "revision": spec.revision, "history_buckets": str(obs.requests.size),
        "mode": decision.mode, "method": fc.method,
        "forecast_error": "" if fc.error is None else f"{fc.error:.3f}",
        "coverage": "" if fc.coverage is None else f"{fc.coverage:.3f}",
        "rps_q0.5": f"{fc.median:.3f}", f"rps_q{inp.params.quantile:g}": f"{fc.upper:.3f}",
        "need_now": str(decision.need_next), "need_lead": str(decision.need_lead),
        "serving_target": str(decision.target),
        "events": str(len(decision.events)), "new_events": str(len(new)), "dropped": str(len(decision.dropped)),
        "pool_target": str(decision.pool_target), "lead_s": f"{decision.lead_s:.1f}",
        "warm_share": f"{decision.warm_share:.3f}",
        "plan": json.dumps([ev.to_payload() for ev in decision.events])[:20000],
    }
    if not ctx.settings.planner.dry_run:  # the recorded target is what KEDA and the HPA act on: dry-run records none
        record |= schedule_fields(schedule, planned_at=inp.now)
    ctx.client.hset(keys.last_forecast(spec.name), mapping=record)
    log.info("forecast_and_plan %s: %s, %s mode, target %d, %d event(s) (%d new), %d dropped", spec.name, status,
             decision.mode, decision.target, len(decision.events), len(new), len(decision.dropped))


def decide(ctx: WorkerContext, *, now: float) -> list[tuple[ModelSpec, StepInputs, Decision]]:
    """What the planner would decide now for every planned model, read-only (`prewarm plan --dry-run`):
    the same history, inputs and step as `plan_model`, nothing saved, submitted or patched."""
    params = PlannerParams.from_settings(ctx.settings.planner)
    out = []
    for spec in planned_models(ctx):
        state = load_planner_state(ctx, spec.name)
        inp = inputs(ctx, spec, state, params, now=now)
        decision, _ = step(inp, state)
        out.append((spec, inp, decision))
    return out


def plan_model(ctx: WorkerContext, spec: ModelSpec, *, now: float) -> ModelPlan:
    """history → forecast → plan → act, for one model (the forecast is inside the pure step)."""
    params = PlannerParams.from_settings(ctx.settings.planner)
    state = load_planner_state(ctx, spec.name)
    inp = inputs(ctx, spec, state, params, now=now)
    decision, state = step(inp, state)
    save_planner_state(ctx, spec.name, state)
    schedule = schedule_of(ctx, spec, decision, now=now)
    new = act(ctx, spec, decision, schedule)
    status = "dry_run" if ctx.settings.planner.dry_run else "planned"
    _report(ctx, spec, inp, decision, new, status, schedule)
    return ModelPlan(spec.name, status, tuple(ev.event_id for ev in decision.events), tuple(new),
                     len(decision.dropped), decision.need_next, decision.mode)


def _apply_to_cluster(ctx: WorkerContext, model: str, target: int, *, revision: str | None = None) -> None:
    """Hand the target to Kubernetes (the scale subresource, when the planner owns the count: the planned
    revision's own Deployment where `kubernetes.deployments` names one; with KEDA or the HPA they read the
    recorded target); a refusal is logged and counted, never fatal to the plan."""
    cfg = ctx.settings.kubernetes
    if cfg.autoscaling != "none":
        return
    try:
        result = apply_target(actuator_for(cfg), cfg, deployment_key(cfg, model, revision), target)
        if result is None:
            return
        log.info("kubernetes %s %s: %d -> %d%s", result.kind.value, result.target, result.before, result.after,
                 " (dry run)" if result.dry_run else "")
    except (PrewarmError, ValueError) as exc:
        log.error("kubernetes target %d for %s not applied: %s", target, model, exc)
        ctx.metrics.dropped_events.labels(model, "kubernetes_error").inc()


def publish_cluster_target(ctx: WorkerContext, model: str, awake: int, asleep: int, *,
                           now: float, revision: str | None = None) -> list[tuple[float, int]]:
    """A fleet round's decision for one model, to the cluster by the same one path as `plan_model`'s
    (`kubernetes.autoscaling`: the recorded target KEDA and the HPA read, or the scale subresource). The
    pods wanted are the awake replicas, plus the ones parked asleep where the pods can sleep
    (`kubernetes.pod_sleep_mode`: a sleeping pod still exists, and the pod warmer keeps `awake` of them
    awake through their servers' /sleep and /wake_up). Fresh unmet demand floors it at one awake pod,
    a parked one woken first. With the `revision` planned, that revision's target is recorded too
    (`publish_planned_revision`); while a rollout runs it owns both (`workers.planning.rollout`)."""
    cfg = ctx.settings.kubernetes
    parked = asleep if cfg.pod_sleep_mode else 0
    last = ctx.client.hget(keys.demand(model), "last")
    floored = with_demand_floor([(now, awake)], float(last) if last else None, now)[0][1]
    parked, awake = max(0, parked - (floored - awake)), floored  # a parked pod is woken before one is added
    schedule = [(now, awake + parked)]
    if ctx.settings.planner.dry_run:
        log.info("dry run: would hand %s a target of %d pod(s), %d awake", model, schedule[0][1], awake)
        return schedule
    ctx.client.hset(keys.last_forecast(model), mapping=schedule_fields(schedule, planned_at=now, awake=awake))
    if planned_revision(ctx, model, revision or "")[1]:  # a running rollout splits the target and scales
        return schedule
    if revision is not None:
        publish_planned_revision(ctx, model, revision, schedule, now=now, awake=awake)
    _apply_to_cluster(ctx, model, schedule[0][1], revision=revision)
    return schedule


def forecast_and_plan(ctx: WorkerContext, *, now: float) -> list[ModelPlan]:
    out = []
    for spec in planned_models(ctx):
        try:
            out.append(plan_model(ctx, spec, now=now))
        except (HistoryError, ValueError) as exc:
            log.error("forecast_and_plan %s failed: %s", spec.name, exc)
            ctx.client.hset(keys.last_forecast(spec.name), mapping={"status": f"error: {exc}"[:500], "at": repr(now)})
    return out
