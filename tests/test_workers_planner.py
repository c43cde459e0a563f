"""The planner worker and the beat as real processes: scale from zero, reaping, exactly one beat.

A real `prewarm planner` consumes `prewarm.planner` and `prewarm.demand` from the test Redis. Node views are
written the way an agent publishes them (`keys.node_info`), and the prewarm the planner
decides is read back from the node's queue in the broker, where that node's agent would
consume it. Demand is recorded with the gateway's own function.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from prewarm.core import keys
from prewarm.registry.counters import record_demand
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import RedisSettings, RegistrySettings, Settings
from tests.celery_helpers import WorkerProcess, publish_node, queued_tasks, steady_counters, wait_for, worker_env
from prewarm.core.domain import ScaleEvent, ScaleEventKind
from workers.app import make_app
from workers.names import DISPATCH_EVENTS, FORECAST, KEEP_WARM, PREWARM, REAP, RETIRE, node_queue
from workers.context import WorkerContext
from workers.planning.executor import submit_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def planner(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    redis_server.start()  # a no-op unless a test stopped it
    tmp = tmp_path_factory.mktemp("planner")
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    port = free_port()
    env = worker_env(redis_server.url, tmp, PREWARM_PLANNER_MODELS='["tiny@r1"]',
                     PREWARM_REGISTRY_REAPER_INTERVAL_S="1",
                     PREWARM_PLANNER_MARGIN_INITIAL="1.5")  # the budget's margin starts at the staffing beta here
    proc = WorkerProcess(["planner", "--metrics-port", str(port)], env, tmp / "planner.log").start()
    settings = Settings(redis=RedisSettings(url=redis_server.url))
    app = make_app(settings)
    try:
        yield {"client": client, "proc": proc, "app": app, "env": env, "tmp": tmp, "metrics_port": port,
               "registry": ReplicaRegistry(client, RegistrySettings())}
    finally:
        proc.stop()
        app.close()
        client.close()


@pytest.fixture(autouse=True)
def _no_reservations_left(planner: dict[str, Any]) -> None:
    """No agent runs here to register (and so release) the slots an earlier test's prewarms reserved: each test
    starts with its nodes' slots free of them, as they would be once those replicas registered."""
    client = planner["client"]
    for key in client.scan_iter(match=keys.slot_claim("*", 0).rsplit(":", 1)[0]):  # every node's, every slot's
        client.delete(key)


def _record_demand(url: str, model: str) -> None:
    async def go() -> None:
        c = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            await record_demand(c, model, time.time())
        finally:
            await c.aclose()

    asyncio.run(go())


def test_unmet_demand_scales_from_zero_once(planner: dict[str, Any], redis_server: EmbeddedRedis) -> None:
    client = planner["client"]
    publish_node(client, "n8", 1)
    now = time.time()
    planner["registry"].register(Replica("other", "r1", "n8", 0, state=ReplicaState.PENDING, created_at=now), now=now)
    publish_node(client, "n9", 2)  # the node with the most free slots
    _record_demand(redis_server.url, "tiny")
    queue = node_queue("n9")
    wait_for(lambda: queued_tasks(client, queue), 20, lambda: f"a prewarm on {queue} (planner log:\n{planner['proc'].log()})")
    for _ in range(3):  # the gateway keeps announcing while nothing is ready: still one prewarm
        _record_demand(redis_server.url, "tiny")
    time.sleep(1.5)
    assert [{k: m[k] for k in ("task", "args")} for m in queued_tasks(client, queue)] == [
        {"task": PREWARM, "args": ["tiny@r1/n9/0", "serving", None]}]
    assert queued_tasks(client, node_queue("n8")) == []


def test_demand_for_an_unknown_model_prewarms_nothing(planner: dict[str, Any], redis_server: EmbeddedRedis) -> None:
    _record_demand(redis_server.url, "mystery")
    wait_for(lambda: "no revision is known" in planner["proc"].log(), 20, "the planner to report the unknown model")
    assert not any(m["args"][0].startswith("mystery@") for q in ("n8", "n9")
                   for m in queued_tasks(planner["client"], node_queue(q)))


def test_reap_fails_replicas_whose_heartbeat_expired(planner: dict[str, Any]) -> None:
    reg: ReplicaRegistry = planner["registry"]
    long_ago = time.time() - 600
    reg.register(Replica("tiny", "r1", "gone", 0, state=ReplicaState.PENDING, created_at=long_ago), now=long_ago)

    def reaped() -> bool:  # one reap per second, as the beat sends them: the registry has just been flushed,
        planner["app"].send_task(REAP)  # so the reaper first waits a heartbeat TTL of continuous activity
        return (reg.get("tiny@r1/gone/0") or Replica("x", "r", "n", 0)).state is ReplicaState.FAILED

    wait_for(reaped, 20, "the reaper to fail the silent replica", poll=1.0)
    assert reg.get("tiny@r1/gone/0").reason == "heartbeat expired"  # type: ignore[union-attr]
    with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'prewarm_replicas{model="tiny",pool="serving",state="failed"} 1.0' in text


def test_exactly_one_beat_runs(planner: dict[str, Any]) -> None:
    client, tmp, env = planner["client"], planner["tmp"], planner["env"]
    first = WorkerProcess(["beat", "--schedule-file", str(tmp / "beat1")], env, tmp / "beat1.log")
    second = WorkerProcess(["beat", "--schedule-file", str(tmp / "beat2")], env, tmp / "beat2.log")
    first.start(ready_marker="beat lock acquired", timeout=30)
    try:
        second.start(ready_marker="waiting as a standby", timeout=30)
        # the active beat's reap entry reaches the planner worker (reaper interval 1 s)
        wait_for(lambda: "prewarm.reap[" in planner["proc"].log() and "Sending due task reap-expired-replicas"
                 in first.log(), 30, "the beat to schedule the reaper")
        assert "Sending due task" not in second.log()
        first.stop()
        second_owner = wait_for(lambda: "beat lock acquired" in second.log(), 60, "the standby to take over")
        assert second_owner
        assert client.get(keys.BEAT_LOCK) is not None
    finally:
        first.stop()
        second.stop()
    assert client.get(keys.BEAT_LOCK) is None  # released on shutdown


def _ready_replica(reg: ReplicaRegistry, model: str, node: str, slot: int, created_at: float) -> str:
    rep = Replica(model, "r1", node, slot, state=ReplicaState.PENDING, created_at=created_at)
    reg.register(rep, now=created_at)
    for state in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        reg.transition(rep.id, state, now=time.time())
    return rep.id


def test_scale_events_are_applied_once_when_due(planner: dict[str, Any], redis_server: EmbeddedRedis) -> None:
    client, app = planner["client"], planner["app"]
    ctx = WorkerContext.build(Settings(redis=RedisSettings(url=redis_server.url)))
    reg: ReplicaRegistry = planner["registry"]
    publish_node(client, "n7", 3)
    publish_node(client, "n6", 2)
    now = time.time()
    older = _ready_replica(reg, "big", "n6", 0, now - 100)
    newer = _ready_replica(reg, "big", "n6", 1, now - 10)
    up = ScaleEvent("up-1", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=2, nodes=("n7", "n7"))
    down = ScaleEvent("down-1", ScaleEventKind.SCALE_DOWN, "big", "r1", at=now - 1, replicas=1)
    hold = ScaleEvent("hold-1", ScaleEventKind.HOLD, "big", "r1", at=now - 1, replicas=1)
    later = ScaleEvent("up-later", ScaleEventKind.SCALE_UP, "m", "r1", at=now + 3600, replicas=1)
    assert submit_events(ctx, [up, down, hold, later]) == ["up-1", "down-1", "hold-1", "up-later"]
    assert submit_events(ctx, [up]) == []  # a re-plan of the same decision is not queued again

    app.send_task(DISPATCH_EVENTS)
    wait_for(lambda: client.hget(keys.planned_event("hold-1"), "status") == "applied"
             and client.hget(keys.planned_event("up-1"), "status") == "applied"
             and client.hget(keys.planned_event("down-1"), "status") == "applied", 20,
             lambda: f"the due events to be applied (planner log:\n{planner['proc'].log()[-3000:]})")
    assert sorted(queued_tasks(client, node_queue("n7")), key=lambda m: m["args"][0]) == [
        {"task": PREWARM, "args": ["m@r1/n7/0", "serving", None], "id": f"up-1/{PREWARM}/m@r1/n7/0"},
        {"task": PREWARM, "args": ["m@r1/n7/1", "serving", None], "id": f"up-1/{PREWARM}/m@r1/n7/1"},
    ]
    on_n6 = queued_tasks(client, node_queue("n6"))
    assert sorted(m["task"] for m in on_n6) == sorted([RETIRE, KEEP_WARM])
    retire = next(m for m in on_n6 if m["task"] == RETIRE)
    assert retire["args"][0] == newer  # scale down removes the newest replica
    keep = next(m for m in on_n6 if m["task"] == KEEP_WARM)
    # HOLD keeps the oldest warm: never the replica the scale-down of the same decision retires
    assert keep["args"][0] == older and keep["args"][1] > now
    assert older not in {m["args"][0] for m in on_n6 if m["task"] == RETIRE}
    assert client.hget(keys.planned_event("up-later"), "status") == "planned"

    app.send_task(DISPATCH_EVENTS)  # nothing is due twice
    time.sleep(1.5)
    assert len(queued_tasks(client, node_queue("n7"))) == 2
    ctx.client.close()


def test_forecast_and_plan_turns_gateway_counters_into_scale_events(planner: dict[str, Any]) -> None:
    """An hour of 10 req/s with 24 in flight at peak, nothing live: the plan scales tiny up now and says so."""
    client = planner["client"]
    steady_counters(client, "tiny")
    planner["app"].send_task(FORECAST)
    wait_for(lambda: client.hget(keys.last_forecast("tiny"), "status") is not None, 60,
             lambda: f"a forecast for tiny (planner log:\n{planner['proc'].log()[-3000:]})")
    record = client.hgetall(keys.last_forecast("tiny"))
    assert record["status"] == "planned", record
    assert record["mode"] == "predictive", record  # a flat load is forecast perfectly
    assert float(record["forecast_error"]) == 0.0
    # 20 in flight + 1.5 sqrt(20) = 26.7 slots of 8 per replica
    assert int(record["target"]) == 4, record
    events = [json.loads(client.hget(keys.planned_event(e), "event") or "{}") for e in
              client.zrange(keys.PLANNED_EVENTS, 0, -1)]
    ups = [e for e in events if e.get("model") == "tiny" and e.get("kind") == "scale_up" and e["pool"] == "serving"]
    assert ups and sum(e["replicas"] for e in ups) == 4, events
    with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'prewarm_forecast_requests{model="tiny",quantile="0.9"}' in text
    assert 'prewarm_forecast_timestamp_seconds{model="tiny"}' in text
    assert 'prewarm_planner_mode{mode="predictive",model="tiny"} 1.0' in text


def test_planner_log_has_no_tracebacks(planner: dict[str, Any]) -> None:
    assert "Traceback" not in planner["proc"].log(), planner["proc"].log()[-3000:]



def test_a_demand_flood_queues_one_task_per_model_and_the_periodic_tasks_go_first(
        planner: dict[str, Any], redis_server: EmbeddedRedis) -> None:
    """Issue 20, major 5: 3,000 requests for a model with nothing ready queued 1,723 `handle_demand`
    tasks on the planner queue, and `reap`/`forecast_and_plan` waited behind them. Now one task per
    model at most is pending, on its own queue, and a reap sent after the flood is not held up."""
    client, proc = planner["client"], planner["proc"]
    flood = 2000

    async def announce() -> None:
        c = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            for _ in range(flood):
                await record_demand(c, "flooded", time.time())
        finally:
            await c.aclose()

    def demand_tasks() -> int:
        return proc.log().count("Task prewarm.handle_demand[") // 2 + sum(  # received + succeeded lines
            1 for q in ("prewarm.planner", "prewarm.demand") for m in queued_tasks(client, q)
            if m["task"] == "prewarm.handle_demand")

    before = proc.log().count("Task prewarm.handle_demand[")
    asyncio.run(announce())
    reap = planner["app"].send_task(REAP)
    wait_for(lambda: f"prewarm.reap[{reap.id}] succeeded" in proc.log(), 60, lambda: f"the reap\n{proc.log()[-3000:]}")
    at_reap = proc.log().count("Task prewarm.handle_demand[") - before
    assert at_reap <= 2 * 3, f"{at_reap // 2} demand tasks ran before the reap"
    _record_demand(redis_server.url, "sentinel")  # announced after the flood: heard after all of it
    wait_for(lambda: "unmet demand for sentinel" in proc.log(), 30, "the sentinel's demand task")
    sent = (proc.log().count("Task prewarm.handle_demand[") - before) // 2
    assert sent <= 10, f"{flood} announcements became {sent} demand tasks"
    assert client.ttl(keys.demand_pending("flooded")) <= keys.DEMAND_COALESCE_S


def test_a_demand_claim_left_for_a_failed_replica_does_not_block_a_new_prewarm(
        planner: dict[str, Any], redis_server: EmbeddedRedis) -> None:
    """Issue 20, major 6: a per-model demand claim set for an earlier wake blocked a new one for 30 s,
    though the replica it was taken for had failed. A claim whose replica failed is replaced."""
    client, reg = planner["client"], planner["registry"]
    publish_node(client, "n7", 3)
    now = time.time()
    dead = Replica("tiny", "r1", "n7", 2, state=ReplicaState.PENDING, created_at=now)
    reg.register(dead, now=now)
    reg.transition(dead.id, ReplicaState.FAILED, now=now, reason="wake: /wake_up failed")
    client.delete(keys.demand_claim("tiny"))
    client.set(keys.demand_claim("tiny"), dead.id, ex=30)  # what the failed wake's demand left
    _record_demand(redis_server.url, "tiny")
    wait_for(lambda: "scale from zero: unmet demand for tiny -> prewarm tiny@r1/n7/" in planner["proc"].log(), 20,
             lambda: f"a prewarm despite the stale claim\n{planner['proc'].log()[-2000:]}")
    assert f"demand claim for tiny was for {dead.id}, which is failed" in planner["proc"].log()
    assert any(m["task"] == PREWARM and m["args"][0].startswith("tiny@r1/n7/")
               for m in queued_tasks(client, node_queue("n7")))
