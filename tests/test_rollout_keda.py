"""Issue 19, Kubernetes with KEDA or the HPA: a rollout across two Deployments (stable and canary)
of one model, each scaled on its own share of the planner's target.

What runs for real: Redis (conftest); the planner's own `forecast_and_plan` and rollout tick (the
two halves of the beat's `forecast_and_plan` task) writing the targets; the chart rendered with
Helm's Go SDK (tests/test_helm.py), whose ScaledObjects' trigger metadata and HPAs' metric
selectors are what the scaler is asked with; the gRPC KEDA external scaler (`TargetScaler`) asked
over a real channel, and its Prometheus endpoint scraped over HTTP (what prometheus-adapter reads
for the HPA) and by a real Prometheus (the Debian binary), queried as the documented
prometheus-adapter rule queries it. The pod warmer's part (a pod is registered as a ready
replica only once warmed and validated) is played by the test, as in tests/test_rollout_k8s.py; KEDA itself and
prometheus-adapter are not here, so the test applies their documented selection: the trigger's
metadata goes to the scaler as is, and an External metric is the series matching the selector.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import Settings
from prewarm.gateway.keda import TargetScaler, build_server, metric_name, run
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.policy import rollout as rp
from prewarm.registry.embedded import free_port
from prewarm.registry.rollouts import RolloutStore
from tests.test_helm import render
from tests.test_prometheus_scrape import Prometheus
from workers.app import make_app
from workers.context import WorkerContext
from workers.planning.forecast import forecast_and_plan
from workers.planning.rollout import tick_all

pytestmark = pytest.mark.timeout(90)

MODEL = "tiny"
DEMAND = 4  # the planner's target: min_serving 4, no traffic, no warm pool
TARGETS = [{"model": MODEL, "deployment": "tiny-stable", "revision": "r1"},
           {"model": MODEL, "deployment": "tiny-canary", "revision": "r2"}]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _ctx(mp: pytest.MonkeyPatch, redis_url: str, mode: str) -> WorkerContext:
    for k, v in {
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_KUBERNETES_ENABLED": "true",
        "PREWARM_KUBERNETES_AUTOSCALING": mode,
        "PREWARM_KUBERNETES_NAMESPACE": "inference",
        "PREWARM_KUBERNETES_DEPLOYMENTS": '{"tiny": "tiny-stable", "tiny@r1": "tiny-stable", "tiny@r2": "tiny-canary"}',
        "PREWARM_PLANNER_MODELS": '["tiny@r1"]',
        "PREWARM_PLANNER_MIN_SERVING": str(DEMAND),
        "PREWARM_PLANNER_WARM_POOL_SIZE": "0",
        "PREWARM_PLANNER_STABILIZATION_S": "0",
        "PREWARM_PLANNER_BUDGET_SHARE": "1",
    }.items():
        mp.setenv(k, v)
    return WorkerContext.build(Settings.load(), registry=CollectorRegistry())


def pod_ready(ctx: WorkerContext, rev: str, slot: int, now: float) -> None:
    """The pod warmer registers a pod once warmed and validated."""
    r = Replica(MODEL, rev, f"pod-{rev}-{slot}", 0, endpoint=f"http://10.0.0.{slot}:8000")
    ctx.registry.register(r, now=now)
    for st in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(r.id, st, now=now)


def retire(ctx: WorkerContext, rev: str, now: float) -> None:
    """The pod warmer drains and retires the pods of a Deployment scaled down."""
    for r in ctx.registry.replicas_of(MODEL):
        if r.revision == rev and r.state is ReplicaState.READY:
            ctx.registry.transition(r.id, ReplicaState.DRAINING, now=now)
            ctx.registry.transition(r.id, ReplicaState.RETIRED, now=now)


def plan_round(ctx: WorkerContext, now: float) -> list[str]:
    """The beat's `forecast_and_plan` task body: every model planned, then every rollout ticked."""
    forecast_and_plan(ctx, now=now)
    return [t.action for t in tick_all(ctx, make_app(ctx.settings), now=now)]


@pytest.fixture()
def scaler(redis_client: "redis.Redis[str]") -> Iterator[tuple[pb_grpc.ExternalScalerStub, Clock]]:
    clock = Clock(time.time())
    servicer = TargetScaler(redis_client, max_age_s=180.0, clock=clock, stream_poll_s=0.05)
    server, port = build_server(servicer, host="127.0.0.1", port=0)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalScalerStub(channel), clock
    finally:
        servicer.stopping.set()
        channel.close()
        server.stop(grace=None)


def scaled_objects() -> dict[str, dict[str, str]]:
    """Deployment -> the trigger metadata of its ScaledObject, as the chart renders them."""
    docs = render({"autoscaling": {"mode": "keda", "targets": TARGETS}, "inference": {"enabled": False},
                   "podWarmer": {"enabled": False}})
    return {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["triggers"][0]["metadata"]
            for d in docs if d["kind"] == "ScaledObject"}


def keda_asks(stub: pb_grpc.ExternalScalerStub, metadata: dict[str, str]) -> tuple[bool, float]:
    """One KEDA polling round for one ScaledObject: IsActive, the metric spec, GetMetrics."""
    ref = pb.ScaledObjectRef(name="so", namespace="inference", scalerMetadata=metadata)
    active = stub.IsActive(ref, timeout=5).result
    spec = stub.GetMetricSpec(ref, timeout=5).metricSpecs[0]
    value = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=spec.metricName), timeout=5)
    assert value.metricValues[0].metricName == spec.metricName
    return active, value.metricValues[0].metricValueFloat


def test_keda_scales_the_stable_and_canary_deployments_each_on_its_share(
        redis_url: str, clean_env: pytest.MonkeyPatch,
        scaler: tuple[pb_grpc.ExternalScalerStub, Clock]) -> None:
    stub, clock = scaler
    ctx = _ctx(clean_env, redis_url, "keda")
    meta = scaled_objects()
    assert set(meta) == {"tiny-stable", "tiny-canary"}

    def shares() -> dict[str, float]:
        return {dep: keda_asks(stub, m)[1] for dep, m in meta.items()}

    t = clock.t
    for slot in range(DEMAND):
        pod_ready(ctx, "r1", slot, t)
    assert plan_round(ctx, t) == []  # no rollout: the planned revision has the model's whole target
    assert keda_asks(stub, meta["tiny-stable"]) == (True, DEMAND)
    # the canary's Deployment exists before its rollout: a fresh 0 (not a missing record, whose KEDA fallback
    # would start canary pods nothing has proved)
    assert keda_asks(stub, meta["tiny-canary"]) == (False, 0)

    spec = rp.RolloutSpec(model=MODEL, stable="r1", canary="r2", steps=(50, 100), pause_s=1.0,
                          logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2,
                          min_requests=20)
    store = RolloutStore(ctx.client)
    store.update(MODEL, lambda running: rp.start(spec, now=t, live_revisions=["r1"], known_revisions=["r2"],
                                                 running=running))
    t += 1.0
    clock.t = t
    assert plan_round(ctx, t) == ["prepare"]  # the canary's pods for 50% come up before any weight moves
    assert shares() == {"tiny-canary": 2, "tiny-stable": DEMAND}
    # the model's own record still holds the whole demand (what a trigger naming no revision reads)
    assert keda_asks(stub, {"model": MODEL})[1] == DEMAND
    for slot in range(2):
        pod_ready(ctx, "r2", slot, t)
    t += 1.0
    clock.t = t
    assert plan_round(ctx, t) == ["shift"]
    assert store.weights(MODEL) == [("r2", 50.0), ("r1", 50.0)]
    assert shares() == {"tiny-canary": 2, "tiny-stable": DEMAND}  # shrunk only after the gateway has the weights
    t += 0.5
    clock.t = t
    assert plan_round(ctx, t) == ["hold"]
    assert shares() == {"tiny-canary": 2, "tiny-stable": 2}
    t += 1.5
    clock.t = t
    assert plan_round(ctx, t) == ["prepare"]  # the next step's (100%) canary pods, before its shift
    assert shares() == {"tiny-canary": DEMAND, "tiny-stable": 2}
    for slot in range(2, DEMAND):
        pod_ready(ctx, "r2", slot, t)
    t += 1.0
    clock.t = t
    assert plan_round(ctx, t) == ["shift"]
    t += 0.5
    clock.t = t
    assert plan_round(ctx, t) == ["hold"]
    active, value = keda_asks(stub, meta["tiny-stable"])
    assert (active, value) == (False, 0.0)  # KEDA scales the stable Deployment to zero
    assert keda_asks(stub, meta["tiny-canary"]) == (True, DEMAND)
    retire(ctx, "r1", t)
    t += 1.5
    clock.t = t
    assert plan_round(ctx, t) == ["complete"]
    # completed: the planner plans the canary revision, the whole target; the retired one stays a fresh 0
    for _ in range(3):
        t += 100.0  # past the scaler's max age (180 s) since the last live tick: renewed, never stale
        clock.t = t
        assert plan_round(ctx, t) == []
        assert shares() == {"tiny-canary": DEMAND, "tiny-stable": 0}
    assert ctx.client.hget(keys.last_forecast(MODEL), "revision") == "r2"
    ctx.client.close()


def test_a_rollback_gives_the_stable_deployment_the_whole_target_and_the_canary_zero(
        redis_url: str, clean_env: pytest.MonkeyPatch,
        scaler: tuple[pb_grpc.ExternalScalerStub, Clock]) -> None:
    stub, clock = scaler
    ctx = _ctx(clean_env, redis_url, "keda")
    meta = scaled_objects()
    t = clock.t
    for slot in range(DEMAND):
        pod_ready(ctx, "r1", slot, t)
    spec = rp.RolloutSpec(model=MODEL, stable="r1", canary="r2", steps=(50, 100), pause_s=1.0,
                          logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2,
                          min_requests=20)
    store = RolloutStore(ctx.client)
    store.update(MODEL, lambda running: rp.start(spec, now=t, live_revisions=["r1"], known_revisions=["r2"],
                                                 running=running))
    assert plan_round(ctx, t) == ["prepare"]
    assert keda_asks(stub, meta["tiny-canary"]) == (True, 2)
    def abort(s: rp.RolloutState | None) -> rp.RolloutState:  # `prewarm rollout abort`
        assert s is not None
        return rp.abort(s, now=t)

    store.update(MODEL, abort)
    for _ in range(3):
        t += 100.0
        clock.t = t
        plan_round(ctx, t)
        assert keda_asks(stub, meta["tiny-canary"]) == (False, 0)
        assert keda_asks(stub, meta["tiny-stable"]) == (True, DEMAND)
    ctx.client.close()


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def external_metric(samples: list[tuple[str, dict[str, str], float]], metric: dict[str, Any]) -> list[float]:
    """The series an HPA's External metric selects (prometheus-adapter: name, then every matchLabel)."""
    want = metric["selector"]["matchLabels"]
    return [v for name, labels, v in samples
            if name == metric["name"] and all(labels.get(k) == w for k, w in want.items())]


def test_the_hpa_of_each_deployment_reads_its_revisions_share(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ctx = _ctx(clean_env, redis_url, "hpa")
    docs = render({"autoscaling": {"mode": "hpa", "targets": TARGETS}, "inference": {"enabled": False},
                   "podWarmer": {"enabled": False}})
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d["spec"]["metrics"][0]["external"]["metric"]
            for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    t = time.time()
    for slot in range(DEMAND):
        pod_ready(ctx, "r1", slot, t)
    spec = rp.RolloutSpec(model=MODEL, stable="r1", canary="r2", steps=(25, 100), pause_s=1.0,
                          logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2,
                          min_requests=20)
    store = RolloutStore(ctx.client)
    store.update(MODEL, lambda running: rp.start(spec, now=t, live_revisions=["r1"], known_revisions=["r2"],
                                                 running=running))
    assert plan_round(ctx, t) == ["prepare"]
    pod_ready(ctx, "r2", 0, t)
    assert plan_round(ctx, t + 1.0) == ["shift"]
    assert plan_round(ctx, t + 1.5) == ["hold"]  # 25%: canary 1, stable 3
    metrics_port = free_port()
    stop = threading.Event()
    started = threading.Event()
    thread = threading.Thread(target=run, kwargs=dict(client=ctx.client, host="127.0.0.1", port=0,
                                                      max_age_s=180.0, metrics_port=metrics_port, stop=stop,
                                                      ready=lambda _p: started.set()), daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        samples = _scrape(metrics_port)
        assert external_metric(samples, hpas["tiny-canary"]) == [1.0]
        assert external_metric(samples, hpas["tiny-stable"]) == [3.0]
        # a selector naming the model only still reads the model's own target, not the sum with its revisions
        assert external_metric(samples, {"name": "prewarm_planner_target_replicas",
                                         "selector": {"matchLabels": {"model": MODEL}}}) == [float(DEMAND)]
        # a real Prometheus scrapes it, and the query of docs/operating.md's prometheus-adapter rule, with each
        # HPA's selector as its label matchers, returns each Deployment's share (the adapter itself is not here)
        prom = Prometheus(tmp_path, {"keda-scaler": metrics_port})
        try:
            prom.wait_ready()
            for deployment, share in (("tiny-canary", 1.0), ("tiny-stable", 3.0)):
                metric = hpas[deployment]
                matchers = ",".join(f'{k}="{v}"' for k, v in sorted(metric["selector"]["matchLabels"].items()))
                prom.wait_value(f"max({metric['name']}{{{matchers}}}) by (model, revision)", share)
        finally:
            prom.stop()
    finally:
        stop.set()
        thread.join(10)
        ctx.client.close()


@pytest.mark.parametrize("metadata, code, words", [
    ({"model": "tiny", "revision": "r9"}, grpc.StatusCode.UNAVAILABLE, "revision 'r9' of model 'tiny'"),
    ({"model": "tiny@r9"}, grpc.StatusCode.UNAVAILABLE, "revision 'r9' of model 'tiny'"),
    ({"model": "tiny@r1", "revision": "r2"}, grpc.StatusCode.INVALID_ARGUMENT, "two revisions"),
    ({"model": "tiny@"}, grpc.StatusCode.INVALID_ARGUMENT, "no revision"),
    ({"model": "tiny", "revision": "bad rev!"}, grpc.StatusCode.INVALID_ARGUMENT, "revision must be"),
    ({"revision": "r1"}, grpc.StatusCode.INVALID_ARGUMENT, "must name the model"),
])
def test_a_revision_the_planner_has_no_target_for_is_refused_by_name(
        redis_url: str, clean_env: pytest.MonkeyPatch, scaler: tuple[pb_grpc.ExternalScalerStub, Clock],
        metadata: dict[str, str], code: grpc.StatusCode, words: str) -> None:
    stub, clock = scaler
    ctx = _ctx(clean_env, redis_url, "keda")
    plan_round(ctx, clock.t)  # r1 planned, nothing else
    assert keda_asks(stub, {"model": "tiny", "revision": "r1"}) == (True, DEMAND)
    assert keda_asks(stub, {"model": "tiny@r1"}) == (True, DEMAND)  # prewarm's own spelling, the same record
    for call in ("IsActive", "GetMetricSpec"):
        ref = pb.ScaledObjectRef(name="so", namespace="inference", scalerMetadata=metadata)
        if call == "GetMetricSpec" and code is grpc.StatusCode.UNAVAILABLE:
            continue  # the spec names the metric only; it reads no record
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, call)(ref, timeout=5)
        assert err.value.code() is code and words in (err.value.details() or ""), err.value.details()
    ctx.client.close()


def test_each_revision_has_its_own_metric_name() -> None:
    assert metric_name("tiny") == "prewarm-target-tiny"
    assert metric_name("tiny", "r2") == "prewarm-target-tiny-r2"
    assert metric_name("Llama3", "2024.06") == "prewarm-target-llama3-2024-06"



def test_external_push_activates_the_canarys_deployment_when_its_rollout_asks_for_pods(
        redis_url: str, clean_env: pytest.MonkeyPatch,
        scaler: tuple[pb_grpc.ExternalScalerStub, Clock]) -> None:
    """`autoscaling.keda.push`: KEDA holds StreamIsActive open per ScaledObject; the canary's stream turns
    true on the tick that asks for its first step's pods, not on the model's (always active) target."""
    stub, clock = scaler
    ctx = _ctx(clean_env, redis_url, "keda")
    t = clock.t
    for slot in range(DEMAND):
        pod_ready(ctx, "r1", slot, t)
    plan_round(ctx, t)
    canary = pb.ScaledObjectRef(name="so", namespace="inference", scalerMetadata=scaled_objects()["tiny-canary"])
    stream = stub.StreamIsActive(canary, timeout=30)
    try:
        assert next(stream).result is False  # before the rollout: the canary's Deployment stays at zero
        spec = rp.RolloutSpec(model=MODEL, stable="r1", canary="r2", steps=(25, 100), pause_s=1.0,
                              logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2,
                              min_requests=20)
        RolloutStore(ctx.client).update(MODEL, lambda running: rp.start(
            spec, now=t, live_revisions=["r1"], known_revisions=["r2"], running=running))
        assert plan_round(ctx, t + 1.0) == ["prepare"]
        assert next(stream).result is True
    finally:
        stream.cancel()
        ctx.client.close()
