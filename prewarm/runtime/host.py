"""The model host's HTTP app: `ModelHost`, an aiohttp server in front of one `Engine`.

`prewarm serve-model` builds it with `prewarm.runtime.serve`; the wire format lives in
`prewarm.runtime.api` and the engine-side computations in `prewarm.runtime.probe`.

Why it exists: a replica must be observable and controllable from outside — loaded on
request with visible progress, put to sleep and woken (vLLM sleep-mode semantics), and
declared ready only once validated — while it answers OpenAI-compatible completions.

Endpoints (control ones need `Authorization: Bearer <token>`; the token is
`PREWARM_RUNTIME_TOKEN`, or `PREWARM_WARMUP_SECRET` when that is unset; with neither set
every control call is refused with 403):

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
- `GET /metrics` (Prometheus) and `GET /stats` (user/warmup request counts, requests in
  flight, allocator fragmentation `1 - allocated/reserved`).

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

import asyncio
import hmac
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prewarm.runtime import api
from prewarm.runtime import probe
from prewarm.core.domain import LoadPhase
from prewarm.core.errors import TemporaryError, failure_reason
from prewarm.core.metrics import Metrics
from prewarm.core.signing import HEADER, is_valid_warmup
from prewarm.policy.validation import (
    LogitStats,
    ValidationReport,
    check_numeric,
    check_performance,
    check_structural,
    tensor_specs,
)

log = logging.getLogger("prewarm.runtime")

#: Phases after which phase 1 (embeddings, positions, final norm, head) is in memory.
_SERVABLE_PHASES = frozenset({LoadPhase.FIRST_LAYERS, LoadPhase.REST, LoadPhase.DONE})


@dataclass
class HostState:
    """What the host knows beyond the engine: validation verdict and traffic counts."""

    validated: bool = False
    report: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"user": 0, "warmup": 0, "forged_warmup": 0})
    inflight: int = 0
    pausing: bool = False  # a sleep is draining in-flight requests; new ones are refused


class ModelHost:
    """One engine behind HTTP; build the aiohttp app with `app()`."""

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        revision: str,
        control_token: str | None,
        warmup_secret: str | None,
        workers: int = 2,
        load_wait_s: float = 0.0,
        drain_timeout_s: float = 30.0,
        mean_bound: float = 50.0,
        latency_factor: float = 1.2,
        metrics: Metrics | None = None,
        node: str = "",
    ) -> None:
        self.engine = engine
        self.node = node
        self.model_name = model_name
        self.revision = revision
        self.control_token = control_token or None
        self.warmup_secret = warmup_secret or None
        self.load_wait_s = load_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.mean_bound = mean_bound
        self.latency_factor = latency_factor
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.state = HostState()
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prewarm-gen")
        self.started_at = int(time.time())
        self._idle = asyncio.Event()
        self._idle.set()
        self._control_lock = asyncio.Lock()
        self.self_validate = False  # validate itself after each load (no agent: `serve-model --self-validate`)
        self._self_check: asyncio.Task[dict[str, Any] | None] | None = None

    # -- engine facts ------------------------------------------------------------------
    @property
    def servable(self) -> bool:
        """Phase 1 is in (or everything is): requests can compute, pipelined if need be."""
        return bool(self.engine.loaded) or self._phase() in _SERVABLE_PHASES

    def _phase(self) -> LoadPhase:
        try:
            return LoadPhase(self.engine.phase)
        except ValueError:
            return LoadPhase.NONE

    def ready(self) -> tuple[bool, str]:
        if self.engine.error is not None:
            return False, f"loading failed: {self.engine.error}"
        if not self.engine.loaded:
            return False, f"loading: phase {self._phase().value}, {self.engine.progress:.0%}"
        if self.engine.is_sleeping:
            return False, "sleeping"
        if not self.state.validated:
            return False, "loaded but not validated"
        return True, "loaded and validated"

    def _run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- the app -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=4 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/healthz", self.healthz)
        r.add_get("/health", self.health)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.prometheus)
        r.add_get("/stats", self.stats)
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
            return web.json_response(exc.body(), status=exc.status, headers=headers)
        except web.HTTPException:
            raise
        except TemporaryError as exc:  # the engine fell asleep or unloaded between admission and compute
            err = api.unavailable(str(exc), exc.retry_after, "unavailable")
            return web.json_response(err.body(), status=503, headers={"Retry-After": str(max(1, round(exc.retry_after)))})
        except Exception as exc:  # noqa: BLE001 - an engine fault is a 500 with a body, never a traceback page
            log.exception("internal error on %s %s", request.method, request.path)
            err = api.ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error")
            return web.json_response(err.body(), status=500)

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
        return web.json_response({"status": "alive"})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.error is not None:
            return web.json_response({"status": "failed", "error": str(self.engine.error)}, status=503)
        if not self.engine.loaded:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ok, reason = self.ready()
        return web.json_response({"ready": ok, "reason": reason}, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.fragmentation.labels(self.node).set(self.engine.fragmentation())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model": self.model_name, **self.state.counts, "inflight": self.state.inflight,
            "fragmentation": float(self.engine.fragmentation()),  # 1 - allocated/reserved; 0.0 on CPU
            "device": str(self.engine.device), "sleeping": bool(self.engine.is_sleeping),
            "validated": self.state.validated,
            "memory": self.engine.memory() if hasattr(self.engine, "memory") else {},  # bytes; the agent books them
        })

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({
            "object": "list",
            "data": [{
                "id": self.model_name, "object": "model", "created": self.started_at, "owned_by": "prewarm",
                "root": self.model_name, "revision": self.revision,
                "max_model_len": self.engine.config.max_seq_len,
            }],
        })

    # -- completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        kind = self._kind(request, raw)
        code = 500
        try:
            response = await self._complete(request, raw)
            code = response.status
            return response
        except api.ApiError as exc:
            code = exc.status
            raise
        finally:
            self.metrics.runtime_requests.labels(self.model_name, kind, str(code)).inc()

    def _kind(self, request: web.Request, raw: bytes) -> str:
        if request.headers.get(HEADER) is None:
            self.state.counts["user"] += 1
            return "user"
        if is_valid_warmup(self.warmup_secret, request.headers, request.method, request.path, raw, time.time()):
            self.state.counts["warmup"] += 1
            return "warmup"
        self.state.counts["forged_warmup"] += 1
        self.state.counts["user"] += 1
        return "user"

    async def _complete(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        cfg = self.engine.config
        req = api.parse_completion(api.parse_json_object(raw), vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len)
        if req.model is not None and req.model != self.model_name:
            raise api.ApiError(404, f"model {req.model!r} is not served here; this runtime serves {self.model_name!r}",
                               param="model", code="model_not_found")
        ids = list(req.prompt) if isinstance(req.prompt, tuple) else list(self.engine.encode(req.prompt))
        if not ids:
            raise api.bad_request("'prompt' encodes to no tokens", "prompt")
        api.check_context(len(ids), req.max_tokens, cfg.max_seq_len)
        await self._admit()
        self.state.inflight += 1
        self._idle.clear()
        try:
            if req.stream:
                return await self._stream(request, req, ids)
            return await self._complete_once(req, ids)
        finally:
            self.state.inflight -= 1
            if self.state.inflight == 0:
                self._idle.set()

    async def _admit(self) -> None:
        """Refuse (503) while sleeping or failed; wait up to load_wait_s for phase 1."""
        if self.engine.error is not None:
            raise api.ApiError(503, f"the model failed to load: {self.engine.error}",
                               type_="service_unavailable", code="load_failed")
        if self.state.pausing or self.engine.is_sleeping:
            raise api.unavailable("the model is sleeping; POST /wake_up first", 1, "sleeping")
        deadline = time.monotonic() + self.load_wait_s
        while not self.servable:
            if time.monotonic() >= deadline:
                if self._phase() is LoadPhase.NONE and not self._loading_started():
                    raise api.unavailable("the model is not loaded; POST /load to start loading", 2, "not_loaded")
                raise api.unavailable(f"the model is loading (phase {self._phase().value}, "
                                      f"{self.engine.progress:.0%}); retry shortly", 1, "loading")
            await asyncio.sleep(0.01)

    def _loading_started(self) -> bool:
        return bool(getattr(self.engine, "load_started", self.engine.progress > 0))

    async def _complete_once(self, req: api.CompletionRequest, ids: list[int]) -> web.Response:
        def work() -> tuple[list[int], dict[str, Any] | None]:
            out = list(self.engine.generate(ids, req.max_tokens))
            lp = probe.logprobs(self.engine, ids, out, req.logprobs) if req.logprobs is not None else None
            return out, lp

        out, logprobs = await self._run(work)
        text = self.engine.decode(out)
        if req.echo:
            text = self.engine.decode(ids) + text
        finish = "length" if len(out) >= req.max_tokens else "stop"
        return web.json_response(
            api.completion_body(api.completion_id(), self.model_name, text, finish, len(ids), len(out), logprobs)
        )

    async def _stream(self, request: web.Request, req: api.CompletionRequest, ids: list[int]) -> web.StreamResponse:
        """SSE chunks as tokens come. One executor job runs the whole generation (the engine
        holds its generation lock for the iterator's life, so stepping it from several jobs
        could starve the holder) and hands each token to the event loop through a queue."""
        cid, created = api.completion_id(), int(time.time())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def produce() -> None:
            it = iter(self.engine.generate(ids, req.max_tokens))
            try:
                for tok in it:
                    loop.call_soon_threadsafe(queue.put_nowait, ("token", tok))
                    if cancel.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop, raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

        job = self._run(produce)
        try:
            kind, item = await queue.get()
            if kind == "error":  # before the first token: still a JSON error (503 when sleeping, ...)
                raise item
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if req.echo:
                await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, self.engine.decode(ids), None)))
            out: list[int] = []
            sent = ""
            while kind != "end":
                if kind == "error":
                    log.error("generation failed mid-stream: %r", item)
                    break
                out.append(int(item))
                text = self.engine.decode(out)
                if not text.endswith("\ufffd") and len(text) > len(sent):  # hold back a partial UTF-8 sequence
                    await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, text[len(sent):], None)))
                    sent = text
                kind, item = await queue.get()
            tail = self.engine.decode(out)[len(sent):]
            finish = "length" if len(out) >= req.max_tokens else "stop"
            usage = api.usage(len(ids), len(out)) if req.include_usage else None
            await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, tail, finish, usage)))
            await resp.write(api.sse("[DONE]"))
            await resp.write_eof()
            return resp
        finally:
            cancel.set()  # a client that went away stops the generation at the next token
            await job

    # -- control -------------------------------------------------------------------------
    def _load_body(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "progress": float(self.engine.progress),
            "phase": self._phase().value,
            "loaded": bool(self.engine.loaded),
            "error": None if self.engine.error is None else str(self.engine.error),
            "error_kind": None if self.engine.error is None else failure_reason(self.engine.error),
            "device": str(self.engine.device),
            "sleeping": bool(self.engine.is_sleeping),
        }

    async def load(self, request: web.Request) -> web.Response:
        async with self._control_lock:
            if self.engine.is_sleeping:
                raise api.ApiError(409, "the model is sleeping: POST /wake_up instead of /load", code="sleeping")
            self.engine.start_load()  # idempotent: a second call while loading or loaded does nothing
        return web.json_response(self._load_body(), status=202 if not self.engine.loaded else 200)

    async def load_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._load_body())

    async def sleep(self, request: web.Request) -> web.Response:
        level = api.parse_level(request.query.get("level"))
        async with self._control_lock:
            if not self.engine.loaded:
                raise api.ApiError(409, "the model is not loaded yet; it cannot sleep", code="not_loaded")
            if not self.engine.is_sleeping:
                self.state.pausing = True
                try:
                    try:
                        await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
                    except asyncio.TimeoutError:
                        raise api.unavailable(
                            f"{self.state.inflight} request(s) still in flight after {self.drain_timeout_s}s; "
                            "sleep not entered", 1, "busy") from None
                    await self._run(self.engine.sleep, level)
                finally:
                    self.state.pausing = False
                if level == 2:
                    self.state.validated = False  # the weights are gone: what comes back must be validated again
        return web.json_response({"is_sleeping": bool(self.engine.is_sleeping), "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        async with self._control_lock:
            if self.engine.is_sleeping:
                await self._run(self.engine.wake_up)
            if self.self_validate and not self.state.validated:
                self.validate_itself()  # level 2 dropped the weights: what comes back is checked again
        return web.json_response({"is_sleeping": bool(self.engine.is_sleeping), **self._load_body()})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.engine.is_sleeping)})

    async def _probe_body(self, request: web.Request) -> str:
        raw = await request.read()
        if not raw:
            return probe.PROBE_PROMPT
        data = api.parse_json_object(raw)
        prompt = data.get("prompt", probe.PROBE_PROMPT)
        if not isinstance(prompt, str) or not prompt:
            raise api.bad_request("'prompt' must be a non-empty string", "prompt")
        return prompt

    def _require_loaded(self) -> None:
        if self.engine.error is not None:
            raise api.ApiError(409, f"the model failed to load: {self.engine.error}", code="load_failed")
        if not self.engine.loaded or self.engine.is_sleeping:
            raise api.ApiError(409, "validation needs a fully loaded, awake model", code="not_loaded")

    async def validation_inputs(self, request: web.Request) -> web.Response:
        prompt = await self._probe_body(request)
        self._require_loaded()
        return web.json_response(await self._run(probe.validation_inputs, self.engine, self.model_name, prompt))

    async def validate(self, request: web.Request) -> web.Response:
        """Run all three checks in-process; body: {"baseline_s": float|null, "requests": n, "mark_ready": bool}."""
        raw = await request.read()
        data = api.parse_json_object(raw) if raw else {}
        baseline = data.get("baseline_s")
        if baseline is not None and (not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or baseline <= 0):
            raise api.bad_request(f"'baseline_s' must be a positive number or null, got {baseline!r}", "baseline_s")
        n = data.get("requests", 5)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 100:
            raise api.bad_request(f"'requests' must be an integer in 1..100, got {n!r}", "requests")
        mark = data.get("mark_ready", True)
        self._require_loaded()
        return web.json_response(await self.run_validation(float(baseline) if baseline is not None else None, n,
                                                           mark=bool(mark)))

    async def run_validation(self, baseline_s: float | None, requests: int, *, mark: bool) -> dict[str, Any]:
        """The three checks in-process (structural, numeric, performance against `baseline_s`);
        with `mark`, their verdict becomes this host's readiness. Returns the report."""
        inputs = await self._run(probe.validation_inputs, self.engine, self.model_name, probe.PROBE_PROMPT)
        ids = list(self.engine.encode(probe.PROBE_PROMPT))
        latencies = [await self._run(probe.timed_completion, self.engine, ids, 1) for _ in range(requests)]
        report = ValidationReport((
            check_structural(tensor_specs(inputs["manifest"]), tensor_specs(inputs["tensors"])),
            check_numeric(LogitStats.from_dict(inputs["logits"]), mean_bound=self.mean_bound),
            check_performance(latencies, baseline_s, factor=self.latency_factor),
        ))
        for c in report.checks:
            self.metrics.validation_results.labels(self.model_name, c.name.value, c.outcome.value).inc()
        body = report.to_dict()
        if mark:
            self.state.validated = report.passed
            self.state.report = body
        return body

    def validate_itself(self) -> None:
        """From now on, validate after each load without an agent: wait for the current load,
        run the three checks in-process and make their verdict this host's readiness (needs
        a running event loop)."""
        self.self_validate = True
        if self._self_check is None or self._self_check.done():
            self._self_check = asyncio.get_running_loop().create_task(self._validate_when_loaded())

    async def _validate_when_loaded(self, requests: int = 5) -> dict[str, Any] | None:
        """None when the load failed: the host then stays unready, and `/load` says why."""
        try:
            await asyncio.to_thread(self.engine.wait_loaded)
        except Exception as exc:  # noqa: BLE001 - the load's own error, already reported by /load and /health
            log.error("not validating %s: its load failed: %s", self.model_name, exc)
            return None
        try:
            report = await self.run_validation(None, requests, mark=True)
        except Exception as exc:  # noqa: BLE001 - e.g. put to sleep meanwhile: unready until the next load
            log.error("validation of %s could not run: %s", self.model_name, exc)
            return None
        if report["passed"]:
            log.info("%s validated itself: ready", self.model_name)
        else:
            log.error("%s failed its own validation (%s): it stays unready", self.model_name, report["reason"])
        return report

    async def mark_ready(self, request: web.Request) -> web.Response:
        """The agent's verdict: {"passed": bool, "report": {...}}; passed=false withdraws readiness."""
        data = api.parse_json_object(await request.read())
        passed = data.get("passed")
        if not isinstance(passed, bool):
            raise api.bad_request(f"'passed' must be a boolean, got {passed!r}", "passed")
        report = data.get("report")
        if report is not None and not isinstance(report, dict):
            raise api.bad_request("'report' must be an object", "report")
        if passed:
            self._require_loaded()
        self.state.validated = passed
        self.state.report = report
        ok, reason = self.ready()
        return web.json_response({"ready": ok, "reason": reason})
