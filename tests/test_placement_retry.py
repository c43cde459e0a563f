"""A load or a wake that does not fit on its node is placed on another node (the planner-side retry).

Real Redis, two real `prewarm agent`s (nodes n1 and n2, Celery workers hosting `serve-model`
runtimes of small models on CPU), each with a GPU-memory budget that holds one replica, and
a real `prewarm planner` consuming the planner queue. A node whose ledger refuses a load or a
wake (`InsufficientMemory`, naming what holds the memory) hands it to the planner
(`place_elsewhere`), which prewarms the model on the other node. Tests run in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import redis
from celery import Celery

from prewarm.core import keys
from prewarm.core.domain import ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.runtime.manifest import load_manifest
from tests.celery_helpers import WorkerProcess, _port_block, runtime_pids, settings_from_env, wait_for, worker_env
from workers.app import make_app
from workers.names import PREWARM, SLEEP, WAKE

pytestmark = pytest.mark.slow


@dataclass
class Pool2:
    app: Celery
    client: "redis.Redis[str]"
    registry: ReplicaRegistry
    procs: list[WorkerProcess] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"--- {' '.join(p.args[:2])}\n{p.log()[-2500:]}" for p in self.procs)

    def state(self, rid: str) -> str | None:
        rec = self.registry.get(rid)
        return rec.state.value if rec else None

    def wait_state(self, rid: str, *states: str, timeout: float = 120.0) -> None:
        wait_for(lambda: self.state(rid) in states, timeout, lambda: f"{rid} to reach {states}\n{self.logs()}")

    def live_of(self, model: str) -> dict[str, str]:
        return {r.id: r.state.value for r in self.registry.replicas_of(model) if r.state is not ReplicaState.FAILED}


def _model(root: Path, name: str, seed: int) -> Path:
    from prewarm.runtime.model import ModelConfig, make_model

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=256)
    return make_model(root / name / "r1", cfg, seed=seed, name=name, revision="r1")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool2]:
    tmp = tmp_path_factory.mktemp("placement")
    server = EmbeddedRedis().start()
    dirs = [_model(tmp / "models", m, seed) for seed, m in enumerate(("a", "b", "c"))]
    footprint = max(load_manifest(d).total_bytes for d in dirs) / 1e9
    common = {"PREWARM_AGENT_TASK_TIME_LIMIT_S": "60", "PREWARM_AGENT_VISIBILITY_TIMEOUT_S": "61",
              "PREWARM_PLANNER_MODELS": '["a@r1","b@r1","c@r1"]'}
    agents = []
    for node in ("n1", "n2"):
        env = worker_env(server.url, tmp, PREWARM_AGENT_NODE=node, PREWARM_METRICS_PORT=str(free_port()),
                         PREWARM_AGENT_PORT_BASE=str(_port_block()), PREWARM_AGENT_STATE_DIR=str(tmp / node),
                         PREWARM_RUNTIME_SNAPSHOT_DIR=str(tmp / node / "snapshots"),
                         PREWARM_AGENT_GPU_MEMORY_GB=repr(1.5 * footprint),  # one replica fits, two do not
                         PREWARM_AGENT_HOST_MEMORY_GB=repr(8 * footprint), **common)
        agents.append(WorkerProcess(["agent", "--node", node], env, tmp / f"agent-{node}.log"))
    planner = WorkerProcess(["planner", "--metrics-port", "0"], worker_env(server.url, tmp, **common),
                            tmp / "planner.log")
    client: "redis.Redis[str]" = redis.Redis.from_url(server.url, decode_responses=True)
    settings = settings_from_env(agents[0].env)
    app = make_app(settings)
    p = Pool2(app, client, ReplicaRegistry(client, settings.registry), [*agents, planner])
    try:
        for proc in p.procs:
            proc.start(ready_marker=None)
        for proc in p.procs:
            proc.wait_ready(timeout=120)
        wait_for(lambda: all(client.hget(keys.node_info(n), "ready") == "1" for n in ("n1", "n2")), 30,
                 "both agents to publish their node")
        yield p
    finally:
        for proc in reversed(p.procs):
            proc.stop()
        app.close()
        client.close()
        server.close()
    for agent in agents:
        base = int(agent.env["PREWARM_AGENT_PORT_BASE"])
        for slot in range(settings.agent.replica_slots):
            assert runtime_pids(base + slot) == [], "an agent left a runtime running"


def test_a_load_that_does_not_fit_its_node_is_placed_on_another(pool: Pool2) -> None:
    pool.app.send_task(PREWARM, args=["a@r1/n1/0", "serving", None])
    pool.wait_state("a@r1/n1/0", "ready")
    pool.app.send_task(PREWARM, args=["b@r1/n1/1", "serving", None])  # n1's GPU holds a: no room for b
    pool.wait_state("b@r1/n1/1", "failed")
    rec = pool.registry.get("b@r1/n1/1")
    assert rec is not None and rec.reason.startswith("insufficient_memory") and "a@r1/n1/0" in rec.reason
    wait_for(lambda: "ready" in pool.live_of("b").values(), 120, lambda: f"b to be ready elsewhere\n{pool.logs()}")
    assert pool.live_of("b") == {"b@r1/n2/0": "ready"}  # placed by the planner on the node with room
    assert pool.client.smembers(keys.placement_refused("b@r1")) == {"n1"}


def test_a_wake_that_does_not_fit_its_node_is_placed_on_another(pool: Pool2) -> None:
    pool.app.send_task(SLEEP, args=["a@r1/n1/0"])
    pool.wait_state("a@r1/n1/0", "asleep")
    pool.app.send_task(PREWARM, args=["c@r1/n1/1", "serving", None])  # a's GPU memory went to host: c fits
    pool.wait_state("c@r1/n1/1", "ready")
    pool.app.send_task(SLEEP, args=["b@r1/n2/0"])  # n2's GPU is free now
    pool.wait_state("b@r1/n2/0", "asleep")
    # the planner places by the memory agents publish: wait until n2's view shows its GPU free
    wait_for(lambda: float(pool.client.hget(keys.node_info("n2"), "gpu_used_gb") or "1") == 0.0, 30,
             "n2's node view to show its GPU free")
    pool.app.send_task(WAKE, args=["a@r1/n1/0"])  # n1's GPU holds c: the wake is refused there
    wait_for(lambda: pool.live_of("a").get("a@r1/n2/1") == "ready", 120,
             lambda: f"a to be ready on n2\n{pool.logs()}")
    assert pool.state("a@r1/n1/0") == "asleep"  # refused and left asleep on n1, not lost
    assert "wake refused on n1" in pool.procs[0].log() or "insufficient" in pool.procs[0].log().lower()
    assert "placed again as a@r1/n2/1" in pool.procs[2].log()


def test_a_malformed_retry_is_refused_naming_the_field() -> None:
    from prewarm.core.errors import InvalidPayload
    from workers.payload import parse_place_elsewhere

    req = parse_place_elsewhere(["a@r1/n1/0", 1000, "no room"], {})
    assert (req.replica.node, req.need_bytes, req.reason) == ("n1", 1000, "no room")
    with pytest.raises(InvalidPayload, match="need_bytes"):
        parse_place_elsewhere(["a@r1/n1/0", -1], {})
    with pytest.raises(InvalidPayload, match="need_bytes"):
        parse_place_elsewhere(["a@r1/n1/0", "lots"], {})
    with pytest.raises(InvalidPayload):
        parse_place_elsewhere(["not a replica id", 1], {})
