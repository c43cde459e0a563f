"""Carrying out canary rollouts on the planner's tick: observe, `advance`, act.

The decisions are the pure `prewarm.policy.rollout.advance`; this module gathers what it
needs and carries out what it answers, nothing more:

- observe: the planner's replica target for the model (what `plan_model` recorded in
  `keys.last_forecast` a moment before, in the same `forecast_and_plan` task) and its lead;
  the canary's ready replicas; canary replicas that failed since the rollout started (a
  failed load, corrupt weights, validation against the stable revision or its speed
  baseline; a replica cancelled by a retire is not a failure); and the gateway's
  per-revision requests, errors and latency since the current step's shift;
- act: scale events for each revision (`executor.submit_events`, deterministic ids so a
  re-tick never starts twice); the weights are written with the state (`RolloutStore.update`);
  a rollback retires every live canary replica at once, records the reason in the state and
  the log, and counts it in `prewarm_rollout_rollbacks_total` (the alert's input); a finished
  rollout is settled (its weights cleared, `rp.settle`) once the revision it retired is gone.

While a rollout runs it owns the model's scaling: `planned_revision` tells the forecast loop
which revision to plan for and that it must not submit its own events (the planner's target
is the demand the rollout splits by weight, through the one owner of scale). In a cluster each
revision's share is recorded as its own target (`keys.revision_target`, what the ScaledObject or
HPA of that revision's Deployment reads), and with `autoscaling: none` also set on its
Deployment; once the rollout is over, the revision it retired keeps a renewed target of 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from celery import Celery

from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, Pool, Replica, ReplicaState, ScaleEvent, ScaleEventKind
from prewarm.policy import rollout as rp
from prewarm.registry.rollouts import RolloutStore
from workers import names
from workers.context import WorkerContext
from prewarm.core.errors import PrewarmError
from workers.planning.executor import ENQUEUE_ERRORS, submit_events, task_id
from workers.planning.kubernetes import actuator_for, apply_target, owns_replicas, publish_revision_target

log = logging.getLogger("prewarm.planner.rollout")

#: A retire that cancels a loading replica marks it failed with this prefix: not a canary failure.
_CANCELLED = "retired while"


@dataclass(frozen=True)
class RolloutTick:
    model: str
    phase: str
    action: str
    weight: int
    canary_replicas: int
    stable_replicas: int
    reason: str
    events: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "phase": self.phase, "action": self.action, "weight": self.weight,
                "canary_replicas": self.canary_replicas, "stable_replicas": self.stable_replicas,
                "reason": self.reason, "events": list(self.events)}


def planned_revision(ctx: WorkerContext, model: str, default: str) -> tuple[str, bool]:
    """The revision the forecast loop plans `model` under, and whether a running rollout owns its scaling."""
    state = RolloutStore(ctx.client).get(model)
    if state is None:
        return default, False
    if state.phase is rp.RolloutPhase.COMPLETED:
        return state.spec.canary, False
    return state.spec.stable, state.phase not in rp.TERMINAL


def _demand(ctx: WorkerContext, model: str, live_serving: int) -> tuple[int, float]:
    """The planner's replica target (serving + warm pool) and its lead, as `plan_model` recorded them."""
    rec = ctx.client.hmget(keys.last_forecast(model), ["serving_target", "pool_target", "lead_s"])
    p = ctx.settings.planner
    lead = float(rec[2]) if rec[2] else p.default_cold_start_s + p.lead_margin_s
    if rec[0] is None:
        return max(1, live_serving), lead
    return int(rec[0]) + int(rec[1] or 0), lead


def _live(replicas: list[Replica], revision: str) -> list[Replica]:
    return [r for r in replicas if r.revision == revision and r.state in LIVE_STATES and r.pool is Pool.SERVING]


def observe(ctx: WorkerContext, state: rp.RolloutState, *, now: float) -> rp.RolloutObservation:
    spec = state.spec
    reps = ctx.registry.replicas_of(spec.model)
    canary = [r for r in reps if r.revision == spec.canary]
    failed = tuple(f"{r.id}: {r.reason or 'failed'}" for r in canary
                   if r.state is ReplicaState.FAILED and r.updated_at >= state.started_at
                   and not r.reason.startswith(_CANCELLED))
    live_serving = len(_live(reps, spec.stable)) + len(_live(reps, spec.canary))
    demand, lead = _demand(ctx, spec.model, live_serving)
    since = max(state.shifted_at if state.shifted_at is not None else now, now - spec.pause_s)
    stats = RolloutStore(ctx.client).stats(spec.model, [spec.canary, spec.stable], start=since, end=now)
    return rp.RolloutObservation(
        now=now, demand_replicas=demand, lead_s=lead,
        canary_ready=sum(r.state is ReplicaState.READY for r in canary if r.pool is Pool.SERVING),
        canary_failed=failed, canary_stats=stats[spec.canary], stable_stats=stats[spec.stable])


def _scale(ctx: WorkerContext, state: rp.RolloutState, revision: str, want: int, live: int, *,
           now: float) -> list[str]:
    """A scale event bringing `revision` from `live` to `want` replicas (deterministic id: a re-tick before
    the first event's replicas register submits nothing new)."""
    if owns_replicas(ctx.settings.kubernetes):
        _scale_deployment(ctx, state.spec.model, revision, want, now=now)
        return []
    if want == live:
        return []
    kind = ScaleEventKind.SCALE_UP if want > live else ScaleEventKind.SCALE_DOWN
    spec = state.spec
    prefix = f"rollout:{spec.model}:{spec.canary}:{int(state.started_at)}:"
    if kind is ScaleEventKind.SCALE_UP and _unapplied(ctx, prefix):
        # slots are picked when an event is applied, from the replicas registered by then: a second
        # scale-up before the first one's replicas registered would pick the same slots
        return []
    eid = f"{prefix}{revision}:{kind.value}:{live}->{want}"
    ev = ScaleEvent(event_id=eid, kind=kind, model=spec.model, revision=revision, at=now, replicas=abs(want - live),
                    reason=f"rollout {spec.stable} -> {spec.canary} at {state.weight}%")
    return submit_events(ctx, [ev])


def _unapplied(ctx: WorkerContext, prefix: str) -> bool:
    """Whether a scale-up this rollout submitted is still waiting to be applied."""
    return any(e.startswith(prefix) and ":scale_up:" in e for e in ctx.client.zrange(keys.PLANNED_EVENTS, 0, -1))


def _scale_deployment(ctx: WorkerContext, model: str, revision: str, want: int, *, now: float) -> None:
    """In a cluster each revision is its own Deployment: the rollout's split of the planner's target goes to
    each through the one owner of scale. Every mode records it as the revision's target
    (`keys.revision_target`): KEDA's ScaledObject and the HPA of that Deployment name the revision and read
    it; with `autoscaling: none` the scale subresource of `kubernetes.deployments["model@revision"]` is set.
    The pod warmer registers a canary pod only once it is warmed and validated, so weight still waits for it."""
    cfg = ctx.settings.kubernetes
    publish_revision_target(ctx, model, revision, [(now, want)], now=now)
    key = f"{model}@{revision}"
    if cfg.autoscaling != "none":
        if key not in cfg.deployments:  # KEDA or the HPA may still read it; the chart always names it
            log.warning("rollout of %s: %s's share (%d) is recorded, but PREWARM_KUBERNETES_DEPLOYMENTS names no "
                        "Deployment for %s: only a ScaledObject or HPA naming revision %s scales on it",
                        model, revision, want, key, revision)
        return
    if key not in cfg.deployments:
        log.error("rollout of %s: no Deployment to scale for %s (set PREWARM_KUBERNETES_DEPLOYMENTS "
                  "{\"%s\": <deployment>}, with kubernetes.autoscaling none)", model, revision, key)
        ctx.metrics.dropped_events.labels(model, "kubernetes_error").inc()
        return
    try:
        apply_target(actuator_for(cfg), cfg, key, want)
    except (PrewarmError, ValueError) as exc:
        log.error("rollout of %s: %s to %d replicas not applied: %s", model, key, want, exc)
        ctx.metrics.dropped_events.labels(model, "kubernetes_error").inc()


def _retire_canary(ctx: WorkerContext, app: Celery, state: rp.RolloutState, *, now: float) -> None:
    """A rollback retires every live canary replica now, loading ones included (they never got weight)."""
    if owns_replicas(ctx.settings.kubernetes):  # the canary's Deployment to zero: its pods go, none is routed
        _scale_deployment(ctx, state.spec.model, state.spec.canary, 0, now=now)
        return
    for r in ctx.registry.replicas_of(state.spec.model):
        if r.revision == state.spec.canary and r.state in LIVE_STATES:
            try:
                app.send_task(names.RETIRE, args=[r.id, f"rollout rolled back: {state.reason}"[:200]],
                              task_id=task_id(f"rollout-rollback:{int(state.started_at)}", names.RETIRE, r.id))
            except ENQUEUE_ERRORS as exc:  # the next tick tries again: the canary is still live then
                log.warning("rollback of %s: retire %s not sent: %s", state.spec.model, r.id, exc)


def _settle(ctx: WorkerContext, store: RolloutStore, model: str, *, now: float) -> None:
    """Clear a finished rollout's split once the revision it retired has no live replica (`rp.settle`)."""

    def change(current: rp.RolloutState | None) -> rp.RolloutState:
        assert current is not None  # rollouts are never deleted
        gone = rp.retired_revision(current)
        live = sum(r.revision == gone and r.state in LIVE_STATES for r in ctx.registry.replicas_of(model))
        return rp.settle(current, retired_live=live, now=now)

    if store.update(model, change).settled:
        log.info("rollout of %s settled: revision split cleared, any ready revision is routed", model)


def _cause(reason: str) -> str:
    if "error rate" in reason:
        return "live_errors"
    if "latency" in reason:
        return "live_latency"
    return "validation"


def _export(ctx: WorkerContext, state: rp.RolloutState) -> None:
    """The rollout's weights and phase as gauges; a revision the split no longer names (the stable one once the
    rollout completed, every one once it settled) has its weight series removed, not left at its last value."""
    m, spec = ctx.metrics, state.spec
    current = dict(rp.weights(state))
    stale = {s.labels["revision"] for metric in m.rollout_weight.collect() for s in metric.samples
             if s.labels.get("model") == spec.model and s.labels.get("revision") not in current}
    for rev in stale:
        m.rollout_weight.remove(spec.model, rev)
    for rev, w in current.items():
        m.rollout_weight.labels(spec.model, rev).set(w)
    for phase in rp.RolloutPhase:
        m.rollout_phase.labels(spec.model, phase.value).set(1.0 if phase is state.phase else 0.0)


def tick(ctx: WorkerContext, app: Celery, model: str, *, now: float) -> RolloutTick | None:
    """One step of `model`'s rollout; None when it has none."""
    store = RolloutStore(ctx.client)
    before = store.get(model)
    if before is None:
        return None
    if before.phase in rp.TERMINAL:  # nothing to decide; a rolled-back canary stays retired (idempotent)
        if before.phase is rp.RolloutPhase.ROLLED_BACK:
            _retire_canary(ctx, app, before, now=now)
        elif owns_replicas(ctx.settings.kubernetes):  # completed: the retired stable revision's target stays 0
            # (renewed, so its ScaledObject or HPA reads a fresh 0, not a stale record and its fallback)
            publish_revision_target(ctx, model, before.spec.stable, [(now, 0)], now=now)
        if not before.settled:
            _settle(ctx, store, model, now=now)
        _export(ctx, store.get(model) or before)  # as it is now: settled, no weight series is left
        return None
    decided: list[rp.RolloutDecision] = []

    def step(current: rp.RolloutState | None) -> rp.RolloutState:
        assert current is not None  # rollouts are never deleted
        decision, new = rp.advance(current, observe(ctx, current, now=now))
        decided[:] = [decision]
        return new

    state = store.update(model, step)
    d = decided[0]
    spec = state.spec
    events: list[str] = []
    reps = ctx.registry.replicas_of(model)
    if d.action is rp.RolloutAction.ROLLBACK:
        log.error("rollout of %s to %s rolled back: %s", model, spec.canary, state.reason)
        ctx.metrics.rollout_rollbacks.labels(model, _cause(state.reason)).inc()
    if state.phase is rp.RolloutPhase.ROLLED_BACK:  # by this tick, or aborted by the operator in between
        _retire_canary(ctx, app, state, now=now)
        # the stable revision takes the whole demand again at once (it may have been shrunk to its share)
        demand = max(d.stable_replicas, observe(ctx, state, now=now).demand_replicas)
        events += _scale(ctx, state, spec.stable, max(demand, len(_live(reps, spec.stable))),
                         len(_live(reps, spec.stable)), now=now)
    else:  # the canary first: one scale-up a tick (see `_scale`), and the step waits on the canary's
        events += _scale(ctx, state, spec.canary, d.canary_replicas, len(_live(reps, spec.canary)), now=now)
        if not events:
            events += _scale(ctx, state, spec.stable, d.stable_replicas, len(_live(reps, spec.stable)), now=now)
    if state != before:
        log.info("rollout %s %s -> %s: %s at %d%% (canary %d, stable %d): %s", model, spec.stable, spec.canary,
                 d.action.value, d.weight, d.canary_replicas, d.stable_replicas, d.reason)
    _export(ctx, state)
    return RolloutTick(model, state.phase.value, d.action.value, d.weight, d.canary_replicas, d.stable_replicas,
                       d.reason, tuple(events))


def tick_all(ctx: WorkerContext, app: Celery, *, now: float) -> list[RolloutTick]:
    out = []
    for model in RolloutStore(ctx.client).models():
        t = tick(ctx, app, model, now=now)
        if t is not None:
            out.append(t)
    return out
