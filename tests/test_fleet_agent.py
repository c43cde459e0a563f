"""Several models on one agent under a GPU-memory budget: a real agent, real runtimes, real Redis.

The agent has room (`agent.gpu_memory_gb`) for two of three tiny models: two prewarms
reach ready, the third is refused for memory (not for slots: there are four), its node
view reports the memory held and each model's tier, and once one replica is retired the
third fits. A replica put to sleep (level 1) frees its GPU memory, leaves the routing view,
and a request through the real gateway wakes it: the gateway holds the request, the
planner worker turns the unmet demand into `wake_replica`, and the request is answered.
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
from workers.names import PREWARM, RETIRE, SLEEP
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
                     PREWARM_METRICS_PORT="0", PREWARM_PLANNER_MODELS='["a@r1","b@r1","c@r1"]',
                     PREWARM_GATEWAY_HOLD_TIMEOUT_S="60")
    proc = WorkerProcess(["agent", "--node", NODE], env, tmp_path / "agent.log").start()
    settings = settings_from_env(env)
    app = make_app(settings)
    try:
        yield {"client": client, "proc": proc, "app": app, "size": size, "budget": budget, "env": env, "tmp": tmp_path,
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
    def ready(rid: str) -> bool:
        return _state(reg, rid) == "ready"

    for rid in (ra, rb):
        wait_for(lambda: ready(rid), 120, lambda: f"{rid} ready ({proc.log()[-2000:]})")
    app.send_task(PREWARM, args=[rc, "serving", None])
    wait_for(lambda: "GB of GPU memory" in proc.log(), 60, lambda: f"c refused for memory ({proc.log()[-2000:]})")
    assert _state(reg, rc) != "ready"
    def view() -> dict[str, str] | None:
        got: dict[str, str] = client.hgetall(keys.node_info(NODE))
        return got if "b" in got.get("residency", "") else None

    info = wait_for(view, 30, "the node view")
    assert info is not None
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


def test_a_sleeping_replica_is_woken_by_a_request_through_the_gateway(agent: dict[str, Any]) -> None:
    import urllib.request

    from prewarm.registry.embedded import free_port

    app, reg, client, proc = agent["app"], agent["registry"], agent["client"], agent["proc"]
    ra = f"a@r1/{NODE}/0"
    app.send_task(PREWARM, args=[ra, "serving", None])
    wait_for(lambda: _state(reg, ra) == "ready", 120, lambda: f"a ready ({proc.log()[-2000:]})")
    app.send_task(SLEEP, args=[ra])
    wait_for(lambda: _state(reg, ra) == "asleep", 60, lambda: f"a asleep ({proc.log()[-2000:]})")
    wait_for(lambda: json.loads(client.hget(keys.node_info(NODE), "residency") or "{}").get("a") == "asleep", 30,
             "the node view to say a is asleep")
    assert reg.view("a", now=time.time()).serving == ()  # not routable while asleep
    planner = WorkerProcess(["planner", "--metrics-port", "0"], agent["env"], agent["tmp"] / "planner.log").start()
    wait_for(lambda: dict(client.pubsub_numsub(keys.DEMAND_CHANNEL)).get(keys.DEMAND_CHANNEL, 0) >= 1, 30,
             "the planner's demand listener to subscribe")
    port = free_port()
    gw = WorkerProcess(["gateway", "--port", str(port)], agent["env"], agent["tmp"] / "gateway.log")
    gw.start(ready_marker="listening on", timeout=30)
    try:
        body = json.dumps({"model": "a", "prompt": "hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=90) as resp:  # held by the gateway while a wakes
            status, answer = resp.status, json.loads(resp.read())
        waited = time.monotonic() - t0
    finally:
        gw.stop()
        planner.stop()
    assert status == 200 and answer["choices"], answer
    assert _state(reg, ra) == "ready"
    moves = [(f.get("from"), f.get("to")) for _, f in reg.events() if f.get("replica") == ra]
    assert ("ready", "asleep") in moves and ("asleep", "ready") in moves
    assert client.llen(keys.wake_times("a")) >= 1  # the measured wake time: the catalog's asleep tier
    assert waited < 90
