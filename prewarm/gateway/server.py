"""The HTTP gateway: an OpenAI-compatible front door that routes each request to a replica.

It reads the `model` field, asks the pure routing policy (`prewarm.policy.routing`) for a
replica using the registry's one-round-trip view, and proxies the request, streaming
included. When nothing is ready it holds the request up to `gateway.hold_timeout_s`
(like Knative's activator) or answers 503 with Retry-After, and records the unmet demand
in Redis either way. It never answers 500 for a condition it can name: bad input is a
4xx, an unreachable or broken replica a 502, an unavailable registry a 503, every replica
at its in-flight limit (`replica_queue_limit`) a 429, a replica silent for the idle
timeout (`upstream_timeout_s`, between two reads) a 504.

What a client sends never counts against a replica (issue 13): only a connection that
fails or breaks mid-answer does; any HTTP answer, a 500 included, proves the replica alive
and is passed through, not re-sent. A broken replica that still answers is the agent's to
find (its `/readyz` health check). A client that goes away mid-stream ends the relay and
nothing else. Connection limits (header timeout, per-client cap) are in `guard.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prewarm.core import json_body, keys, signing
from prewarm.registry.counters import RequestCounter, announce_demand, demand_met, record_demand
from prewarm.core.domain import ReplicaState
from prewarm.core.errors import IllegalTransition, RegistryUnavailable, ReplicaNotFound
from prewarm.core.metrics import Metrics, RegistryCollector
from prewarm.registry.connection import async_client, sync_client
from prewarm.registry.replicas import AsyncRegistryReader, ReplicaRegistry, RoutingView
from prewarm.gateway.fairness import FairTurns
from prewarm.gateway.guard import ConnectionGate, serve
from prewarm.gateway.nonces import SharedNonces
from prewarm.gateway.revisions import REQUEST_KEY, RevisionSplit, narrow
from prewarm.gateway.upstream_auth import UpstreamKeys
from prewarm.gateway.registry_view import RegistryViews
from prewarm.policy.stale_view import StalenessRule, may_serve_stale
from prewarm.policy.revisions import RevisionChoiceKind
from prewarm.gateway.client_auth import ClientKeys
from prewarm.gateway.limits import CLIENT_NAME_KEY, TICKET_KEY, BodyTimeout, ClientStalled, Limits, read_body, write as write_client
from prewarm.policy.engine_load import merged_inflight, model_level
from prewarm.policy.routing import RouteDecision, RouteOutcome, choose_replica
from prewarm.core.settings import Settings

log = logging.getLogger(__name__)

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"content-type", "accept", signing.HEADER.lower(), signing.HEADER_TS.lower(), signing.HEADER_SIG.lower(),
                signing.HEADER_NONCE.lower()}
_UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


def _error(status: int, message: str, code: str, *, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _is_demand(status: int) -> bool:
    """Whether an answered request is demand the planner should serve: everything but a 4xx — counting
    requests refused as invalid would let any client make the planner scale up with cheap bad requests,
    and counting 429s would count each client that retries as told once per retry (issue 20)."""
    return not 400 <= status < 500


@dataclass
class GatewayState:
    """What the gateway tracks in memory: requests in flight and failures per replica."""

    inflight: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, float] = field(default_factory=dict)  # replica id -> until (monotonic)

    def exclusions(self, now: float) -> frozenset[str]:
        for rid in [r for r, until in self.excluded.items() if until <= now]:
            del self.excluded[rid]
        return frozenset(self.excluded)


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method) as the same JSON error body as the rest."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        reason = exc.reason or "error"
        return _error(exc.status, f"{request.method} {request.path}: {reason}", reason.lower().replace(" ", "_"),
                      headers=headers)


class Gateway:
    def __init__(self, settings: Settings, metrics_registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.cfg = settings.gateway
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = Metrics(self.metrics_registry)
        self.state = GatewayState()
        self.limits = Limits(self.cfg)  # body/write deadlines, clients behind trusted proxies, fair admission
        self.turns = FairTurns()  # past the replicas' concurrency, requests wait their client's turn here
        self.gate = ConnectionGate(self.cfg.header_timeout_s, self.cfg.max_connections_per_client,
                                   trusted=self.limits.trusted, retry_after_s=self.cfg.retry_after_s)
        self.counter = RequestCounter()
        self.secret = settings.warmup.secret.get_secret_value() if settings.warmup.secret else None
        key = settings.runtime.api_key  # each replica's own key, or the runtimes' (a client's own never passes)
        self.upstream_keys = UpstreamKeys(key.get_secret_value() if key is not None else None,
                                          self.cfg.upstream_keys_dir, self.cfg.upstream_keys_refresh_s)
        self.client_keys = ClientKeys(self.cfg.client_keys_dir, self.cfg.client_keys_refresh_s)  # who may call
        self.configured_models = {m.split("@", 1)[0] for m in settings.planner.models}
        self.redis = async_client(settings.redis)
        self.nonces = SharedNonces(self.redis, self.secret)  # a replayed warmup request is user traffic (all gateways)
        self.reader = AsyncRegistryReader(self.redis)
        self.views = RegistryViews(self.reader, StalenessRule(self.cfg.stale_view_max_s, settings.registry.heartbeat_ttl_s,
                                                              self.cfg.refresh_interval_s), self.metrics, self.configured_models)
        self.registry = ReplicaRegistry(sync_client(settings.redis), settings.registry)
        self.revisions = RevisionSplit(self.redis, self.metrics, self.views)  # rollouts' split
        self.metrics_registry.register(RegistryCollector(self._replica_counts))
        self.session: aiohttp.ClientSession | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._announced: dict[str, float] = {}  # model -> when its unmet demand was last announced (monotonic)
        self._unmet: set[str] = set()  # models announced by this gateway and not yet marked met (one write per burst)

    def _replica_counts(self) -> dict[tuple[str, str, str], int]:
        return self.registry.counts()

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, _app: web.Application | None = None) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector,
            # No total: a long generation is fine as long as bytes keep coming. sock_read is the idle
            # timeout between two reads; connecting is quick or the replica is gone.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                          sock_read=self.cfg.upstream_timeout_s),
            auto_decompress=False,
        )
        self._flusher = asyncio.create_task(self._flush_loop())

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._flusher:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
        try:
            await self.counter.flush(self.redis)
        except Exception:  # noqa: BLE001 - shutting down; counts are logged by flush
            pass
        if self.session:
            await self.session.close()
        await self.redis.aclose()
        self.registry.client.close()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.counter.flush(self.redis)
                await self.revisions.flush()
            except Exception as exc:  # noqa: BLE001 - keep flushing whatever one batch did
                log.warning("counter flush failed: %s", exc)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.gate.middleware, _json_errors])
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        for path in PROXIED_PATHS:
            app.router.add_post(path, self.handle_proxy)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/healthz", self.handle_health)
        app.router.add_get("/readyz", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        return app

    # --- registry reads: cached, and the last good view while Redis is away (registry_view.py) ---
    async def _view(self, model: str, *, fresh: bool = False) -> RoutingView:
        view = await self.views.view(model, fresh=fresh)
        self.counter.observe(model, time.time(), model_level(view.engine_load))  # engines count every gateway's
        return view

    async def _known_models(self) -> set[str]:
        return await self.views.known_models()

    def _capacity(self, model: str) -> int | None:
        """Requests the model's ready replicas serve at once (None: none ready, the hold decides)."""
        cached = self.views.views.get(model)
        view = cached.view if cached is not None else None
        n = len(view.serving) + len(view.warm) + len(view.loading) if view is not None else 0
        return n * self.cfg.replica_concurrency if n else None

    def _route(self, view: RoutingView, warmup: bool, tried: frozenset[str] = frozenset()) -> RouteDecision:
        return choose_replica(
            view.serving, view.warm, view.loading, merged_inflight(self.state.inflight, view.engine_load),
            warm_threshold=self.cfg.warm_threshold, warmup=warmup,
            exclude=self.state.exclusions(time.monotonic()) | tried, replica_concurrency=self.cfg.replica_concurrency,
            replica_limit=self.cfg.replica_queue_limit,
        )

    # --- handlers -------------------------------------------------------------------------
    async def _registry_ok(self) -> bool:
        try:
            await self.redis.ping()
            return True
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("health: registry unavailable: %s", exc)  # the address goes to the log, not to clients
            return False

    async def handle_health(self, _request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves (a restart would not bring Redis back), with
        the registry's state and no internal detail (no address: anyone can call this)."""
        ok = await self._registry_ok()
        return web.json_response({"status": "ok" if ok else "degraded", "registry": "ok" if ok else "unavailable"})

    async def handle_ready(self, _request: web.Request) -> web.Response:
        """Readiness: 503 while the registry is unreachable and the last view is too old to route from."""
        ok = await self._registry_ok()
        stale = not ok and may_serve_stale(self.views.health.last_ok_at, time.time(), self.views.rule)
        state = "ok" if ok else "stale" if stale else "unavailable"
        return web.json_response({"ready": ok or stale, "registry": state}, status=200 if ok or stale else 503)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.metrics_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_models(self, _request: web.Request) -> web.Response:
        try:
            models = sorted(await self._known_models())
        except RegistryUnavailable as exc:
            return self._unavailable("registry unavailable", exc.retry_after)
        data = [{"id": m, "object": "model", "owned_by": "prewarm"} for m in models]
        return web.json_response({"object": "list", "data": data})

    def _unavailable(self, message: str, retry_after: float | None = None) -> web.Response:
        seconds = max(1, int(retry_after or self.cfg.retry_after_s))
        return _error(503, message, "unavailable", headers={"Retry-After": str(seconds)})

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body = await read_body(request, self.cfg.body_timeout_s)
        except BodyTimeout as exc:  # a body trickled in (slow-body abuse): answered, and the connection closed
            late = _error(408, str(exc), "body_timeout")
            late.force_close()
            return late
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", "body_too_large")
        try:
            payload = json_body.load_json(body)
        except json_body.NestedTooDeep as exc:  # a bound of our own: where json.loads gives up differs between Pythons
            return _error(400, f"request body is nested too deeply: {exc}", "invalid_json")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(payload, dict):
            return _error(400, "request body must be a JSON object", "invalid_body")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return _error(400, "the 'model' field is required and must be a non-empty string", "missing_model")

        warmup = False
        if signing.HEADER in request.headers:
            warmup = await self.nonces.is_valid_warmup(request.headers, request.method, request.path, body, time.time())
            if not warmup and self.cfg.warmup_forged == "refuse":
                return _error(403, "X-Warmup present without a valid signature", "invalid_warmup_signature")
        kind = "warmup" if warmup else "user"
        if not warmup and self.client_keys.enabled:
            name = self.client_keys.client(request.headers.get("Authorization"))
            if name is None:
                return _error(401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            request[CLIENT_NAME_KEY] = name

        try:
            if model not in await self._known_models():
                self.metrics.routing_decisions.labels("unknown", "unknown_model").inc()
                return _error(404, f"model {model!r} is not served here", "model_not_found")
            if warmup:
                response = await self._route_and_proxy(request, model, body, payload, warmup, started)
            else:
                # requests in flight (waiting for a slot included) and their busy time: the planner's
                # fine signals; a refused request (not demand) leaves no busy time
                ticket = self.limits.admit(request, model, payload)
                if isinstance(ticket, web.Response):  # over its fair share: 429, not demand, no busy time
                    self.metrics.routing_decisions.labels(model, "refused").inc()
                    return self._answered(request, model, kind, ticket, started)
                request[TICKET_KEY] = ticket
                began = time.time()
                self.counter.begin(model, began)
                proxied: web.StreamResponse | None = None
                try:
                    async with self.turns.turn(model, ticket.client, self._capacity(model)):  # fair, per client
                        proxied = await self._route_and_proxy(request, model, body, payload, warmup, started)
                finally:
                    self.limits.release(ticket, proxied.status if proxied is not None else None)
                    demand = proxied is not None and _is_demand(proxied.status)
                    self.counter.end(model, time.time(), began, demand=demand)
                response = proxied
        except RegistryUnavailable as exc:
            # a model name a client chose is a label only once it is known to be served: while Redis
            # is down, arbitrary names would each make new Prometheus series
            if model not in self.views.models | self.configured_models:
                model = "unknown"
            self.metrics.routing_decisions.labels(model, "registry_unavailable").inc()
            response = self._unavailable("registry unavailable, retry shortly", exc.retry_after)
        if not warmup and model != "unknown" and _is_demand(response.status):
            self.counter.add(model, time.time())
        return self._answered(request, model, kind, response, started)

    def _answered(self, request: web.Request, model: str, kind: str, response: web.StreamResponse,
                  started: float) -> web.StreamResponse:
        self.metrics.requests.labels(model, kind, str(response.status)).inc()
        if kind == "user":
            self.metrics.request_duration.labels(model).observe(time.monotonic() - started)
            self.revisions.observe(model, request.get(REQUEST_KEY), response.status, time.monotonic() - started)
        return response

    async def _route_and_proxy(
        self, request: web.Request, model: str, body: bytes, payload: dict[str, Any], warmup: bool, started: float
    ) -> web.StreamResponse:
        view = await self._view(model)
        choice = await self.revisions.choose(model, view, request.headers)
        if choice.kind is RevisionChoiceKind.UNKNOWN:
            return _error(404, f"model {model!r}: {choice.reason}", "revision_not_found")
        rev = request[REQUEST_KEY] = choice.revision
        decision = self._route(narrow(view, rev), warmup)
        if decision.outcome is RouteOutcome.SATURATED:
            return self._saturated(model)
        if decision.replica is None:
            if not warmup:
                await self._record_demand(model)
            deadline = started + self.cfg.hold_timeout_s
            while decision.replica is None and time.monotonic() < deadline:
                await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                if not warmup and time.monotonic() - self._announced.get(model, 0.0) >= keys.DEMAND_REANNOUNCE_S:
                    await self._record_demand(model, again=True)  # still held: ask again, once for all held
                decision = self._route(narrow(await self._view(model, fresh=True), rev), warmup)
                if decision.outcome is RouteOutcome.SATURATED:
                    return self._saturated(model)
            if not warmup and (decision.replica is None or time.monotonic() - started > self.cfg.wait_threshold_s):
                self.counter.waited(model, time.time())  # the cold-start budget's observation
            if not warmup and decision.replica is not None:
                await self._demand_met(model)
        self.metrics.routing_decisions.labels(model, decision.outcome.value if decision.replica else "unavailable").inc()
        if decision.replica is None:
            return self._unavailable(f"no replica of {model!r} is ready; one is being started")
        if not warmup:
            self.metrics.cold_start_wait.labels(model).observe(time.monotonic() - started)
            ticket = request.get(TICKET_KEY)
            if ticket is not None:
                self.limits.serving(ticket)

        headers = {k: v for k, v in request.headers.items() if k.lower() in _HOP_HEADERS}
        if not warmup:
            for h in (signing.HEADER, signing.HEADER_TS, signing.HEADER_SIG, signing.HEADER_NONCE):
                headers.pop(h, None)
        stream = bool(payload.get("stream"))
        tried: set[str] = set()
        refused: list[web.Response] = []
        while decision.replica is not None:
            replica = decision.replica
            tried.add(replica.id)
            auth = self.upstream_keys.headers(replica)
            result = None if auth is None else await self._proxy_once(
                request, replica.id, replica.endpoint + request.path, body, {**headers, **auth}, stream, model, refused,
                replica.auth_ref)
            if auth is None:
                refused.append(self.upstream_keys.missing(replica))
            if result is not None:
                return result
            decision = self._route(narrow(await self._view(model), rev), warmup, frozenset(tried))
        if refused:  # every replica tried refused it (sleeping, unloaded, busy): the client may retry later
            return refused[-1]
        return _error(502, f"the replicas of {model!r} could not be reached", "upstream_unreachable")

    def _saturated(self, model: str) -> web.Response:
        """Backpressure: every ready replica has `replica_queue_limit` requests in flight. A bounded
        queue and a quick 429 beat a long wait behind clients that hold streams open."""
        self.metrics.routing_decisions.labels(model, RouteOutcome.SATURATED.value).inc()
        return _error(429, f"every replica of {model!r} is at its limit of {self.cfg.replica_queue_limit} requests "
                           "in flight; retry shortly", "overloaded", headers={"Retry-After": str(self.limits.drain_s(model))})

    async def _demand_met(self, model: str) -> None:
        if model not in self._unmet:
            return  # already marked since this gateway last announced it: a burst served at once writes once
        self._unmet.discard(model)
        try:
            await demand_met(self.redis, model, time.time())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("met demand for %s not recorded: %s", model, exc)

    async def _record_demand(self, model: str, *, again: bool = False) -> None:
        """Record a request's unmet demand, or (`again`) announce it anew while held (once per `keys.DEMAND_REANNOUNCE_S`)."""
        self._announced[model] = time.monotonic()
        self._unmet.add(model)
        try:
            await (announce_demand if again else record_demand)(self.redis, model, time.time())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("demand for %s not recorded: %s", model, exc)

    async def _proxy_once(
        self, request: web.Request, rid: str, url: str, body: bytes, headers: dict[str, str], stream: bool, model: str,
        refused: list[web.Response] | None = None, auth_ref: str = "",
    ) -> web.StreamResponse | None:
        """Send the request to one replica. None: it could not be reached or refused it (try another).

        What counts against a replica is only what says it is gone: no connection, or a connection
        that breaks mid-answer. Any HTTP answer means it is alive — a 500 caused by the request
        would be the same on every replica, so it is passed through, not counted and not re-sent.
        A 503 is a refusal before any work (asleep, weights unloaded, draining): the request goes
        to another replica, and the refusal, with a Retry-After, is appended to `refused` for the
        caller to answer with when no replica takes it. A replica slower than the idle timeout
        (`upstream_timeout_s` between two reads) gets 504, not a re-send and not a failure; a
        client that goes away is the client's doing.
        """
        assert self.session is not None
        self._count_inflight(model, rid, +1)
        try:
            try:
                upstream = await self.session.post(url, data=body, headers=headers)
            except aiohttp.SocketTimeoutError:  # connected and sent: the replica is slow, not gone
                return self._timed_out(rid)
            except _UPSTREAM_ERRORS as exc:
                await self._failed(rid, f"unreachable: {exc!r}")
                return None
            async with upstream:
                self.state.failures.pop(rid, None)  # it answered: whatever the status, it is alive
                ctype = upstream.headers.get("Content-Type", "application/json")
                if upstream.status == 503 and refused is not None:
                    try:
                        data = await upstream.read()
                    except _UPSTREAM_ERRORS:
                        data = b""
                    retry = upstream.headers.get("Retry-After", "")
                    retry = retry if retry.isdigit() and int(retry) >= 1 else str(self.cfg.retry_after_s)
                    if not data:
                        refused.append(self._unavailable(f"replica {rid} refused the request", float(retry)))
                    else:
                        refused.append(web.Response(status=503, body=data,
                                                    headers={"Content-Type": ctype, "Retry-After": retry}))
                    return None
                if upstream.status in (401, 403) and refused is not None:  # the gateway's key, not the client's
                    refused.append(self.upstream_keys.refused(rid, auth_ref, upstream.status))
                    return None
                if not stream or upstream.status != 200:
                    try:
                        data = await upstream.read()
                    except aiohttp.SocketTimeoutError:
                        return self._timed_out(rid)
                    except _UPSTREAM_ERRORS as exc:
                        await self._failed(rid, f"closed mid-response: {exc!r}")
                        return _error(502, f"replica {rid} closed the connection mid-response", "upstream_closed")
                    return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype})
                return await self._relay_stream(request, upstream, rid, ctype)
        finally:
            self._count_inflight(model, rid, -1)

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, rid: str,
                            ctype: str) -> web.StreamResponse:
        """Copy an SSE stream to the client. A replica that breaks the stream is counted; one that
        stalls past the idle timeout is not (the client gets an error event either way); a client
        that goes away ends the relay (closing the upstream connection stops the generation)."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
        except ConnectionResetError:
            return resp
        upstream_error: dict[str, Any] | None = None
        try:
            async for chunk in upstream.content.iter_any():
                try:
                    await write_client(resp, chunk, self.cfg.write_timeout_s)
                except (ConnectionResetError, ClientStalled) as exc:  # gone or not reading: not the replica's fault
                    upstream.close()
                    if isinstance(exc, ClientStalled) and request.transport is not None:
                        log.warning("stream from %s cut: %s", rid, exc)  # the slot is freed as the relay returns
                        request.transport.abort()
                    return resp
        except aiohttp.SocketTimeoutError:
            log.warning("replica %s sent nothing for %.0fs mid-stream: the stream is ended, the replica is not blamed",
                        rid, self.cfg.upstream_timeout_s)
            upstream_error = {"message": f"replica {rid} sent nothing for {self.cfg.upstream_timeout_s:.0f}s",
                              "type": "server_error", "code": "upstream_timeout"}
        except _UPSTREAM_ERRORS as exc:
            await self._failed(rid, f"closed mid-stream: {exc!r}")
            upstream_error = {"message": f"replica {rid} closed the stream", "type": "server_error",
                              "code": "upstream_closed"}
        try:
            if upstream_error is not None:
                await resp.write(f"data: {json.dumps({'error': upstream_error})}\n\n".encode())
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    def _timed_out(self, rid: str) -> web.Response:
        """The replica took the request and then sent nothing for the idle timeout: a slow answer.
        It is not re-sent (it may be expensive, and is probably still running) and not counted."""
        log.warning("replica %s sent nothing for %.0fs: 504, the replica is not blamed", rid, self.cfg.upstream_timeout_s)
        return _error(504, f"the replica sent nothing for {self.cfg.upstream_timeout_s:.0f}s", "upstream_timeout")

    def _count_inflight(self, model: str, rid: str, delta: int) -> None:
        """Requests in flight to a replica: the routing policy's saturation input and `gateway_inflight_requests`."""
        n = max(0, self.state.inflight.get(rid, 0) + delta)
        if n:
            self.state.inflight[rid] = n
        else:
            self.state.inflight.pop(rid, None)
        self.metrics.inflight.labels(model, rid).set(n)

    async def _failed(self, rid: str, why: str) -> None:
        """Count a failure; past the threshold, stop routing to the replica and mark it failed."""
        n = self.state.failures.get(rid, 0) + 1
        self.state.failures[rid] = n
        log.warning("replica %s failed a request (%d in a row): %s", rid, n, why)
        self.state.excluded[rid] = time.monotonic() + self.settings.registry.heartbeat_interval_s
        if n >= self.cfg.failure_threshold:
            self.state.failures.pop(rid, None)
            try:
                await asyncio.to_thread(
                    self.registry.transition, rid, ReplicaState.FAILED, now=time.time(), reason=f"failing requests: {why}"
                )
            except (IllegalTransition, ReplicaNotFound, RegistryUnavailable) as exc:
                log.info("could not mark %s failed: %s", rid, exc)


def run(settings: Settings, *, host: str | None = None, port: int | None = None, print_fn: Any = print) -> None:
    """Serve the gateway until interrupted, behind its connection gate (header timeout, per-client cap)."""
    gw = Gateway(settings)
    host = host or settings.gateway.host
    port = settings.gateway.port if port is None else port
    print_fn(f"prewarm gateway listening on http://{host}:{port}")
    factory = None
    try:  # uvloop roughly halves the event loop's cost per proxied request; optional
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(gw.app(), host, port, gw.gate))
