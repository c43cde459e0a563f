"""The node agent end to end: a real `prewarm agent` worker process, real Redis, real runtimes on CPU.

One agent (node n1) is started for the module; the tests run in order on distinct replica
ids and slots, and the last one SIGKILLs the agent mid-load and starts a new one. Nothing
is mocked: tasks travel through the Redis broker as JSON, the agent spawns `serve-model`
processes that load a tiny random-weight model with torch, and the assertions read the
registry, the agent's /metrics and the runtimes' HTTP answers.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from celery import Celery

from prewarm.core import keys
from prewarm.core.domain import Pool, Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port
from prewarm.runtime.manifest import load_manifest
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import Settings
from tests.celery_helpers import WorkerProcess, runtime_pids, settings_from_env, wait_for, worker_env
from workers.app import make_app
from workers.names import KEEP_WARM, PREWARM, RECYCLE, RETIRE, node_queue

pytestmark = pytest.mark.slow

NODE = "n1"


@dataclass
class World:
    tmp: Path
    env: dict[str, str]
    agent: WorkerProcess
    app: Celery
    client: "redis.Redis[str]"
    registry: ReplicaRegistry
    settings: Settings
    metrics_port: int
    tiny_dir: Path

    def state(self, rid: str) -> str | None:
        rec = self.registry.get(rid)
        return rec.state.value if rec else None

    def wait_state(self, rid: str, *states: str, timeout: float = 90.0) -> Replica:
        wait_for(lambda: self.state(rid) in states, timeout, lambda: f"{rid} to reach {states} (agent log:\n"
                 f"{self.agent.log()[-3000:]})")
        rec = self.registry.get(rid)
        assert rec is not None
        return rec

    def transitions(self, rid: str) -> list[tuple[str, str]]:
        return [(f.get("from", ""), f.get("to", "")) for _, f in self.registry.events() if f.get("replica") == rid]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def deliveries(self, task_id: str, retries: int = 0) -> int:
        return int(self.client.get(keys.task_deliveries(task_id, retries)) or 0)

    def attempts(self, task_id: str) -> int:
        """Executions of a task message: its deliveries summed over its retries."""
        return sum(self.deliveries(task_id, r) for r in range(10))

    def assert_failure_not_retried(self, task_id: str, rid: str, reason: str) -> None:
        """The permanent failure ended the task: no delivery after it, one failure line."""
        before = self.attempts(task_id)
        time.sleep(1.5)  # a retry would come after a backoff of 0.5 s
        assert self.attempts(task_id) == before, f"{rid}: the permanent failure ({reason}) was retried"
        assert self.agent.log().count(f"replica={rid} model=") and \
            self.agent.log().count(f"state=failed reason={reason}") >= 1
        assert sum(1 for line in self.agent.log().splitlines()
                   if f"replica={rid} " in line and "state=failed" in line) == 1


@pytest.fixture(scope="module")
def world(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from prewarm.runtime.model import make_model

    redis_server.start()  # a no-op unless a test stopped it
    tmp = tmp_path_factory.mktemp("agent")
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    tiny = make_model(tmp / "models" / "tiny" / "r1", "tiny", seed=0, name="tiny", revision="r1")
    metrics_port = free_port()
    env = worker_env(redis_server.url, tmp, PREWARM_AGENT_NODE=NODE, PREWARM_METRICS_PORT=str(metrics_port))
    agent = WorkerProcess(["agent", "--node", NODE], env, tmp / "agent.log").start()
    settings = settings_from_env(env)
    app = make_app(settings)
    w = World(tmp, env, agent, app, client, ReplicaRegistry(client, settings.registry), settings, metrics_port,
              Path(tiny))
    try:
        yield w
    finally:
        w.agent.stop()
        app.close()
        for slot in range(settings.agent.replica_slots):
            assert runtime_pids(settings.agent.port_base + slot) == [], "the agent left a runtime running"
            assert runtime_pids(settings.agent.port_base + slot, guards=True) == [], "the agent left a guard"
        client.close()


def _get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_prewarm_reaches_ready_and_answers(world: World) -> None:
    rid = f"tiny@r1/{NODE}/0"
    world.client.set(keys.slot_claim(NODE, 0), rid, ex=600)  # the planner's reservation of its slot
    world.app.send_task(PREWARM, args=[rid, "serving", None])  # model dir resolved from runtime.models_dir
    rec = world.wait_state(rid, "ready", "failed")
    assert rec.state is ReplicaState.READY, rec.reason
    # the prewarm ended and released the reservation: the registry holds the slot
    wait_for(lambda: world.client.get(keys.slot_claim(NODE, 0)) is None, 10, "the slot's reservation to end")
    assert rec.progress == 1.0 and rec.phase.value == "done"
    assert world.transitions(rid) == [("", "pending"), ("pending", "loading"), ("loading", "warming"),
                                      ("warming", "ready")]
    assert [r.id for r in world.registry.ready("tiny", Pool.SERVING, now=time.time())] == [rid]

    status, body = _get(f"{rec.endpoint}/readyz")
    assert status == 200 and body["ready"] is True
    status, body = _post(f"{rec.endpoint}/v1/completions", {"prompt": "hello there", "max_tokens": 3})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3

    # the first validated replica of the model on this node class recorded a sample towards the latency
    # baseline (the median of the first `warmup.baseline_samples`)
    node_class = world.settings.agent.node_class
    assert world.client.llen(keys.baseline_samples("tiny", node_class, "r1")) >= 1 or \
        world.registry.baseline("tiny", node_class, "r1") is not None
    assert world.registry.load_time_p95("tiny") is not None
    text = world.metrics()
    for phase in ("embeddings", "first_layers", "rest"):
        assert f'model_loading_phase_duration_seconds_count{{model="tiny",node="{NODE}",phase="{phase}"}} 1.0' in text
    assert f'model_cold_start_seconds_count{{model="tiny",node="{NODE}"}} 1.0' in text
    assert 'prewarm_validation_results_total{check="structural",model="tiny",result="passed"} 1.0' in text
    assert f"[COLDSTART] replica={rid}" in world.agent.log()
    # the node view the planner places by: live, its slots, and the model's node-local snapshot
    info = wait_for(lambda: (lambda i: i if "tiny@r1" in i.get("snapshots", "") else None)(
        world.client.hgetall(keys.node_info(NODE))), 10, "the node view to list the tiny snapshot")
    assert info["ready"] == "1" and info["replica_slots"] == str(world.settings.agent.replica_slots)


def test_through_the_gateway(world: World) -> None:
    """The ready replica answers through the real gateway, which routes by the registry."""
    port = free_port()
    gw = WorkerProcess(["gateway", "--port", str(port)], world.env, world.tmp / "gateway.log")
    gw.start(ready_marker="listening on", timeout=30)
    try:
        def answer() -> tuple[int, Any] | None:
            try:
                got = _post(f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            except urllib.error.URLError:
                return None  # not listening yet
            return got if got[0] == 200 else None

        status, body = wait_for(answer, 30, "the gateway to answer")
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        gw.stop()


def test_duplicate_prewarm_is_a_normal_return(world: World) -> None:
    rid = f"tiny@r1/{NODE}/0"
    before = world.transitions(rid)
    result = world.app.send_task(PREWARM, args=[rid])
    wait_for(lambda: f"{result.id}] succeeded" in world.agent.log(), 30, "the duplicate prewarm to finish")
    assert "already_ready" in world.agent.log()
    assert world.transitions(rid) == before  # no second registration, no second ready
    assert world.state(rid) == "ready"


def test_keep_warm_sends_signed_synthetic_requests(world: World) -> None:
    rid = f"tiny@r1/{NODE}/0"
    endpoint = world.registry.get(rid).endpoint  # type: ignore[union-attr]
    world.app.send_task(KEEP_WARM, args=[rid, time.time() + 3])
    wait_for(lambda: 'warmup_requests_total{model="tiny",purpose="keepalive"}' in world.metrics(), 20,
             "keepalive requests to be counted")

    def keepalive_count() -> float:
        for line in world.metrics().splitlines():
            if line.startswith('warmup_requests_total{model="tiny",purpose="keepalive"}'):
                return float(line.split()[-1])
        return 0.0

    first = keepalive_count()
    wait_for(lambda: keepalive_count() > first, 10, "the keeper thread to send periodic requests")
    # the runtime counted them as warmup traffic (valid signatures), not as user traffic
    status, stats = _get(f"{endpoint}/stats")
    assert status == 200 and stats.get("warmup", 0) >= first, stats
    assert stats.get("forged_warmup") == 0, stats
    assert world.client.get(keys.keep_warm(rid)) is not None


def test_fragmentation_is_measured_and_a_healthy_replica_is_kept(world: World) -> None:
    """On CPU the allocator reports no fragmentation: measured, exported, and the replica stays ready.

    (Recycling itself is retire + the normal prewarm, each tested here; a fragmented CUDA
    allocator cannot be produced on this CPU-only machine.)
    """
    rid = f"tiny@r1/{NODE}/0"
    task = world.app.send_task(RECYCLE, args=[rid])
    wait_for(lambda: f"{task.id}] succeeded" in world.agent.log(), 30, "the fragmentation check to finish")
    assert "'fragmentation': 0.0, 'recycled': False" in world.agent.log()
    assert f'gpu_fragmentation_rate{{node="{NODE}"}} 0.0' in world.metrics()
    assert world.state(rid) == "ready"
    # past the 3 s heartbeat TTL since it became ready, only the agent's heartbeats keep it routable
    ready_at = world.registry.get(rid).updated_at  # type: ignore[union-attr]
    time.sleep(max(0.0, ready_at + 3.5 - time.time()))
    assert [r.id for r in world.registry.ready("tiny", Pool.SERVING, now=time.time())] == [rid]


def test_malformed_payloads_are_refused_and_not_retried(world: World) -> None:
    q = node_queue(NODE)
    cases = [
        ((), {}, "missing required argument(s) replica_id"),
        (("not-a-replica-id",), {}, "replica_id must look like model@revision/node/slot"),
        ((), {"replica_id": f"tiny@r1/{NODE}/0", "pool": "bogus"}, "pool must be one of"),
        ((f"tiny@r1/{NODE}/0",), {"colour": "red"}, "unknown argument 'colour'"),
        ((f"tiny@r1/{NODE}/0", "serving", 42), {}, "model_dir must be a non-empty path string"),
        (("tiny@r1/other-node/0",), {}, "belongs to node 'other-node'"),
    ]
    ids = [world.app.send_task(PREWARM, args=list(a), kwargs=k, queue=q).id for a, k, _ in cases]
    keep = world.app.send_task(KEEP_WARM, args=[f"tiny@r1/{NODE}/0", "soon"], queue=q).id

    def refused() -> dict[str, str]:
        return {r["id"]: r["error"] for r in map(json.loads, world.client.lrange(keys.REJECTED_TASKS, 0, -1))}

    wait_for(lambda: set(ids + [keep]) <= set(refused()), 30, "every malformed task to be refused")
    errors = refused()
    for task_id, (_, _, expected) in zip(ids, cases):
        assert expected in errors[task_id], errors[task_id]
    assert "until must be a finite number" in errors[keep]
    time.sleep(1.5)  # a retry would have a backoff of 0.5 s
    for task_id in ids + [keep]:
        assert world.deliveries(task_id, 0) <= 1
        assert world.client.get(keys.task_deliveries(task_id, 1)) is None, "a malformed payload was retried"
    assert world.registry.get("tiny@r1/other-node/0") is None  # the registry was not touched
    assert world.state(f"tiny@r1/{NODE}/0") == "ready"


def test_validation_failure_leaves_the_replica_failed_and_unroutable(world: World) -> None:
    rid = f"slow@r1/{NODE}/1"
    # an impossible baseline for this model on this node class: the performance check must fail
    world.client.hset(keys.baseline("slow", world.settings.agent.node_class, "r1"), "latency_s", "0.000001")
    task = world.app.send_task(PREWARM, args=[rid, "serving", str(world.tiny_dir)])
    rec = world.wait_state(rid, "failed", "ready")
    assert rec.state is ReplicaState.FAILED
    assert "validation_failed" in rec.reason and "performance" in rec.reason
    view = world.registry.view("slow", now=time.time())
    assert not view.serving and not view.warm and not view.loading
    assert ("warming", "failed") in world.transitions(rid)
    wait_for(lambda: 'model_loading_failures_total{model="slow",node="n1",reason="validation_failed"} 1.0' in world.metrics(), 5, 'the failure to be counted')  # marked failed, then counted
    assert 'prewarm_validation_results_total{check="performance",model="slow",result="failed"} 1.0' in world.metrics()
    wait_for(lambda: runtime_pids(world.settings.agent.port_base + 1) == [], 20, "the failed runtime to stop")
    world.assert_failure_not_retried(task.id, rid, "validation_failed")


def test_corrupt_weights_fail_without_retry(world: World) -> None:
    from prewarm.runtime.model import make_model

    rid = f"corrupt@r1/{NODE}/2"
    bad = Path(make_model(world.tmp / "corrupt", "tiny", seed=7, name="corrupt", revision="r1"))
    entry = max(load_manifest(bad).tensors, key=lambda t: t.length)
    with open(bad / "model.safetensors", "r+b") as fh:  # flip bytes inside the biggest tensor
        fh.seek(entry.offset + entry.length // 2)
        chunk = fh.read(16)
        fh.seek(entry.offset + entry.length // 2)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    task = world.app.send_task(PREWARM, args=[rid, "serving", str(bad)])
    rec = world.wait_state(rid, "failed", "ready")
    assert rec.state is ReplicaState.FAILED
    assert "bad_weights" in rec.reason and entry.name in rec.reason, rec.reason
    wait_for(lambda: 'model_loading_failures_total{model="corrupt",node="n1",reason="bad_weights"} 1.0' in world.metrics(), 5, 'the failure to be counted')  # marked failed, then counted
    world.assert_failure_not_retried(task.id, rid, "bad_weights")
    shutil.rmtree(bad)


def test_attempt_cap_gives_up_a_task_delivered_too_often(world: World) -> None:
    """A message its workers never finish (they die each time) is given up after agent.max_attempts deliveries."""
    rid = f"cap@r1/{NODE}/3"
    now = time.time()
    world.registry.register(Replica("cap", "r1", NODE, 3, state=ReplicaState.PENDING, created_at=now), now=now)
    task_id = "cap-test-task"
    # as if three earlier deliveries of this very message had each killed their worker
    world.client.set(keys.task_deliveries(task_id, 0), world.settings.agent.max_attempts)
    world.app.send_task(PREWARM, args=[rid, "serving", str(world.tiny_dir)], task_id=task_id)
    rec = world.wait_state(rid, "failed", timeout=30)
    assert "gave_up" in rec.reason
    assert runtime_pids(world.settings.agent.port_base + 3) == []  # the work itself never started


def test_retire_drains_and_stops_the_runtime(world: World) -> None:
    rid = f"tiny@r1/{NODE}/0"
    port = world.settings.agent.port_base + 0
    assert runtime_pids(port)
    world.app.send_task(RETIRE, args=[rid, "scale down"])
    rec = world.wait_state(rid, "retired", "failed", timeout=30)
    assert rec.state is ReplicaState.RETIRED and rec.reason == "scale down"
    assert world.transitions(rid)[-2:] == [("ready", "draining"), ("draining", "retired")]
    wait_for(lambda: runtime_pids(port) == [], 20, "the retired runtime to stop")
    assert world.client.get(keys.keep_warm(rid)) is None


def test_sigkill_mid_load_is_redelivered_and_ready_exactly_once(world: World) -> None:
    rid = f"tiny@r1/{NODE}/1"
    port = world.settings.agent.port_base + 1
    task = world.app.send_task(PREWARM, args=[rid])
    world.wait_state(rid, "loading", timeout=60)
    # killed as soon as the runtime is spawned: its record is written before the spawn (its pid after it), so
    # the successor finds it, by its port if the agent died before learning the pid, and adopts it
    wait_for(lambda: runtime_pids(port), 30, "the runtime process to be spawned")
    assert world.state(rid) == "loading"
    world.agent.kill()  # SIGKILL while loading: no ack, no cleanup

    # a replica the registry places on this node that no agent hosts: reconciliation must fail it
    ghost = f"ghost@r1/{NODE}/3"
    now = time.time()
    world.registry.register(Replica("ghost", "r1", NODE, 3, state=ReplicaState.PENDING, created_at=now), now=now)
    world.registry.transition(ghost, ReplicaState.LOADING, now=now)

    world.agent.start()
    ghost_rec = world.wait_state(ghost, "failed", timeout=30)
    assert "reconcile" in ghost_rec.reason

    rec = world.wait_state(rid, "ready", "failed", timeout=120)
    assert rec.state is ReplicaState.READY, rec.reason
    assert f"resuming the prewarm of adopted replica {rid}" in world.agent.log()
    # the crashed task's own message comes back after the visibility timeout and finds the work done
    wait_for(lambda: world.deliveries(task.id, 0) == 2, 60, "the killed task to be redelivered")
    wait_for(lambda: f"{task.id}] succeeded" in world.agent.log(), 30, "the redelivered task to finish")
    assert world.deliveries(task.id, 0) == 2, "the task was redelivered more than once"
    assert "'outcome': 'already_ready'" in world.agent.log().split(f"{task.id}] succeeded")[1].splitlines()[0]
    steps = world.transitions(rid)
    assert steps.count(("warming", "ready")) == 1, steps
    assert steps.count(("", "pending")) == 1, f"registered more than once: {steps}"
    assert world.client.smembers(keys.model_replicas("tiny")) >= {rid}
    live = {r.id for r in world.registry.live_on_node(NODE)}
    assert live == {rid}, f"stale live entries: {live - {rid}}"
    assert world.client.zscore(keys.HEARTBEATS, ghost) is None
    assert len(runtime_pids(port)) == 1, "an orphaned runtime is still running next to the adopted one"
    assert len(runtime_pids(port, guards=True)) == 1
    status, body = _post(f"{rec.endpoint}/v1/completions", {"prompt": "after the crash", "max_tokens": 2})
    assert status == 200, body
