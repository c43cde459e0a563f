"""Faults on a running stack: nothing lost, nothing stuck (issue 6).

One stack per module, on its OWN Redis (a dedicated `EmbeddedRedis`, so restarting it does
not disturb the session server): two node agents (`prewarm agent`, nodes n1 and n2) as real
Celery worker processes, each hosting one real runtime of a tiny random-weight torch model,
and a real `prewarm gateway` process in front. Heartbeats are short (1 s, TTL 3 s).

- Redis restarted with no persistence: the gateway answers 503 with Retry-After while it is
  gone (never 500, never a crash), and once it is back the agents' heartbeats re-create
  every live replica within two heartbeat intervals.
- A replica that starts failing requests: its runtime is put to sleep at level 2 behind the
  registry's back (the weights are dropped; the process stays up and healthy, and every
  completion is answered 503 — a real runtime's refusal, not a stand-in). The gateway
  sends those requests to the other replica (a refusal is not a failure: issue 13), and
  the agent's health check (`/readyz` says "sleeping") marks it failed after
  `agent.health_failures` checks and stops its runtime; the traffic goes to the other replica.

- An agent killed with SIGKILL while it loads a replica: a client polls the gateway through
  the whole episode and only ever gets 200 (from the other node's replica) — never a 5xx —
  and the gateway never tries the dead agent's replica (no failed request in its log);
  the restarted agent brings the replica to ready exactly once, and traffic reaches it.

The broker outage is in tests/test_faults_broker.py; fuzzed inputs in
tests/test_faults_fuzz.py and tests/test_history.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from redis import Redis

from prewarm.core.domain import ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import Settings
from tests.celery_helpers import WorkerProcess, runtime_pids, settings_from_env, wait_for, worker_env
from workers.app import make_app
from workers.names import PREWARM
from workers.node.supervision import RuntimeSupervisor
from workers.node.runtime_client import control_token

pytestmark = pytest.mark.slow

NODES = ("n1", "n2")
HEARTBEAT_S = 1.0
REPLICAS = {node: f"tiny@r1/{node}/0" for node in NODES}


@dataclass
class Stack:
    redis: EmbeddedRedis
    tmp: Path
    agents: dict[str, WorkerProcess]
    envs: dict[str, dict[str, str]]
    gateway: WorkerProcess
    gateway_url: str
    client: "Redis[str]"  # (`redis` names the server here)
    registry: ReplicaRegistry
    settings: Settings

    def complete(self, prompt: str = "hello", timeout: float = 30.0) -> tuple[int, dict[str, str], Any]:
        """One completion through the gateway: (status, headers, JSON body)."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{self.gateway_url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            return exc.code, dict(exc.headers), json.loads(raw) if raw else None

    def ready_ids(self) -> set[str]:
        try:
            return {r.id for r in self.registry.view("tiny", now=time.time()).serving}
        except Exception:  # noqa: BLE001 - Redis may still be coming back
            return set()

    def logs(self) -> str:
        parts = [f"--- agent {n}\n{a.log()[-2500:]}" for n, a in self.agents.items()]
        return "\n".join(parts + [f"--- gateway\n{self.gateway.log()[-2500:]}"])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from prewarm.runtime.model import make_model

    tmp = tmp_path_factory.mktemp("faults")
    server = EmbeddedRedis().start()
    short = {"PREWARM_REGISTRY_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "PREWARM_REGISTRY_HEARTBEAT_TTL_S": "3",
             "PREWARM_REDIS_SOCKET_TIMEOUT_S": "2", "PREWARM_REGISTRY_REAPER_INTERVAL_S": "1"}
    make_model(tmp / "models" / "tiny" / "r1", "tiny", seed=0, name="tiny", revision="r1")
    # the agents wait out a stalled Redis (socket timeout 10 s, as in worker_env): a heartbeat sent into a
    # frozen server arrives with the time it was sent (test_redis_frozen_past_the_ttl_fails_no_healthy_replica)
    envs = {n: worker_env(server.url, tmp, PREWARM_AGENT_NODE=n, PREWARM_METRICS_PORT=str(free_port()),
                          **{**short, "PREWARM_REDIS_SOCKET_TIMEOUT_S": "10"})
            for n in NODES}
    agents = {n: WorkerProcess(["agent", "--node", n], envs[n], tmp / f"agent-{n}.log") for n in NODES}
    port = free_port()
    gw_env = worker_env(server.url, tmp, **short)
    gateway = WorkerProcess(["gateway", "--port", str(port)], gw_env, tmp / "gateway.log")
    client: "redis.Redis[str]" = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=2)
    settings = settings_from_env(envs["n1"])
    app = make_app(settings)
    try:
        for a in agents.values():  # both start at once; each waits for Celery's "ready" below
            a.start(ready_marker=None)
        gateway.start(ready_marker="listening on", timeout=30)
        for a in agents.values():
            a.wait_ready(timeout=90)
        st = Stack(server, tmp, agents, envs, gateway, f"http://127.0.0.1:{port}", client,
                   ReplicaRegistry(client, settings.registry), settings)
        for rid in REPLICAS.values():
            app.send_task(PREWARM, args=[rid, "serving", None])
        wait_for(lambda: st.ready_ids() == set(REPLICAS.values()), 120,
                 lambda: f"both replicas to be ready\n{st.logs()}")
        yield st
    finally:
        gateway.stop()
        for a in agents.values():
            a.stop()
        app.close()
        client.close()
        server.close()
    for n in NODES:
        base = int(envs[n]["PREWARM_AGENT_PORT_BASE"])
        assert runtime_pids(base) == [], f"agent {n} left a runtime running"


def test_redis_restart_without_persistence(stack: Stack) -> None:
    status, _, body = stack.complete()
    assert status == 200, body
    outage: list[tuple[int, dict[str, str], Any]] = []
    stack.client.set("test:marker", "written before the restart")
    stack.redis.stop()
    try:
        deadline = time.monotonic() + 2.5  # past the gateway's cached view (refresh 0.5 s): it must read Redis
        while time.monotonic() < deadline:
            outage.append(stack.complete(timeout=15))
        with urllib.request.urlopen(f"{stack.gateway_url}/healthz", timeout=10) as resp:
            health = json.loads(resp.read())
        assert health["registry"].startswith("unavailable"), health
    finally:
        stack.redis.start()  # same port, empty: nothing was persisted
    back = time.monotonic()
    assert stack.client.get("test:marker") is None, "the restarted Redis should have lost everything"

    statuses = [s for s, _, _ in outage]
    # issue 20: the gateway routes from its last view of ready replicas while Redis is away
    # (prewarm/policy/stale_view.py): every replica is alive, so every request is answered
    assert statuses and set(statuses) == {200}, statuses

    # the agents' heartbeats re-create both replicas (record, indexes, model list) from what they host
    wait_for(lambda: stack.ready_ids() == set(REPLICAS.values()), 10, lambda: f"the replicas to come back\n{stack.logs()}",
             poll=0.05)
    took = time.monotonic() - back
    print(f"registry rebuilt {took:.2f}s after Redis came back (heartbeat interval {HEARTBEAT_S}s)")
    # two heartbeat intervals, plus what a shared 2-core machine adds to a poll and a reconnect
    assert took <= 2 * HEARTBEAT_S + 0.5, f"took {took:.2f}s"
    for rid in REPLICAS.values():
        rec = stack.registry.get(rid)
        assert rec is not None and rec.state is ReplicaState.READY and rec.endpoint, rec

    status, _, body = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(stack.complete()), 10,
                               "the gateway to route again")
    assert body["usage"]["completion_tokens"] == 2
    assert stack.gateway.proc is not None and stack.gateway.proc.poll() is None, "the gateway died"
    for node, agent in stack.agents.items():
        assert agent.proc is not None and agent.proc.poll() is None, f"agent {node} died:\n{agent.log()[-3000:]}"
    assert "Traceback" not in stack.gateway.log(), stack.gateway.log()[-3000:]


def test_redis_frozen_past_the_ttl_fails_no_healthy_replica(stack: Stack) -> None:
    """Chaos (issue 13): Redis SIGSTOPped for longer than the heartbeat TTL, then resumed, under traffic
    and with reaps queued meanwhile (the reaper's own code, `ReplicaRegistry.reap`, called again and again
    from threads, so that reaps carrying the current time wait in the frozen server as a planner worker's
    would). The agents' heartbeats sent into the frozen server carry the time they were sent, so when
    Redis resumes every replica looks expired, and a queued reap runs before the agents heartbeat
    again; no healthy replica may be failed for that."""
    wait_for(lambda: stack.ready_ids() == set(REPLICAS.values()), 30, lambda: f"both replicas ready\n{stack.logs()}")
    reaper_client: "redis.Redis[str]" = redis.Redis.from_url(stack.redis.url, decode_responses=True,
                                                             socket_timeout=0.5)
    reaper = ReplicaRegistry(reaper_client, stack.settings.registry)
    stop = threading.Event()
    reaped: list[str] = []
    answers: list[int] = []

    def reap_loop() -> None:
        while not stop.is_set():
            try:
                reaped.extend(reaper.reap(now=time.time()))
            except Exception:  # noqa: BLE001 - Redis frozen: the call times out or errors; reap again
                pass
            time.sleep(0.2)

    def traffic() -> None:
        while not stop.is_set():
            answers.append(stack.complete("chaos", timeout=20)[0])
            time.sleep(0.05)

    threads = [threading.Thread(target=f, daemon=True) for f in (reap_loop, reap_loop, reap_loop, traffic)]
    for t in threads:
        t.start()
    assert stack.redis.proc is not None
    pid = stack.redis.proc.pid
    try:
        time.sleep(1.0)
        os.kill(pid, signal.SIGSTOP)
        frozen = stack.settings.registry.heartbeat_ttl_s + 2.0
        time.sleep(frozen)  # past the TTL: every heartbeat score is in the past when Redis resumes
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        time.sleep(stack.settings.registry.heartbeat_ttl_s + 2.0)  # the settling period, and reaps after it
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        reaper_client.close()

    assert reaped == [], f"healthy replicas were reaped after the stall: {reaped}\n{stack.logs()}"
    failed = [(f.get("replica"), f.get("reason")) for _, f in stack.registry.events() if f.get("to") == "failed"]
    assert not failed, failed
    wait_for(lambda: stack.ready_ids() == set(REPLICAS.values()), 10, lambda: f"both replicas routable\n{stack.logs()}")
    assert set(answers) <= {200, 503}, sorted(set(answers))
    assert answers[-1] == 200 or stack.complete()[0] == 200


def test_failing_replica_is_marked_failed_and_traffic_moves(stack: Stack) -> None:
    bad, good = REPLICAS["n1"], REPLICAS["n2"]
    wait_for(lambda: stack.ready_ids() == {bad, good}, 15, "both replicas to be ready")
    bad_rec, good_rec = stack.registry.get(bad), stack.registry.get(good)
    assert bad_rec is not None and good_rec is not None
    token = control_token(stack.settings)
    req = urllib.request.Request(f"{bad_rec.endpoint}/sleep?level=2", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["is_sleeping"] is True
    with urllib.request.urlopen(f"{bad_rec.endpoint}/healthz", timeout=5) as resp:
        assert resp.status == 200  # the process is alive: only requests show the failure

    def served_by_good() -> int:
        with urllib.request.urlopen(f"{good_rec.endpoint}/stats", timeout=5) as resp:
            return int(json.loads(resp.read()).get("user", 0))

    answers: list[tuple[int, dict[str, str], Any]] = []

    def marked_failed() -> bool:
        answers.append(stack.complete())
        rec = stack.registry.get(bad)
        return rec is not None and rec.state is ReplicaState.FAILED

    wait_for(marked_failed, 30, lambda: f"the gateway to mark {bad} failed\n{stack.logs()}", poll=0.05)
    rec = stack.registry.get(bad)
    assert rec is not None and "health check" in rec.reason, rec  # the agent's check, not the answers: issue 13
    statuses = [s for s, _, _ in answers]
    assert 500 not in statuses and set(statuses) <= {200, 503}, statuses
    for status, headers, _ in answers:
        if status == 503:
            assert int(headers.get("Retry-After", "0")) >= 1, headers

    before = served_by_good()
    after = [stack.complete(f"after {i}") for i in range(10)]
    assert [s for s, _, _ in after] == [200] * 10, after
    assert served_by_good() - before == 10, "the traffic did not all go to the healthy replica"
    # the agent sees the failed record on its next heartbeat and stops the runtime
    port = int(stack.envs["n1"]["PREWARM_AGENT_PORT_BASE"])
    wait_for(lambda: runtime_pids(port) == [], 20, "the failed replica's runtime to stop")
    assert stack.ready_ids() == {good}


def test_agent_sigkill_mid_load_gateway_never_routes_to_it(stack: Stack) -> None:
    rid, good = "tiny@r1/n1/1", REPLICAS["n2"]
    agent = stack.agents["n1"]
    port = int(stack.envs["n1"]["PREWARM_AGENT_PORT_BASE"]) + 1
    answers: list[tuple[float, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            status, _, _ = stack.complete("during the crash")
            answers.append((time.monotonic(), status))
            time.sleep(0.05)

    app = make_app(stack.settings)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        task = app.send_task(PREWARM, args=[rid, "serving", None])
        wait_for(lambda: (r := stack.registry.get(rid)) is not None and r.state is ReplicaState.LOADING, 60,
                 lambda: f"{rid} to start loading\n{stack.logs()}", poll=0.05)
        wait_for(lambda: runtime_pids(port), 30, "its runtime to be spawned", poll=0.05)
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}"), 150,
                 lambda: f"its runtime to answer on port {port}\n{stack.logs()}\n"
                         f"--- runtime\n{RuntimeSupervisor(stack.settings).log_tail(1, 40)}",
                 poll=0.05)
        agent.kill()  # SIGKILL mid-load: no ack, no cleanup, no more heartbeats
        state = stack.registry.get(rid)
        assert state is not None and state.state in (ReplicaState.LOADING, ReplicaState.WARMING), state
        killed = time.monotonic()
        time.sleep(3.5)  # past the heartbeat TTL (3 s): the dead agent's replica is not routable now
        assert rid not in {r.id for r in stack.registry.view("tiny", now=time.time()).loading}
        agent.start()
        wait_for(lambda: (r := stack.registry.get(rid)) is not None and r.state is ReplicaState.READY, 90,
                 lambda: f"{rid} to be ready\n{stack.logs()}")
        wait_for(lambda: stack.ready_ids() == {rid, good}, 10, "both replicas to be routable")
        time.sleep(1.0)  # a few answers after the recovery
    finally:
        stop.set()
        poller.join(60)
        app.close()

    statuses = [s for _, s in answers]
    assert statuses and set(statuses) == {200}, f"not every request was answered: {sorted(set(statuses))}"
    assert any(t > killed for t, _ in answers), "the poller stopped during the episode"
    assert f"replica {rid} failed a request" not in stack.gateway.log(), "the gateway tried the dead agent's replica"
    steps = [(f.get("from", ""), f.get("to", "")) for _, f in stack.registry.events() if f.get("replica") == rid]
    assert steps.count(("warming", "ready")) == 1, steps
    assert steps.count(("", "pending")) == 1, f"registered more than once: {steps}"
    assert len(runtime_pids(port)) == 1, "two runtimes serve the slot"
    # the revived replica takes traffic (ties in flight go to the lower id: tiny@r1/n1/1)
    before = stack.complete("after")
    assert before[0] == 200
    rec = stack.registry.get(rid)
    assert rec is not None
    with urllib.request.urlopen(f"{rec.endpoint}/stats", timeout=5) as resp:
        assert json.loads(resp.read())["user"] >= 1
    assert task.id  # the crashed task's message, redelivered later, finds the replica ready (tests/test_workers_agent.py)
