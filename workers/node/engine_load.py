"""The agent's side of the engine load signal: each vLLM replica's own queue, into Redis.

On every heartbeat the agent reads `vllm:num_requests_running` + `num_requests_waiting`
from each ready vLLM replica it hosts and writes them to `keys.engine_load(model)`, which
the gateway reads with its routing view (`prewarm.policy.engine_load`): routing and the
planner's in-flight peak then count what the engine holds, not only what one gateway sent.
The hash expires a heartbeat TTL after the last write, so a dead agent's figures vanish;
a replica that stops being ready is removed from it.
"""

from __future__ import annotations

import logging

from prewarm.core import keys
from prewarm.core.domain import ReplicaState
from workers.context import WorkerContext
from workers.node.engines import VLLM
from workers.node.runtime_client import client_for

log = logging.getLogger("prewarm.agent.engine_load")


def publish_engine_load(ctx: WorkerContext) -> dict[str, int]:
    """Read and write every hosted vLLM replica's load; returns what was written (replica id -> count)."""
    written: dict[str, int] = {}
    pipe = ctx.client.pipeline(transaction=False)
    ttl = max(1, int(ctx.settings.registry.heartbeat_ttl_s + 0.999))
    for hosted in ctx.runtimes.all():
        if hosted.engine != VLLM or hosted.exit_code() is not None:
            continue
        rid, key = hosted.replica.id, keys.engine_load(hosted.replica.model)
        if hosted.replica.state is not ReplicaState.READY:
            pipe.hdel(key, rid)
            continue
        n = client_for(ctx.settings, hosted).inflight()
        if n is None:
            continue
        pipe.hset(key, rid, n)
        pipe.expire(key, ttl)
        written[rid] = n
    pipe.execute()
    return written
