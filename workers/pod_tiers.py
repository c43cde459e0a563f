"""Sleeping and waking the pods of a Deployment through their servers' own HTTP API (issue 17).

In a cluster Kubernetes starts and stops the pods; the planner's count reaches the
Deployment's one owner, and with it (`prewarm.registry.targets`, `awake`) how many of the
pods wanted now are wanted awake: a fleet round may park a model's pod asleep rather than
give it up, where the pods' server has vLLM's sleep mode (`kubernetes.pod_sleep_mode`:
`/sleep`, `/wake_up`, `/is_sleeping`; prewarm's own runtime speaks the same). The pod
warmer calls `tier_round` on its keep-alive cadence and moves its ready pods to match:

- sleep (more ready than wanted awake): `ready -> draining` (the gateway stops routing to
  it), then one gateway view refresh (a view read just before may still route a request)
  and until the server reports nothing running or waiting (`vllm:num_requests_running` and
  `vllm:num_requests_waiting` on its /metrics, where it exposes them), then `/sleep?level=1`
  (weights to host memory, GPU memory freed) confirmed by `/is_sleeping`, `-> asleep`. A pod
  still busy stays draining and is looked at again next round: a request is never cut.
- wake (fewer ready than wanted awake, some asleep): `/wake_up` confirmed by
  `/is_sleeping`, `asleep -> ready`, the wake timed into the registry as agents time theirs
  (`record_ready_time(model, "asleep", node class, s)`: the catalog's measured wake).

A pod whose server does not answer `/is_sleeping` is never drained for a sleep. One that
refuses `/sleep` after its drain (vLLM where the platform has no sleep mode) cannot go back
from `draining` to `ready`: it is failed with the server's reason and the pod warmer warms,
validates and registers the pod again (`"failed"` in the result). Without a fresh planner
record (3 planning intervals) nothing moves. The awake count is the pods' own revision's where the
planner records one (`keys.revision_target`: a rollout's stable and canary Deployments each get
their share), else the model's. Each move holds the replica's lock, as every
other change of a replica does.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from prewarm.adapters.runtimes import OpenAICompatibleAdapter
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.errors import IllegalTransition, PrewarmError, ReplicaNotFound, TemporaryError
from prewarm.registry.targets import ReplicaTarget, read_target
from workers.context import WorkerContext
from workers.node.lock import ReplicaLock
from workers.node.memory import ASLEEP
from workers.planning.round_lock import ttl_s

log = logging.getLogger("prewarm.external.tiers")


def awake_target(ctx: WorkerContext, model: str, revision: str | None) -> ReplicaTarget:
    """The planner's fresh target for the pods of `revision` (its own record: its share while a rollout runs),
    else for the model; the reader's error when neither is fresh."""
    max_age_s = ttl_s(ctx.settings.planner.interval_s)  # older than the round's lock: no planner has planned since
    if revision is not None:
        try:
            return read_target(ctx.client, model, now=ctx.clock(), max_age_s=max_age_s, revision=revision)
        except TemporaryError as exc:
            log.debug("no fresh target for %s@%s (%s); the model's is used", model, revision, exc)
    return read_target(ctx.client, model, now=ctx.clock(), max_age_s=max_age_s)


def tier_round(ctx: WorkerContext, model: str, node_class: str, endpoints: Mapping[str, str],
               adapter_for: Callable[[str], OpenAICompatibleAdapter], owner: str,
               on_change: Callable[[Replica], None], *, revision: str | None = None) -> dict[str, str]:
    """One round over the tracked pods' replicas (`endpoints`: replica id -> pod endpoint) of `model` (its
    `revision`'s Deployment). Returns {replica id: "asleep" | "ready" | "draining" | "failed"} for each one
    it moved or is draining."""
    try:
        target = awake_target(ctx, model, revision)
    except (TemporaryError, PrewarmError) as exc:  # no fresh plan: leave every pod where it is
        log.debug("no tier change for %s: %s", model, exc)
        return {}
    records = {rid: ctx.registry.get(rid) for rid in sorted(endpoints)}
    by_state: dict[ReplicaState, list[str]] = {}
    for rid, rec in records.items():
        if rec is not None:
            by_state.setdefault(rec.state, []).append(rid)
    ready, asleep = by_state.get(ReplicaState.READY, []), by_state.get(ReplicaState.ASLEEP, [])
    draining = [rid for rid in by_state.get(ReplicaState.DRAINING, []) if _parked_here(ctx, rid)]
    done: dict[str, str] = {}
    extra = len(ready) + len(draining) - target.awake
    for rid in draining + ready[::-1][:max(0, extra - len(draining))]:  # the newest pods go first
        done[rid] = _locked(ctx, rid, owner, lambda: _sleep(ctx, rid, adapter_for(endpoints[rid]), on_change))
    for rid in asleep[:max(0, target.awake - len(ready))]:
        done[rid] = _locked(ctx, rid, owner,
                            lambda: _wake(ctx, rid, node_class, adapter_for(endpoints[rid]), on_change))
    return {rid: what for rid, what in done.items() if what}


def _parked_here(ctx: WorkerContext, rid: str) -> bool:
    """A draining replica this module began to put to sleep (not one the pod's deletion is retiring)."""
    rec = ctx.registry.get(rid)
    return rec is not None and rec.reason.startswith(_PARK)


_PARK = "planner: park asleep"


def _locked(ctx: WorkerContext, rid: str, owner: str, work: Callable[[], str]) -> str:
    lock = ReplicaLock(ctx.client, rid, owner, ctx.settings.agent.lock_ttl_s)
    try:
        lock.acquire(deadline=time.monotonic())  # one try
    except TimeoutError:
        return ""  # a warmup or another move holds it: next round
    with lock:
        try:
            return work()
        except (IllegalTransition, ReplicaNotFound) as exc:  # the pod went away meanwhile
            log.info("tier move of %s abandoned: %s", rid, exc)
            return ""


def _sleep(ctx: WorkerContext, rid: str, server: OpenAICompatibleAdapter, on_change: Callable[[Replica], None]) -> str:
    rec = ctx.registry.get(rid)
    if rec is None:
        return ""
    if rec.state is ReplicaState.READY:
        try:
            server.is_sleeping()
        except PrewarmError as exc:
            log.warning("pod %s has no sleep mode (/is_sleeping: %s); it stays awake", rid, exc)
            return ""
        rec = ctx.registry.transition(rid, ReplicaState.DRAINING, now=ctx.clock(), expected=ReplicaState.READY,
                                      reason=_PARK)
        on_change(rec)
        time.sleep(ctx.settings.gateway.refresh_interval_s)  # a view read just before may still route one
    try:
        busy = server.engine_load()
    except PrewarmError as exc:
        busy = None
        log.info("pod %s: no load figures (%s); its server's /sleep is trusted to wait for its requests", rid, exc)
    if busy:
        log.info("pod %s: %d request(s) still running or waiting; it sleeps once they are done", rid, busy)
        return "draining"
    try:
        slept = server.sleep(1)
    except PrewarmError as exc:
        slept, why = False, str(exc)
    else:
        why = "its server still says it is awake"
    if not slept:
        on_change(ctx.registry.transition(rid, ReplicaState.FAILED, now=ctx.clock(),
                                          reason=f"sleep refused: {why}"[:500]))
        log.warning("pod %s could not be put to sleep: %s", rid, why)
        return "failed"
    on_change(ctx.registry.transition(rid, ReplicaState.ASLEEP, now=ctx.clock(), expected=ReplicaState.DRAINING,
                                      reason="planner: parked asleep"))
    log.info("pod %s is asleep (its server's /sleep)", rid)
    return "asleep"


def _wake(ctx: WorkerContext, rid: str, node_class: str, server: OpenAICompatibleAdapter,
          on_change: Callable[[Replica], None]) -> str:
    started = time.monotonic()
    try:
        woke = server.wake_up()
    except PrewarmError as exc:
        log.warning("pod %s could not be woken, left asleep: %s", rid, exc)
        return ""
    if not woke:
        log.warning("pod %s: /wake_up answered but /is_sleeping still says asleep; left asleep", rid)
        return ""
    seconds = time.monotonic() - started
    rec = ctx.registry.transition(rid, ReplicaState.READY, now=ctx.clock(), expected=ReplicaState.ASLEEP,
                                  reason="planner: woken")
    on_change(rec)
    ctx.registry.record_ready_time(rec.model, ASLEEP, node_class, seconds)
    log.info("pod %s woken in %.2fs (its server's /wake_up)", rid, seconds)
    return "ready"
