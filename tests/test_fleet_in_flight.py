"""The live fleet round does not evict a model whose requests are being counted now (a real Redis, an in-process
agent's node view): a sparse model loaded on demand for a burst that began after the last complete bucket was
evicted mid-burst by the next round (`workers.planning.fleet.counting_now`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterator

import pytest

from forecasting.fleet.planner import ActionKind
from forecasting.fleet.round import RoundState
from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.embedded import free_port
from tests.celery_helpers import settings_from_env, worker_env
from workers.node.agent import Agent
from workers.planning.fleet import counting_now, fleet_decide


@pytest.fixture()
def agent(redis_url: str, tmp_path: Path) -> Iterator[Agent]:
    """Node n1's agent in this process (its heartbeat publishes the node view), not consuming tasks; the planner
    settings of a two-model pool under a fleet budget."""
    env = worker_env(redis_url, tmp_path, PREWARM_AGENT_NODE="n1", PREWARM_METRICS_PORT=str(free_port()),
                     PREWARM_PLANNER_MODELS='["b@r1", "c@r1"]', PREWARM_PLANNER_FLEET_BUDGET_GB="40",
                     PREWARM_PLANNER_MODEL_MEMORY_GB='{"b": 20, "c": 20}', PREWARM_AGENT_GPU_MEMORY_GB="40")
    a = Agent(settings_from_env(env))
    yield a
    a.ctx.client.close()


def test_a_model_with_requests_in_the_bucket_being_counted_is_not_evicted(agent: Agent) -> None:
    ctx = agent.ctx
    agent.heartbeat_once()
    rep = Replica("b", "r1", "n1", 0, state=ReplicaState.PENDING, created_at=time.time())
    ctx.registry.register(rep, now=time.time())
    for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(rep.id, s, now=time.time())
    bucket = float(ctx.settings.planner.bucket_s)
    now = time.time()
    start = math.floor(now / bucket) * bucket

    def evicted() -> set[str]:
        decision, _ = fleet_decide(ctx, now=now, state=RoundState())
        assert decision is not None
        return {a.model for a in decision.result.plan.actions if a.kind is ActionKind.EVICT}

    assert evicted() == {"b"}  # no request anywhere: "b" holds GPU memory for nothing
    assert counting_now(ctx, ["b", "c"], start=start, now=now, bucket=bucket) == set()
    fine = keys.FINE_RESOLUTION_S  # a burst began in this bucket, its requests held or served: in flight
    ctx.client.set(keys.inflight_peak("b", fine, int(now // fine) * fine), 3)
    assert counting_now(ctx, ["b", "c"], start=start, now=now, bucket=bucket) == {"b"}
    assert evicted() == set()
    ctx.client.delete(keys.inflight_peak("b", fine, int(now // fine) * fine))
    # a round just after a boundary: the new bucket has had no flush yet, the last fine one holds the requests
    after = start + 0.5
    ctx.client.set(keys.inflight_peak("b", fine, int(start) - fine), 2)
    assert counting_now(ctx, ["b", "c"], start=start, now=after, bucket=bucket) == {"b"}
    ctx.client.delete(keys.inflight_peak("b", fine, int(start) - fine))
    for res in keys.REQUEST_RESOLUTIONS_S:  # ... or answered already: counted, at each resolution
        ctx.client.incrby(keys.requests("b", res, int(now // res) * res), 3)
    assert counting_now(ctx, ["b", "c"], start=start, now=now, bucket=bucket) == {"b"}
    assert evicted() == set()
