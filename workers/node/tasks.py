"""Celery task definitions: payload check, attempt cap, failure policy; the work is elsewhere.

Every task here is thin: it validates its payload (`workers.payload`), counts the delivery,
calls the pipeline or an operation, and applies one failure policy:

- a malformed payload (`InvalidPayload`) is refused: logged, recorded in Redis
  (`keys.REJECTED_TASKS`), never retried, and the registry is not touched;
- a permanent error (bad weights, failed validation, a refused transition) marks the
  replica `failed`, counts `model_loading_failures_total{model,node,reason}`, logs
  `[COLDSTART] ... reason=` and stops the runtime; no retry;
- a temporary error is retried with exponential backoff, up to `agent.max_attempts` (a retry the
  broker cannot take, during a restart or a failover, requeues the message instead of dropping it);
- a message delivered more than `agent.max_attempts` times (its worker died every time:
  acks_late + reject_on_worker_lost redeliver it) is given up and the replica failed.

Settling is every task's, not this module's (`workers/delivery.py`): a task that returned or
failed for good is marked done (`keys.task_done`), so a copy the broker redelivers later, or
one delivered while it runs, does nothing at all. A retry or a requeue is not settled (its next
delivery is), nor is a task Redis went away under (a failover): the outbox sweep sends that again.

Tasks take `*args, **kwargs` so that a producer's wrong arguments reach the validator and
are refused with a message naming the field, instead of a bare TypeError.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, TypeVar

import redis
from celery import Celery, Task
from celery.exceptions import Reject, Retry

from prewarm.core import keys
from prewarm.core.errors import InvalidPayload, PermanentError, TemporaryError
from workers import names
from workers import context, payload
from workers.node import operations, tiers
from workers.context import WorkerContext
from workers.payload import ReplicaRef
from prewarm.core.errors import failure_reason
from workers.node.bringup import LockLost, PrewarmJob, owner_token
from workers.node.memory import InsufficientMemory

log = logging.getLogger("prewarm.agent.tasks")

T = TypeVar("T")


def _ctx(task: Task) -> WorkerContext:
    return context.current(task.app.conf.prewarm_settings)


def _refuse(ctx: WorkerContext, task: Task, exc: InvalidPayload, args: Any, kwargs: Any) -> None:
    log.error("refused %s[%s]: %s (args=%.200r kwargs=%.200r); not retried", task.name, task.request.id, exc,
              args, kwargs)
    record = json.dumps({"task": task.name, "id": task.request.id, "error": str(exc), "at": ctx.clock()})
    try:
        pipe = ctx.client.pipeline(transaction=True)
        pipe.lpush(keys.REJECTED_TASKS, record)
        pipe.ltrim(keys.REJECTED_TASKS, 0, keys.REJECTED_KEEP - 1)
        pipe.execute()
    except redis.RedisError as rexc:
        log.warning("could not record the refused payload: %s", rexc)


def _delivery_number(ctx: WorkerContext, task: Task) -> int:
    key = keys.task_deliveries(task.request.id or "?", int(task.request.retries or 0))
    pipe = ctx.client.pipeline(transaction=True)
    pipe.incr(key)
    pipe.expire(key, keys.TASK_DELIVERIES_TTL_S)
    return int(pipe.execute()[0])


def _fail(ctx: WorkerContext, ref: ReplicaRef, exc: BaseException, *, reason: str | None = None) -> None:
    """Mark the replica failed; only the delivery that made the transition counts and logs it."""
    code = reason or failure_reason(exc)
    detail = f"{code}: {exc}"
    rec = operations.safe_fail(ctx, ref.replica_id, detail)
    if rec is None:
        log.info("replica %s was not live any more (%s); left as it is", ref.replica_id, code)
    else:
        ctx.metrics.loading_failures.labels(ref.model, ref.node, code).inc()
        log.error("[COLDSTART] replica=%s model=%s node=%s state=failed reason=%s detail=%s", ref.replica_id,
                  ref.model, ref.node, code, str(exc).replace("\n", " | ")[:1000])
    if ref.node == ctx.node:
        ctx.runtimes.stop(ref.replica_id)


def _backoff(ctx: WorkerContext, task: Task, exc: BaseException) -> float:
    agent = ctx.settings.agent
    delay = agent.retry_backoff_s * (2 ** int(task.request.retries or 0))
    if isinstance(exc, TemporaryError):
        delay = max(delay, exc.retry_after)
    # A retry waits in the worker, unacked, from its delivery: countdown + time limit must stay
    # under the visibility timeout, or the broker hands a copy to another worker meanwhile.
    room = agent.effective_visibility_timeout_s - agent.task_time_limit_s - 1
    return max(0.1, min(delay, room))


def _replica_task(task: Task, parse: Callable[[Any, Any], T], ref_of: Callable[[T], ReplicaRef],
                  work: Callable[[WorkerContext, T, float], Any], args: Any, kwargs: Any) -> Any:
    """Run `work` under the shared failure policy (see the module docstring)."""
    ctx = _ctx(task)
    try:
        req = parse(args, kwargs)
    except InvalidPayload as exc:
        _refuse(ctx, task, exc, args, kwargs)
        raise
    ref = ref_of(req)
    max_attempts = ctx.settings.agent.max_attempts
    delivery = _delivery_number(ctx, task)
    if delivery > max_attempts:
        gave_up = PermanentError(f"{task.name} was delivered {delivery} times without finishing "
                                 f"(agent.max_attempts={max_attempts}); giving up")
        _fail(ctx, ref, gave_up, reason="gave_up")
        return {"replica_id": ref.replica_id, "outcome": "gave_up"}
    deadline = time.monotonic() + ctx.settings.agent.task_time_limit_s
    try:
        result = work(ctx, req, deadline)
    except Retry:
        raise
    except InvalidPayload as exc:
        _refuse(ctx, task, exc, args, kwargs)
        raise
    except LockLost as exc:
        log.warning("%s[%s]: %s; leaving the replica to its new owner", task.name, task.request.id, exc)
        return {"replica_id": ref.replica_id, "outcome": "taken_over"}
    except PermanentError as exc:
        _fail(ctx, ref, exc)
        raise
    except (TemporaryError, redis.RedisError, OSError, TimeoutError) as exc:
        if int(task.request.retries or 0) + 1 >= max_attempts:
            _fail(ctx, ref, exc, reason="gave_up")
            raise
        countdown = _backoff(ctx, task, exc)
        log.warning("%s[%s] of %s: temporary failure (%s); retry %d/%d in %.1fs", task.name, task.request.id,
                    ref.replica_id, exc, int(task.request.retries or 0) + 1, max_attempts - 1, countdown)
        try:
            raise task.retry(exc=exc, countdown=countdown, max_retries=max_attempts - 1)
        except Reject as rejected:
            # Celery rejects the message WITHOUT requeue when the retry cannot be published (the
            # broker away: a restart, a Sentinel failover), and the task was lost (issue 20). Requeued
            # instead: kombu puts the message back, or, with the broker still away, it stays unacked
            # and comes back after the visibility timeout; the attempt cap still counts it.
            log.warning("%s[%s] of %s: the retry could not be sent (%s); the message is requeued", task.name,
                        task.request.id, ref.replica_id, rejected.reason)
            raise Reject(rejected.reason, requeue=True) from exc
    except Exception as exc:
        _fail(ctx, ref, exc, reason="internal")
        raise
    return result


def _place_elsewhere(task: Task, rid: str, need_bytes: int, reason: str) -> None:
    """Hand a load or a wake this node's memory refused to the planner (`workers.planning.elsewhere`).
    Its id derives from the task refused (a redelivered copy sends the same one, settled once)."""
    task.app.send_task(names.PLACE_ELSEWHERE, args=[rid, int(need_bytes), reason[:2000]],
                       task_id=f"{task.request.id}/{names.PLACE_ELSEWHERE}")
    log.warning("%s does not fit on this node (%s): handed to the planner to place elsewhere", rid, reason)


# --- node tasks ----------------------------------------------------------------------------
def prewarm_replica(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Bring a replica to `ready`: register, spawn or reuse its runtime, load, warm up, validate."""

    def work(ctx: WorkerContext, req: payload.PrewarmRequest, deadline: float) -> dict[str, Any]:
        try:
            result = PrewarmJob(ctx, req, owner=owner_token(self.request.id or "?"), deadline=deadline).run()
        except InsufficientMemory as exc:  # nothing started here: the planner places it on another node
            _place_elsewhere(self, req.replica.replica_id, exc.nbytes, str(exc))
            raise
        return {"replica_id": result.replica_id, "outcome": result.outcome.value, "cold_start_s": result.cold_start_s}

    return _replica_task(self, payload.parse_prewarm, lambda r: r.replica, work, args, kwargs)


def retire_replica(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Drain a replica (no new requests, in-flight ones finish) and retire it; stops its runtime."""

    def work(ctx: WorkerContext, req: payload.RetireRequest, deadline: float) -> dict[str, Any]:
        outcome = operations.retire(ctx, req, owner=owner_token(self.request.id or "?"), deadline=deadline)
        return {"replica_id": req.replica.replica_id, "outcome": outcome.value}

    return _replica_task(self, payload.parse_retire, lambda r: r.replica, work, args, kwargs)


def keep_warm(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Hold a replica warm with periodic signed synthetic requests until `until` (epoch seconds)."""

    def work(ctx: WorkerContext, req: payload.KeepWarmRequest, deadline: float) -> dict[str, Any]:
        sent = operations.keep_warm(ctx, req)
        return {"replica_id": req.replica.replica_id, "until": req.until, "sent": sent}

    return _replica_task(self, payload.parse_keep_warm, lambda r: r.replica, work, args, kwargs)


def recycle_if_fragmented(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Measure fragmentation; above `agent.fragmentation_threshold`, drain and re-prewarm the replica."""

    def work(ctx: WorkerContext, req: payload.ReplicaOnlyRequest, deadline: float) -> dict[str, Any]:
        rid = req.replica.replica_id
        decision = operations.fragmentation_decision(ctx, rid)
        if decision.recycle:
            hosted = ctx.runtimes.get(rid)
            rec = ctx.registry.get(rid)
            model_dir = hosted.model_dir if hosted else None
            pool = rec.pool.value if rec else "serving"
            reason = f"recycled: fragmentation {decision.fragmentation:.3f} > {decision.threshold}"
            log.warning("replica %s: %s", rid, reason)
            operations.retire(ctx, payload.RetireRequest(req.replica, reason),
                              owner=owner_token(self.request.id or "?"), deadline=deadline)
            self.app.send_task(names.PREWARM, args=[rid, pool, model_dir])
        return {"replica_id": rid, "fragmentation": decision.fragmentation, "recycled": decision.recycle}

    return _replica_task(self, lambda a, k: payload.parse_replica_only("recycle_if_fragmented", a, k),
                         lambda r: r.replica, work, args, kwargs)


def sleep_replica(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Drain a ready replica (no request in flight is cut) and put its engine to level-1 sleep (tier asleep)."""

    def work(ctx: WorkerContext, req: payload.ReplicaOnlyRequest, deadline: float) -> dict[str, Any]:
        rid = req.replica.replica_id
        outcome = tiers.sleep(ctx, rid, owner=owner_token(self.request.id or "?"), deadline=deadline)
        if outcome is tiers.TierOutcome.STILL_DRAINING:  # a long request is still running: go on waiting
            self.app.send_task(names.SLEEP, args=[rid])
        return {"replica_id": rid, "outcome": outcome.value}

    return _replica_task(self, lambda a, k: payload.parse_replica_only("sleep_replica", a, k),
                         lambda r: r.replica, work, args, kwargs)


def wake_replica(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Wake an asleep replica to ready (refused, left asleep, when the node's GPU memory is full)."""

    def work(ctx: WorkerContext, req: payload.ReplicaOnlyRequest, deadline: float) -> dict[str, Any]:
        rid = req.replica.replica_id
        outcome, seconds = tiers.wake(ctx, rid, owner=owner_token(self.request.id or "?"), deadline=deadline)
        if outcome in (tiers.TierOutcome.READY, tiers.TierOutcome.WAKE_FAILED):
            # the wake the demand claim was taken for is over: the next unmet demand must not wait for its TTL
            claim = keys.demand_claim(req.replica.model)
            if ctx.client.get(claim) == rid:
                ctx.client.delete(claim)
        if outcome is tiers.TierOutcome.NO_MEMORY:  # left asleep here: the planner places it on another node
            booking = ctx.runtimes.ledger.get(rid)
            _place_elsewhere(self, rid, booking.nbytes if booking else 0,
                             f"wake refused on {req.replica.node}: GPU memory full")
        elif outcome is tiers.TierOutcome.WAKE_FAILED:  # failed: the planner prewarms a replacement now
            self.app.send_task(names.HANDLE_DEMAND, args=[req.replica.model])
        return {"replica_id": rid, "outcome": outcome.value, "wake_s": seconds}

    return _replica_task(self, lambda a, k: payload.parse_replica_only("wake_replica", a, k),
                         lambda r: r.replica, work, args, kwargs)


def evict_replica(self: Task, *args: Any, **kwargs: Any) -> Any:
    """Drain until no request is in flight (no drain timeout), then retire; the snapshot keeps the weights."""

    def work(ctx: WorkerContext, req: payload.RetireRequest, deadline: float) -> dict[str, Any]:
        rid = req.replica.replica_id
        outcome = tiers.evict(ctx, rid, req.reason, owner=owner_token(self.request.id or "?"), deadline=deadline)
        if outcome is tiers.TierOutcome.STILL_DRAINING:
            self.app.send_task(names.EVICT, args=[rid, req.reason])
        return {"replica_id": rid, "outcome": outcome.value}

    return _replica_task(self, payload.parse_retire, lambda r: r.replica, work, args, kwargs)


def register(app: Celery) -> None:
    """Register the node tasks on `app` (the planner's are in `workers.planning.tasks`)."""
    app.task(name=names.PREWARM, **names.TASK_OPTIONS)(prewarm_replica)
    app.task(name=names.RETIRE, **names.TASK_OPTIONS)(retire_replica)
    app.task(name=names.KEEP_WARM, **names.TASK_OPTIONS)(keep_warm)
    app.task(name=names.RECYCLE, **names.TASK_OPTIONS)(recycle_if_fragmented)
    app.task(name=names.SLEEP, **names.TASK_OPTIONS)(sleep_replica)
    app.task(name=names.WAKE, **names.TASK_OPTIONS)(wake_replica)
    app.task(name=names.EVICT, **names.TASK_OPTIONS)(evict_replica)
