"""Moving a replica between tiers of warmth on its node: sleep, wake, evict; and admitting a load.

The fleet planner decides which models stay on GPU, which sleep (engine level-1 sleep:
weights in host memory, GPU freed, woken in a fraction of a load) and which are evicted
(the weights stay in the node snapshot). These functions carry that out on the agent that
hosts the replica, each under the replica lock, so they never interleave with a prewarm
or a retire of the same replica.

Never a request in flight is dropped: a replica leaves the GPU only through `draining`
(the gateway stops routing to it), then the agent waits one gateway view refresh (a view
read just before may still route one request) and until the runtime reports nothing in
flight, with no limit but the task's own deadline. A drain that reaches the deadline
leaves the replica draining and says so (`STILL_DRAINING`); the task sends itself again
to go on waiting, rather than cutting a long stream.

Memory: a load books its footprint on the node's GPU budget before its runtime starts
(`admit_load`); it waits while an eviction or sleep on this node is freeing memory and is
refused with `InsufficientMemory` otherwise. A sleep moves the booking to host memory, a
wake moves it back (refused, the replica left asleep, when the GPU is full), a stop frees
it. Each wake is timed and recorded in the registry (`record_ready_time`, tier `asleep`),
like a load's time from the snapshot (`cached`) or from disk (`disk`): the catalog's
measured time to ready per tier.
"""

from __future__ import annotations

import logging
import time
from enum import Enum
from pathlib import Path

from prewarm.core.domain import TERMINAL_STATES, Replica, ReplicaState
from prewarm.core.errors import IllegalTransition, PrewarmError, ReplicaNotFound, TemporaryError
from workers.context import WorkerContext
from workers.node.lock import ReplicaLock
from workers.node.memory import ASLEEP, GPU, InsufficientMemory, footprint_bytes
from workers.node.runtime_client import client_for

log = logging.getLogger("prewarm.agent.tiers")

#: SIGTERM to SIGKILL for the runtime of a replica that did not wake: it is failed and serves nothing,
#: and a frozen process never handles SIGTERM; its replacement waits for the slot.
WAKE_FAILED_STOP_GRACE_S = 1.0


class TierOutcome(str, Enum):
    ASLEEP = "asleep"  # this task put it to sleep
    READY = "ready"  # this task woke it
    EVICTED = "evicted"  # drained and retired; its weights stay in the node snapshot
    ALREADY = "already"  # it was already where it was asked to go
    STILL_DRAINING = "still_draining"  # requests still in flight at the task's deadline: sent again to go on
    NOT_READY = "not_ready"  # still loading: left alone (the next planning round decides again)
    NO_MEMORY = "insufficient_memory"  # the destination memory is full: left where it was
    NO_SLEEP = "no_sleep_mode"  # the engine reports no sleep mode (vLLM off CUDA): the tier is absent, left ready
    GONE = "gone"  # retired, failed, never registered, or its runtime is gone
    WAKE_FAILED = "wake_failed"  # the runtime did not wake within agent.wake_timeout_s: failed, to be replaced


def _lock(ctx: WorkerContext, rid: str, owner: str, deadline: float) -> ReplicaLock:
    lock = ReplicaLock(ctx.client, rid, owner, ctx.settings.agent.lock_ttl_s)
    lock.acquire(deadline=deadline)
    return lock


def _set(ctx: WorkerContext, rid: str, to: ReplicaState, reason: str) -> Replica:
    rec = ctx.registry.transition(rid, to, now=ctx.clock(), reason=reason)
    ctx.runtimes.update(rec)
    return rec


def _fail_gone(ctx: WorkerContext, rid: str, why: str) -> TierOutcome:
    try:
        ctx.runtimes.update(ctx.registry.transition(rid, ReplicaState.FAILED, now=ctx.clock(), reason=why[:500]))
    except (IllegalTransition, ReplicaNotFound):
        pass
    ctx.runtimes.stop(rid)
    return TierOutcome.GONE


def drain_idle(ctx: WorkerContext, rec: Replica, reason: str, deadline: float) -> bool:
    """Stop routing to `rec` and wait until nothing is in flight; False if requests remain at `deadline`."""
    if rec.state is ReplicaState.READY:
        rec = _set(ctx, rec.id, ReplicaState.DRAINING, reason)
        time.sleep(min(ctx.settings.gateway.refresh_interval_s, max(0.0, deadline - time.monotonic())))
    hosted = ctx.runtimes.get(rec.id)
    if hosted is None or hosted.exit_code() is not None:
        return True
    client = client_for(ctx.settings, hosted)
    idle_polls = 0
    while True:
        try:
            inflight: int | None = client.inflight()
        except Exception as exc:  # noqa: BLE001 - a slow answer is not an idle runtime; a dead one has nothing
            if hosted.exit_code() is not None:
                return True
            log.info("replica %s: no answer to /stats while draining (%s); asking again", rec.id, exc)
            inflight = -1
        idle_polls = idle_polls + 1 if inflight == 0 or inflight is None else 0  # None: not reported
        if idle_polls >= 2:  # twice idle: a request admitted between two polls is seen
            return True
        if time.monotonic() > deadline:
            log.info("replica %s: %s request(s) still in flight at the task's deadline", rec.id, inflight)
            return False
        time.sleep(0.05)


def sleep(ctx: WorkerContext, rid: str, *, owner: str, deadline: float) -> TierOutcome:
    """Drain the replica, put its engine to level-1 sleep and mark it `asleep` (not routable)."""
    with _lock(ctx, rid, owner, deadline):
        rec = ctx.registry.get(rid)
        hosted = ctx.runtimes.get(rid)
        if rec is None or rec.state in TERMINAL_STATES:
            return TierOutcome.GONE
        if rec.state is ReplicaState.ASLEEP:
            return TierOutcome.ALREADY
        if rec.state not in (ReplicaState.READY, ReplicaState.DRAINING):
            return TierOutcome.NOT_READY
        if hosted is None or hosted.exit_code() is not None:
            return _fail_gone(ctx, rid, "sleep: its runtime is gone")
        try:
            ctx.runtimes.ledger.check(rid, ASLEEP, what="sleep of")
        except InsufficientMemory as exc:
            log.warning("%s; not put to sleep", exc)
            return TierOutcome.NO_MEMORY
        client = client_for(ctx.settings, hosted)
        if not client.sleep_supported():  # asked of the engine before draining: nothing is disturbed
            log.warning("replica %s: its engine reports no sleep mode; the asleep tier is absent, left ready", rid)
            return TierOutcome.NO_SLEEP
        if not drain_idle(ctx, rec, "sleep: going to sleep", deadline):
            return TierOutcome.STILL_DRAINING
        started = time.monotonic()
        if not client.sleep(1):
            raise TemporaryError(f"the runtime of {rid} did not enter sleep mode", retry_after=1.0)
        ctx.runtimes.ledger.move(rid, ASLEEP, what="sleep of", force=True)
        _set(ctx, rid, ReplicaState.ASLEEP, "sleep: level 1 (weights in host memory)")
        log.info("[TIER] replica=%s model=%s node=%s tier=asleep sleep_s=%.3f", rid, rec.model, rec.node,
                 time.monotonic() - started)
        return TierOutcome.ASLEEP


def wake(ctx: WorkerContext, rid: str, *, owner: str, deadline: float) -> tuple[TierOutcome, float | None]:
    """Wake an asleep replica to `ready` (under the replica lock); returns the outcome and the wake time."""
    with _lock(ctx, rid, owner, deadline):
        return wake_locked(ctx, rid)


def wake_locked(ctx: WorkerContext, rid: str) -> tuple[TierOutcome, float | None]:
    """`wake` for a caller that already holds the replica lock (a prewarm that finds the replica asleep)."""
    rec = ctx.registry.get(rid)
    if rec is None or rec.state in TERMINAL_STATES:
        return TierOutcome.GONE, None
    if rec.state is not ReplicaState.ASLEEP:
        return (TierOutcome.ALREADY if rec.state is ReplicaState.READY else TierOutcome.NOT_READY), None
    hosted = ctx.runtimes.get(rid)
    if hosted is None or hosted.exit_code() is not None:
        return _fail_gone(ctx, rid, "wake: its runtime is gone"), None
    started = time.monotonic()
    try:
        ctx.runtimes.ledger.move(rid, GPU, what="wake of")
    except InsufficientMemory as exc:
        log.error("%s; the replica stays asleep until the planner frees memory", exc)
        return TierOutcome.NO_MEMORY, None
    timeout_s = ctx.settings.agent.wake_timeout_s
    try:
        awake = client_for(ctx.settings, hosted, timeout_s=timeout_s).wake_up()
        why = "" if awake else "its runtime is still asleep after /wake_up"
    except (OSError, PrewarmError) as exc:  # unreachable, frozen (no answer within the timeout), or broken
        why = f"/wake_up failed: {exc}"
    if why:
        return _wake_failed(ctx, rid, f"wake: {why} (agent.wake_timeout_s {timeout_s:g}s)"), None
    _set(ctx, rid, ReplicaState.READY, "woken")
    seconds = time.monotonic() - started
    ctx.registry.record_ready_time(rec.model, ASLEEP, ctx.settings.agent.node_class, seconds)
    log.info("[COLDSTART] replica=%s model=%s node=%s state=ready tier=asleep wake_s=%.3f", rid, rec.model, rec.node,
             seconds)
    return TierOutcome.READY, seconds


def _wake_failed(ctx: WorkerContext, rid: str, why: str) -> TierOutcome:
    """Issue 20: a replica that does not wake is failed at once (not retried while every request gets 503),
    its memory freed and its runtime stopped at once (a frozen one ignores SIGTERM: a short grace, then
    SIGKILL), so that a replacement fits on this node too. The caller asks the planner for it."""
    log.error("replica %s: %s; failed, a replacement is asked for", rid, why)
    try:
        ctx.runtimes.update(ctx.registry.transition(rid, ReplicaState.FAILED, now=ctx.clock(), reason=why[:500]))
    except (IllegalTransition, ReplicaNotFound):
        pass
    ctx.runtimes.ledger.release(rid)
    ctx.runtimes.stop(rid, grace_s=WAKE_FAILED_STOP_GRACE_S)
    return TierOutcome.WAKE_FAILED


def evict(ctx: WorkerContext, rid: str, reason: str, *, owner: str, deadline: float) -> TierOutcome:
    """Drain until nothing is in flight, then retire and stop the runtime (the snapshot keeps the weights)."""
    with _lock(ctx, rid, owner, deadline):
        rec = ctx.registry.get(rid)
        if rec is None or rec.state in TERMINAL_STATES:
            ctx.runtimes.stop(rid)
            return TierOutcome.GONE
        if rec.state not in (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.ASLEEP):
            return TierOutcome.NOT_READY
        why = f"evicted: {reason}" if reason else "evicted"
        if rec.state is not ReplicaState.ASLEEP and not drain_idle(ctx, rec, why, deadline):
            return TierOutcome.STILL_DRAINING
        _set(ctx, rid, ReplicaState.RETIRED, why[:200])
        ctx.runtimes.stop(rid)
        log.info("[TIER] replica=%s model=%s node=%s tier=cached reason=%s", rid, rec.model, rec.node, why)
        return TierOutcome.EVICTED


def admit_load(ctx: WorkerContext, rid: str, model: str, model_dir: str | Path, deadline: float) -> None:
    """Book the replica's GPU footprint before its runtime starts.

    While another replica of this node is draining (an eviction or a sleep the planner
    ordered first), wait for it to free its memory; otherwise, or at the deadline, raise
    `InsufficientMemory` naming what holds the node's memory.
    """
    nbytes = footprint_bytes(ctx.settings, model, model_dir)
    while True:
        try:
            ctx.runtimes.ledger.book_gpu(rid, model, nbytes)
            return
        except InsufficientMemory:
            releasing = [h for h in ctx.runtimes.all() if h.replica.state is ReplicaState.DRAINING and h.replica.id != rid]
            if not releasing or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


__all__ = ["TierOutcome", "admit_load", "drain_idle", "evict", "sleep", "wake", "wake_locked"]
