"""Queue and task names and the routing rule: the wire format producers and consumers share.

Producers (the executor, the planner's tasks, the gateway's demand path) import these names
instead of the Celery app, so a task module never imports the app that registers it.
Routing: replica tasks go to `prewarm.node.<node>`, the node read from the replica id
(`model@revision/node/slot`) so a producer cannot send a replica to the wrong node;
cluster-wide tasks go to `prewarm.planner`, except `handle_demand`, which goes to `prewarm.demand`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from prewarm.core.domain import parse_replica_id
from prewarm.core.errors import InvalidPayload

PLANNER_QUEUE = "prewarm.planner"
#: Unmet-demand tasks, apart from the planner's periodic ones (reap, forecast_and_plan) so that a flood
#: of demand never delays them (issue 20); the planner worker consumes both.
DEMAND_QUEUE = "prewarm.demand"
NODE_QUEUE_PREFIX = "prewarm.node."

# Task names (producers use these with `send_task`; they are part of the wire format).
PREWARM = "prewarm.prewarm_replica"
RETIRE = "prewarm.retire_replica"
KEEP_WARM = "prewarm.keep_warm"
RECYCLE = "prewarm.recycle_if_fragmented"
SLEEP = "prewarm.sleep_replica"  # drain, then engine level-1 sleep (tier asleep)
WAKE = "prewarm.wake_replica"  # asleep -> ready
EVICT = "prewarm.evict_replica"  # drain until no request is in flight, then retire (weights stay in the snapshot)
REAP = "prewarm.reap"
HANDLE_DEMAND = "prewarm.handle_demand"
SCAN_DEMAND = "prewarm.scan_demand"
SWEEP_FRAGMENTATION = "prewarm.sweep_fragmentation"
DISPATCH_EVENTS = "prewarm.dispatch_due_events"
APPLY_EVENT = "prewarm.apply_scale_event"
FORECAST = "prewarm.forecast_and_plan"
PLACE_ELSEWHERE = "prewarm.place_elsewhere"  # a load or wake its node's memory refused: another node (planner)
SWEEP_OUTBOX = "prewarm.sweep_outbox"  # send again what a failover lost (workers/delivery.py)

#: The beat's periodic tasks (workers/schedule.py): the next tick is their redelivery, so they are not
#: kept in the task outbox; every other task is (workers/delivery.py).
PERIODIC = frozenset({REAP, SCAN_DEMAND, SWEEP_FRAGMENTATION, DISPATCH_EVENTS, FORECAST, SWEEP_OUTBOX})

#: Tasks that act on one replica and run on the replica's node.
NODE_TASKS = frozenset({PREWARM, RETIRE, KEEP_WARM, RECYCLE, SLEEP, WAKE, EVICT})


def node_queue(node: str) -> str:
    return f"{NODE_QUEUE_PREFIX}{node}"


def route_task(
    name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any], task: Any = None,
    **_extra: Any,
) -> dict[str, str]:
    """Node tasks to the queue of the node named in their replica id; everything else to the planner.

    A node task whose replica id cannot be read goes to the planner queue, where the task
    refuses it with a clear error (rather than to a queue nobody consumes).
    """
    if name in NODE_TASKS:
        rid = args[0] if args else kwargs.get("replica_id")
        try:
            _, _, node, _ = parse_replica_id(rid)
        except InvalidPayload:
            return {"queue": PLANNER_QUEUE}
        return {"queue": node_queue(node)}
    if name == HANDLE_DEMAND:
        return {"queue": DEMAND_QUEUE}
    return {"queue": PLANNER_QUEUE}


#: Options every prewarm task is registered with (DESIGN.md: acks late, redelivered when a
#: worker dies, no result kept; a malformed payload is refused, never retried).
TASK_OPTIONS: Mapping[str, Any] = {"bind": True, "typing": False, "acks_late": True, "reject_on_worker_lost": True,
                                   "ignore_result": True, "throws": (InvalidPayload,)}
