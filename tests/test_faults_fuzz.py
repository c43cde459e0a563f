"""Fuzzed inputs: always a clear error, never an unhandled exception (issue 6).

- The gateway's HTTP API, served for real (aiohttp on a free port, the session Redis as its
  registry, one ready replica behind it that is a real HTTP server): arbitrary methods,
  paths, bodies and headers, `X-Warmup` junk included. Every answer is a 2xx, a 4xx or a
  503; every error has a JSON body `{"error": {...}}`; nothing is logged at ERROR by the
  gateway or by aiohttp ("Error handling request" is how an unhandled exception shows).
- The task payload parsers (`workers.payload`): any JSON-shaped args and kwargs give either
  a parsed request or `InvalidPayload`.
- The history loaders are fuzzed in tests/test_history.py
  (`test_fuzz_loaders_give_a_frame_or_history_error`).
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any, Callable, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prewarm.core import signing
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.core.errors import InvalidPayload
from prewarm.gateway.server import Gateway
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import GatewaySettings, RedisSettings, RegistrySettings, Settings, WarmupSettings
from tests.logs import ErrorRecords
from tests.httpservers import AppThread, Upstream
from workers import payload

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


class Server:
    def __init__(self, redis_url: str) -> None:
        self.settings = Settings(
            redis=RedisSettings(url=redis_url, socket_timeout_s=2, connect_timeout_s=2),
            gateway=GatewaySettings(max_body_bytes=4096),
            registry=RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3600.0),
            warmup=WarmupSettings(secret="fuzz-secret"),
        )
        self.upstream = AppThread(Upstream("u0").app()).start()
        self.client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
        reg = ReplicaRegistry(self.client, self.settings.registry)
        rep = Replica("m", "r1", "n1", 0, endpoint=self.upstream.url)
        now = time.time()
        reg.register(rep, now=now)
        for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
            reg.transition(rep.id, s, now=now)
        self.gateway = AppThread(Gateway(self.settings).app()).start()
        self.port = self.gateway.port

    def close(self) -> None:
        self.gateway.stop()
        self.upstream.stop()
        self.client.close()


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis) -> Iterator[Server]:
    redis_server.start()  # a no-op unless a test stopped it
    redis.Redis.from_url(redis_server.url).flushall()
    s = Server(redis_server.url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def errors() -> Iterator[ErrorRecords]:
    handler = ErrorRecords()
    loggers = [logging.getLogger(n) for n in ("aiohttp.server", "aiohttp.web", "aiohttp.access", "prewarm.gateway")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_bodies = st.one_of(
    st.binary(max_size=300),
    _json.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model": st.sampled_from(["m", "", "nope", "m" * 300]) | _json},
                          optional={"prompt": _json, "stream": _json, "max_tokens": _json,
                                    "messages": _json}).map(lambda v: json.dumps(v).encode()),
    st.just(b"x" * 5000),  # above max_body_bytes
)
_paths = st.one_of(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/",
                     "/v1/completions/", "/v1//completions", "/v1/completions?x=1", "/%00", "/v1/%ff"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"), max_size=30)
    .map(lambda t: "/" + t),
)
_methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
_headers = st.dictionaries(
    st.sampled_from([signing.HEADER, signing.HEADER_TS, signing.HEADER_SIG, "Content-Type", "Accept",
                     "X-Anything", "Authorization"]),
    _header_text, max_size=5,
)


def _send(port: int, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@FUZZ
@given(method=_methods, path=_paths, body=_bodies, headers=_headers)
def test_fuzzed_http_requests_get_a_clear_answer(server: Server, errors: ErrorRecords, method: str, path: str,
                                                 body: bytes, headers: dict[str, str]) -> None:
    status, raw = _send(server.port, method, path, body, headers)
    assert status < 500 or status == 503, (status, raw[:300])
    if status >= 400:
        try:
            parsed = json.loads(raw)
        except ValueError:
            raise AssertionError(f"{method} {path} -> {status} without a JSON body: {raw[:200]!r}") from None
        assert isinstance(parsed, dict) and isinstance(parsed.get("error"), dict), parsed
        assert parsed["error"].get("message"), parsed
    assert not errors.records, [r.getMessage() for r in errors.records]


def test_the_fuzzed_gateway_still_serves(server: Server, errors: ErrorRecords) -> None:
    status, raw = _send(server.port, "POST", "/v1/completions", json.dumps({"model": "m", "prompt": "hi"}).encode(),
                        {"Content-Type": "application/json"})
    assert status == 200, raw
    assert not errors.records, [r.getMessage() for r in errors.records]


# --- task payloads ----------------------------------------------------------------------------------------
_ids = st.one_of(
    st.sampled_from(["m@r1/n1/0", "m@r1/n1/-1", "m@r1/n1/x", "@r/n/0", "m@/n/0", "m@r/n/", "m@r/n/0/1", "m/r/n/0",
                     "m@r1/n1/99999999999999999999", "m@r1/n1/０", " m@r1/n1/0", "m@r1/n\n1/0", ""]),
    st.from_regex(r"[a-z0-9._@/-]{0,20}", fullmatch=True),
    _json,
)
_args = st.lists(st.one_of(_ids, _json), max_size=4)
_kwargs = st.dictionaries(
    st.sampled_from(["replica_id", "pool", "model_dir", "reason", "until", "model", "event_id", "extra"])
    | st.text(max_size=6),
    st.one_of(_ids, _json, st.sampled_from(["serving", "warm", "/models/m", "\x00"])), max_size=3,
)
PARSERS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("prewarm", payload.parse_prewarm),
    ("retire", payload.parse_retire),
    ("keep_warm", payload.parse_keep_warm),
    ("replica_only", lambda a, k: payload.parse_replica_only("recycle", a, k)),
    ("model", lambda a, k: payload.parse_model("handle_demand", a, k)),
    ("nothing", lambda a, k: payload.parse_nothing("reap", a, k)),
    ("event_id", lambda a, k: payload.parse_event_id("apply_scale_event", a, k)),
]


@settings(max_examples=200, deadline=None)
@given(which=st.sampled_from(PARSERS), args=_args, kwargs=_kwargs)
def test_fuzzed_task_payloads_parse_or_are_refused(which: tuple[str, Callable[[Any, Any], Any]], args: list[Any],
                                                  kwargs: dict[str, Any]) -> None:
    name, parse = which
    try:
        parsed = parse(args, kwargs)
    except InvalidPayload as exc:
        assert str(exc), f"{name}: an InvalidPayload without a message"
        return
    if name == "nothing":
        assert parsed is None and not args and not kwargs
    elif name == "event_id":
        assert isinstance(parsed, str) and parsed and not any(c.isspace() for c in parsed)
    elif name == "model":
        assert isinstance(parsed.model, str) and parsed.model
    else:
        ref = parsed.replica
        assert ref.replica_id == f"{ref.model}@{ref.revision}/{ref.node}/{ref.slot}" and ref.slot >= 0
