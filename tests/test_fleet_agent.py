"""Several models on one agent under a GPU-memory budget: a real agent, real runtimes, real Redis.

The agent has room (`agent.gpu_memory_gb`) for two of three tiny models: two prewarms
reach ready, the third is refused for memory (not for slots: there are four), its node
view reports the memory held and each model's tier, and once one replica is retired the
third fits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from prewarm.core import keys
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.runtime.model import make_model
from tests.celery_helpers import WorkerProcess, settings_from_env, wait_for, worker_env
from workers.app import make_app
from workers.names import PREWARM, RETIRE
from workers.node.bringup import model_footprint_gb

pytestmark = pytest.mark.slow

NODE = "f1"


@pytest.fixture()
def agent(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[dict[str, Any]]:
    redis_server.start()
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    dirs = {m: make_model(tmp_path / "models" / m / "r1", "tiny", seed=i, name=m, revision="r1")
            for i, m in enumerate(("a", "b", "c"))}
    size = {m: model_footprint_gb(d) for m, d in dirs.items()}
    budget = size["a"] + size["b"] + 0.5 * size["c"]
    env = worker_env(redis_server.url, tmp_path, PREWARM_AGENT_NODE=NODE, PREWARM_AGENT_GPU_MEMORY_GB=repr(budget),
                     PREWARM_METRICS_PORT="0")
    proc = WorkerProcess(["agent", "--node", NODE], env, tmp_path / "agent.log").start()
    settings = settings_from_env(env)
    app = make_app(settings)
    try:
        yield {"client": client, "proc": proc, "app": app, "size": size, "budget": budget,
               "registry": ReplicaRegistry(client, settings.registry)}
    finally:
        proc.stop()
        app.close()
        client.close()


def _state(reg: ReplicaRegistry, rid: str) -> str | None:
    rec = reg.get(rid)
    return rec.state.value if rec else None


def test_two_models_on_one_agent_under_a_memory_budget(agent: dict[str, Any]) -> None:
    app, reg, client, proc = agent["app"], agent["registry"], agent["client"], agent["proc"]
    ra, rb, rc = f"a@r1/{NODE}/0", f"b@r1/{NODE}/1", f"c@r1/{NODE}/2"
    app.send_task(PREWARM, args=[ra, "serving", None])
    app.send_task(PREWARM, args=[rb, "serving", None])
    for rid in (ra, rb):
        wait_for(lambda rid=rid: _state(reg, rid) == "ready", 120, lambda: f"{rid} ready ({proc.log()[-2000:]})")
    app.send_task(PREWARM, args=[rc, "serving", None])
    wait_for(lambda: "GB of GPU memory" in proc.log(), 60, lambda: f"c refused for memory ({proc.log()[-2000:]})")
    assert _state(reg, rc) != "ready"
    info = wait_for(lambda: client.hgetall(keys.node_info(NODE)) if client.hget(keys.node_info(NODE), "residency")
                    and "b" in client.hget(keys.node_info(NODE), "residency") else None, 30, "the node view")
    residency = json.loads(info["residency"])
    assert residency.get("a") == "gpu" and residency.get("b") == "gpu" and residency.get("c") != "gpu"
    assert float(info["gpu_used_gb"]) == pytest.approx(agent["size"]["a"] + agent["size"]["b"], rel=1e-6)
    assert float(info["gpu_used_gb"]) <= agent["budget"]
    # evict a (nothing in flight): c now fits
    app.send_task(RETIRE, args=[ra, "fleet: evict"])
    wait_for(lambda: _state(reg, ra) == "retired", 60, lambda: f"a retired ({proc.log()[-2000:]})")
    time.sleep(0.5)
    app.send_task(PREWARM, args=[rc, "serving", None])
    wait_for(lambda: _state(reg, rc) == "ready", 120, lambda: f"c ready after the eviction ({proc.log()[-3000:]})")
