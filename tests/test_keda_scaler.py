"""The planner's target reaches KEDA: planner record in Redis → external scaler (gRPC) → replica count.

What runs for real: Redis (conftest), the planner step (`forecasting.planner.plan`) and the
record writer `plan_model` uses, the gRPC server of `prewarm.gateway.keda` and a gRPC client
made from the same `externalscaler.proto` KEDA is built from, the CLI subprocess
`prewarm keda-scaler`, and the Prometheus endpoint. What stands in for KEDA and the HPA it
manages is `keda_replicas` below: their documented arithmetic (KEDA's activation and
`minReplicaCount`, the HPA's `AverageValue` rule with its 10% tolerance), not their code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from forecasting.planner import (
    BatchJob,
    PlannerParams,
    PlannerState,
    ReplicaCounts,
    StepInputs,
    observed_from_counts,
    step,
)
from prewarm.core import keys
from prewarm.core.domain import ModelSpec
from prewarm.registry.embedded import free_port
from prewarm.gateway.keda import TARGET_METRIC, TargetScaler, build_server, metric_name, run
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.targets import schedule_fields
from tests.test_cluster import JOB_AT, _planner_ctx
from workers.app import make_app
from workers.planning.forecast import forecast_and_plan
from workers.planning.tasks import handle_demand_for
from workers.planning.kubernetes import target_schedule

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
SPEC = ModelSpec(MODEL, "r1", slots=8)
#: One rise to 4 replicas between 120 s and 240 s past each hour (a batch job the planner knows of), nothing
#: else; the schedule looks 10 minutes ahead.
PARAMS = PlannerParams(warm_pool_size=0, budget_share=1.0, margin_initial=1.5, default_cold_start_s=20.0, lead_margin_s=10.0,
                       min_serving=0, stabilization_s=0.0, schedule_horizon_s=600.0,
                       batch_jobs=(BatchJob(cron="2 * * * *", model=MODEL, replicas=4, duration_s=120.0),))
#: The tests planned at the wall clock (a served target must be fresh by it) plan without the batch job: within its
#: lead of minute 2 of an hour it added its 4 replicas to what they assert (CI at 18:02 read 8, not 4).
UNSCHEDULED = dataclasses.replace(PARAMS, batch_jobs=())


def keda_replicas(*, active: bool, metric: float, target: float, current: int, min_rc: int = 0,
                  max_rc: int = 10, tolerance: float = 0.1) -> int:
    """The count KEDA and its HPA converge to for one ScaledObject with one `external` trigger
    (KEDA docs: "Scaling Deployments" and "External Scalers"; Kubernetes docs: HPA algorithm).

    No active trigger: KEDA scales to minReplicaCount (0 scales to zero, after cooldownPeriod).
    Active at 0 replicas: KEDA activates the Deployment to max(minReplicaCount, 1), then the HPA
    takes over: with metric type AverageValue, desired = ceil(metric / target), unless the
    per-pod ratio is within the tolerance of 1; bounded by [max(minReplicaCount, 1), maxReplicaCount]."""
    if not active:
        return min_rc
    current = max(current, min_rc, 1)
    ratio = (metric / current) / target
    desired = current if abs(ratio - 1.0) <= tolerance else math.ceil(metric / target)
    return min(max(desired, min_rc, 1), max_rc)


def record_plan(client: "redis.Redis[str]", *, live: int, now: float, inflight: float = 0.0,
                params: PlannerParams = PARAMS) -> list[tuple[float, int]]:
    """Plan with the real planner at `now` (an hour of `inflight` requests in flight behind it; the batch
    rise of PARAMS unless `params` drop it) and write the target as `plan_model` does."""
    y = [inflight] * 360
    observed = observed_from_counts(now - 3600.0, 10.0, y, y, [v * 10.0 for v in y])
    decision, _ = step(StepInputs(SPEC, now, observed, ReplicaCounts(ready=live), params), PlannerState())
    schedule = target_schedule(decision, now)
    client.hset(keys.last_forecast(MODEL), mapping={"status": "planned", "at": repr(now),
                                                    **schedule_fields(schedule, planned_at=now)})
    return schedule


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def scaler(redis_client: "redis.Redis[str]") -> Iterator[tuple[pb_grpc.ExternalScalerStub, Clock]]:
    clock = Clock()
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


def ref(model: str | None = MODEL) -> pb.ScaledObjectRef:
    meta = {"scalerAddress": "prewarm-keda-scaler:9090"} | ({"model": model} if model else {})
    return pb.ScaledObjectRef(name=f"{MODEL}-inference", namespace="inference", scalerMetadata=meta)


def keda_round(stub: pb_grpc.ExternalScalerStub, current: int) -> int:
    """One KEDA polling round: IsActive, the metric spec and value, then the count applied."""
    active = stub.IsActive(ref(), timeout=5).result
    spec = stub.GetMetricSpec(ref(), timeout=5).metricSpecs[0]
    value = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName=spec.metricName),
                            timeout=5).metricValues[0]
    assert value.metricName == spec.metricName == metric_name(MODEL)
    assert value.metricValue == int(value.metricValueFloat)
    return keda_replicas(active=active, metric=value.metricValueFloat, target=spec.targetSizeFloat, current=current)


def test_a_rise_and_a_fall_reach_keda_from_and_to_zero(
        scaler: tuple[pb_grpc.ExternalScalerStub, Clock], redis_client: "redis.Redis[str]") -> None:
    stub, clock = scaler
    # t=0: nothing wanted before 120 s; the rise to 4 is due at 90 s (the 20 s cold start + 10 s margin ahead)
    assert record_plan(redis_client, live=0, now=0.0) == [(0.0, 0), (90.0, 4), (240.0, 0)]
    replicas = 0
    clock.t = 10.0
    replicas = keda_round(stub, replicas)
    assert replicas == 0  # inactive: the Deployment stays at zero
    clock.t = 95.0  # no new planning round: the scaler reads the schedule's step due at 90 s
    replicas = keda_round(stub, replicas)
    assert replicas == 4  # activated from zero, then the HPA's AverageValue rule: ceil(4 / 1)
    clock.t = 130.0
    record_plan(redis_client, live=4, now=130.0)
    assert keda_round(stub, replicas) == 4  # steady: within tolerance, nothing changes
    clock.t = 250.0  # the forecast falls to nothing at 240 s: the planner releases all four
    assert record_plan(redis_client, live=4, now=250.0) == [(250.0, 0)]
    replicas = keda_round(stub, replicas)
    assert replicas == 0  # deactivated: KEDA scales to minReplicaCount 0


def test_stream_is_active_pushes_each_change(scaler: tuple[pb_grpc.ExternalScalerStub, Clock],
                                             redis_client: "redis.Redis[str]") -> None:
    stub, clock = scaler
    record_plan(redis_client, live=0, now=0.0)
    stream = stub.StreamIsActive(ref(), timeout=20)
    try:
        assert next(stream).result is False  # the current answer, at once
        clock.t = 91.0  # the rise's step falls due
        assert next(stream).result is True
        clock.t = 250.0
        record_plan(redis_client, live=4, now=250.0)
        assert next(stream).result is False
    finally:
        stream.cancel()


def test_errors_are_grpc_statuses_keda_counts_as_scaler_failures(
        scaler: tuple[pb_grpc.ExternalScalerStub, Clock], redis_client: "redis.Redis[str]") -> None:
    stub, clock = scaler
    with pytest.raises(grpc.RpcError) as missing:
        stub.IsActive(ref(None), timeout=5)
    assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "model" in (missing.value.details() or "")
    with pytest.raises(grpc.RpcError) as unknown:
        stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName="x"), timeout=5)
    assert unknown.value.code() is grpc.StatusCode.UNAVAILABLE  # no planner record yet: KEDA's fallback applies
    record_plan(redis_client, live=0, now=0.0)
    clock.t = 1000.0  # the planner stopped: older than max_age_s (180 s)
    with pytest.raises(grpc.RpcError) as stale:
        stub.IsActive(ref(), timeout=5)
    assert stale.value.code() is grpc.StatusCode.UNAVAILABLE and "old" in (stale.value.details() or "")
    # a failed planning round rewrites the record's "at" but not the target's own time: still stale
    redis_client.hset(keys.last_forecast(MODEL), mapping={"status": "error: boom", "at": repr(clock.t)})
    with pytest.raises(grpc.RpcError):
        stub.IsActive(ref(), timeout=5)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["model"]: s.value for fam in text_string_to_metric_families(text) if fam.name == TARGET_METRIC
            for s in fam.samples}


def test_the_same_target_is_a_prometheus_gauge(redis_client: "redis.Redis[str]") -> None:
    """What prometheus-adapter (the HPA's External metric) or KEDA's Prometheus scaler reads."""
    now = time.time()
    record_plan(redis_client, live=0, now=now, inflight=24.0, params=UNSCHEDULED)  # 24 in flight: 4 replicas of 8 slots
    metrics_port = free_port()
    stop = threading.Event()
    started = threading.Event()
    thread = threading.Thread(target=run, kwargs=dict(client=redis_client, host="127.0.0.1", port=0,
                                                      max_age_s=180.0, metrics_port=metrics_port, stop=stop,
                                                      ready=lambda _p: started.set()), daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        assert _scrape(metrics_port) == {MODEL: 4.0}
        redis_client.hset(keys.last_forecast("other"), mapping={"status": "cold", "at": "0"})  # no target: no sample
        assert _scrape(metrics_port) == {MODEL: 4.0}
    finally:
        stop.set()
        thread.join(10)


def test_prewarm_keda_scaler_command_serves_keda(redis_url: str, redis_client: "redis.Redis[str]") -> None:
    now = time.time()
    record_plan(redis_client, live=4, now=now, inflight=24.0, params=UNSCHEDULED)  # 4 replicas wanted
    port = free_port()
    env = {**os.environ, "PREWARM_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "prewarm.cli", "keda-scaler", "--port", str(port),
                             "--host", "127.0.0.1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening" in line, line
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            assert stub.IsActive(ref(), timeout=5).result is True
            got = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref(), metricName=metric_name(MODEL)),
                                  timeout=5)
            assert got.metricValues[0].metricValueFloat == 4.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_checked_in_modules_are_what_grpc_tools_generates(tmp_path: Path) -> None:
    from grpc_tools import protoc

    proto = "prewarm/gateway/kedaproto/externalscaler.proto"
    (tmp_path / proto).parent.mkdir(parents=True)
    (tmp_path / proto).write_text((ROOT / proto).read_text())
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", str(tmp_path / proto)]
    assert protoc.main(args) == 0
    for name in ("externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py"):
        assert (tmp_path / proto).with_name(name).read_text() == (ROOT / proto).with_name(name).read_text(), \
            f"{name} is stale: run `make proto`"


def test_the_live_planning_task_drives_keda_through_the_scaler(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The whole path with nothing written by hand: `forecast_and_plan` (the beat's task body) records
    the target, the scaler serves it over gRPC, and KEDA's rule turns it into replicas."""
    ctx = _planner_ctx(clean_env, redis_url, tmp_path / "unused-kubeconfig", "keda")
    clock = Clock(JOB_AT - 60.0)
    servicer = TargetScaler(ctx.client, max_age_s=180.0, clock=clock)
    server, port = build_server(servicer, host="127.0.0.1", port=0)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            forecast_and_plan(ctx, now=clock.t)  # no traffic, min_serving 0: nothing wanted yet
            replicas = keda_round(stub, 0)
            assert replicas == 0
            clock.t = JOB_AT - 5.0  # the batch job's 3 replicas are due one lead (18.7 s) ahead of it
            replicas = keda_round(stub, replicas)
            assert replicas == 3
            clock.t = JOB_AT + 200.0  # the job is over
            forecast_and_plan(ctx, now=clock.t)
            assert keda_round(stub, replicas) == 0
    finally:
        server.stop(grace=None)
        ctx.client.close()


def test_unmet_demand_activates_keda_from_zero(redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing forecast, nothing running: a request the gateway could not serve re-plans the model at
    once, and the next IsActive brings the Deployment back from zero (before the demand reaches the
    forecast, which only sees complete buckets)."""
    ctx = _planner_ctx(clean_env, redis_url, tmp_path / "unused-kubeconfig", "keda")
    clock = Clock(JOB_AT - 300.0)
    ctx = dataclasses.replace(ctx, clock=clock)
    servicer = TargetScaler(ctx.client, max_age_s=180.0, clock=clock)
    server, port = build_server(servicer, host="127.0.0.1", port=0)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            forecast_and_plan(ctx, now=clock.t)
            assert stub.IsActive(ref(), timeout=5).result is False
            ctx.client.hset(keys.demand(MODEL), mapping={"count": "1", "last": repr(clock.t)})  # as the gateway does
            assert handle_demand_for(ctx, make_app(ctx.settings), MODEL)["outcome"] == "planned"
            assert stub.IsActive(ref(), timeout=5).result is True
            assert keda_round(stub, 0) == 1
    finally:
        server.stop(grace=None)
        ctx.client.close()
