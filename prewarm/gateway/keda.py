"""The planner's target as KEDA sees it: an external scaler (gRPC), and the same number as a gauge.

KEDA (trigger type `external` or `external-push`) asks this server about each ScaledObject;
the trigger's `metadata` names the model (`model: <name>`) and, for one Deployment of a model
served by several (a rollout's stable and canary), its revision (`revision: <rev>`, or in
prewarm's own spelling `model: <name>@<rev>`): the scaler then serves that revision's share
(`read_target(..., revision=...)`). A revision the planner has no record for is UNAVAILABLE,
as an unknown model is. The answers come from the
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
record at scrape time, so the value is the one for the scrape's `now`. Each revision's target
is its own gauge, `prewarm_planner_revision_target_replicas{model,revision}`: a second metric,
not a `revision` label on the first, because an HPA selecting `{model: m}` would otherwise sum
the model's series with its revisions'.

It lives beside the HTTP gateway: both are servers answering outsiders from the registry
(import-linter keeps `prewarm.registry` and `prewarm.adapters` independent, so a reader of
the registry that serves clients sits one layer above them).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable, Iterator, Mapping

import grpc
import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prewarm.core.domain import check_name
from prewarm.core.errors import InvalidPayload, PrewarmError, SettingsError, TemporaryError
from prewarm.core.settings import KedaSettings
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.targets import ReplicaTarget, read_target, recorded_models, recorded_revisions

log = logging.getLogger("prewarm.keda")

#: The trigger metadata key naming the model.
MODEL_KEY = "model"
#: The trigger metadata key naming the revision (optional: without it, the model's own target).
REVISION_KEY = "revision"
#: The trigger metadata keys carrying the scaler's token (`keda.token`). KEDA sends an external scaler the
#: trigger's `metadata` only (never a TriggerAuthentication's parameters); a key ending in `FromEnv` it resolves
#: from the scaled Deployment's container environment and sends under the same key, so `tokenFromEnv:
#: PREWARM_KEDA_TOKEN` (that variable set from a Secret) keeps the token out of the ScaledObject.
TOKEN_KEY = "token"
TOKEN_FROM_ENV_KEY = "tokenFromEnv"
#: Gauge names (also listed in `prewarm.core.metrics.EXPORTED`).
TARGET_METRIC = "prewarm_planner_target_replicas"
TARGET_AGE_METRIC = "prewarm_planner_target_age_seconds"
REVISION_TARGET_METRIC = "prewarm_planner_revision_target_replicas"
REVISION_TARGET_AGE_METRIC = "prewarm_planner_revision_target_age_seconds"

Clock = Callable[[], float]


def metric_name(model: str, revision: str | None = None) -> str:
    """The external metric name of a model's (or one revision's) target (KEDA prefixes it with the trigger
    index)."""
    name = model if revision is None else f"{model}-{revision}"
    return "prewarm-target-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def target_ref(metadata: Mapping[str, str]) -> tuple[str, str | None]:
    """The model and revision (None: the model's own target) a trigger's metadata names: `model: m` with an
    optional `revision: r`, or `model: m@r`. ValueError naming what is wrong."""
    model, sep, inline = metadata.get(MODEL_KEY, "").strip().partition("@")
    revision = metadata.get(REVISION_KEY, "").strip()
    if not model:
        raise ValueError(f"its trigger metadata must name the model ({MODEL_KEY}: <name>, optionally with "
                         f"{REVISION_KEY}: <revision>)")
    if sep and revision and inline != revision:
        raise ValueError(f"its trigger metadata names two revisions: {MODEL_KEY} {model}@{inline} and "
                         f"{REVISION_KEY} {revision}")
    revision = revision or inline
    if sep and not revision:
        raise ValueError(f"its trigger metadata {MODEL_KEY} {model}@ names no revision after '@'")
    try:
        check_name(model, "model")
        if revision:
            check_name(revision, "revision")
    except InvalidPayload as exc:
        raise ValueError(f"its trigger metadata: {exc}") from exc
    return model, revision or None


class TargetScaler(pb_grpc.ExternalScalerServicer):
    """KEDA's ExternalScaler service over the planner's records in one Redis (grpc.aio).

    Issue 20: each `StreamIsActive` held one of 8 worker threads, so 8 open streams left
    `IsActive`/`GetMetrics` no thread and KEDA's calls missed their deadline. Every call is a
    coroutine now; a Redis read borrows a thread for its few milliseconds only (`to_thread`), and
    the streams open at once are bounded (`max_streams`, RESOURCE_EXHAUSTED past it). With a
    `token`, a call without it is UNAUTHENTICATED.
    """

    def __init__(self, client: "redis.Redis[str]", *, max_age_s: float, clock: Clock = time.time,
                 stream_poll_s: float = 1.0, max_streams: int = 256, token: str | None = None) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self.clock = clock
        self.stream_poll_s = stream_poll_s
        self.max_streams = max_streams
        self.token = token
        self.streams = 0
        self.stopping = threading.Event()

    async def _authorized(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> None:
        if self.token is None:
            return
        given = ref.scalerMetadata.get(TOKEN_FROM_ENV_KEY) or ref.scalerMetadata.get(TOKEN_KEY, "")
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                given = value[7:]
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"ScaledObject {ref.namespace}/{ref.name}: the scaler's token is missing or wrong "
                                f"(trigger metadata {TOKEN_FROM_ENV_KEY} or {TOKEN_KEY}, or authorization: "
                                f"Bearer <token>)")

    async def _ref(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> tuple[str, str | None]:
        """The model and revision the ScaledObject's trigger names; INVALID_ARGUMENT naming what is wrong."""
        try:
            return target_ref(ref.scalerMetadata)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ScaledObject {ref.namespace}/{ref.name}: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    async def _target(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> ReplicaTarget:
        await self._authorized(ref, context)
        model, revision = await self._ref(ref, context)
        try:
            return await asyncio.to_thread(read_target, self.client, model, now=self.clock(), max_age_s=self.max_age_s,
                                           revision=revision)
        except TemporaryError as exc:
            log.warning("ScaledObject %s/%s (model %s%s): %s", ref.namespace, ref.name, model,
                        f", revision {revision}" if revision else "", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PrewarmError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        raise AssertionError("unreachable: context.abort raises")

    async def IsActive(self, request: pb.ScaledObjectRef,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=(await self._target(request, context)).active)

    async def StreamIsActive(self, request: pb.ScaledObjectRef,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.IsActiveResponse]:
        await self._authorized(request, context)
        if self.streams >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_streams} StreamIsActive streams are open already (keda.max_streams)")
        self.streams += 1
        try:
            last: bool | None = None
            while not self.stopping.is_set():
                active = (await self._target(request, context)).active
                if active != last:
                    last = active
                    yield pb.IsActiveResponse(result=active)
                await asyncio.sleep(self.stream_poll_s)
        finally:
            self.streams -= 1

    async def GetMetricSpec(self, request: pb.ScaledObjectRef,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.GetMetricSpecResponse:
        await self._authorized(request, context)
        model, revision = await self._ref(request, context)
        return pb.GetMetricSpecResponse(
            metricSpecs=[pb.MetricSpec(metricName=metric_name(model, revision), targetSize=1, targetSizeFloat=1.0)])

    async def GetMetrics(self, request: pb.GetMetricsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.GetMetricsResponse:
        target = await self._target(request.scaledObjectRef, context)
        name = request.metricName or metric_name(target.model, target.revision)
        return pb.GetMetricsResponse(metricValues=[
            pb.MetricValue(metricName=name, metricValue=target.replicas, metricValueFloat=float(target.replicas))])


class TargetCollector(Collector):
    """`prewarm_planner_target_replicas{model}` and `prewarm_planner_revision_target_replicas{model,revision}`
    (and their ages), read from Redis at scrape time."""

    def __init__(self, client: "redis.Redis[str]", *, max_age_s: float, clock: Clock = time.time,
                 models: Callable[[], Iterable[str]] | None = None,
                 revisions: Callable[[], Iterable[tuple[str, str]]] | None = None) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self.clock = clock
        self.models = models or (lambda: recorded_models(client))
        self.revisions = revisions or (lambda: recorded_revisions(client))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily(TARGET_METRIC, "Replicas the planner wants running now (warm pool included); "
                                     "absent while its record is missing or stale", labels=["model"])
        age = GaugeMetricFamily(TARGET_AGE_METRIC, "Age of the planner's target schedule", labels=["model"])
        rev_replicas = GaugeMetricFamily(REVISION_TARGET_METRIC, "Replicas the planner wants running now for one "
                                         "revision of a model (its share while a rollout runs); absent while its "
                                         "record is missing or stale", labels=["model", "revision"])
        rev_age = GaugeMetricFamily(REVISION_TARGET_AGE_METRIC, "Age of the planner's target of one revision",
                                    labels=["model", "revision"])
        now = self.clock()
        for model, revision in self._refs():
            try:
                target = read_target(self.client, model, now=now, max_age_s=self.max_age_s, revision=revision)
            except PrewarmError:
                continue  # no sample: prometheus-adapter reports the metric missing, the HPA holds its count
            if revision is None:
                replicas.add_metric([model], float(target.replicas))
                age.add_metric([model], target.age_s)
            else:
                rev_replicas.add_metric([model, revision], float(target.replicas))
                rev_age.add_metric([model, revision], target.age_s)
        yield replicas
        yield age
        yield rev_replicas
        yield rev_age

    def _refs(self) -> list[tuple[str, str | None]]:
        out: list[tuple[str, str | None]] = []
        try:
            out += [(model, None) for model in self.models()]
            out += list(self.revisions())
        except PrewarmError as exc:
            log.warning("planner targets not readable: %s", exc)
        return out


class ScalerServer:
    """The grpc.aio server on its own event loop thread, with a blocking start/stop for the CLI and tests."""

    def __init__(self, scaler: TargetScaler, address: str, credentials: grpc.ServerCredentials | None) -> None:
        self.scaler = scaler
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="keda-scaler", daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._bind(address, credentials), self.loop).result(30)

    async def _bind(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalScalerServicer_to_server(self.scaler, self.server)
        bound = (self.server.add_secure_port(address, credentials) if credentials is not None
                 else self.server.add_insecure_port(address))
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        return bound

    def start(self) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self, grace: float | None = None) -> None:
        self.scaler.stopping.set()
        if self.server is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(30 + (grace or 0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"keda.{what}: cannot read {path}: {exc}") from exc


def server_credentials(cfg: KedaSettings) -> grpc.ServerCredentials | None:
    """TLS as KEDA's external scaler speaks it: a certificate, and with a client CA, mutual TLS."""
    if cfg.tls_cert_file is None and cfg.tls_key_file is None:
        if cfg.tls_client_ca_file is not None:
            raise SettingsError("keda.tls_client_ca_file needs keda.tls_cert_file and keda.tls_key_file")
        return None
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        raise SettingsError("keda.tls_cert_file and keda.tls_key_file go together: set both or neither")
    pair = (_read(cfg.tls_key_file, "tls_key_file"), _read(cfg.tls_cert_file, "tls_cert_file"))
    ca = _read(cfg.tls_client_ca_file, "tls_client_ca_file") if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def build_server(scaler: TargetScaler, *, host: str, port: int,
                 credentials: grpc.ServerCredentials | None = None) -> tuple[ScalerServer, int]:
    """A started-not-yet gRPC server with the ExternalScaler service bound; returns it and the bound port."""
    server = ScalerServer(scaler, f"{host}:{port}", credentials)
    return server, server.port


def run(client: "redis.Redis[str]", *, host: str, port: int, max_age_s: float, metrics_port: int | None = None,
        stop: threading.Event | None = None, ready: Callable[[int], None] | None = None,
        cfg: KedaSettings | None = None) -> int:
    """`prewarm keda-scaler`: serve until `stop` is set (the CLI sets it on SIGTERM/SIGINT)."""
    from prometheus_client import CollectorRegistry, start_http_server

    cfg = cfg or KedaSettings()
    stop = stop or threading.Event()
    token = cfg.token.get_secret_value() if cfg.token is not None else None
    scaler = TargetScaler(client, max_age_s=max_age_s, stream_poll_s=cfg.stream_poll_s, max_streams=cfg.max_streams,
                          token=token)
    credentials = server_credentials(cfg)
    server, bound = build_server(scaler, host=host, port=port, credentials=credentials)
    if metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(TargetCollector(client, max_age_s=max_age_s))
        start_http_server(metrics_port, addr=host, registry=registry)
    server.start()
    log.info("KEDA external scaler listening on %s:%d%s%s (targets older than %.0fs are refused, at most %d streams)%s",
             host, bound, " with TLS" if credentials else "", " and a token" if token else "", max_age_s,
             cfg.max_streams, f"; /metrics on :{metrics_port}" if metrics_port is not None else "")
    if ready is not None:
        ready(bound)
    try:
        stop.wait()
    finally:
        server.stop(grace=2.0)
    return 0
