"""What a client sends can never take a replica down (issue 13).

Two real `prewarm serve-model` processes (a tiny random-weight torch model) are registered
ready in the session Redis, and a real gateway (aiohttp on a free port) routes to them.
Every test sends something hostile or unlucky through the gateway and then checks that
both replicas are still `ready` in the registry and that a plain request still gets 200.

- a prompt with a lone surrogate escape (`"\\ud800"`: not encodable as UTF-8) and JSON
  nested deeper than `json_body.MAX_DEPTH` are answered 400, by the gateway or the
  runtime, never 500 (the bound is our own: where `json.loads` gives up differs between
  Python builds); and a 500 the runtime does answer is passed through without
  counting against the replica (the rule: only connection-level failures and health
  checks fail a replica);
- a client that closes a stream mid-way ("stop generating") is not blamed on the replica;
- hypothesis-generated bodies through the gateway to the real runtimes never take a
  replica out of `ready`;
- a node snapshot rewritten in place under a replica that maps it: the replica refuses
  instead of answering garbage (or `NaN`, which is not JSON) with 200.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.json_body import MAX_DEPTH
from prewarm.core.settings import (
    GatewaySettings,
    RedisSettings,
    RegistrySettings,
    RuntimeSettings,
    Settings,
    WarmupSettings,
)
from prewarm.gateway.server import Gateway
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.runtime.model import make_model
from tests.logs import ErrorRecords
from tests.httpservers import AppThread
from tests.runtime_server import SECRET, TOKEN, RuntimeProcess, call, start_runtime, wait_loaded

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"


class Stack:
    """Two real runtimes, ready in the registry, behind an in-process gateway."""

    def __init__(self, redis_url: str, runtimes: list[RuntimeProcess], **gateway: Any) -> None:
        self.settings = Settings(
            redis=RedisSettings(url=redis_url, socket_timeout_s=5, connect_timeout_s=2),
            gateway=GatewaySettings(refresh_interval_s=0.05, **gateway),
            registry=RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3600.0),
            warmup=WarmupSettings(secret=SECRET),
        )
        self.client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
        self.registry = ReplicaRegistry(self.client, self.settings.registry)
        self.replicas: list[Replica] = []
        now = time.time()
        for slot, rt in enumerate(runtimes):
            rep = Replica(MODEL, "r1", "n1", slot, endpoint=rt.url)
            self.registry.register(rep, now=now)
            for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
                self.registry.transition(rep.id, s, now=now)
            self.replicas.append(rep)
        self.gateway = Gateway(self.settings)
        self.server = AppThread(self.gateway.app()).start()
        self.port = self.server.port

    def states(self) -> dict[str, str]:
        out = {}
        for rep in self.replicas:
            rec = self.registry.get(rep.id)
            out[rep.id] = rec.state.value if rec is not None else "missing"
        return out

    def assert_all_ready(self) -> None:
        assert set(self.states().values()) == {"ready"}, self.states()
        assert not self.gateway.state.excluded, f"replicas excluded: {self.gateway.state.excluded}"
        assert not self.gateway.state.failures, f"failures counted: {self.gateway.state.failures}"

    def send(self, raw: bytes, path: str = "/v1/completions", timeout: float = 60.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def complete(self, **body: Any) -> tuple[int, bytes]:
        return self.send(json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, **body}).encode())

    def close(self) -> None:
        self.server.stop()
        self.client.close()


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeProcess]]:
    tmp = tmp_path_factory.mktemp("client-faults")
    model_dir = make_model(tmp / "models" / MODEL, MODEL, seed=0, name=MODEL, revision="r1")
    started: list[RuntimeProcess] = []
    try:
        for i in range(2):
            (tmp / f"rt{i}").mkdir()
            started.append(start_runtime(model_dir, tmp / f"rt{i}", "--model-name", MODEL))
        for rt in started:
            wait_loaded(rt.url)
            status, body, _ = call(rt.url + "/ready", "POST", {"passed": True}, token=TOKEN)
            assert status == 200 and body["ready"], body
        yield started
    finally:
        for rt in started:
            rt.stop()


@pytest.fixture()
def stack(redis_url: str, runtimes: list[RuntimeProcess]) -> Iterator[Stack]:
    s = Stack(redis_url, runtimes)
    try:
        yield s
    finally:
        s.close()


LONE_SURROGATE = b'{"model":"tiny","prompt":"\\ud800"}'


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    """`{"model":"tiny","prompt":"x","x":[[[...]]]}`: valid JSON, nested `depth` deep."""
    return b'{"model":"tiny","prompt":"x","x":' + b"[" * depth + inner + b"]" * depth + b"}"


def test_runtime_answers_400_to_what_it_cannot_encode_or_parse(runtimes: list[RuntimeProcess]) -> None:
    url = runtimes[0].url + "/v1/completions"
    for raw in (LONE_SURROGATE, b'{"prompt":"a\\udfff b"}', _nested(5000)):
        status, body, _ = call(url, "POST", raw=raw)
        assert status == 400, (raw[:60], status, body)
        assert body["error"]["type"] == "invalid_request_error", body
    at_bound = MAX_DEPTH - 2  # the outer object and the innermost one are two of the levels
    assert call(url, "POST", raw=_nested(at_bound, b'{"max_tokens": 1}'))[0] == 200
    status, body, _ = call(url, "POST", raw=_nested(at_bound + 1, b'{"max_tokens": 1}'))
    assert status == 400 and "nested too deeply" in body["error"]["message"], body
    assert call(runtimes[0].url + "/readyz")[0] == 200


def test_gateway_answers_400_to_json_nested_too_deep(stack: Stack) -> None:
    status, body = stack.send(b'{"model":' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "invalid_json"


def test_requests_that_break_the_runtime_do_not_fail_replicas(stack: Stack) -> None:
    """The critical finding: eight 40-byte requests used to fail both replicas."""
    for _ in range(4):
        for raw in (LONE_SURROGATE, b'{"model":"tiny","prompt":"ok \\udc00"}'):
            status, body = stack.send(raw)
            assert status == 400, (raw[:60], status, body)
    for depth in (MAX_DEPTH - 2, MAX_DEPTH - 1, 990, 100_000):  # at the bound, past it, past a parser's guard
        status, body = stack.send(_nested(depth, b'{"max_tokens": 1}'))
        assert status == (200 if depth <= MAX_DEPTH - 2 else 400), (depth, status, body)
    stack.assert_all_ready()
    assert stack.complete()[0] == 200


def test_client_closing_a_stream_is_not_blamed_on_the_replica(stack: Stack, runtimes: list[RuntimeProcess]) -> None:
    errors = ErrorRecords()
    loggers = [logging.getLogger(n) for n in ("aiohttp.server", "aiohttp.web", "prewarm.gateway")]
    for lg in loggers:
        lg.addHandler(errors)
    try:
        for _ in range(stack.settings.gateway.failure_threshold + 1):
            body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 200, "stream": True}).encode()
            sock = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            first = sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200"), first
            # "stop generating": reset the connection at once (RST, not FIN) while tokens still come
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
        time.sleep(1.0)  # the gateway notices while it writes the next chunks
        stack.assert_all_ready()
        assert stack.complete()[0] == 200
        assert not errors.records, [r.getMessage() for r in errors.records]
        for rt in runtimes:  # nor is it an error at the runtime (it stops generating, no traceback)
            assert "internal error" not in rt.output() and "Traceback" not in rt.output(), rt.output()[-2000:]
    finally:
        for lg in loggers:
            lg.removeHandler(errors)


# --- fuzzing: generated bodies through the gateway to the real runtimes -----------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_prompt = st.one_of(
    st.text(max_size=30),  # lone surrogates included: hypothesis generates them
    st.lists(st.integers(min_value=-5, max_value=300), max_size=6),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\ufffd" * 5, ""]),
    _json,
)
_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={"prompt": _prompt, "max_tokens": st.one_of(st.integers(min_value=-2, max_value=40), _json),
              "stream": st.one_of(st.booleans(), _json), "logprobs": st.one_of(st.integers(-1, 25), _json),
              "echo": st.one_of(st.booleans(), _json), "n": _json, "temperature": _json, "stop": _json,
              "stream_options": _json, "suffix": _json},
)


def _encode(body: dict[str, Any], deep: int) -> bytes:
    raw = json.dumps(body, ensure_ascii=True)  # lone surrogates become \\udXXX escapes, as a client would send them
    if deep:
        raw = raw[:-1] + (", " if len(body) else "") + '"deep": ' + "[" * deep + "]" * deep + "}"
    return raw.encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=_bodies, deep=st.sampled_from([0, 0, 0, 10, 990, 3000]))
def test_fuzzed_bodies_never_take_a_replica_out_of_ready(stack: Stack, body: dict[str, Any], deep: int) -> None:
    status, raw = stack.send(_encode(body, deep))
    assert status < 500 or status == 503, (status, raw[:300])
    if status >= 400:
        parsed = json.loads(raw)
        assert isinstance(parsed.get("error"), dict), parsed
    assert set(stack.states().values()) == {"ready"}, stack.states()
    assert not stack.gateway.state.failures, stack.gateway.state.failures


# --- a snapshot modified in place under a replica that maps it --------------------------------------------
def _strict_json(raw: str) -> Any:
    def refuse(word: str) -> Any:
        raise AssertionError(f"the runtime wrote {word}, which is not JSON")

    return json.loads(raw, parse_constant=refuse)


def test_a_snapshot_rewritten_in_place_takes_the_replica_out_not_garbage(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 13: a replica mapping a node snapshot that is then rewritten in place used to serve NaN or
    garbage with 200 and stay ready (and emit `NaN`, which is not JSON). Now it refuses (503, so the
    gateway goes elsewhere), says why on /readyz and /health, and the agent's health check fails it."""
    tmp = tmp_path_factory.mktemp("snapshot-in-place")
    model_dir = make_model(tmp / "models" / MODEL, MODEL, seed=0, name=MODEL, revision="r1")
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    writer = start_runtime(model_dir, tmp / "a", "--model-name", MODEL)
    mapper = None
    try:
        wait_loaded(writer.url)
        snaps = tmp / "a" / "snapshots"
        deadline = time.monotonic() + 60
        while not list(snaps.glob("*.snap")) and time.monotonic() < deadline:
            time.sleep(0.1)
        [snap] = list(snaps.glob("*.snap"))
        mapper = start_runtime(model_dir, tmp / "b", "--model-name", MODEL,
                               env={"PREWARM_RUNTIME_SNAPSHOT_DIR": str(snaps)})
        wait_loaded(mapper.url)
        assert call(mapper.url + "/ready", "POST", {"passed": True}, token=TOKEN)[0] == 200
        body = {"prompt": "hello", "max_tokens": 4, "logprobs": 2}
        status, good, _ = call(mapper.url + "/v1/completions", "POST", body)
        assert status == 200, good

        with open(snap, "r+b") as f:  # in place: same inode, new bytes (0xff.. is NaN as float32)
            f.seek(4 * 4096)
            f.write(b"\xff" * (snap.stat().st_size - 5 * 4096))
        for _ in range(3):
            req = urllib.request.Request(mapper.url + "/v1/completions", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    status, raw = resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                status, raw = exc.code, exc.read().decode()
            parsed = _strict_json(raw)
            assert status == 503, (status, parsed)
            assert parsed["error"]["code"] == "weights_changed", parsed
        status, ready, _ = call(mapper.url + "/readyz")
        assert status == 503 and "modified in place" in ready["reason"], ready
        assert call(mapper.url + "/health")[0] == 503
    finally:
        writer.stop()
        if mapper is not None:
            mapper.stop()


def test_runtime_refusals_are_openai_shaped(runtimes: list[RuntimeProcess]) -> None:
    """Issue 13 (minor): /v1/chat/completions on the built-in runtime was a plain-text 404."""
    for method, path, code in (("POST", "/v1/chat/completions", 404), ("GET", "/v1/completions", 405),
                               ("GET", "/nowhere", 404)):
        status, body, _ = call(runtimes[0].url + path, method, {"model": MODEL, "messages": []} if method == "POST"
                               else None)
        assert status == code, (path, status, body)
        assert isinstance(body, dict) and body["error"]["message"] and body["error"]["type"], body


def test_a_runtime_beyond_loopback_needs_its_own_token_and_an_api_key(
        runtimes: list[RuntimeProcess], tmp_path: Path, redis_url: str) -> None:
    """Issue 13 (minor): the runtime's /v1/*, /stats and /metrics had no auth while Helm and compose bind
    it to 0.0.0.0, and its control token defaulted to the warmup secret, which the gateway holds too."""
    import subprocess
    import sys

    model_dir = make_model(tmp_path / "m", MODEL, seed=0, name=MODEL, revision="r1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env.update({"PREWARM_WARMUP_SECRET": SECRET, "PREWARM_RUNTIME_DEVICE": "cpu"})
    refused = subprocess.run([sys.executable, "-m", "prewarm.cli", "serve-model", "--model-dir", str(model_dir),
                              "--host", "0.0.0.0", "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "PREWARM_RUNTIME_TOKEN" in refused.stderr, refused.stderr[-1000:]

    key = "runtime-api-key"
    (tmp_path / "rt").mkdir()
    rt = start_runtime(model_dir, tmp_path / "rt", "--model-name", MODEL, "--host", "0.0.0.0",
                       env={"PREWARM_RUNTIME_API_KEY": key})
    try:
        wait_loaded(rt.url)
        assert call(rt.url + "/ready", "POST", {"passed": True}, token=TOKEN)[0] == 200
        for path, method, body in (("/v1/completions", "POST", {"prompt": "hi", "max_tokens": 1}),
                                   ("/v1/models", "GET", None), ("/stats", "GET", None), ("/metrics", "GET", None)):
            status, answer, _ = call(rt.url + path, method, body)
            assert status == 401, (path, status, answer)
            assert call(rt.url + path, method, body, token=SECRET)[0] == 401  # the warmup secret opens nothing
            assert call(rt.url + path, method, body, token=key)[0] == 200, path
        assert call(rt.url + "/sleep", "POST", token=SECRET)[0] == 403  # nor the control endpoints
        assert call(rt.url + "/healthz")[0] == 200 and call(rt.url + "/readyz")[0] == 200  # probes stay open

        # the gateway sends the key; a client's own Authorization never reaches the runtime
        settings = Settings(
            redis=RedisSettings(url=redis_url, socket_timeout_s=5, connect_timeout_s=2),
            gateway=GatewaySettings(refresh_interval_s=0.05),
            registry=RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3600.0),
            warmup=WarmupSettings(secret=SECRET), runtime=RuntimeSettings(api_key=key),
        )
        registry = ReplicaRegistry(redis.Redis.from_url(redis_url, decode_responses=True), settings.registry)
        rep = Replica(MODEL, "r1", "n9", 0, endpoint=rt.url)
        now = time.time()
        registry.register(rep, now=now)
        for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
            registry.transition(rep.id, s, now=now)
        with AppThread(Gateway(settings).app()) as gw:
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                         headers={"Content-Type": "application/json", "Authorization": "Bearer nope"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            conn.close()
        registry.client.close()
    finally:
        rt.stop()


def test_slow_headers_and_too_many_connections_from_one_client_are_cut(redis_url: str, tmp_path: Path) -> None:
    """Issue 13 (minor): no header-read timeout and no per-client cap (3,000 slow connections held for
    75 s). A real `prewarm gateway` process: header timeout 2 s, at most 5 connections per address (the
    sixth is answered 429, issue 20)."""
    from prewarm.registry.embedded import free_port, wait_for_port
    from tests.celery_helpers import WorkerProcess, worker_env

    port = free_port()
    env = worker_env(redis_url, tmp_path, PREWARM_GATEWAY_HEADER_TIMEOUT_S="2",
                     PREWARM_GATEWAY_MAX_CONNECTIONS_PER_CLIENT="5")
    gw = WorkerProcess(["gateway", "--port", str(port)], env, tmp_path / "gateway.log")
    gw.start(ready_marker="listening on", timeout=60)
    try:
        wait_for_port("127.0.0.1", port, 30.0, "prewarm gateway")
        time.sleep(0.3)
        started = time.monotonic()
        held = []
        for _ in range(5):  # slowloris: half a request line each, then nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := extra.recv(4096):  # issue 20: answered 429 + Retry-After and closed, not reset
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 429") and b"Retry-After: " in answer, answer
        extra.close()
        for s in held:  # each is closed once its header deadline passes
            s.settimeout(10)
            assert s.recv(1) == b""
            s.close()
        took = time.monotonic() - started
        assert 1.5 <= took < 9, f"the slow connections were closed after {took:.1f}s"
        # and the gateway serves normally afterwards
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        assert "Traceback" not in gw.log()
    finally:
        gw.stop()
