"""The planner-side retry of a load or a wake that did not fit on its node: place it on another.

A node agent refuses a load (`admit_load`) or a wake (`tiers.wake`) that its memory ledger
cannot take, with `InsufficientMemory` naming what holds the memory; nothing was started.
The agent cannot choose another node (it knows only its own), so it hands the refusal to
the planner queue (`place_elsewhere`), and this module places the model again:

- the refusing node is remembered for `keys.PLACEMENT_REFUSED_TTL_S`
  (`keys.placement_refused`), and so is every node that refuses it after, so a retry never
  goes back to a node that just said no, and the retries end when no node is left;
- among the other live nodes with a free slot whose published free GPU memory
  (`gpu_free_gb`; unaccounted: any) takes what the replica needs, the planner's one
  placement rule chooses (`pick_slots`: snapshot holders first, then the least loaded);
- a prewarm of the model is sent there (a wake elsewhere is a load from that node's
  snapshot or disk; the sleeping replica stays asleep where it is, for the fleet round to
  keep or evict). The choice is claimed under the refused replica's id
  (`keys.placement_claim`), so a redelivered retry re-sends the same idempotent prewarm;
- with no node left, nothing is sent: the refusal is logged and counted in
  `prewarm_dropped_events_total{reason="no_memory"}`, and the next planning round decides.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from prewarm.core import keys
from prewarm.core.domain import Pool, replica_id
from workers import names
from workers.context import WorkerContext
from workers.payload import PlaceElsewhereRequest
from workers.planning.nodes import NodeSlots, live_nodes, release_slot, reserve_slots

log = logging.getLogger("prewarm.planner.elsewhere")

GB = 1e9


def _room(info: dict[str, str], need_bytes: int) -> bool:
    """Whether a node's published view has `need_bytes` of GPU memory free (unaccounted: yes)."""
    free = info.get("gpu_free_gb", "")
    try:
        return free == "" or float(free) * GB >= need_bytes
    except ValueError:
        return False


def place_elsewhere(ctx: WorkerContext, app: Celery, req: PlaceElsewhereRequest) -> dict[str, Any]:
    ref = req.replica
    model_key = f"{ref.model}@{ref.revision}"
    claim = keys.placement_claim(ref.replica_id)
    refused = keys.placement_refused(model_key)
    pipe = ctx.client.pipeline(transaction=True)
    pipe.sadd(refused, ref.node)
    pipe.expire(refused, keys.PLACEMENT_REFUSED_TTL_S)
    pipe.get(claim)
    chosen = pipe.execute()[2]
    if chosen is None:
        passed_over = ctx.client.smembers(refused)
        infos = {ns.node: ctx.client.hgetall(keys.node_info(ns.node)) for ns in live_nodes(ctx)}
        snaps = {n: frozenset(s for s in info.get("snapshots", "").split(",") if s) for n, info in infos.items()}

        def nodes() -> list[NodeSlots]:
            return [ns for ns in live_nodes(ctx)
                    if ns.node not in passed_over and ns.free and _room(infos.get(ns.node, {}), req.need_bytes)]

        got = reserve_slots(ctx, 1, lambda node, slot: replica_id(ref.model, ref.revision, node, slot), nodes=nodes,
                            model_key=model_key, snapshots=snaps)  # a dry run reserves nothing
        if not got:
            log.error("no other node has room for %s (%.3g GB; passed over: %s) after %s: %s", model_key,
                      req.need_bytes / GB, ", ".join(sorted(passed_over)), ref.replica_id, req.reason)
            ctx.metrics.dropped_events.labels(ref.model, "no_memory").inc()
            return {"replica_id": ref.replica_id, "outcome": "no_room", "passed_over": sorted(passed_over)}
        node, slot = got[0]
        candidate = replica_id(ref.model, ref.revision, node, slot)
        if not ctx.client.set(claim, candidate, nx=True, ex=keys.PLACEMENT_REFUSED_TTL_S):
            chosen = ctx.client.get(claim)  # a concurrent copy of this retry claimed first: send its choice
            release_slot(ctx, node, slot, candidate)  # and the slot reserved for ours goes back
        else:
            chosen = candidate
    if ctx.settings.planner.dry_run:
        log.info("dry run: %s did not fit (%s); would prewarm %s", ref.replica_id, req.reason, chosen)
        return {"replica_id": ref.replica_id, "outcome": "dry_run", "placed": chosen}
    app.send_task(names.PREWARM, args=[chosen, Pool.SERVING.value, None],
                  task_id=f"{ref.replica_id}/{names.PLACE_ELSEWHERE}/{chosen}")
    log.info("%s did not fit on %s (%s): placed again as %s", ref.replica_id, ref.node, req.reason, chosen)
    return {"replica_id": ref.replica_id, "outcome": "placed", "placed": chosen}


__all__ = ["place_elsewhere"]
