"""Cluster-wide tasks on the `prewarm.planner` queue: reaping, scale from zero, fragmentation sweeps.

- `reap`: fail replicas whose heartbeat expired (their agent died), so nothing routes to them.
- `handle_demand(model)`: the gateway found nothing ready for `model` and recorded unmet
  demand (`keys.demand`, announced on `keys.DEMAND_CHANNEL`). If the model's only live
  replicas are asleep, wake one (`wake_replica` on its node); if none is ready or loading,
  prewarm one on the live node with the most free slots. Idempotent: a
  short claim key and the deterministic replica id make repeats harmless.
- `scan_demand`: the beat's safety net for demand announcements nobody heard.
- `sweep_fragmentation`: ask every ready replica's agent to check its fragmentation.
- `dispatch_due_events` / `apply_scale_event(event_id)`: carry out the planner's scale
  events when they are due (see `workers.planning.executor`).
- `forecast_and_plan`: counters → forecast → plan → submitted events (see `workers.planning.forecast`); one
  round at a time (`workers.planning.round_lock`): a round that finds another running is skipped.
- `place_elsewhere(replica_id, need_bytes, reason)`: a load or a wake its node's memory refused is
  placed on another node (see `workers.planning.elsewhere`).
- `sweep_outbox`: send again the tasks a Redis failover lost (see `workers.delivery`).

Placement reads the node views agents publish (`workers.planning.nodes`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from celery import Celery, Task

from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, TERMINAL_STATES, Pool, ReplicaState, replica_id
from workers import names
from workers import context, delivery, payload
from workers.context import WorkerContext
from workers.planning.elsewhere import place_elsewhere as run_place_elsewhere
from workers.planning.executor import apply_event, dispatch_due
from workers.planning.nodes import reserve_slots
from workers.planning.forecast import forecast_and_plan as run_forecast_and_plan
from workers.planning.forecast import plan_model, planned_models
from workers.planning.kubernetes import owns_replicas
from workers.planning.rollout import tick_all
from workers.planning.round_lock import planning_round

log = logging.getLogger("prewarm.planner.tasks")

#: Demand older than this is history for the forecaster, not a reason to scale from zero now.
DEMAND_FRESH_S = 120.0
#: How long a scale-from-zero claim suppresses repeats (the prewarm is idempotent anyway).
DEMAND_CLAIM_S = 30


def resolve_revision(model: str, configured: Iterable[str], known: Iterable[tuple[str, float]]) -> str | None:
    """The revision to start: `planner.models` (model@revision) first, else the most recently seen one."""
    for entry in configured:
        name, sep, rev = entry.partition("@")
        if name == model and sep:
            return rev
    recent = sorted(known, key=lambda rv: rv[1], reverse=True)
    return recent[0][0] if recent else None


def _claim(ctx: WorkerContext, model: str, target: str) -> bool:
    """Take the model's demand claim for `target` (the replica it wakes or starts), or False if held.

    Issue 20: a claim left by a wake that then failed blocked every new attempt for DEMAND_CLAIM_S
    while requests got 503. A claim whose replica has since failed or retired is stale and replaced."""
    key = keys.demand_claim(model)
    if ctx.client.set(key, target, nx=True, ex=DEMAND_CLAIM_S):
        return True
    held = ctx.client.get(key)
    rec = ctx.registry.get(held) if held and "/" in held else None
    if rec is None or rec.state not in TERMINAL_STATES:
        return False
    log.info("demand claim for %s was for %s, which is %s: a new one is taken", model, held, rec.state.value)
    ctx.client.set(key, target, ex=DEMAND_CLAIM_S)
    return True


def handle_demand_for(ctx: WorkerContext, app: Celery, model: str) -> dict[str, Any]:
    now = ctx.clock()
    view = ctx.registry.view(model, now=now)
    if view.serving or view.warm or view.loading:
        return {"model": model, "outcome": "covered"}
    replicas = ctx.registry.replicas_of(model)
    asleep = sorted(r.id for r in replicas if r.state is ReplicaState.ASLEEP)
    if asleep and not any(r.state in LIVE_STATES - {ReplicaState.ASLEEP} for r in replicas):
        # Only sleeping replicas: wake one (a fraction of a load), on its own node. Repeats are
        # harmless (the wake is idempotent under the replica lock); the claim keeps them rare.
        if not _claim(ctx, model, asleep[0]):
            return {"model": model, "outcome": "claimed"}
        app.send_task(names.WAKE, args=[asleep[0]])
        log.info("wake on demand: unmet demand for %s -> wake %s", model, asleep[0])
        return {"model": model, "outcome": "wake", "replica_id": asleep[0]}
    if any(r.state in LIVE_STATES for r in replicas):
        return {"model": model, "outcome": "starting"}
    if not _claim(ctx, model, model):
        return {"model": model, "outcome": "claimed"}
    if owns_replicas(ctx.settings.kubernetes):
        # In a cluster the Deployment's owner starts pods, not an agent: plan the model now, with the
        # demand as a floor of one replica (the scaler, the metric or the scale subresource carry it).
        spec = next((s for s in planned_models(ctx) if s.name == model), None)
        if spec is None:
            log.warning("unmet demand for %s, which the planner does not plan (PREWARM_PLANNER_MODELS)", model)
            return {"model": model, "outcome": "unknown_model"}
        planned = plan_model(ctx, spec, now=now)
        log.info("scale from zero: unmet demand for %s -> planned again, target now %s", model,
                 ctx.client.hget(keys.last_forecast(model), "target"))
        return {"model": model, "outcome": "planned", "need_now": planned.need_now}
    revision = resolve_revision(model, ctx.settings.planner.models, [(r.revision, r.updated_at) for r in replicas])
    if revision is None:
        log.warning("unmet demand for %s, but no revision is known (set PREWARM_PLANNER_MODELS=%s@<rev>)", model,
                    model)
        return {"model": model, "outcome": "unknown_model"}
    dry = ctx.settings.planner.dry_run  # dry-run never acts, nor reserves a slot: it says what would start
    placement = reserve_slots(ctx, 1, lambda node, slot: replica_id(model, revision, node, slot))
    if not placement:
        log.warning("unmet demand for %s, but no live node has a free slot", model)
        ctx.client.delete(keys.demand_claim(model))
        return {"model": model, "outcome": "no_capacity"}
    node, slot = placement[0]
    rid = replica_id(model, revision, node, slot)
    if dry:
        log.info("dry run: scale from zero for %s would prewarm %s", model, rid)
        ctx.client.delete(keys.demand_claim(model))
        return {"model": model, "outcome": "dry_run", "replica_id": rid}
    ctx.client.set(keys.demand_claim(model), rid, xx=True, keepttl=True)  # the claim names what it is for
    app.send_task(names.PREWARM, args=[rid, Pool.SERVING.value, None])
    log.info("scale from zero: unmet demand for %s -> prewarm %s", model, rid)
    return {"model": model, "outcome": "prewarm", "replica_id": rid}


def _ctx(task: Task) -> WorkerContext:
    return context.current(task.app.conf.prewarm_settings)


def reap(self: Task, *args: Any, **kwargs: Any) -> Any:
    payload.parse_nothing("reap", args, kwargs)
    ctx = _ctx(self)
    reaped = ctx.registry.reap(now=ctx.clock())
    for rid in reaped:
        log.warning("replica %s failed: heartbeat expired", rid)
    return {"reaped": reaped}


def handle_demand(self: Task, *args: Any, **kwargs: Any) -> Any:
    req = payload.parse_model("handle_demand", args, kwargs)
    ctx = _ctx(self)
    try:
        return handle_demand_for(ctx, self.app, req.model)
    finally:  # the listener may send the next one for this model once the coalescing window has passed
        ctx.client.expire(keys.demand_pending(req.model), keys.DEMAND_COALESCE_S)


def unmet(demand: Mapping[str, str], now: float) -> bool:
    """Whether a model's demand record (`keys.demand`) is unmet and fresh: a request found nothing ready within
    `DEMAND_FRESH_S`, and no held request got a replica since (`met`). Met demand is not restarted by the scan:
    it restarted every model the fleet round had just evicted for two minutes after its last cold request
    (`prewarm up --models 3`: a sparse model reloaded every 10 s), against the planner's own decision."""
    try:
        last = float(demand["last"])
        met = float(demand.get("met", "-inf"))
    except (KeyError, ValueError):
        return False
    return last >= now - DEMAND_FRESH_S and last > met


def scan_demand(self: Task, *args: Any, **kwargs: Any) -> Any:
    payload.parse_nothing("scan_demand", args, kwargs)
    ctx = _ctx(self)
    now = ctx.clock()
    prefix = keys.demand("")
    results = []
    for key in ctx.client.scan_iter(match=prefix + "*", count=200):
        if unmet(ctx.client.hgetall(key), now):
            results.append(handle_demand_for(ctx, self.app, key[len(prefix):]))
    return {"handled": results}


def sweep_fragmentation(self: Task, *args: Any, **kwargs: Any) -> Any:
    payload.parse_nothing("sweep_fragmentation", args, kwargs)
    ctx = _ctx(self)
    sent: list[str] = []
    if ctx.settings.planner.dry_run:  # a recycle retires a replica: dry-run never acts
        return {"checked": sent, "dry_run": True}
    for model in ctx.registry.models():
        for rec in ctx.registry.replicas_of(model):
            if rec.state is ReplicaState.READY:
                self.app.send_task(names.RECYCLE, args=[rec.id])
                sent.append(rec.id)
    return {"checked": sent}


def dispatch_due_events(self: Task, *args: Any, **kwargs: Any) -> Any:
    payload.parse_nothing("dispatch_due_events", args, kwargs)
    ctx = _ctx(self)
    if ctx.settings.planner.dry_run:  # nothing was submitted; events from before stay queued, not carried out
        return {"dispatched": [], "dry_run": True}
    return {"dispatched": dispatch_due(ctx, self.app, now=ctx.clock())}


def apply_scale_event(self: Task, *args: Any, **kwargs: Any) -> Any:
    bound = payload.parse_event_id("apply_scale_event", args, kwargs)
    applied = apply_event(_ctx(self), self.app, bound)
    return {"event_id": applied.event_id, "kind": applied.kind.value, "replicas": list(applied.replica_ids),
            "outcome": applied.outcome}


def forecast_and_plan(self: Task, *args: Any, **kwargs: Any) -> Any:
    at = payload.parse_forecast(args, kwargs)
    ctx = _ctx(self)
    now = ctx.clock() if at is None else at
    with planning_round(ctx.client, ctx.settings.planner.interval_s) as mine:
        if not mine:  # another round is running (this pod's other thread, another pod, `prewarm plan`)
            log.warning("forecast_and_plan: a planning round is still running; this one is skipped")
            return {"models": [], "rollouts": [], "skipped": "a planning round is in progress"}
        if ctx.settings.planner.fleet_budget_gb > 0:  # many models, one GPU budget: one fleet round
            from workers.planning.fleet import fleet_and_plan

            plans = fleet_and_plan(ctx, self.app, now=now)
        else:
            plans = run_forecast_and_plan(ctx, now=now)
        rollouts = [] if ctx.settings.planner.dry_run else tick_all(ctx, self.app, now=now)  # after the targets
    return {"models": [{"model": m.model, "status": m.status, "need_now": m.need_now, "events": list(m.events),
                        "new_events": list(m.new_events), "dropped": m.dropped, "mode": m.mode}
                       for m in plans], "rollouts": [r.to_json() for r in rollouts]}


def place_elsewhere(self: Task, *args: Any, **kwargs: Any) -> Any:
    req = payload.parse_place_elsewhere(args, kwargs)
    return run_place_elsewhere(_ctx(self), self.app, req)


def sweep_outbox(self: Task, *args: Any, **kwargs: Any) -> Any:
    payload.parse_nothing("sweep_outbox", args, kwargs)
    ctx = _ctx(self)
    return delivery.sweep(self.app, ctx.metrics, now=ctx.clock())


def register(app: Celery) -> None:
    """Register the cluster-wide tasks on `app`."""
    common = names.TASK_OPTIONS
    app.task(name=names.REAP, **common)(reap)
    app.task(name=names.HANDLE_DEMAND, **common)(handle_demand)
    app.task(name=names.SCAN_DEMAND, **common)(scan_demand)
    app.task(name=names.SWEEP_FRAGMENTATION, **common)(sweep_fragmentation)
    app.task(name=names.DISPATCH_EVENTS, **common)(dispatch_due_events)
    app.task(name=names.APPLY_EVENT, **common)(apply_scale_event)
    app.task(name=names.FORECAST, **common)(forecast_and_plan)
    app.task(name=names.PLACE_ELSEWHERE, **common)(place_elsewhere)
    app.task(name=names.SWEEP_OUTBOX, **common)(sweep_outbox)
