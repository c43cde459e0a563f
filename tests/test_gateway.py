"""The gateway over real HTTP: real upstream servers, a real Redis registry, the real proxy."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any, Iterator

import pytest
import redis

from prewarm.core import keys, signing
from prewarm.core.domain import LoadPhase, Pool, Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.gateway.server import Gateway
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import GatewaySettings, RedisSettings, RegistrySettings, Settings, WarmupSettings
from workers.planning.tasks import unmet
from tests.httpservers import AppThread, Upstream

SECRET = "test-secret"


def request(url: str, method: str = "GET", path: str = "/", body: Any = None,
            headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    try:
        payload = resp.read()
    except http.client.IncompleteRead as exc:
        payload = exc.partial
    out = (resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload)
    conn.close()
    return out


def make_settings(redis_url: str, **gateway: Any) -> Settings:
    return Settings(
        redis=RedisSettings(url=redis_url, socket_timeout_s=0.5, connect_timeout_s=0.5),
        gateway=GatewaySettings(refresh_interval_s=0.01, **gateway),
        registry=RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3.0),
        warmup=WarmupSettings(secret=SECRET),
    )


class Harness:
    def __init__(self, redis_url: str, **gateway: Any) -> None:
        self.settings = make_settings(redis_url, **gateway)
        self.gateway = Gateway(self.settings)
        self.server = AppThread(self.gateway.app()).start()
        self.url = self.server.url
        self.reg = ReplicaRegistry(redis.Redis.from_url(redis_url, decode_responses=True), self.settings.registry)
        self.upstreams: list[AppThread] = []

    def upstream(self, up: Upstream) -> str:
        t = AppThread(up.app()).start()
        self.upstreams.append(t)
        return t.url

    def add(self, slot: int, up: Upstream, *, pool: Pool = Pool.SERVING, state: ReplicaState = ReplicaState.READY,
            progress: float = 1.0, phase: LoadPhase = LoadPhase.DONE) -> Replica:
        r = Replica("m", "r1", "n1", slot, endpoint=self.upstream(up), pool=pool)
        now = time.time()
        self.reg.register(r, now=now)
        path = {ReplicaState.PENDING: [], ReplicaState.LOADING: [ReplicaState.LOADING],
                ReplicaState.READY: [ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY]}[state]
        for s in path:
            self.reg.transition(r.id, s, now=now)
        if state is ReplicaState.LOADING:
            self.reg.set_progress(r.id, progress, phase, now=now)
        return r

    def complete(self, model: str = "m", **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return request(self.url, "POST", "/v1/completions", {"model": model, "prompt": "hi", **kw.pop("extra", {})}, **kw)

    def close(self) -> None:
        self.server.stop()
        for t in self.upstreams:
            t.stop()
        self.reg.client.close()


@pytest.fixture()
def gw(redis_url: str) -> Iterator[Harness]:
    h = Harness(redis_url)
    yield h
    h.close()


def served_by(resp: tuple[int, dict[str, str], bytes]) -> str:
    assert resp[0] == 200, resp
    return str(json.loads(resp[2])["served_by"])


def test_fewest_in_flight_among_ready_serving(gw: Harness) -> None:
    slow, fast = Upstream("a", delay_s=2.0), Upstream("b")  # long enough for a request and a scrape meanwhile
    a = gw.add(0, slow)
    b = gw.add(1, fast)
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(gw.complete()))
    t.start()
    deadline = time.time() + 5
    while not slow.received and time.time() < deadline:
        time.sleep(0.01)
    assert served_by(gw.complete()) == "b"  # a has one request in flight
    metrics = request(gw.url, path="/metrics")[2].decode()
    assert f'gateway_inflight_requests{{model="m",replica="{a.id}"}} 1.0' in metrics
    assert f'gateway_inflight_requests{{model="m",replica="{b.id}"}} 0.0' in metrics
    t.join()
    assert served_by(first[0]) == "a"
    assert f'gateway_inflight_requests{{model="m",replica="{a.id}"}} 0.0' in request(gw.url, path="/metrics")[2].decode()


def test_loading_under_threshold_goes_to_warm_pool_then_to_the_loading_replica(gw: Harness) -> None:
    warm, loading = Upstream("warm"), Upstream("loading")
    gw.add(5, warm, pool=Pool.WARM)
    r = gw.add(0, loading, state=ReplicaState.LOADING, progress=0.5, phase=LoadPhase.FIRST_LAYERS)
    assert served_by(gw.complete()) == "warm"
    gw.reg.set_progress(r.id, 0.75, LoadPhase.REST, now=time.time())
    time.sleep(0.05)
    assert served_by(gw.complete()) == "loading"


def test_nothing_ready_answers_503_with_retry_after_and_records_demand(gw: Harness) -> None:
    gw.add(0, Upstream("x"), state=ReplicaState.LOADING, progress=0.1, phase=LoadPhase.EMBEDDINGS)
    status, headers, body = gw.complete()
    assert status == 503
    assert int(headers["retry-after"]) >= 1
    assert json.loads(body)["error"]["code"] == "unavailable"
    demand = gw.reg.client.hgetall(keys.demand("m"))
    assert demand["count"] == "1"


def test_hold_waits_for_a_replica_to_become_ready(redis_url: str) -> None:
    h = Harness(redis_url, hold_timeout_s=5.0)
    try:
        r = h.add(0, Upstream("late"), state=ReplicaState.LOADING, progress=0.2, phase=LoadPhase.FIRST_LAYERS)

        def finish() -> None:
            time.sleep(0.5)
            h.reg.transition(r.id, ReplicaState.WARMING, now=time.time())
            h.reg.transition(r.id, ReplicaState.READY, now=time.time())

        threading.Thread(target=finish).start()
        started = time.monotonic()
        assert served_by(h.complete()) == "late"
        assert time.monotonic() - started >= 0.4
        assert h.reg.client.hget(keys.demand("m"), "count") == "1"
    finally:
        h.close()


def test_a_held_request_announces_its_demand_again_until_a_replica_is_ready(redis_url: str) -> None:
    """The planner's answer to the first announcement may have come while the model's only replica was still
    draining (to sleep): it started nothing, and nothing asked again until the beat's scan, up to 10 s later.
    A held request now re-announces every `DEMAND_REANNOUNCE_S`, without counting the demand twice."""
    h = Harness(redis_url, hold_timeout_s=2.6)
    sub = h.reg.client.pubsub(ignore_subscribe_messages=True)
    try:
        sub.subscribe(keys.DEMAND_CHANNEL)
        got: list[str] = []
        r = h.add(0, Upstream("x"))
        h.reg.transition(r.id, ReplicaState.DRAINING, now=time.time())  # on its way to sleep: routes nothing
        status, _, _ = h.complete()
        assert status == 503  # nothing became ready within the hold
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            msg = sub.get_message(timeout=0.1)
            if msg:
                got.append(msg["data"])
        assert got.count("m") >= 3, got  # at arrival, then about every second of the 2.6 s hold
        assert h.reg.client.hget(keys.demand("m"), "count") == "1"  # one request: one unit of demand
        assert "met" not in h.reg.client.hgetall(keys.demand("m"))  # answered 503: still unmet

        def ready_soon() -> None:
            time.sleep(0.5)
            h.add(1, Upstream("y"))

        threading.Thread(target=ready_soon).start()
        assert served_by(h.complete()) == "y"
        demand = h.reg.client.hgetall(keys.demand("m"))
        assert float(demand["met"]) >= float(demand["last"])  # the held request got a replica: the demand is met
        assert not unmet(demand, time.time()) and unmet({**demand, "last": repr(time.time())}, time.time())
    finally:
        sub.close()
        h.close()


def test_a_cold_start_does_not_starve_the_drain_rate_admission_reads(redis_url: str) -> None:
    """The drain rate was measured over every second a request was queued, the wait for a cold
    start included: after a 2 s load the model seemed to drain ~25 tokens/s, and a burst that its
    ready replica serves at once was answered 429 (`prewarm up --models 3` lost 8 of 43 that way)."""
    h = Harness(redis_url, hold_timeout_s=10.0, max_queue_wait_s=2.0)
    try:
        r = h.add(0, Upstream("late", delay_s=0.5), state=ReplicaState.LOADING, progress=0.2,
                  phase=LoadPhase.FIRST_LAYERS)
        held: list[Any] = []
        threads = [threading.Thread(target=lambda: held.append(h.complete())) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the cold start: the held requests drain nothing meanwhile
        h.reg.transition(r.id, ReplicaState.WARMING, now=time.time())
        h.reg.transition(r.id, ReplicaState.READY, now=time.time())
        for t in threads:
            t.join(15)
        assert [x[0] for x in held] == [200] * 4
        burst: list[Any] = []
        threads = [threading.Thread(target=lambda: burst.append(h.complete(extra={"max_tokens": 4})))
                   for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert sorted(x[0] for x in burst) == [200] * 20, [(x[0], x[2][:200]) for x in burst if x[0] != 200]
    finally:
        h.close()


def _user_count(client: "redis.Redis[str]") -> int:
    return sum(int(client.get(k) or 0) for k in client.scan_iter(keys.requests("m", 60, 0).rsplit(":", 1)[0] + ":*"))


def test_signed_warmup_goes_to_warm_pool_and_is_not_counted(gw: Harness) -> None:
    serving, warm = Upstream("serving"), Upstream("warm")
    gw.add(0, serving)
    gw.add(5, warm, pool=Pool.WARM)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    hdrs = signing.warmup_headers(SECRET, "POST", "/v1/completions", body, time.time())
    status, _, payload = request(gw.url, "POST", "/v1/completions", raw=body, headers=hdrs)
    assert status == 200 and json.loads(payload)["served_by"] == "warm"
    assert warm.headers[-1].get(signing.HEADER) == "1"  # the replica sees it as warmup too
    time.sleep(1.3)  # one counter flush
    assert _user_count(gw.reg.client) == 0


def test_a_replayed_warmup_request_is_user_traffic(gw: Harness) -> None:
    """Issue 13 (minor): a captured signed warmup request could be replayed as warmup for 300 s."""
    serving, warm = Upstream("serving"), Upstream("warm")
    gw.add(0, serving)
    gw.add(5, warm, pool=Pool.WARM)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    hdrs = signing.warmup_headers(SECRET, "POST", "/v1/completions", body, time.time())
    first = request(gw.url, "POST", "/v1/completions", raw=body, headers=hdrs)
    again = request(gw.url, "POST", "/v1/completions", raw=body, headers=hdrs)
    assert json.loads(first[2])["served_by"] == "warm"
    assert json.loads(again[2])["served_by"] == "serving"  # the replay is plain user traffic
    assert signing.HEADER not in serving.headers[-1]
    time.sleep(1.3)
    assert _user_count(gw.reg.client) == 1


def test_forged_warmup_gains_nothing(gw: Harness) -> None:
    serving, warm = Upstream("serving"), Upstream("warm")
    gw.add(0, serving)
    gw.add(5, warm, pool=Pool.WARM)
    forged = {signing.HEADER: "1", signing.HEADER_TS: f"{time.time():.3f}", signing.HEADER_SIG: "0" * 64}
    status, _, payload = gw.complete(headers=forged)
    assert status == 200 and json.loads(payload)["served_by"] == "serving"  # routed as plain user traffic
    assert signing.HEADER not in serving.headers[-1]  # the marker is stripped
    time.sleep(1.3)
    assert _user_count(gw.reg.client) == 1  # counted as user traffic


def test_forged_warmup_refused_when_configured(redis_url: str) -> None:
    h = Harness(redis_url, warmup_forged="refuse")
    try:
        h.add(0, Upstream("s"))
        status, _, body = h.complete(headers={signing.HEADER: "1"})
        assert status == 403 and json.loads(body)["error"]["code"] == "invalid_warmup_signature"
    finally:
        h.close()


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_body"),
        (b'{"prompt": "hi"}', 400, "missing_model"),
        (b'{"model": 42}', 400, "missing_model"),
        (b'{"model": "nope", "prompt": "x"}', 404, "model_not_found"),
    ],
)
def test_bad_input_gets_a_clear_4xx(gw: Harness, raw: bytes, status: int, code: str) -> None:
    gw.add(0, Upstream("s"))
    got, _, body = request(gw.url, "POST", "/v1/completions", raw=raw)
    assert got == status
    assert json.loads(body)["error"]["code"] == code
    assert served_by(gw.complete()) == "s"  # and it keeps serving


def test_oversized_body_is_413(redis_url: str) -> None:
    h = Harness(redis_url, max_body_bytes=1024)
    try:
        h.add(0, Upstream("s"))
        status, _, _ = h.complete(extra={"prompt": "x" * 4096})
        assert status == 413
        assert served_by(h.complete()) == "s"
    finally:
        h.close()


def test_streaming_is_proxied(gw: Harness) -> None:
    gw.add(0, Upstream("s"))
    status, headers, body = gw.complete(extra={"stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")


def test_replica_closing_mid_stream_and_mid_body(gw: Harness) -> None:
    up = Upstream("s", mode="close_mid_stream")
    gw.add(0, up)
    status, _, body = gw.complete(extra={"stream": True})
    assert status == 200 and b"upstream_closed" in body and b"[DONE]" not in body
    up.mode = "close_mid_body"
    time.sleep(1.1)  # the exclusion after a failure lasts one heartbeat interval
    status, _, body = gw.complete()
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_closed"
    up.mode = "ok"
    time.sleep(1.1)  # the exclusion after a failure lasts one heartbeat interval
    assert served_by(gw.complete()) == "s"


def test_a_replica_answering_500_is_passed_through_not_failed(gw: Harness) -> None:
    """Issue 13: a 500 is an answer (the replica is alive); a request that causes one would cause it on
    every replica, so it is neither counted against the replica nor re-sent."""
    bad, good = Upstream("bad", mode="fail"), Upstream("good")
    r_bad = gw.add(0, bad)
    gw.add(1, good)
    statuses = []
    for _ in range(gw.settings.gateway.failure_threshold * 2):
        status, _, _ = gw.complete()
        statuses.append(status)
    assert 500 in statuses, statuses  # the replica's own answer is passed through
    assert not good.received or len(good.received) == statuses.count(200)  # never a re-send of a 500
    stored = gw.reg.get(r_bad.id)
    assert stored is not None and stored.state is ReplicaState.READY, stored
    assert not gw.gateway.state.failures and not gw.gateway.state.excluded


def test_a_slow_answer_is_a_504_not_a_dead_replica(redis_url: str) -> None:
    """Issue 13: the upstream timeout is an idle timeout; a request that outlives it is not re-sent
    (it may be expensive and is probably still running) and does not count against the replica."""
    h = Harness(redis_url, upstream_timeout_s=0.5)
    try:
        slow, other = Upstream("slow", delay_s=1.5), Upstream("other")
        r_slow = h.add(0, slow)
        h.add(1, other)
        for _ in range(h.settings.gateway.failure_threshold + 1):
            status, _, body = h.complete()
            assert status == 504 and json.loads(body)["error"]["code"] == "upstream_timeout", body
            h.gateway.state.excluded.clear()
        assert other.received == [], "the timed-out request was re-sent to another replica"
        stored = h.reg.get(r_slow.id)
        assert stored is not None and stored.state is ReplicaState.READY, stored
        assert not h.gateway.state.failures
    finally:
        h.close()


def test_a_long_stream_is_fine_while_chunks_keep_coming(redis_url: str) -> None:
    """The whole stream takes 4x the timeout; no gap between chunks reaches it."""
    h = Harness(redis_url, upstream_timeout_s=0.6)
    try:
        h.add(0, Upstream("s", chunk_delay_s=0.2, chunks=12))
        status, _, body = h.complete(extra={"stream": True})
        assert status == 200 and body.count(b"data: ") == 13 and body.endswith(b"data: [DONE]\n\n"), body
    finally:
        h.close()


def test_full_replicas_answer_429_with_retry_after(redis_url: str) -> None:
    """Issue 13 (backpressure): a bounded queue per replica; when every one is full, 429 at once."""
    h = Harness(redis_url, replica_queue_limit=2)
    try:
        slow = Upstream("slow", delay_s=2.0)
        h.add(0, slow)
        held: list[Any] = []
        threads = [threading.Thread(target=lambda: held.append(h.complete())) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(slow.received) < 2 and time.time() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        status, headers, body = h.complete()
        assert status == 429 and int(headers["retry-after"]) >= 1, (status, body)
        assert json.loads(body)["error"]["code"] == "overloaded"
        assert time.monotonic() - started < 1.5  # at once, not after a wait behind the others
        for t in threads:
            t.join()
        assert [r[0] for r in held] == [200, 200]
        assert served_by(h.complete()) == "slow"
    finally:
        h.close()


def test_unreachable_replica_is_marked_failed_and_traffic_moves(gw: Harness) -> None:
    good = Upstream("good")
    dead = Replica("m", "r1", "n1", 0, endpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    now = time.time()
    gw.reg.register(dead, now=now)
    for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        gw.reg.transition(dead.id, s, now=now)
    gw.add(1, good)
    for _ in range(gw.settings.gateway.failure_threshold):
        assert served_by(gw.complete()) == "good"  # falls over within the request
        gw.gateway.state.excluded.clear()  # force the dead replica to be tried again until marked failed
    stored = gw.reg.get(dead.id)
    assert stored is not None and stored.state is ReplicaState.FAILED and "failing requests" in stored.reason


def test_unreachable_replica_falls_over_to_another(gw: Harness) -> None:
    good = Upstream("good")
    dead = Replica("m", "r1", "n1", 0, endpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    now = time.time()
    gw.reg.register(dead, now=now)
    for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        gw.reg.transition(dead.id, s, now=now)
    gw.add(1, good)
    assert served_by(gw.complete()) == "good"


def test_models_health_metrics_and_counters(gw: Harness) -> None:
    gw.add(0, Upstream("s"))
    status, _, body = request(gw.url, path="/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["m"]
    assert json.loads(request(gw.url, path="/healthz")[2])["registry"] == "ok"
    for _ in range(3):
        served_by(gw.complete())
    time.sleep(1.3)
    now = time.time()
    minute = keys.requests("m", 60, int(now // 60) * 60)
    prev = keys.requests("m", 60, int(now // 60) * 60 - 60)
    assert int(gw.reg.client.get(minute) or 0) + int(gw.reg.client.get(prev) or 0) == 3
    assert 0 < gw.reg.client.ttl(minute) <= keys.REQUEST_RESOLUTIONS_S[60] or gw.reg.client.ttl(prev) > 0
    first = float(gw.reg.client.hget(keys.REQUESTS_FIRST, "m") or "nan")
    assert now - 130 <= first <= now  # where the forecaster's history begins
    # the planner's fine signals: peak requests in flight (one at a time here) and their busy seconds
    fine = keys.FINE_RESOLUTION_S
    peaks = [float(gw.reg.client.get(k) or 0) for k in gw.reg.client.scan_iter(keys.inflight_peak("m", fine, 0)[:-1] + "*")]
    busy = [float(gw.reg.client.get(k) or 0) for k in gw.reg.client.scan_iter(keys.busy("m", fine, 0)[:-1] + "*")]
    assert peaks and max(peaks) == 1.0
    assert 0.0 < sum(busy) < 3 * 5.0
    text = request(gw.url, path="/metrics")[2].decode()
    assert 'gateway_requests_total{code="200",kind="user",model="m"} 3.0' in text
    assert 'prewarm_replicas{model="m",pool="serving",state="ready"} 1.0' in text
    assert 'gateway_routing_decisions_total{model="m",outcome="serving"} 3.0' in text


def test_requests_a_replica_refuses_as_invalid_are_not_demand(gw: Harness) -> None:
    """Issue 13 (minor): 400s from the runtime used to count as demand (a cheap way to make the planner
    scale up)."""
    up = Upstream("s", mode="bad_request")
    gw.add(0, up)
    for _ in range(5):
        assert gw.complete()[0] == 400
    up.mode = "ok"
    assert served_by(gw.complete()) == "s"
    time.sleep(1.3)  # one counter flush
    assert _user_count(gw.reg.client) == 1


def test_client_chosen_model_names_are_not_labels_while_redis_is_down() -> None:
    """Issue 13 (minor): 13 requests with made-up model names during an outage made 286 series."""
    with EmbeddedRedis() as server:
        h = Harness(server.url, stale_view_max_s=0)  # no last view to route from
        try:
            h.add(0, Upstream("s"))
            assert served_by(h.complete()) == "s"
            server.stop()
            time.sleep(0.05)
            for i in range(13):
                assert h.complete(model=f"made-up-{i}")[0] == 503
            text = request(h.url, path="/metrics")[2].decode()
            assert "made-up" not in text
            assert 'model="unknown"' in text
        finally:
            h.close()


def test_redis_outage_gives_503_never_500() -> None:
    """With the stale view off (or past its bound, tests/test_gateway_stale_view.py) an outage is a clean 503."""
    with EmbeddedRedis() as server:
        h = Harness(server.url, stale_view_max_s=0)
        try:
            h.add(0, Upstream("s"))
            assert served_by(h.complete()) == "s"
            server.stop()
            time.sleep(0.05)
            for _ in range(3):
                status, headers, body = h.complete()
                assert status == 503, body
                assert "retry-after" in headers
            assert request(h.url, path="/v1/models")[0] == 503
            status, _, health = request(h.url, path="/healthz")
            assert status == 200 and json.loads(health) == {"status": "degraded", "registry": "unavailable"}
            assert str(server.port) not in health.decode()  # issue 13: no internal address to clients
            assert request(h.url, path="/readyz")[0] == 503
            assert request(h.url, path="/metrics")[0] == 200
            server.start()
            h.reg.heartbeat(Replica("m", "r1", "n1", 0, endpoint=h.upstreams[0].url, state=ReplicaState.READY), now=time.time())
            time.sleep(0.05)
            assert served_by(h.complete()) == "s"
        finally:
            h.close()
