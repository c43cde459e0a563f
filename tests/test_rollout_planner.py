"""Rollouts carried out by a real planner worker (Celery, Redis): capacity first, then the shift; rollback.

A real `prewarm planner` consumes `prewarm.planner` from the test Redis. The test plays the
node agents' part the way `tests/test_workers_planner.py` does: the prewarms the planner
sends are read back from the node queues, and the replicas they name are moved through the
registry's states as an agent would move them (the agent's own bring-up is tested elsewhere).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, Iterator, Sequence

import pytest
import redis

from prewarm.cli import main
from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, Replica, ReplicaState
from prewarm.core.settings import RedisSettings, RegistrySettings, Settings
from prewarm.policy.rollout import share
from prewarm.registry.embedded import EmbeddedRedis, free_port
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.rollouts import RolloutStore
from tests.celery_helpers import WorkerProcess, publish_node, queued_tasks, steady_counters, wait_for, worker_env
from workers.app import make_app
from workers.names import DISPATCH_EVENTS, FORECAST, PREWARM, RETIRE, node_queue

pytestmark = pytest.mark.slow


@pytest.fixture()
def planner(redis_server: EmbeddedRedis, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    redis_server.start()
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    port = free_port()
    env = worker_env(redis_server.url, tmp_path, PREWARM_PLANNER_MODELS='["tiny@r1"]')
    for k in [k for k in __import__("os").environ if k.startswith("PREWARM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PREWARM_REDIS_URL", redis_server.url)  # for `prewarm rollout` run in this process
    proc = WorkerProcess(["planner", "--metrics-port", str(port)], env, tmp_path / "planner.log").start()
    app = make_app(Settings(redis=RedisSettings(url=redis_server.url)))
    try:
        yield {"client": client, "proc": proc, "app": app, "metrics_port": port,
               "registry": ReplicaRegistry(client, RegistrySettings())}
    finally:
        proc.stop()
        app.close()
        client.close()


def agent_brings_up(reg: ReplicaRegistry, rid: str, *, fail: str | None = None) -> None:
    """What the node agent does with a prewarm: pending -> loading -> warming -> ready (or failed)."""
    model, rest = rid.split("@", 1)
    rev, node, slot = rest.split("/")
    now = time.time()
    reg.register(Replica(model, rev, node, int(slot), endpoint=f"http://127.0.0.1:{9000 + int(slot)}",
                         state=ReplicaState.PENDING, created_at=now), now=now)
    reg.transition(rid, ReplicaState.LOADING, now=now)
    if fail:
        reg.transition(rid, ReplicaState.FAILED, now=time.time(), reason=fail)
        return
    for st in (ReplicaState.WARMING, ReplicaState.READY):
        reg.transition(rid, st, now=time.time())


def agents_retire(reg: ReplicaRegistry, rev: str) -> None:
    """What the node agents do with the retires: every live replica of `rev` drains, then is retired."""
    for r in reg.replicas_of("tiny"):
        if r.revision == rev and r.state in LIVE_STATES:
            if r.state is not ReplicaState.DRAINING:
                reg.transition(r.id, ReplicaState.DRAINING, now=time.time())
            reg.transition(r.id, ReplicaState.RETIRED, now=time.time())


def demand(client: "redis.Redis[str]") -> int:
    """The planner's recorded target for tiny (serving + warm pool): what the rollout splits by weight."""
    rec = client.hmget(keys.last_forecast("tiny"), ["serving_target", "pool_target"])
    return int(rec[0] or 0) + int(rec[1] or 0)


def steady_load(client: "redis.Redis[str]") -> None:
    """An hour of steady load, 20 in flight on average: a target above the 4 stable replicas' slots."""
    steady_counters(client, "tiny", ahead=30)


def setup_stable(p: dict[str, Any]) -> None:
    client, reg = p["client"], p["registry"]
    publish_node(client, "n1", 4)
    publish_node(client, "n2", 8)  # room for the whole target on the canary's node
    for slot in range(4):
        agent_brings_up(reg, f"tiny@r1/n1/{slot}")
    client.hset(keys.node_info("n2"), "residency", json.dumps({"tiny@r2": "disk"}))
    client.sadd(keys.NODES, "n2")
    steady_load(client)


def plan_tick(p: dict[str, Any], done: int) -> None:
    """One forecast_and_plan (the beat's tick), then dispatch the due events; waits for the tick's result."""
    p["app"].send_task(FORECAST)
    wait_for(lambda: p["proc"].log().count("prewarm.forecast_and_plan[") >= 2 * done
             and p["proc"].log().count("succeeded") >= done, 60,
             lambda: f"forecast_and_plan #{done} (planner log:\n{p['proc'].log()[-3000:]})")
    p["app"].send_task(DISPATCH_EVENTS)


def prewarms(client: "redis.Redis[str]", rev: str) -> list[str]:
    return sorted({m["args"][0] for n in ("n1", "n2") for m in queued_tasks(client, node_queue(n))
                   if m["task"] == PREWARM and m["args"][0].startswith(f"tiny@{rev}/")})


def canary_prewarms(client: "redis.Redis[str]", weight: int, before: Sequence[str] = ()) -> list[str]:
    """The canary's prewarms (less those in `before`) once every one a step to `weight`% asks for is queued: the
    executor sends them one by one, and a read between two sends sees only some."""
    def full() -> list[str] | None:
        got = prewarms(client, "r2")
        return [r for r in got if r not in before] if got and len(got) >= share(demand(client), weight) else None
    return wait_for(full, 30, lambda: f"the canary's prewarms for {weight}% (queued: {prewarms(client, 'r2')}, "
                                      f"target {demand(client)})")


def test_the_shift_waits_for_validated_canary_capacity_then_the_stable_shrinks(planner: dict[str, Any]) -> None:
    client, reg = planner["client"], planner["registry"]
    setup_stable(planner)
    store = RolloutStore(client)
    assert main(["rollout", "start", "tiny", "--revision", "r2", "--steps", "50,100", "--pause", "1s"]) == 0
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]
    tick = 0
    tick += 1
    plan_tick(planner, tick)
    canary = canary_prewarms(client, 50)
    assert len(canary) == share(demand(client), 50)  # the canary's half of the planner's target
    st = store.get("tiny")
    assert st is not None and st.weight == 0  # no weight before the canary is ready, whatever the clock says
    tick += 1
    plan_tick(planner, tick)
    time.sleep(0.5)
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]
    for rid in canary:  # the agents warm and validate them
        agent_brings_up(reg, rid)
    tick += 1
    plan_tick(planner, tick)
    wait_for(lambda: store.weights("tiny") == [("r2", 50.0), ("r1", 50.0)], 30, "the shift to 50%")
    tick += 1
    plan_tick(planner, tick)  # the tick after the shift shrinks the stable revision to its half
    wait_for(lambda: any(m["task"] == RETIRE and m["args"][0].startswith("tiny@r1/")
                         for m in queued_tasks(client, node_queue("n1"))), 30, "the stable shrink")
    time.sleep(1.0)  # the step's pause
    tick += 1
    plan_tick(planner, tick)
    more = canary_prewarms(client, 100, canary)
    for rid in more:
        agent_brings_up(reg, rid)
    for _ in range(3):  # shift to 100%, then the pause runs, then complete
        tick += 1
        plan_tick(planner, tick)
        time.sleep(1.0)
    wait_for(lambda: (store.get("tiny") or st).phase.value == "completed", 30,
             lambda: f"completion (planner log:\n{planner['proc'].log()[-3000:]})")
    assert store.weights("tiny") == [("r2", 100.0)]
    with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'prewarm_rollout_weight{model="tiny",revision="r2"} 100.0' in text
    assert 'prewarm_rollout_weight{model="tiny",revision="r1"}' not in text  # not left at its last 50
    assert 'prewarm_rollout_phase{model="tiny",phase="completed"} 1.0' in text
    # the split holds while a stable replica is still live, then is cleared: a revision deployed later
    # without a rollout gets traffic (no weights = any ready revision)
    tick += 1
    plan_tick(planner, tick)
    assert store.weights("tiny") == [("r2", 100.0)]
    agents_retire(reg, "r1")
    tick += 1
    plan_tick(planner, tick)
    wait_for(lambda: store.weights("tiny") == [], 30, lambda: f"the split cleared (planner log:\n{planner['proc'].log()[-3000:]})")
    assert client.get(keys.revision_weights("tiny")) == "[]"
    with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
        assert "prewarm_rollout_weight{" not in resp.read().decode()  # settled: no split, no weight series
    assert "Traceback" not in planner["proc"].log()


def test_a_canary_that_fails_validation_rolls_back(planner: dict[str, Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    client, reg = planner["client"], planner["registry"]
    setup_stable(planner)
    store = RolloutStore(client)
    assert main(["rollout", "start", "tiny", "--revision", "r2", "--steps", "50,100", "--pause", "1s"]) == 0
    plan_tick(planner, 1)
    canary = canary_prewarms(client, 50)
    agent_brings_up(reg, canary[0], fail="validation: top logprobs differ from r1 by 4.2 > 0.05")
    agent_brings_up(reg, canary[1])  # ready, but must never get weight now
    plan_tick(planner, 2)
    st = wait_for(lambda: s if (s := store.get("tiny")) is not None and s.phase.value == "rolled_back" else None, 30,
                  lambda: f"the rollback (planner log:\n{planner['proc'].log()[-3000:]})")
    assert "logprobs differ" in st.reason
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]
    wait_for(lambda: [m["args"][0] for m in queued_tasks(client, node_queue("n2")) if m["task"] == RETIRE]
             == [canary[1]], 30, "the live canary replica retired")
    with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'prewarm_rollout_rollbacks_total{cause="validation",model="tiny"} 1.0' in text
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]  # the canary is still retiring
    agents_retire(reg, "r2")
    plan_tick(planner, 3)
    wait_for(lambda: store.weights("tiny") == [], 30, "the split cleared once the canary is retired")
    final = store.get("tiny")
    assert final is not None and final.phase.value == "rolled_back" and final.settled
    capsys.readouterr()
    assert main(["rollout", "status", "tiny"]) == 0
    assert "traffic: any ready revision (split cleared)" in capsys.readouterr().out
