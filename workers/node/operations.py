"""Node operations on a live replica: retire (drain), keep warm, recycle when fragmented.

Each is idempotent by replica id and holds the replica lock while it changes state, so it
never interleaves with a prewarm of the same replica. Draining stops routing first (only
`ready` replicas are routable), waits for in-flight requests, and only then stops the
runtime. Recycling never resets the GPU: a fragmented replica goes through retire and the
normal prewarm pipeline again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.errors import IllegalTransition, ReplicaNotFound
from prewarm.policy.warmup import WarmupPlan, generate_requests
from workers.context import WorkerContext
from workers.node.lock import ReplicaLock
from workers.payload import KeepWarmRequest, RetireRequest
from workers.node.runtime_client import client_for

log = logging.getLogger("prewarm.agent.operations")


class RetireOutcome(str, Enum):
    RETIRED = "retired"
    ALREADY_GONE = "already_gone"  # retired, failed or never registered: only the runtime is stopped
    CANCELLED = "cancelled"  # it was still loading: marked failed with the retire reason


@dataclass(frozen=True)
class RecycleDecision:
    replica_id: str
    fragmentation: float | None
    threshold: float
    recycle: bool


def _lock(ctx: WorkerContext, rid: str, owner: str, deadline: float) -> ReplicaLock:
    lock = ReplicaLock(ctx.client, rid, owner, ctx.settings.agent.lock_ttl_s)
    lock.acquire(deadline=deadline)
    return lock


def retire(ctx: WorkerContext, req: RetireRequest, *, owner: str, deadline: float) -> RetireOutcome:
    rid = req.replica.replica_id
    reason = req.reason or "retired"
    with _lock(ctx, rid, owner, deadline):
        rec = ctx.registry.get(rid)
        ctx.client.delete(keys.keep_warm(rid))
        if rec is None or rec.state in (ReplicaState.RETIRED, ReplicaState.FAILED):
            ctx.runtimes.stop(rid)
            return RetireOutcome.ALREADY_GONE
        if rec.state in (ReplicaState.LOADING, ReplicaState.WARMING):
            _set_state(ctx, rid, ReplicaState.FAILED, f"retired while {rec.state.value}: {reason}")
            ctx.runtimes.stop(rid)
            return RetireOutcome.CANCELLED
        if rec.state is ReplicaState.PENDING:
            _set_state(ctx, rid, ReplicaState.RETIRED, reason)
            ctx.runtimes.stop(rid)
            return RetireOutcome.RETIRED
        if rec.state is ReplicaState.READY:
            rec = _set_state(ctx, rid, ReplicaState.DRAINING, reason)
        _drain(ctx, rec, min(deadline, time.monotonic() + ctx.settings.agent.drain_timeout_s))
        _set_state(ctx, rid, ReplicaState.RETIRED, reason)
        ctx.runtimes.stop(rid)
        log.info("replica %s retired: %s", rid, reason)
        return RetireOutcome.RETIRED


def _set_state(ctx: WorkerContext, rid: str, to: ReplicaState, reason: str) -> Replica:
    rec = ctx.registry.transition(rid, to, now=ctx.clock(), reason=reason)
    ctx.runtimes.update(rec)
    return rec


def _drain(ctx: WorkerContext, rec: Replica, deadline: float) -> None:
    """Wait until the runtime has no request in flight (or the drain timeout passes)."""
    hosted = ctx.runtimes.get(rec.id)
    if hosted is None or hosted.exit_code() is not None:
        return
    client = client_for(ctx.settings, hosted)
    while time.monotonic() < deadline:
        try:
            inflight = client.inflight()
        except Exception:  # noqa: BLE001 - a runtime that cannot answer has nothing to drain
            return
        if not inflight:
            return
        time.sleep(0.1)
    log.warning("replica %s still had requests in flight when its drain timeout ended", rec.id)


def keep_warm(ctx: WorkerContext, req: KeepWarmRequest) -> int:
    """Hold the replica warm until `until` (the keeper thread sends the periodic requests); returns requests sent now."""
    rid = req.replica.replica_id
    now = ctx.clock()
    if req.until <= now:
        ctx.client.delete(keys.keep_warm(rid))
        return 0
    ctx.client.set(keys.keep_warm(rid), repr(req.until), exat=int(req.until) + 1)
    return send_keepalive(ctx, rid)


def send_keepalive(ctx: WorkerContext, rid: str) -> int:
    """One round of signed synthetic requests to a ready hosted replica; returns how many were sent."""
    rec = ctx.registry.get(rid)
    hosted = ctx.runtimes.get(rid)
    if rec is None or rec.state is not ReplicaState.READY or hosted is None or hosted.exit_code() is not None:
        return 0
    wcfg = ctx.settings.warmup
    plan = WarmupPlan.from_settings(rec.model, wcfg, count=max(1, min(wcfg.requests, 2)),
                                    seed=wcfg.seed + int(ctx.clock()))
    requests = generate_requests(plan, secret=wcfg.require_secret(), now=ctx.clock())
    client_for(ctx.settings, hosted).warmup(requests)
    ctx.metrics.warmup_requests.labels(rec.model, "keepalive").inc(len(requests))
    return len(requests)


def fragmentation_decision(ctx: WorkerContext, rid: str) -> RecycleDecision:
    """Measure the replica's allocator fragmentation and decide whether to recycle it."""
    threshold = ctx.settings.agent.fragmentation_threshold
    rec = ctx.registry.get(rid)
    hosted = ctx.runtimes.get(rid)
    if rec is None or rec.state is not ReplicaState.READY or hosted is None or hosted.exit_code() is not None:
        return RecycleDecision(rid, None, threshold, False)
    frag = client_for(ctx.settings, hosted).fragmentation()
    if frag is not None:
        ctx.metrics.fragmentation.labels(ctx.node).set(frag)
    return RecycleDecision(rid, frag, threshold, frag is not None and frag > threshold)


def safe_fail(ctx: WorkerContext, rid: str, reason: str) -> Replica | None:
    """Mark a replica failed; a replica already gone or terminal is left as it is."""
    try:
        rec = ctx.registry.transition(rid, ReplicaState.FAILED, now=ctx.clock(), reason=reason[:500])
    except (IllegalTransition, ReplicaNotFound):
        return None
    ctx.runtimes.update(rec)
    return rec
