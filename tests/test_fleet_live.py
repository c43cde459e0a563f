"""The fleet round in the real planner worker: three models, one GPU budget, no in-flight eviction.

A real `prewarm planner` (Celery worker on the test Redis) with `planner.fleet_budget_gb`
set runs `forecast_and_plan` as one fleet round. History is the gateway's own counters,
nodes are published the way agents publish them (with their GPU memory), and the
planner's decisions are read back from the node queues in the broker, where the agents
would consume them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import pytest
import redis

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import RedisSettings, RegistrySettings, Settings
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.replicas import ReplicaRegistry
from tests.celery_helpers import WorkerProcess, queued_tasks, wait_for, worker_env
from workers.app import make_app
from workers.names import EVICT, FORECAST, PREWARM, RETIRE, SLEEP, node_queue

pytestmark = pytest.mark.slow

MEM = {"a": 40.0, "b": 40.0, "c": 40.0}


@pytest.fixture()
def fleet(redis_server: EmbeddedRedis, tmp_path: Any) -> Iterator[dict[str, Any]]:
    redis_server.start()
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    env = worker_env(redis_server.url, tmp_path, PREWARM_PLANNER_MODELS='["a@r1","b@r1","c@r1"]',
                     PREWARM_PLANNER_FLEET_BUDGET_GB="80", PREWARM_PLANNER_MODEL_MEMORY_GB=json.dumps(MEM))
    proc = WorkerProcess(["planner", "--metrics-port", "0"], env, tmp_path / "planner.log").start()
    app = make_app(Settings(redis=RedisSettings(url=redis_server.url)))
    try:
        yield {"client": client, "proc": proc, "app": app, "registry": ReplicaRegistry(client, RegistrySettings())}
    finally:
        proc.stop()
        app.close()
        client.close()


def _node(client: "redis.Redis[str]", node: str, slots: int, gpu_gb: float) -> None:
    client.hset(keys.node_info(node), mapping={"name": node, "replica_slots": str(slots), "ready": "1",
                                              "gpu_memory_gb": repr(gpu_gb), "host_memory_gb": "0"})
    client.expire(keys.node_info(node), keys.NODE_INFO_TTL_S)


def _counts(client: "redis.Redis[str]", model: str, per_minute: dict[int, int]) -> None:
    current = int(time.time() // 60) * 60
    for ago, n in per_minute.items():
        client.set(keys.requests(model, 60, current - 60 * ago), n)
    client.sadd(keys.REQUEST_MODELS, model)


def _round(fleet: dict[str, Any]) -> dict[str, Any]:
    client = fleet["client"]
    client.delete(keys.FLEET_PLAN)
    fleet["app"].send_task(FORECAST)
    raw = wait_for(lambda: client.get(keys.FLEET_PLAN), 60,
                   lambda: f"a fleet plan (planner log:\n{fleet['proc'].log()[-3000:]})")
    return dict(json.loads(raw))


def test_forecast_and_plan_over_three_models_respects_the_fleet_budget(fleet: dict[str, Any]) -> None:
    """Room on the nodes for all three, budget for two: the two with traffic get GPU, nothing more is loaded."""
    client = fleet["client"]
    for node in ("n1", "n2"):
        _node(client, node, slots=2, gpu_gb=100.0)
    _counts(client, "a", {ago: 600 for ago in range(1, 120)})  # dense: every minute
    _counts(client, "b", {ago: 30 for ago in range(1, 120) if ago % 2})  # every other minute
    _counts(client, "c", {110: 1})  # one request, long ago
    plan = _round(fleet)
    assert plan["gpu_gb"] <= 80.0 and plan["budget_gb"] == 80.0
    on_gpu = {m for m, v in plan["models"].items() if v["tier"] == "gpu"}
    assert "a" in on_gpu and "c" not in on_gpu and sum(MEM[m] for m in on_gpu) <= 80.0, json.dumps(plan["models"])
    prewarms = [t for n in ("n1", "n2") for t in queued_tasks(client, node_queue(n)) if t["task"] == PREWARM]
    loaded = [t["args"][0].split("@")[0] for t in prewarms]
    assert sorted(loaded) == sorted(on_gpu) and sum(MEM[m] for m in loaded) <= 80.0
    assert client.hget(keys.last_forecast("c"), "status") == "fleet: cold"


def test_eviction_under_pressure_never_drops_a_replica_with_requests_in_flight(fleet: dict[str, Any]) -> None:
    """Budget for two, three live: the idle one is retired, the one serving requests right now is kept."""
    client, reg = fleet["client"], fleet["registry"]
    _node(client, "n1", slots=4, gpu_gb=200.0)
    now = time.time()
    ids = {}
    for slot, model in enumerate(("a", "b", "c")):
        rep = Replica(model, "r1", "n1", slot, state=ReplicaState.PENDING, created_at=now - 300)
        reg.register(rep, now=now - 300)
        for state in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
            reg.transition(rep.id, state, now=time.time())
        ids[model] = rep.id
    _counts(client, "a", {ago: 600 for ago in range(1, 120)})
    _counts(client, "b", {ago: 5 for ago in range(60, 120)})  # busy an hour ago, idle since
    _counts(client, "c", {1: 3, 100: 1})  # almost nothing, but requests in the last minute: in flight
    plan = _round(fleet)
    retired = {t["args"][0] for t in queued_tasks(client, node_queue("n1")) if t["task"] in (RETIRE, SLEEP, EVICT)}
    assert ids["c"] not in retired and plan["models"]["c"]["tier"] == "gpu"
    assert ids["a"] not in retired
    assert ids["b"] in retired and plan["models"]["b"]["tier"] != "gpu"
