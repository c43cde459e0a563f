"""Carrying out the planner's scale events: submit, dispatch when due, apply once.

The planner (`forecasting.planner.plan`) decides; this module only interprets its
`ScaleEvent`s, in three idempotent steps so that a re-plan or a redelivery never acts twice:

1. `submit_events`: each event is stored under `keys.planned_event(id)` (SET NX: the
   planner's deterministic ids deduplicate re-plans) and queued in `keys.PLANNED_EVENTS`
   scored by its due time;
2. `dispatch_due` (beat, planner queue): events whose time has come are claimed and handed
   to `apply_scale_event(event_id)` — a task carries the id only. The claim is a lease, not
   a removal: the event's score moves to the lease's end (the broker's visibility timeout),
   so an event whose apply task never ran is dispatched again instead of lost;
3. `apply_event`: SCALE_UP prewarms new replicas on the chosen nodes (the event's
   placement, else the node with most free slots; each slot reserved for its replica until
   its agent's prewarm of it ends, so two events applied at once never pick one slot),
   SCALE_DOWN cancels replicas still coming up, then retires ready ones (newest first
   each); PARK puts the newest ready to sleep instead (drain, level-1 sleep) and a later
   SCALE_UP wakes parked replicas before it loads new ones; HOLD keeps ready replicas warm
   until the event's hold ends. The replica
   ids chosen are written to the event record before any task is sent, so a redelivered
   apply re-sends the same (idempotent) prewarms instead of choosing new slots. Only an
   applied event leaves the queue.

A broker that cannot take a message (down, unreachable) never drops an event: the send
fails, the event is due again at once (status `planned`, `last_error` set), the failure is
logged and counted in `prewarm_dropped_events_total{reason="enqueue_failed"}` (an enqueue
that failed, retried on the next dispatch round), and the round stops there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Iterable

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, NodeView, Replica, ReplicaState, ScaleEvent, ScaleEventKind, replica_id
from prewarm.core.errors import InvalidPayload
from workers import names
from workers.context import WorkerContext
from workers.planning.nodes import live_nodes, reserve_slots

log = logging.getLogger("prewarm.planner.executor")

#: What a send to an unreachable broker raises (kombu wraps connection errors in OperationalError).
ENQUEUE_ERRORS = (OperationalError, redis.RedisError, OSError)

#: Claim a due event: its score moves to the lease's end and its status to dispatched, atomically;
#: 0 when it is not due (not queued, or another dispatcher's lease still runs).
_CLAIM = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], 'status', 'dispatched')
return 1
"""


@dataclass(frozen=True)
class Applied:
    event_id: str
    kind: ScaleEventKind
    replica_ids: tuple[str, ...]
    outcome: str  # "applied", "already_applied", "partial" (fewer replicas than asked), "unknown", "enqueue_failed"


def submit_events(ctx: WorkerContext, events: Iterable[ScaleEvent]) -> list[str]:
    """Store and queue events not seen before; returns the ids that were new."""
    new = []
    for ev in events:
        key = keys.planned_event(ev.event_id)
        if not ctx.client.hsetnx(key, "event", json.dumps(ev.to_payload())):
            continue  # seen before (planned, dispatched or applied): a re-plan of the same decision
        ctx.client.hset(key, mapping={"status": "planned", "replicas": "[]"})
        ctx.client.expire(key, keys.EVENT_TTL_S)
        ctx.client.zadd(keys.PLANNED_EVENTS, {ev.event_id: ev.at}, nx=True)
        ctx.metrics.planned_events.labels(ev.model, ev.kind.value).inc()
        new.append(ev.event_id)
    return new


def _lease_s(ctx: WorkerContext) -> float:
    """How long a dispatched event waits for its apply before it is dispatched again."""
    return float(ctx.settings.agent.effective_visibility_timeout_s)


def _requeue(ctx: WorkerContext, event_id: str, *, now: float, error: BaseException) -> None:
    """An event that could not be handed on: due again at once, status planned, reported."""
    model = "unknown"
    try:
        raw = ctx.client.hget(keys.planned_event(event_id), "event")
        model = str(json.loads(raw).get("model", "unknown")) if raw else "unknown"
        pipe = ctx.client.pipeline(transaction=True)
        pipe.zadd(keys.PLANNED_EVENTS, {event_id: now}, xx=True)
        pipe.hset(keys.planned_event(event_id), mapping={"status": "planned", "last_error": f"{error}"[:300]})
        pipe.execute()
        log.error("scale event %s could not be enqueued (%s); it stays queued for the next dispatch", event_id, error)
    except redis.RedisError as rexc:  # the lease still holds it: dispatched again when the lease ends
        log.error("scale event %s could not be enqueued (%s) nor requeued (%s); it is dispatched again in %.0fs",
                  event_id, error, rexc, _lease_s(ctx))
    ctx.metrics.dropped_events.labels(model, "enqueue_failed").inc()


def task_id(event_id: str, task: str, replica_id: str = "") -> str:
    """The id of the task an event causes, derived from the event (as arq derives job ids): an event
    sent twice is the same task twice, and a node task settled once (`keys.task_done`) is not redone."""
    return f"{event_id}/{task}/{replica_id}" if replica_id else f"{event_id}/{task}"


def dispatch_due(ctx: WorkerContext, app: Celery, *, now: float) -> list[str]:
    """Send `apply_scale_event` for every event due at `now`; each is claimed by exactly one dispatcher.

    A send the broker refuses puts the event back (see `_requeue`) and ends the round: the
    broker is down, and the other due events stay queued too.
    """
    sent = []
    claim = ctx.client.register_script(_CLAIM)
    for event_id in ctx.client.zrangebyscore(keys.PLANNED_EVENTS, "-inf", now):
        if claim(keys=[keys.PLANNED_EVENTS, keys.planned_event(event_id)], args=[event_id, now, now + _lease_s(ctx)]) != 1:
            continue  # another dispatcher claimed it
        try:
            # one task per dispatch (a task settled once is never run again, and an apply that could not
            # send everything leaves its event queued for the next dispatch); the apply itself is idempotent
            app.send_task(names.APPLY_EVENT, args=[event_id],
                          task_id=task_id(f"{event_id}@{now:.3f}", names.APPLY_EVENT))
        except ENQUEUE_ERRORS as exc:
            _requeue(ctx, event_id, now=now, error=exc)
            break
        sent.append(event_id)
    return sent


def node_views(ctx: WorkerContext) -> tuple[NodeView, ...]:
    """The planner's view of the live nodes, for `StepInputs.nodes`."""
    views = []
    for ns in live_nodes(ctx):
        info = ctx.client.hgetall(keys.node_info(ns.node))
        snaps = frozenset(s for s in info.get("snapshots", "").split(",") if s)
        views.append(NodeView(name=ns.node, replica_slots=ns.slots, replicas=len(ns.used), snapshots=snaps,
                              model_type=info.get("node_class", ""), ready=True))
    return tuple(views)


#: The states of a replica still coming up (a scale-down cancels these first).
_COMING_UP = (ReplicaState.PENDING, ReplicaState.LOADING, ReplicaState.WARMING)


def _asleep_of(ctx: WorkerContext, ev: ScaleEvent) -> list[Replica]:
    """The event's model's parked (asleep) replicas, the most recently parked first."""
    return sorted((r for r in ctx.registry.replicas_of(ev.model)
                   if r.state is ReplicaState.ASLEEP and r.pool is ev.pool and r.revision == ev.revision),
                  key=lambda r: r.updated_at, reverse=True)


def _candidates(ctx: WorkerContext, ev: ScaleEvent) -> list[Replica]:
    """The replicas an event may pick, in its order. SCALE_DOWN cancels replicas still coming up first
    (newest first: they serve nothing yet), then retires the newest ready; HOLD keeps the oldest ready
    warm. The planner counts a scale-down the same way (`forecasting.planner`), so a hold and a
    scale-down of one decision never pick the same replica."""
    recs = [r for r in ctx.registry.replicas_of(ev.model) if r.pool is ev.pool and r.revision == ev.revision]
    ready = [r for r in recs if r.state is ReplicaState.READY]
    if ev.kind is ScaleEventKind.PARK:  # the newest ready, as a scale-down would retire them
        return sorted(ready, key=lambda r: r.created_at, reverse=True)
    if ev.kind is not ScaleEventKind.SCALE_DOWN:
        return sorted(ready, key=lambda r: r.created_at)
    coming = [r for r in recs if r.state in _COMING_UP]
    return (sorted(coming, key=lambda r: r.created_at, reverse=True)
            + sorted(ready, key=lambda r: r.created_at, reverse=True))


def hold_until(ctx: WorkerContext, ev: ScaleEvent) -> float:
    """A HOLD keeps replicas warm for two planning periods; the next plan renews it if still needed."""
    p = ctx.settings.planner
    return ev.at + 2 * max(p.interval_s, float(p.fine_bucket_s))


def apply_event(ctx: WorkerContext, app: Celery, event_id: str) -> Applied:
    key = keys.planned_event(event_id)
    record = ctx.client.hgetall(key)
    if not record or "event" not in record:
        log.warning("scale event %s is unknown (expired or never submitted)", event_id)
        ctx.client.zrem(keys.PLANNED_EVENTS, event_id)
        return Applied(event_id, ScaleEventKind.HOLD, (), "unknown")
    ev = ScaleEvent.from_payload(json.loads(record["event"]))
    if record.get("status") == "applied":
        ctx.client.zrem(keys.PLANNED_EVENTS, event_id)
        return Applied(event_id, ev.kind, tuple(json.loads(record.get("replicas", "[]"))), "already_applied")
    chosen: list[str] = json.loads(record.get("replicas", "[]"))
    if not chosen:
        chosen = _choose(ctx, ev)
        ctx.client.hset(key, "replicas", json.dumps(chosen))
    asleep = {r.id for r in _asleep_of(ctx, ev)} if ev.kind is ScaleEventKind.SCALE_UP else set()
    try:
        for rid in chosen:  # the same ids again on a re-apply: each task is idempotent
            if ev.kind is ScaleEventKind.SCALE_UP and rid in asleep:  # a parked replica: woken, not loaded
                app.send_task(names.WAKE, args=[rid], task_id=task_id(event_id, names.WAKE, rid))
            elif ev.kind is ScaleEventKind.SCALE_UP:
                app.send_task(names.PREWARM, args=[rid, ev.pool.value, None],
                              task_id=task_id(event_id, names.PREWARM, rid))
            elif ev.kind is ScaleEventKind.PARK:
                app.send_task(names.SLEEP, args=[rid], task_id=task_id(event_id, names.SLEEP, rid))
            elif ev.kind is ScaleEventKind.SCALE_DOWN:
                app.send_task(names.RETIRE, args=[rid, f"scale down ({event_id}): {ev.reason}"[:200]],
                              task_id=task_id(event_id, names.RETIRE, rid))
            else:
                until = hold_until(ctx, ev)
                # the hold itself, for whoever keeps this replica warm: its agent (the task below) or,
                # for a Kubernetes pod no agent hosts, the pod warmer's keep-alive loop
                ctx.client.set(keys.keep_warm(rid), repr(until), exat=int(until) + 1)
                app.send_task(names.KEEP_WARM, args=[rid, until], task_id=task_id(event_id, names.KEEP_WARM, rid))
    except ENQUEUE_ERRORS as exc:
        _requeue(ctx, event_id, now=ctx.clock(), error=exc)
        return Applied(event_id, ev.kind, tuple(chosen), "enqueue_failed")
    outcome = "applied" if len(chosen) >= ev.replicas else "partial"
    if outcome == "partial":
        ctx.metrics.dropped_events.labels(ev.model, "no_capacity" if ev.kind is ScaleEventKind.SCALE_UP
                                          else "too_few_ready").inc()
    pipe = ctx.client.pipeline(transaction=True)
    pipe.hset(key, mapping={"status": "applied", "outcome": outcome})
    pipe.zrem(keys.PLANNED_EVENTS, event_id)
    pipe.execute()
    log.info("scale event %s (%s %s x%d, pool %s): %s %s", event_id, ev.kind.value, ev.model, ev.replicas,
             ev.pool.value, outcome, chosen)
    return Applied(event_id, ev.kind, tuple(chosen), outcome)


def _choose(ctx: WorkerContext, ev: ScaleEvent) -> list[str]:
    if ev.replicas < 0:
        raise InvalidPayload(f"scale event {ev.event_id} asks for {ev.replicas} replicas")
    if ev.kind is ScaleEventKind.SCALE_UP:  # parked replicas are woken first (a wake, not a load)
        woken = [r.id for r in _asleep_of(ctx, ev)][: ev.replicas]

        def replica_of(node: str, slot: int) -> str:
            return replica_id(ev.model, ev.revision, node, slot)

        slots = reserve_slots(ctx, ev.replicas - len(woken), replica_of, wanted=ev.nodes,
                              model_key=f"{ev.model}@{ev.revision}")
        return woken + [replica_of(node, slot) for node, slot in slots]
    return [r.id for r in _candidates(ctx, ev)[: ev.replicas]]


def live_counts(replicas: Iterable[Replica]) -> dict[str, int]:
    """Ready / loading / warm / asleep counts of a model's replicas (the planner's `ReplicaCounts` fields).

    A warm-pool replica counts as warm while it is still loading too: otherwise each new
    plan would start another while the first one loads."""
    out = {"ready": 0, "loading": 0, "warm": 0, "asleep": 0}
    for r in replicas:
        if r.state not in LIVE_STATES:
            continue
        if r.state is ReplicaState.ASLEEP:  # parked: not live capacity, woken before any new load
            out["asleep"] += r.pool.value != "warm"
            continue
        if r.pool.value == "warm":
            out["warm"] += r.state is ReplicaState.READY or r.state in _COMING_UP
        elif r.state is ReplicaState.READY:
            out["ready"] += 1
        elif r.state in _COMING_UP:
            out["loading"] += 1
    return out


__all__ = ["Applied", "apply_event", "dispatch_due", "hold_until", "live_counts", "node_views",
           "submit_events"]
