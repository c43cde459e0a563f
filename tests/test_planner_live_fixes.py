"""Fixes on the live planner path (issue 17), each against a real Redis: the executor's scale-down
order, the counter resolutions the planner reads, the catalog's per-class times, the Kubernetes
targets. What the pure planner decides is in tests/test_planner.py; here its decisions meet the
registry and the broker the way `forecast_and_plan` and `apply_scale_event` meet them."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import pytest

from forecasting.planner import BatchJob, PlannerParams, PlannerState, ReplicaCounts, StepInputs, \
    observed_from_counts, step
from prewarm.core.domain import ModelSpec, Replica, ReplicaState
from prewarm.core.settings import RedisSettings, Settings
from tests.celery_helpers import publish_node, queued_tasks
from workers.app import make_app
from workers.context import WorkerContext
from workers.names import KEEP_WARM, RETIRE, node_queue
from workers.planning.executor import apply_event, live_counts, submit_events


@pytest.fixture()
def ctx(redis_url: str) -> Iterator[WorkerContext]:
    c = WorkerContext.build(Settings(redis=RedisSettings(url=redis_url)))
    yield c
    c.client.close()


def _replica(ctx: WorkerContext, model: str, node: str, slot: int, created_at: float, state: ReplicaState) -> str:
    rep = Replica(model, "r1", node, slot, state=ReplicaState.PENDING, created_at=created_at)
    ctx.registry.register(rep, now=created_at)
    path = [ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY]
    for s in path[: path.index(state) + 1] if state in path else []:
        ctx.registry.transition(rep.id, s, now=time.time())
    return rep.id


def test_scale_down_cancels_loading_replicas_and_never_retires_one_a_hold_keeps(ctx: WorkerContext) -> None:
    """5 ready and 4 loading, a batch rise within the lead: the decision (SCALE_DOWN 4, HOLD 3) is carried
    out over disjoint replicas: the 4 loading are cancelled, 3 of the 5 ready are kept warm, none retired."""
    publish_node(ctx.client, "n1", 9)
    now = time.time()
    ready = [_replica(ctx, "m", "n1", i, now - 100 + i, ReplicaState.READY) for i in range(5)]
    loading = [_replica(ctx, "m", "n1", 5 + i, now - 10 + i, ReplicaState.LOADING) for i in range(4)]
    counts = live_counts(ctx.registry.replicas_of("m"))
    assert counts == {"ready": 5, "loading": 4, "warm": 0}
    params = PlannerParams(budget_share=1.0, batch_jobs=(BatchJob(cron="*/10 * * * *", model="m", replicas=3,
                                                                   duration_s=300.0),))
    t = float(int(now // 600) * 600 + 590)  # 10 s before a run of the job: a rise within the 18.7 s lead
    y = np.full(400, 8.0)
    inp = StepInputs(ModelSpec("m", "r1", slots=8), t, observed_from_counts(t - 4000, 10.0, y, y, y * 10),
                     ReplicaCounts(**counts), params)
    d, _ = step(inp, PlannerState())
    assert [(e.kind.value, e.replicas) for e in d.events] == [("scale_down", 4), ("hold", 3)]
    assert submit_events(ctx, d.events) == [e.event_id for e in d.events]
    app = make_app(ctx.settings)
    try:
        for ev in d.events:
            assert apply_event(ctx, app, ev.event_id).outcome == "applied"
    finally:
        app.close()
    tasks = queued_tasks(ctx.client, node_queue("n1"))
    retired = {m["args"][0] for m in tasks if m["task"] == RETIRE}
    kept = {m["args"][0] for m in tasks if m["task"] == KEEP_WARM}
    assert retired == set(loading)
    assert kept == set(ready[:3]) and not kept & retired
