"""The engines' sleep-mode report, from a node agent's view to the planner, with a real Redis.

A real `prewarm agent` (Celery worker) publishes its built-in engine's answer ("can sleep") in
its node view (`keys.node_info`, `sleep_mode`); a model it serves on vLLM whose interpreter is
missing has no answer, so it is unreported and the planner keeps its asleep tier (never assumed
absent). The "cannot sleep" side is vLLM's answer on CPU: starting a real vLLM costs minutes here,
so this file feeds that answer to the agent's own report function (`Agent.record_sleep_mode`, the
call `run_agent` makes with `probe_sleep_mode`'s result) and reads what its heartbeat publishes;
tests/test_vllm.py checks the same field on the agent that asked a real vLLM.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from forecasting.planner import PlannerParams, PlannerState
from prewarm.core import keys
from prewarm.core.domain import ModelSpec, Replica, ReplicaState
from prewarm.registry.embedded import free_port
from tests.celery_helpers import WorkerProcess, settings_from_env, wait_for, worker_env
from workers.context import WorkerContext
from workers.node.agent import Agent
from workers.node.engines import VLLM
from workers.planning.fleet import _nodes, fleet_catalog
from workers.planning.forecast import inputs as inputs_of

MODELS = json.dumps({"v": "vllm"})  # "b" runs on the default (built-in) engine


def _env(redis_url: str, tmp: Path, node: str) -> dict[str, str]:
    return worker_env(redis_url, tmp, PREWARM_AGENT_NODE=node, PREWARM_METRICS_PORT=str(free_port()),
                      PREWARM_ENGINE_MODELS=MODELS, PREWARM_ENGINE_VLLM_PYTHON=str(tmp / "no-vllm" / "python"))


@pytest.fixture()
def agent(redis_url: str, tmp_path: Path) -> Iterator[Agent]:
    """An in-process agent of node n2 (its heartbeat publishes the node view), not consuming tasks."""
    a = Agent(settings_from_env(_env(redis_url, tmp_path, "n2")))
    yield a
    a.ctx.client.close()


def _ready(ctx: WorkerContext, model: str, node: str) -> None:
    rep = Replica(model, "r1", node, 0, state=ReplicaState.PENDING, created_at=time.time())
    ctx.registry.register(rep, now=time.time())
    for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(rep.id, s, now=time.time())


@pytest.mark.slow
def test_a_real_agent_reports_its_builtin_engine_can_sleep_and_nothing_for_an_engine_not_asked(
        redis_url: str, tmp_path: Path) -> None:
    env = _env(redis_url, tmp_path, "n1")
    proc = WorkerProcess(["agent", "--node", "n1"], env, tmp_path / "agent.log").start()
    ctx = WorkerContext.build(settings_from_env(env))
    try:
        wait_for(lambda: ctx.client.hget(keys.node_info("n1"), "sleep_mode") is not None, 30,
                 lambda: f"the node view to carry the report (agent log:\n{proc.log()[-3000:]})")
        assert json.loads(ctx.client.hget(keys.node_info("n1"), "sleep_mode") or "") == {"*": True}
        assert "no interpreter" in proc.log()  # vLLM could not be asked: "v" is left unreported
        catalog = fleet_catalog(ctx, ["b", "v"])
        assert catalog.card("b").sleeps and catalog.card("v").sleeps  # unreported: the tier is kept
    finally:
        proc.stop()
        ctx.client.close()


def test_the_agents_report_of_an_engine_without_sleep_reaches_the_planner(agent: Agent) -> None:
    ctx = agent.ctx
    agent.heartbeat_once()
    assert json.loads(ctx.client.hget(keys.node_info("n2"), "sleep_mode") or "") == {"*": True}
    agent.record_sleep_mode(VLLM, False)  # what vLLM answers on CPU (`is_sleep_mode_available()`)
    agent.heartbeat_once()
    assert json.loads(ctx.client.hget(keys.node_info("n2"), "sleep_mode") or "") == {"*": True, "v": False}
    # the fleet round: no asleep tier for "v", kept for the built-in engine's "b"
    catalog = fleet_catalog(ctx, ["b", "v"])
    assert catalog.card("b").sleeps and not catalog.card("v").sleeps
    assert [n.no_sleep for n in _nodes(ctx, catalog, set())] == [frozenset({"v"})]
    # the single-model planner: a scale-down of "v" retires, one of "b" may park
    params = PlannerParams.from_settings(ctx.settings.planner)
    for model, sleeps in (("b", True), ("v", False)):
        _ready(ctx, model, "n2")
        inp = inputs_of(ctx, ModelSpec(model, "r1", slots=8), PlannerState(), params, now=time.time())
        assert inp.sleep_tier is sleeps, model
