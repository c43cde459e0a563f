"""The planner's target as KEDA sees it: an external scaler (gRPC), and the same number as a gauge.

KEDA (trigger type `external` or `external-push`) asks this server about each ScaledObject;
the trigger's `metadata` names the model (`model: <name>`). The answers come from the
planner's record in Redis (`prewarm.registry.targets.read_target`), never from a choice made
here: this module is an adapter.

- `IsActive` / `StreamIsActive`: the planner wants at least one replica. This is KEDA's
  activation: false lets KEDA scale the Deployment to `minReplicaCount` (0: to zero), true
  brings it back from zero. The stream sends the current answer at once and then every
  change it sees while polling the record.
- `GetMetricSpec`: one metric per ScaledObject, `prewarm-target-<model>`, with target size 1.
- `GetMetrics`: the planner's replica count now. With KEDA's default metric type
  (`AverageValue`) the HPA KEDA manages computes `ceil(value / 1)` = the planner's count
  (within the HPA's ±10% tolerance), bounded by `minReplicaCount`/`maxReplicaCount`.

No record, a record older than `max_age_s`, or Redis down are answered with gRPC
`UNAVAILABLE` (a missing `model` with `INVALID_ARGUMENT`): KEDA counts these as scaler
errors and, after `fallback.failureThreshold` of them, holds `fallback.replicas`.

`TargetCollector` exports the same number as `prewarm_planner_target_replicas{model}` for
prometheus-adapter (the HPA's `External` metric) or KEDA's Prometheus scaler; it reads the
record at scrape time, so the value is the one for the scrape's `now`.

It lives beside the HTTP gateway: both are servers answering outsiders from the registry
(import-linter keeps `prewarm.registry` and `prewarm.adapters` independent, so a reader of
the registry that serves clients sits one layer above them).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent import futures
from typing import Callable, Iterable, Iterator

import grpc
import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prewarm.core.errors import PrewarmError, TemporaryError
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.targets import ReplicaTarget, read_target, recorded_models

log = logging.getLogger("prewarm.keda")

#: The trigger metadata key naming the model.
MODEL_KEY = "model"
#: Gauge names (also listed in `prewarm.core.metrics.EXPORTED`).
TARGET_METRIC = "prewarm_planner_target_replicas"
TARGET_AGE_METRIC = "prewarm_planner_target_age_seconds"

Clock = Callable[[], float]


def metric_name(model: str) -> str:
    """The external metric name of a model's target (KEDA prefixes it with the trigger index)."""
    return "prewarm-target-" + re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")


class TargetScaler(pb_grpc.ExternalScalerServicer):
    """KEDA's ExternalScaler service over the planner's records in one Redis."""

    def __init__(self, client: "redis.Redis[str]", *, max_age_s: float, clock: Clock = time.time,
                 stream_poll_s: float = 1.0) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self.clock = clock
        self.stream_poll_s = stream_poll_s
        self.stopping = threading.Event()

    def _target(self, ref: pb.ScaledObjectRef, context: grpc.ServicerContext) -> ReplicaTarget:
        model = ref.scalerMetadata.get(MODEL_KEY, "").strip()
        if not model:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"ScaledObject {ref.namespace}/{ref.name}: its trigger metadata must name the model "
                          f"({MODEL_KEY}: <name>)")
        try:
            return read_target(self.client, model, now=self.clock(), max_age_s=self.max_age_s)
        except TemporaryError as exc:
            log.warning("ScaledObject %s/%s (model %s): %s", ref.namespace, ref.name, model, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PrewarmError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        raise AssertionError("unreachable: context.abort raises")

    def IsActive(self, request: pb.ScaledObjectRef, context: grpc.ServicerContext) -> pb.IsActiveResponse:  # noqa: N802
        return pb.IsActiveResponse(result=self._target(request, context).active)

    def StreamIsActive(self, request: pb.ScaledObjectRef,  # noqa: N802
                       context: grpc.ServicerContext) -> Iterator[pb.IsActiveResponse]:
        last: bool | None = None
        while context.is_active() and not self.stopping.is_set():
            active = self._target(request, context).active
            if active != last:
                last = active
                yield pb.IsActiveResponse(result=active)
            self.stopping.wait(self.stream_poll_s)

    def GetMetricSpec(self, request: pb.ScaledObjectRef,  # noqa: N802
                      context: grpc.ServicerContext) -> pb.GetMetricSpecResponse:
        model = request.scalerMetadata.get(MODEL_KEY, "").strip()
        if not model:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"trigger metadata must name the model ({MODEL_KEY})")
        return pb.GetMetricSpecResponse(
            metricSpecs=[pb.MetricSpec(metricName=metric_name(model), targetSize=1, targetSizeFloat=1.0)])

    def GetMetrics(self, request: pb.GetMetricsRequest, context: grpc.ServicerContext) -> pb.GetMetricsResponse:  # noqa: N802
        target = self._target(request.scaledObjectRef, context)
        name = request.metricName or metric_name(target.model)
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=name, metricValue=target.replicas, metricValueFloat=float(target.replicas))])


class TargetCollector(Collector):
    """`prewarm_planner_target_replicas{model}` (and its age), read from Redis at scrape time."""

    def __init__(self, client: "redis.Redis[str]", *, max_age_s: float, clock: Clock = time.time,
                 models: Callable[[], Iterable[str]] | None = None) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self.clock = clock
        self.models = models or (lambda: recorded_models(client))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily(TARGET_METRIC, "Replicas the planner wants running now (warm pool included); "
                                     "absent while its record is missing or stale", labels=["model"])
        age = GaugeMetricFamily(TARGET_AGE_METRIC, "Age of the planner's target schedule", labels=["model"])
        now = self.clock()
        try:
            names = list(self.models())
        except PrewarmError as exc:
            log.warning("planner targets not readable: %s", exc)
            names = []
        for model in names:
            try:
                target = read_target(self.client, model, now=now, max_age_s=self.max_age_s)
            except PrewarmError:
                continue  # no sample: prometheus-adapter reports the metric missing, the HPA holds its count
            replicas.add_metric([model], float(target.replicas))
            age.add_metric([model], target.age_s)
        yield replicas
        yield age


def build_server(scaler: TargetScaler, *, host: str, port: int, workers: int = 8) -> tuple[grpc.Server, int]:
    """A started-not-yet gRPC server with the ExternalScaler service bound; returns it and the bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="keda"))
    pb_grpc.add_ExternalScalerServicer_to_server(scaler, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound


def run(client: "redis.Redis[str]", *, host: str, port: int, max_age_s: float, metrics_port: int | None = None,
        stop: threading.Event | None = None, ready: Callable[[int], None] | None = None) -> int:
    """`prewarm keda-scaler`: serve until `stop` is set (the CLI sets it on SIGTERM/SIGINT)."""
    from prometheus_client import CollectorRegistry, start_http_server

    stop = stop or threading.Event()
    scaler = TargetScaler(client, max_age_s=max_age_s)
    server, bound = build_server(scaler, host=host, port=port)
    if metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(TargetCollector(client, max_age_s=max_age_s))
        start_http_server(metrics_port, addr=host, registry=registry)
    server.start()
    log.info("KEDA external scaler listening on %s:%d (targets older than %.0fs are refused)%s", host, bound,
             max_age_s, f"; /metrics on :{metrics_port}" if metrics_port is not None else "")
    if ready is not None:
        ready(bound)
    try:
        stop.wait()
    finally:
        scaler.stopping.set()
        server.stop(grace=2.0).wait()
    return 0
