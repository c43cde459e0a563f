"""The live fleet round does not evict a model whose requests are being counted now (a real Redis, an in-process
agent's node view): a sparse model loaded on demand for a burst that began after the last complete bucket was
evicted mid-burst by the next round (`workers.planning.fleet.counting_now`)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Iterator

import numpy as np
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


def test_the_live_round_steers_its_price_by_the_waits_the_gateway_counted(agent: Agent) -> None:
    """The live round reads the requests that waited for capacity (`keys.waited`, the gateway's fine counter) in
    the buckets since its last round, of the models it plans by their outlook, and steers its memory price by the
    cold-start budget with them, as the replay does: the same bucket with a tenth of its requests waiting lowers
    the price (more models stay warm), calm raises it; the normaliser it carries is saved with the price."""
    from forecasting.fleet.planner import FleetState
    from workers.planning.fleet import load_state, save_state

    ctx = agent.ctx
    agent.heartbeat_once()
    bucket = int(ctx.settings.planner.bucket_s)
    fine = keys.FINE_RESOLUTION_S
    t0 = math.floor(time.time() / bucket) * bucket - 3 * bucket
    _, state = fleet_decide(ctx, now=t0 + 1, state=RoundState())  # the first round: where counting starts
    assert state.seen_to == t0
    for model, n in (("b", 6), ("c", 30)):  # under a request a second each: neither is a dense model
        for res in keys.REQUEST_RESOLUTIONS_S:
            for b in range(int(t0), int(t0) + bucket, res):
                ctx.client.set(keys.requests(model, res, b), n * res // bucket)
        ctx.client.sadd(keys.REQUEST_MODELS, model)
    probe, _ = fleet_decide(ctx, now=t0 + bucket + 1, state=state)
    assert probe is not None and probe.result.dense == ()
    density = probe.result.plan.density
    mid = float(np.sqrt(density.min() * density.max()))  # a price between the two models' densities
    save_state(ctx, FleetState(lam=mid))
    _, calm = fleet_decide(ctx, now=t0 + bucket + 1, state=state)
    ctx.client.set(keys.waited("c", fine, int(t0)), 4)  # a tenth of the bucket's requests waited
    _, missed = fleet_decide(ctx, now=t0 + bucket + 1, state=state)
    assert missed.planner.lam < mid < calm.planner.lam, (missed.planner, calm.planner)
    assert missed.planner.counted_rate == pytest.approx(36 / bucket)
    save_state(ctx, missed.planner)
    assert load_state(ctx) == missed.planner
