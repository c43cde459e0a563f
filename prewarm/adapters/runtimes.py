"""Runtime adapters: one synchronous interface over the model servers the agent drives.

The node agent (a Celery worker) prewarms replicas through this interface, so the same
pipeline drives the built-in runtime (`prewarm serve-model`) or any OpenAI-compatible
server with vLLM-style sleep endpoints. The API is synchronous because Celery tasks are;
it speaks HTTP through the process's pooled client (`prewarm.core.http`: keep-alive
connections, no event loop in a worker process). Adapters are thin: they carry requests and map failures to the
project's error types, and they make no decisions — validation is decided by the pure
checks of `prewarm.policy.validation`.

Errors: a refused connection, a timeout or a 503 is a `RuntimeUnavailable` (temporary,
with the server's Retry-After); a 4xx is a `RuntimeRequestError` (permanent, with the
server's message); any other status is a `RuntimeServerError` (temporary).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from prewarm.adapters.engine_timing import Timers, timers_from
from prewarm.core import http
from prewarm.core.domain import LoadPhase
from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.policy.validation import LogitStats, TensorSpec, ValidationReport, logit_stats, tensor_specs
from prewarm.policy.warmup import WarmupRequest

PROBE_PROMPT = "The quick brown fox jumps over the lazy dog."


class RuntimeUnavailable(TemporaryError):
    """The runtime cannot be reached or answered 503; retry after `retry_after` seconds."""

    reason = "unreachable"


class RuntimeServerError(TemporaryError):
    """The runtime answered with a 5xx other than 503."""

    reason = "bad_response"


class RuntimeRequestError(PermanentError):
    """The runtime refused the request (4xx); `status` and the server's message say why."""

    reason = "refused"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoadStatus:
    progress: float  # bytes loaded / total, 0..1
    phase: LoadPhase
    loaded: bool
    error: str | None = None
    error_kind: str | None = None  # the failure's reason code (`errors.failure_reason`), e.g. bad_weights


@dataclass(frozen=True)
class Completion:
    text: str
    latency_s: float  # wall time of the whole request, measured by the adapter
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class ValidationInputs:
    """What the checks need from a live replica. `None` means the runtime cannot provide it."""

    expected: Mapping[str, TensorSpec] | None  # the manifest's tensors
    live: Mapping[str, TensorSpec] | None  # the tensors the running model holds
    logits: LogitStats | None
    source: str  # where the numbers came from, e.g. "builtin" or "top_logprobs"
    device: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class RuntimeAdapter(Protocol):
    """What the agent needs from a model server. All calls block; all raise the errors above."""

    base_url: str

    def load(self) -> LoadStatus: ...
    def load_status(self) -> LoadStatus: ...
    def complete(self, prompt: str, max_tokens: int = 1, headers: Mapping[str, str] | None = None) -> Completion: ...
    def warmup(self, requests: Sequence[WarmupRequest]) -> list[float]: ...
    def validation_inputs(self, prompt: str = PROBE_PROMPT) -> ValidationInputs: ...
    def mark_ready(self, report: ValidationReport) -> bool: ...
    def sleep(self, level: int = 1) -> bool: ...
    def wake_up(self) -> bool: ...
    def is_sleeping(self) -> bool: ...
    def ready(self) -> bool: ...


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except json.JSONDecodeError as exc:
            raise RuntimeServerError(f"runtime answered {self.status} with a body that is not JSON: {exc}") from exc


class _HttpAdapter:
    """Shared HTTP plumbing: bearer token, timeouts, error mapping."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0,
                 api_key: str | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise PermanentError(f"runtime base URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.api_key = api_key or None  # sent on the data endpoints (/v1/*, /stats, /metrics)
        self.timeout_s = timeout_s

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        control: bool = False,
        accept: Sequence[int] = (),
    ) -> _Response:
        """Send one request; statuses in `accept` are returned rather than raised."""
        h = {"Accept": "application/json"}
        if body is not None:
            h["Content-Type"] = "application/json"
        if control and self.token:
            h["Authorization"] = f"Bearer {self.token}"
        elif not control and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(headers or {})
        try:  # the process's pooled client: warmup and validation reuse their connections
            resp = http.fetch(method, self.base_url + path, body, h, timeout=self.timeout_s)
        except http.Unreachable as exc:
            raise RuntimeUnavailable(f"{method} {self.base_url}{path}: cannot reach the runtime: {exc}", 1.0) from exc
        got = _Response(resp.status, resp.body, dict(resp.headers))
        if got.status < 400 or got.status in accept:
            return got
        raise self._error(method, path, got) from None

    def _error(self, method: str, path: str, resp: _Response) -> Exception:
        message = resp.body.decode("utf-8", "replace")[:500]
        try:
            data = json.loads(resp.body)
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                message = str(data["error"].get("message", message))
            elif isinstance(data, dict) and "error" in data:
                message = str(data["error"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        what = f"{method} {self.base_url}{path} -> {resp.status}: {message}"
        if resp.status == 503:
            try:
                retry = float(resp.headers.get("Retry-After", "1"))
            except ValueError:
                retry = 1.0
            return RuntimeUnavailable(what, retry)
        if 400 <= resp.status < 500:
            return RuntimeRequestError(what, resp.status)
        return RuntimeServerError(what, 1.0)

    def _json(self, method: str, path: str, payload: Any = None, *, control: bool = False) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        return self._request(method, path, body, control=control).json()

    # -- shared by both adapters ------------------------------------------------------------
    def engine_timers(self) -> Timers:
        """How the engine has timed its requests so far, from its /metrics (`engine_timing`); a server that
        exports neither engine's timers is a `RuntimeServerError` that names them."""
        resp = self._request("GET", "/metrics")
        try:
            return timers_from(resp.body.decode("utf-8", "replace"))
        except ValueError as exc:
            raise RuntimeServerError(f"GET {self.base_url}/metrics: {exc}", 1.0) from exc

    def complete(self, prompt: str, max_tokens: int = 1, headers: Mapping[str, str] | None = None) -> Completion:
        payload: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": False}
        model = getattr(self, "model", None)
        if model:
            payload["model"] = model
        return self._send_completion(json.dumps(payload).encode(), headers)

    def _send_completion(self, body: bytes, headers: Mapping[str, str] | None) -> Completion:
        t0 = time.perf_counter()
        data = self._request("POST", "/v1/completions", body, headers).json()
        latency = time.perf_counter() - t0
        try:
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return Completion(
                text=str(choice.get("text", "")),
                latency_s=latency,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
                finish_reason=str(choice.get("finish_reason") or ""),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise RuntimeServerError(f"completion answer is malformed: {exc!r}: {str(data)[:200]}") from exc

    def warmup(self, requests: Sequence[WarmupRequest]) -> list[float]:
        """Send each signed request exactly as signed (same bytes); return each latency in seconds."""
        latencies = []
        for r in requests:
            if r.path != "/v1/completions" or r.method != "POST":
                raise PermanentError(f"warmup request {r.index} targets {r.method} {r.path}; only POST /v1/completions is sent")
            latencies.append(self._send_completion(r.body, r.header_dict()).latency_s)
        return latencies

    def sleep(self, level: int = 1) -> bool:
        if level not in (1, 2):
            raise PermanentError(f"sleep level must be 1 or 2, got {level!r}")
        self._request("POST", f"/sleep?level={level}", b"", control=True)
        return self.is_sleeping()

    def wake_up(self) -> bool:
        self._request("POST", "/wake_up", b"", control=True)
        return not self.is_sleeping()

    def is_sleeping(self) -> bool:
        data = self._json("GET", "/is_sleeping", control=True)
        if not isinstance(data, dict) or not isinstance(data.get("is_sleeping"), bool):
            raise RuntimeServerError(f"/is_sleeping answered {data!r}, expected {{'is_sleeping': bool}}")
        return bool(data["is_sleeping"])


class BuiltinRuntimeAdapter(_HttpAdapter):
    """`prewarm serve-model`: explicit load with progress, tensors and logits for validation, /readyz."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0, model: str | None = None,
                 api_key: str | None = None) -> None:
        super().__init__(base_url, token, timeout_s, api_key)
        self.model = model

    def _status(self, data: Any) -> LoadStatus:
        try:
            return LoadStatus(float(data["progress"]), LoadPhase(data["phase"]), bool(data["loaded"]), data.get("error"), data.get("error_kind"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RuntimeServerError(f"/load answered {data!r}: {exc!r}") from exc

    def load(self) -> LoadStatus:
        return self._status(self._json("POST", "/load", {}, control=True))

    def load_status(self) -> LoadStatus:
        return self._status(self._json("GET", "/load", control=True))

    def validation_inputs(self, prompt: str = PROBE_PROMPT) -> ValidationInputs:
        data = self._json("POST", "/validate/inputs", {"prompt": prompt}, control=True)
        try:
            return ValidationInputs(
                expected=tensor_specs(data["manifest"]),
                live=tensor_specs(data["tensors"]),
                logits=LogitStats.from_dict(data["logits"]),
                source="builtin",
                device=str(data.get("device", "")),
            )
        except (KeyError, TypeError) as exc:
            raise RuntimeServerError(f"/validate/inputs answer is malformed: {exc!r}") from exc

    def mark_ready(self, report: ValidationReport) -> bool:
        data = self._json("POST", "/ready", {"passed": report.passed, "report": report.to_dict()}, control=True)
        return bool(data.get("ready"))

    def ready(self) -> bool:
        return self._request("GET", "/readyz", accept=(503,)).status == 200


class OpenAICompatibleAdapter(_HttpAdapter):
    """Any OpenAI-compatible server with vLLM-style `/sleep`, `/wake_up`, `/is_sleeping`.

    - load() is wake_up(): such a server loads its weights when it starts; "loading" an
      already running server means bringing its weights back from sleep.
    - load_status() and ready(): `/health` (vLLM), or `/v1/models` when the server has no
      `/health`; a sleeping server is not ready.
    - validation_inputs(): tensors cannot be listed over this API, so the structural check
      reports UNSUPPORTED (never a silent pass); the numeric check uses the top-k
      log-probabilities of the probe's next token (`logprobs`), when the server returns them.
    - mark_ready(): such servers have no readiness switch; the verdict lives in the registry
      only, and this returns whether the server itself is ready.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        model: str | None = None,
        logprobs: int = 5,
        has_sleep_mode: bool = True,
        health_paths: Sequence[str] = ("/health", "/v1/models"),
    ) -> None:
        super().__init__(base_url, token, timeout_s)
        if not health_paths:
            raise PermanentError("health_paths must name at least one readiness path")
        self.model = model
        self.logprobs = logprobs
        self.has_sleep_mode = has_sleep_mode
        self.health_paths = tuple(health_paths)
        self._health_path: str | None = None  # the first of health_paths the server answered (not 404)

    def _request(self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
                 *, control: bool = False, accept: Sequence[int] = ()) -> _Response:
        # vLLM-style servers take the API key on every route; send it everywhere.
        return super()._request(method, path, body, headers, control=True, accept=accept)

    def _healthy(self) -> bool:
        """200 on the first readiness path the server knows; a 404 moves on to the next path."""
        paths = [self._health_path] if self._health_path else list(self.health_paths)
        for path in paths:
            try:
                resp = self._request("GET", path, accept=(404, 503))
            except RuntimeUnavailable:
                return False
            if resp.status == 404:
                continue
            self._health_path = path
            return resp.status == 200
        return False

    def load(self) -> LoadStatus:
        if self.has_sleep_mode and self.is_sleeping():
            self.wake_up()
        return self.load_status()

    def load_status(self) -> LoadStatus:
        if self._healthy() and not (self.has_sleep_mode and self.is_sleeping()):
            return LoadStatus(1.0, LoadPhase.DONE, True)
        return LoadStatus(0.0, LoadPhase.NONE, False)

    def validation_inputs(self, prompt: str = PROBE_PROMPT) -> ValidationInputs:
        payload: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "logprobs": self.logprobs}
        if self.model:
            payload["model"] = self.model
        data = self._json("POST", "/v1/completions", payload)
        stats: LogitStats | None = None
        try:
            top = (data["choices"][0].get("logprobs") or {}).get("top_logprobs") or []
            values = [v if v is not None else float("nan") for d in top for v in (d or {}).values()]
            stats = logit_stats(values) if values else None
        except (KeyError, IndexError, TypeError, AttributeError):
            stats = None
        return ValidationInputs(expected=None, live=None, logits=stats, source="top_logprobs")

    def mark_ready(self, report: ValidationReport) -> bool:
        return report.passed and self.ready()

    def engine_load(self) -> int | None:
        """Requests the engine is running or holding (vLLM's `num_requests_running` + `num_requests_waiting`
        on /metrics, summed over their label sets); None when the server does not export them."""
        resp = self._request("GET", "/metrics", accept=(404,))
        if resp.status == 404:
            return None
        total, seen = 0.0, False
        for line in resp.body.decode("utf-8", "replace").splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                    seen = True
                except (IndexError, ValueError):
                    continue
        return int(total) if seen else None

    def ready(self) -> bool:
        return self.load_status().loaded
