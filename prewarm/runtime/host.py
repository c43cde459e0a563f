"""The model host's HTTP app: `ModelHost`, an aiohttp server in front of one `Engine`.

`prewarm serve-model` builds it with `prewarm.runtime.serve`; the wire format lives in
`prewarm.runtime.api` and the engine-side computations in `prewarm.runtime.probe`.

Why it exists: a replica must be observable and controllable from outside — loaded on
request with visible progress, put to sleep and woken (vLLM sleep-mode semantics), and
declared ready only once validated — while it answers OpenAI-compatible completions.

Endpoints (control ones need `Authorization: Bearer <token>`; the token is
`PREWARM_RUNTIME_TOKEN`, or, on loopback only, `PREWARM_WARMUP_SECRET` when that is unset;
with neither set every control call is refused with 403. With `PREWARM_RUNTIME_API_KEY`
set — required beyond loopback — `/v1/*`, `/stats` and `/metrics` need it, or the control
token, as a Bearer token; the probes stay open):

- `POST /v1/completions` (greedy; `stream` gives SSE `data: {...}` chunks then
  `data: [DONE]`), `GET /v1/models`.
- `GET /healthz`: the process is alive (always 200). `GET /health`: vLLM's probe, 200
  once the weights are fully loaded and the engine has not failed.
- `GET /readyz`: 200 only when loaded AND validated AND awake. Validation is decided by
  the agent, which owns the latency baseline: it reads `POST /validate/inputs`, runs the
  pure checks of `prewarm.policy.validation`, and posts the verdict to `POST /ready`. For a
  stand-alone host, `POST /validate` runs the same three checks in-process (with an
  optional `baseline_s`) and marks the host ready when they pass; `serve-model
  --self-validate` does that by itself when the load completes, and again after a wake
  from level-2 sleep (a pod that Kubernetes starts, with no agent).
- control: `POST /load` (idempotent), `GET /load` (progress, phase, loaded, error),
  `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping`, `POST /validate/inputs`,
  `POST /validate`, `POST /ready`.
- `GET /metrics` (Prometheus: requests by kind and code, and each completion's time to first
  token and time per output token as the host timed it, which the speed checks read) and
  `GET /stats` (user/warmup request counts, requests in flight, allocator fragmentation
  `1 - allocated/reserved`).

A completion that arrives while the model loads is served pipelined as soon as phase 1
(embeddings and head) is in: its computation waits per layer for that layer's weights.
Before phase 1 is in it waits up to `PREWARM_RUNTIME_LOAD_WAIT_S` (default 0), then gets
503 with `Retry-After`. A sleeping host answers 503 with `Retry-After`. Bad input gets 400
in the OpenAI error shape. Generation runs in a thread pool so the event loop stays
responsive. A request with a valid warmup signature counts as warmup; a forged one
counts as user traffic.

Sleep level 1 moves the weights to host memory and keeps the validation (the same bytes
come back); level 2 drops them, so after waking the host must be validated again.
"""

from __future__ import annotations

import hmac
import logging
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prewarm.core.errors import TemporaryError
from prewarm.runtime import api
from prewarm.runtime.completions import CompletionHandlers
from prewarm.runtime.control import ControlHandlers
from prewarm.runtime.hostcore import HostState, _json
from prewarm.runtime.selfcheck import ValidationHandlers

log = logging.getLogger("prewarm.runtime")

__all__ = ["HostState", "ModelHost"]


class ModelHost(CompletionHandlers, ControlHandlers, ValidationHandlers):
    """One engine behind HTTP; build the aiohttp app with `app()`. Its roles live in their own
    modules (completions, control, selfcheck over hostcore); this class wires the routes, the
    error shape, the credentials and the probes."""

    # -- the app -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=4 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", self._data(self.completions))
        r.add_get("/v1/models", self._data(self.models))
        r.add_get("/healthz", self.healthz)
        r.add_get("/health", self.health)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self._data(self.prometheus))
        r.add_get("/stats", self._data(self.stats))
        r.add_post("/load", self._control(self.load))
        r.add_get("/load", self._control(self.load_status))
        r.add_post("/sleep", self._control(self.sleep))
        r.add_post("/wake_up", self._control(self.wake_up))
        r.add_get("/is_sleeping", self._control(self.is_sleeping))
        r.add_post("/validate/inputs", self._control(self.validation_inputs))
        r.add_post("/validate", self._control(self.validate))
        r.add_post("/ready", self._control(self.mark_ready))
        app.on_shutdown.append(self._on_shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except api.ApiError as exc:
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else None
            return _json(exc.body(), status=exc.status, headers=headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            # aiohttp's own refusals (unknown path such as /v1/chat/completions, wrong method, body too
            # large) in the OpenAI error shape too: a client library parses every error the same way
            code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 404 and request.path.startswith("/v1/"):
                message += "; this runtime serves POST /v1/completions and GET /v1/models"
            headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            return _json(api.ApiError(exc.status, message, code=code).body(), status=exc.status, headers=headers)
        except TemporaryError as exc:  # the engine fell asleep or unloaded between admission and compute
            err = api.unavailable(str(exc), exc.retry_after, "unavailable")
            return _json(err.body(), status=503, headers={"Retry-After": str(max(1, round(exc.retry_after)))})
        except Exception as exc:  # noqa: BLE001 - an engine fault is a 500 with a body, never a traceback page
            log.exception("internal error on %s %s", request.method, request.path)
            err = api.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error")
            return _json(err.body(), status=500)

    def _data(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """With an API key configured, the data endpoints need it (or the control token): a runtime
        that listens beyond loopback is not a way around the gateway."""
        if self.api_key is None:
            return handler

        async def guarded(request: web.Request) -> web.StreamResponse:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not (
                    hmac.compare_digest(token, self.api_key or "")
                    or (self.control_token is not None and hmac.compare_digest(token, self.control_token))):
                raise api.ApiError(401, "this runtime needs 'Authorization: Bearer <PREWARM_RUNTIME_API_KEY>'",
                                   type_="authentication_error", code="invalid_api_key")
            return await handler(request)

        return guarded

    def _control(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def guarded(request: web.Request) -> web.StreamResponse:
            auth = request.headers.get("Authorization", "")
            if not auth:
                raise api.ApiError(401, "control endpoints need 'Authorization: Bearer <token>'",
                                   type_="authentication_error", code="missing_token")
            if self.control_token is None:
                raise api.ApiError(403, "no control token is configured on this runtime "
                                   "(set PREWARM_RUNTIME_TOKEN or PREWARM_WARMUP_SECRET)",
                                   type_="permission_error", code="no_token_configured")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.control_token):
                raise api.ApiError(403, "the control token is wrong", type_="permission_error", code="bad_token")
            return await handler(request)

        return guarded

    async def _on_shutdown(self, app: web.Application) -> None:
        if self._self_check is not None:
            self._self_check.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- probes ------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "alive"})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.error is not None:
            return _json({"status": "failed", "error": str(self.engine.error)}, status=503)
        if not self.engine.loaded:
            return _json({"status": "loading"}, status=503)
        fault = self.weights_fault()
        if fault is not None:
            return _json({"status": "failed", "error": fault}, status=503)
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ok, reason = self.ready()
        return _json({"ready": ok, "reason": reason}, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.fragmentation.labels(self.node).set(self.engine.fragmentation())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        return _json({
            "model": self.model_name, **self.state.counts, "inflight": self.state.inflight,
            "fragmentation": float(self.engine.fragmentation()),  # 1 - allocated/reserved; 0.0 on CPU
            "device": str(self.engine.device), "sleeping": bool(self.engine.is_sleeping),
            "validated": self.state.validated,
            "memory": self.engine.memory() if hasattr(self.engine, "memory") else {},  # bytes; the agent books them
        })

    async def models(self, request: web.Request) -> web.Response:
        return _json({
            "object": "list",
            "data": [{
                "id": self.model_name, "object": "model", "created": self.started_at, "owned_by": "prewarm",
                "root": self.model_name, "revision": self.revision,
                "max_model_len": self.engine.config.max_seq_len,
            }],
        })
