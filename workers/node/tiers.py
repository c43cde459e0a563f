"""Sleep and wake: moving a hosted replica between the GPU and host-memory tiers on command.

A replica put to sleep (engine level-1 sleep: weights to host memory, GPU freed) leaves the
routing view at once (`ready -> asleep` before the runtime is told), and the runtime only
sleeps after the requests in flight have finished: a sleep never drops a request. Woken,
it goes back to `ready` without a load or a new validation (level 1 keeps the same bytes).
A wake is admitted like a load: the replica's weights must fit beside the replicas awake
on this node (`agent.gpu_memory_gb`).
"""

from __future__ import annotations

import logging
import time

from prewarm.core import keys
from prewarm.core.domain import ReplicaState
from prewarm.core.errors import PermanentError, TemporaryError
from workers.context import WorkerContext
from workers.node.lock import ReplicaLock
from workers.node.runtime_client import make_client
from workers.node.supervision import gpu_used_gb, model_footprint_gb
from workers.payload import ReplicaOnlyRequest

log = logging.getLogger("prewarm.agent.tiers")


def _lock(ctx: WorkerContext, rid: str, owner: str, deadline: float) -> ReplicaLock:
    lock = ReplicaLock(ctx.client, rid, owner, ctx.settings.agent.lock_ttl_s)
    lock.acquire(deadline=deadline)
    return lock


def sleep(ctx: WorkerContext, req: ReplicaOnlyRequest, *, owner: str, deadline: float, level: int = 1) -> str:
    """Put a ready replica to sleep; returns the outcome ("asleep", "already_asleep", "not_ready")."""
    rid = req.replica.replica_id
    with _lock(ctx, rid, owner, deadline):
        rec = ctx.registry.get(rid)
        hosted = ctx.host.get(rid)
        if rec is None or hosted is None:
            return "not_ready"
        if rec.state is ReplicaState.ASLEEP:
            return "already_asleep"
        if rec.state is not ReplicaState.READY:
            return "not_ready"
        rec = ctx.registry.transition(rid, ReplicaState.ASLEEP, now=ctx.clock(), reason="fleet: sleep",
                                      expected=ReplicaState.READY)
        ctx.host.update(rec)
        t0 = time.monotonic()
        try:
            make_client(ctx.settings, hosted.endpoint).adapter.sleep(level)
        except Exception as exc:
            back = ctx.registry.transition(rid, ReplicaState.READY, now=ctx.clock(), reason=f"sleep failed: {exc}"[:200])
            ctx.host.update(back)
            raise TemporaryError(f"replica {rid} did not go to sleep: {exc}", 1.0) from exc
        log.info("replica %s asleep (level %d) in %.2fs", rid, level, time.monotonic() - t0)
        return "asleep"


def wake(ctx: WorkerContext, req: ReplicaOnlyRequest, *, owner: str, deadline: float) -> tuple[str, float]:
    """Wake a sleeping replica back to ready; returns the outcome and the wake time in seconds."""
    rid = req.replica.replica_id
    with _lock(ctx, rid, owner, deadline):
        rec = ctx.registry.get(rid)
        hosted = ctx.host.get(rid)
        if rec is None or hosted is None:
            raise PermanentError(f"replica {rid} is not hosted here: nothing to wake")
        if rec.state is ReplicaState.READY:
            return "already_awake", 0.0
        if rec.state is not ReplicaState.ASLEEP:
            return f"not_asleep ({rec.state.value})", 0.0
        budget = ctx.settings.agent.gpu_memory_gb
        if budget > 0:
            used, need = gpu_used_gb(ctx, exclude=rid), model_footprint_gb(hosted.model_dir)
            if used + need > budget + 1e-12:
                raise TemporaryError(f"replica {rid} needs {need:.4g} GB of GPU memory to wake; {used:.4g} of "
                                     f"{budget:.4g} GB are held here", 2.0)
        t0 = time.monotonic()
        make_client(ctx.settings, hosted.endpoint).adapter.wake_up()
        woke_s = time.monotonic() - t0
        rec = ctx.registry.transition(rid, ReplicaState.READY, now=ctx.clock(), reason=f"woken in {woke_s:.2f}s",
                                      expected=ReplicaState.ASLEEP)
        ctx.host.update(rec)
        ctx.client.rpush(keys.wake_times(rec.model), repr(woke_s))
        ctx.client.ltrim(keys.wake_times(rec.model), -keys.LOADTIMES_KEEP, -1)
        log.info("replica %s woken in %.2fs", rid, woke_s)
        return "woken", woke_s
