"""Prewarming the pods of an inference Deployment (workers/pods.py), end to end.

What runs for real: Redis (conftest), two `prewarm serve-model` processes on CPU standing in
for the pods' OpenAI-compatible servers (one with a healthy tiny model, one whose final norm
holds NaN, a broken checkpoint with a consistent manifest), the real `kubernetes` client,
and the pod watcher. What is a double: the Kubernetes API server (tests/k8s_double.py; no
API server can run here), whose pods point at the runtimes' loopback addresses.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry

from prewarm import cli
from prewarm.core import keys
from prewarm.core.domain import Pool, ReplicaState
from prewarm.adapters.k8s_watch import ReadyPod
from prewarm.runtime.model import make_model
from prewarm.core.settings import Settings
from prewarm.registry.targets import schedule_fields
from tests.celery_helpers import wait_for
from tests.k8s_double import KubeDouble
from tests.k8s_events import KubeDoubleWithEvents
from tests.runtime_server import SECRET, TOKEN, RuntimeProcess, poison, start_runtime, wait_loaded
from workers.context import WorkerContext
from workers.pods import (
    EXTERNAL_SLOT_BASE,
    PodOutcome,
    PodPrewarmer,
    PodTarget,
    pod_replica_id,
    pod_slot,
    run_pod_prewarmer,
)

pytestmark = pytest.mark.timeout(90)

NS = "inference"
LABELS = {"app": "llm"}
TARGET = PodTarget(model="tiny", revision="r1", served_model="tiny", ready_timeout_s=10.0)


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RuntimeProcess]]:
    """Both runtimes, started side by side (each spends most of its start importing torch)."""
    good_dir = Path(make_model(tmp_path_factory.mktemp("good") / "tiny", "tiny", seed=1, name="tiny", revision="r1"))
    nan_dir = Path(make_model(tmp_path_factory.mktemp("nan") / "tiny", "tiny", seed=2, name="tiny", revision="r1"))
    poison(nan_dir, "norm.weight")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(start_runtime, d, tmp_path_factory.mktemp(f"{name}-rt"))
                   for name, d in (("good", good_dir), ("nan", nan_dir))}
        started = {name: f.result() for name, f in futures.items()}
    try:
        for rp in started.values():
            wait_loaded(rp.url)
        yield started
    finally:
        for rp in started.values():
            rp.stop()


@pytest.fixture(scope="module")
def good(runtimes: dict[str, RuntimeProcess]) -> RuntimeProcess:
    return runtimes["good"]


@pytest.fixture(scope="module")
def nan(runtimes: dict[str, RuntimeProcess]) -> RuntimeProcess:
    return runtimes["nan"]


def _port(rp: RuntimeProcess) -> int:
    return int(rp.url.rsplit(":", 1)[1])


def _settings(mp: pytest.MonkeyPatch, redis_url: str, pod_port: int) -> Settings:
    for k, v in {
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_WARMUP_SECRET": SECRET,  # the runtimes verify the warmup signatures with it
        "PREWARM_WARMUP_REQUESTS": "3",
        # a shared, noisy machine: a wide margin here; the slow-server test sets an impossible baseline instead
        "PREWARM_WARMUP_LATENCY_FACTOR": "50",
        "PREWARM_REGISTRY_HEARTBEAT_INTERVAL_S": "0.3",
        "PREWARM_REGISTRY_HEARTBEAT_TTL_S": "3",
        "PREWARM_AGENT_LOCK_TTL_S": "3",
        "PREWARM_KUBERNETES_POD_PORT": str(pod_port),
        "PREWARM_KUBERNETES_POD_READY_TIMEOUT_S": "10",
        "PREWARM_WARMUP_KEEPALIVE_INTERVAL_S": "0.3",
    }.items():
        mp.setenv(k, v)
    return Settings.load()


@dataclass
class Running:
    ctx: WorkerContext
    double: KubeDoubleWithEvents
    stop: threading.Event
    thread: threading.Thread
    out: dict[str, object]

    def sample(self, name: str, **labels: str) -> float:
        return self.ctx.metrics.registry.get_sample_value(name, labels) or 0.0

    def counted(self, name: str, **labels: str) -> float:
        """The sample once it is non-zero: the watcher thread marks a replica failed, then counts it."""
        return wait_for(lambda: self.sample(name, **labels), 5, f"{name}{labels} to be counted")

    def state(self, rid: str) -> str | None:
        rec = self.ctx.registry.get(rid)
        return rec.state.value if rec else None

    def transitions(self, rid: str) -> list[tuple[str, str]]:
        return [(f["from"], f["to"]) for _, f in self.ctx.registry.events() if f.get("replica") == rid]


@pytest.fixture()
def running(redis_url: str, clean_env: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Running]:
    """The prewarmer watching deployments/llm, its pods served by the runtime the test names."""
    runtime: RuntimeProcess = request.getfixturevalue(request.param)
    settings = _settings(clean_env, redis_url, _port(runtime))
    ctx = WorkerContext.build(settings, registry=CollectorRegistry())
    with KubeDoubleWithEvents() as double:
        double.add_deployment(NS, "llm", replicas=1, labels=LABELS)
        stop = threading.Event()
        out: dict[str, object] = {}

        def run() -> None:
            out["stats"] = run_pod_prewarmer(ctx, double.api_client(), NS, "llm", TARGET, stop=stop,
                                             watch_timeout_s=1)

        t = threading.Thread(target=run, name="prewarm-pods")
        t.start()
        double.wait_for_watch()
        r = Running(ctx, double, stop, t, out)
        try:
            yield r
        finally:
            stop.set()
            t.join(timeout=20)
            assert not t.is_alive(), "the pod prewarmer did not stop"
            ctx.client.close()


def _ready_pod(name: str, endpoint: str, node: str = "gpu-a", uid: str = "uid-1") -> ReadyPod:
    return ReadyPod(name=name, namespace=NS, uid=uid, node=node, pod_ip="127.0.0.1", endpoint=endpoint,
                    labels=LABELS, resource_version="1")


def test_replica_ids_are_stable_per_pod() -> None:
    a = _ready_pod("llm-7d9f-abcde", "http://10.0.0.1:8000")
    rid = pod_replica_id("tiny", "r1", a)
    slot = pod_slot(NS, "llm-7d9f-abcde")
    assert rid == f"tiny@r1/gpu-a/{slot}" and slot >= EXTERNAL_SLOT_BASE
    assert pod_replica_id("tiny", "r1", _ready_pod("llm-7d9f-abcde", "http://10.0.0.9:8000", uid="other")) == rid
    assert pod_slot(NS, "llm-7d9f-zzzzz") != slot and pod_slot("other-ns", "llm-7d9f-abcde") != slot
    with pytest.raises(Exception, match="nodeName"):
        pod_replica_id("tiny", "r1", _ready_pod("p", "http://10.0.0.1:8000", node=""))


@pytest.mark.parametrize("running", ["good"], indirect=True)
def test_a_pods_time_to_ready_is_the_planners_lead_and_keep_warm_reaches_it(
    running: Running, good: RuntimeProcess
) -> None:
    """Creation to validated, less the image pull the pod waited for, is recorded as agents record a
    cold start (the planner's lead in a cluster: `load_time_p95`, per model, revision and node class); the
    pull is recorded apart. A HOLD's keep-warm mark makes the pod warmer send it signed requests."""
    double, ctx = running.double, running.ctx
    created = time.time() - 40.0  # scheduled, pulled and started 40 s ago; Ready only now
    double.put_pod(NS, "llm-t", LABELS, ready=False, ip="127.0.0.1", node="gpu-a", created_at=created)
    double.add_pod_event(NS, "llm-t", "Pulling", 'Pulling image "vllm/vllm-openai:v0.6.3"', created + 1)
    double.add_pod_event(NS, "llm-t", "Pulled", 'Successfully pulled image "vllm/vllm-openai:v0.6.3" in 24.5s '
                         '(25s including waiting). Image size: 9876543210 bytes.', created + 26)
    double.put_pod(NS, "llm-t", LABELS, ready=True, ip="127.0.0.1", node="gpu-a", created_at=created)
    rid = f"tiny@r1/gpu-a/{pod_slot(NS, 'llm-t')}"
    wait_for(lambda: running.state(rid) in ("ready", "failed"), 30, f"{rid} to be ready")
    assert running.state(rid) == "ready"
    node_class = ctx.settings.agent.node_class
    p95 = ctx.registry.load_time_p95("tiny", "r1", node_class)
    assert p95 is not None and 14.0 <= p95 <= time.time() - created - 25.0 + 1.0  # whole seconds on the API server
    assert ctx.registry.image_pulls("tiny", "r1", node_class) == [25.0]  # reported apart
    assert running.sample("model_image_pull_seconds_sum", model="tiny", node="gpu-a") == 25.0
    assert ctx.registry.load_time_p95("tiny", "r2") is None and ctx.registry.load_time_p95("tiny", "r1", "h100") is None
    assert running.sample("model_cold_start_seconds_count", model="tiny", node="gpu-a") == 1

    warm0 = json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))["warmup"]
    time.sleep(1.0)  # no hold: no keep-alive traffic
    assert json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))["warmup"] == warm0
    ctx.client.set(keys.keep_warm(rid), repr(time.time() + 60.0))  # what the executor's HOLD writes
    wait_for(lambda: running.sample("warmup_requests_total", model="tiny", purpose="keepalive") >= 4, 10,
             "two keep-alive rounds")
    # signed: the runtime counted them as warmup traffic, not as user requests
    assert json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))["warmup"] >= warm0 + 4


@pytest.mark.parametrize("running", ["good"], indirect=True)
def test_ready_pod_is_warmed_validated_registered_and_retired_when_deleted(
    running: Running, good: RuntimeProcess
) -> None:
    double, ctx = running.double, running.ctx
    stats0 = json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))
    double.put_pod(NS, "llm-a", LABELS, ready=False, ip="127.0.0.1", node="gpu-a")  # started, not Ready yet
    time.sleep(0.5)
    rid = f"tiny@r1/gpu-a/{pod_slot(NS, 'llm-a')}"
    assert ctx.registry.get(rid) is None, "a pod that is not Ready was registered"
    double.put_pod(NS, "llm-a", LABELS, ready=True, ip="127.0.0.1", node="gpu-a")
    wait_for(lambda: running.state(rid) in ("ready", "failed"), 30, f"{rid} to be ready")
    rec = ctx.registry.get(rid)
    assert rec is not None and rec.state is ReplicaState.READY, rec
    assert rec.endpoint == good.url and rec.pool is Pool.SERVING
    assert "structural unsupported" in rec.reason  # reported honestly, not passed
    assert running.transitions(rid) == [("", "pending"), ("pending", "loading"), ("loading", "warming"),
                                        ("warming", "ready")]
    assert [r.id for r in ctx.registry.ready("tiny", Pool.SERVING, now=time.time())] == [rid]
    # the warmup was signed (the runtime counted it as warmup traffic) and validation was recorded
    stats1 = json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))
    assert stats1["warmup"] - stats0["warmup"] == 3
    for check, result in (("structural", "unsupported"), ("numeric", "passed"), ("performance", "no_baseline")):
        assert running.sample("prewarm_validation_results_total", model="tiny", check=check, result=result) == 1
    assert running.sample("warmup_requests_total", model="tiny", purpose="prewarm") == 3
    assert ctx.client.llen(keys.baseline_samples("tiny", ctx.settings.agent.node_class, "r1")) == 1  # 1 of 5

    # heartbeats while the pod stays Ready
    first = rec.heartbeat_at
    wait_for(lambda: (ctx.registry.get(rid) or rec).heartbeat_at > first + 0.5, 5, "a heartbeat")

    # a pod seen twice is one replica: a restarted watcher adopts it without warming it again
    again = PodPrewarmer(ctx, TARGET).handle(_ready_pod("llm-a", good.url, uid="x"))
    assert again.outcome is PodOutcome.ALREADY_READY and again.replica_id == rid
    assert [r.id for r in ctx.registry.replicas_of("tiny")] == [rid]
    assert json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))["warmup"] == stats1["warmup"]

    # the pod turns unready (its container restarted): retired; Ready again: the same replica, warmed again
    double.put_pod(NS, "llm-a", LABELS, ready=False, ip="127.0.0.1", node="gpu-a")
    wait_for(lambda: running.state(rid) == "retired", 10, f"{rid} to be retired when its pod is unready")
    assert "not Ready" in (ctx.registry.get(rid) or rec).reason
    double.put_pod(NS, "llm-a", LABELS, ready=True, ip="127.0.0.1", node="gpu-a")
    wait_for(lambda: running.state(rid) == "ready", 30, f"{rid} to be ready again")
    assert running.transitions(rid)[4:] == [("ready", "draining"), ("draining", "retired"), ("retired", "pending"),
                                            ("pending", "loading"), ("loading", "warming"), ("warming", "ready")]
    assert json.load(urllib.request.urlopen(good.url + "/stats", timeout=5))["warmup"] == stats1["warmup"] + 3

    # the pod is deleted: drained and retired, no longer routable
    double.delete_pod(NS, "llm-a")
    wait_for(lambda: running.state(rid) == "retired", 10, f"{rid} to be retired")
    assert running.transitions(rid)[-2:] == [("ready", "draining"), ("draining", "retired")]
    assert "deleted" in (ctx.registry.get(rid) or rec).reason
    assert ctx.registry.ready("tiny", Pool.SERVING, now=time.time()) == []
    assert running.sample("model_loading_failures_total", model="tiny", node="gpu-a", reason="pod_gone") == 0


@pytest.mark.parametrize("running", ["nan"], indirect=True)
def test_pod_whose_server_answers_nan_is_failed(running: Running) -> None:
    ctx = running.ctx
    running.double.put_pod(NS, "llm-nan", LABELS, ready=True, ip="127.0.0.1", node="gpu-b")
    rid = f"tiny@r1/gpu-b/{pod_slot(NS, 'llm-nan')}"
    wait_for(lambda: running.state(rid) in ("ready", "failed"), 30, f"{rid} to end")
    rec = ctx.registry.get(rid)
    assert rec is not None and rec.state is ReplicaState.FAILED
    assert rec.reason.startswith("validation_failed") and "numeric" in rec.reason and "not finite" in rec.reason
    assert running.counted("model_loading_failures_total", model="tiny", node="gpu-b", reason="validation_failed") == 1
    assert running.sample("prewarm_validation_results_total", model="tiny", check="numeric", result="failed") == 1
    assert ctx.registry.ready("tiny", Pool.SERVING, now=time.time()) == []


@pytest.mark.parametrize("running", ["good"], indirect=True)
def test_pod_too_slow_against_its_baseline_is_failed_and_a_dead_server_is_unreachable(running: Running) -> None:
    ctx = running.ctx
    ctx.registry.record_baseline_sample("tiny", ctx.settings.agent.node_class, 1e-6, "r1", samples=1)  # 1 µs: nothing is that fast
    running.double.put_pod(NS, "llm-slow", LABELS, ready=True, ip="127.0.0.1", node="gpu-a")
    rid = f"tiny@r1/gpu-a/{pod_slot(NS, 'llm-slow')}"
    wait_for(lambda: running.state(rid) in ("ready", "failed"), 30, f"{rid} to end")
    rec = ctx.registry.get(rid)
    assert rec is not None and rec.state is ReplicaState.FAILED
    assert "performance" in rec.reason and "exceeds" in rec.reason
    assert running.counted("model_loading_failures_total", model="tiny", node="gpu-a", reason="validation_failed") == 1

    # a Ready pod whose server does not answer at all
    from prewarm.registry.embedded import free_port

    quick = PodTarget(model="tiny", revision="r1", served_model="tiny", ready_timeout_s=0.5)
    dead = PodPrewarmer(ctx, quick).handle(_ready_pod("llm-dead", f"http://127.0.0.1:{free_port()}"))
    assert dead.outcome is PodOutcome.FAILED and dead.reason.startswith("unreachable")
    assert running.state(dead.replica_id) == "failed"
    assert running.sample("model_loading_failures_total", model="tiny", node="gpu-a", reason="unreachable") == 1


def _kubeconfig(tmp_path: Path, double: KubeDouble) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "double", "cluster": {"server": double.url}}],
        "users": [{"name": "u", "user": {"token": "test"}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "u", "namespace": NS}}],
        "current-context": "double",
    }))
    return str(path)


def test_cli_prewarm_pods(redis_url: str, clean_env: pytest.MonkeyPatch, good: RuntimeProcess, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    settings = _settings(clean_env, redis_url, _port(good))
    with KubeDouble() as double:
        double.add_deployment(NS, "llm", replicas=1, labels=LABELS)
        double.put_pod(NS, "llm-cli", LABELS, ready=True, ip="127.0.0.1", node="gpu-c")
        argv = ["k8s", "--kubeconfig", _kubeconfig(tmp_path, double), "--namespace", NS, "prewarm-pods",
                "--deployment", "llm", "--model", "tiny", "--revision", "r1", "--count", "1"]
        assert cli.main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rid = f"tiny@r1/gpu-c/{pod_slot(NS, 'llm-cli')}"
    assert line == {"pod": "llm-cli", "replica_id": rid, "outcome": "ready", "reason": line["reason"]}
    ctx = WorkerContext.build(settings)
    rec = ctx.registry.get(rid)
    assert rec is not None and rec.state is ReplicaState.READY and rec.endpoint == good.url
    ctx.client.close()


def test_pods_are_parked_asleep_and_woken_through_their_servers_http_api(
        redis_url: str, clean_env: pytest.MonkeyPatch, good: RuntimeProcess) -> None:
    """Issue 17: a pod the planner parks asleep goes through its server's /sleep, /is_sleeping and
    /wake_up. The server here is prewarm's own runtime, which speaks vLLM's sleep API (on CPU its
    level-1 sleep moves nothing, but the API, the drain and the states are the same)."""
    ctx = WorkerContext.build(_settings(clean_env, redis_url, _port(good)), registry=CollectorRegistry())
    target = PodTarget(model="tiny", revision="r1", served_model="tiny", ready_timeout_s=10.0, sleep_mode=True,
                       api_key=TOKEN, api_key_ref="tiny-key/api-key")
    warmer = PodPrewarmer(ctx, target)
    pod = _ready_pod("llm-s", good.url)
    rid = warmer.handle(pod).replica_id
    assert ctx.registry.get(rid).state is ReplicaState.READY  # type: ignore[union-attr]
    # issue 18: registered with the reference of its key (what the gateway sends it), never the key
    assert ctx.registry.get(rid).auth_ref == "tiny-key/api-key"  # type: ignore[union-attr]
    assert TOKEN not in json.dumps(ctx.client.hgetall(keys.replica(rid)))

    def plan(pods: int, awake: int) -> None:  # what the planner records (`publish_cluster_target`)
        ctx.client.hset(keys.last_forecast("tiny"), mapping=schedule_fields([(time.time(), pods)],
                                                                            planned_at=time.time(), awake=awake))

    def sleeping() -> bool:
        req = urllib.request.Request(good.url + "/is_sleeping", headers={"Authorization": f"Bearer {TOKEN}"})
        return bool(json.load(urllib.request.urlopen(req, timeout=5))["is_sleeping"])

    try:
        assert warmer.tier_round() == {}  # no plan recorded: nothing moves
        plan(1, 1)
        assert warmer.tier_round() == {} and not sleeping()
        plan(1, 0)  # parked asleep
        assert warmer.tier_round() == {rid: "asleep"}
        assert sleeping() and ctx.registry.get(rid).state is ReplicaState.ASLEEP  # type: ignore[union-attr]
        assert ctx.registry.ready("tiny", Pool.SERVING, now=time.time()) == []  # the gateway routes nothing to it
        assert warmer.sync({"llm-s": _listed(pod)}) == {rid: "heartbeat"}  # asleep, and alive
        plan(1, 1)
        assert warmer.tier_round() == {rid: "ready"}
        assert not sleeping() and [r.id for r in ctx.registry.ready("tiny", Pool.SERVING, now=time.time())] == [rid]
        assert ctx.registry.ready_time_p95("tiny", "asleep", target.node_class) is not None  # the measured wake
        transitions = [(f["from"], f["to"]) for _, f in ctx.registry.events() if f.get("replica") == rid]
        assert transitions[-3:] == [("ready", "draining"), ("draining", "asleep"), ("asleep", "ready")]
        # issue 19: where the planner records the pods' own revision's target (a rollout's share), it governs
        revision = {"model": "tiny", "revision": "r1"}
        ctx.client.hset(keys.revision_target(**revision), mapping=schedule_fields(
            [(time.time(), 1)], planned_at=time.time(), awake=0))
        assert warmer.tier_round() == {rid: "asleep"}  # though the model's record still wants one awake
        ctx.client.hset(keys.revision_target(**revision), mapping=schedule_fields(
            [(time.time(), 1)], planned_at=time.time(), awake=1))
        assert warmer.tier_round() == {rid: "ready"}
    finally:
        if sleeping():
            urllib.request.urlopen(urllib.request.Request(good.url + "/wake_up", data=b"", method="POST",
                                                          headers={"Authorization": f"Bearer {TOKEN}"}), timeout=30)
        ctx.client.close()


def _listed(pod: ReadyPod) -> Any:
    """The pod as the API lists it (what `sync` reads): Ready, with its uid and IP."""
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=pod.name, uid=pod.uid),
                     status=k8s.V1PodStatus(pod_ip=pod.pod_ip, conditions=[k8s.V1PodCondition(type="Ready",
                                                                                               status="True")]))
