"""Issue 20, major 7: the gateway keeps routing from its last view of ready replicas while Redis
is away, within the bound of `gateway.stale_view_max_s` (rule: prewarm/policy/stale_view.py).

Real Redis (stopped and started again, with AOF as the Helm chart runs it), real HTTP
upstreams, the real gateway. The replicas' heartbeats come from a thread calling the
registry's own `heartbeat` every `heartbeat_interval_s`, as the node agent's loop does,
failing while Redis is away and resuming when it returns.
"""

from __future__ import annotations

import json
import threading
import time


from prewarm.core.domain import Replica, ReplicaState
from prewarm.policy import stale_view
from prewarm.registry.embedded import EmbeddedRedis
from tests.httpservers import Upstream
from tests.test_gateway import Harness, request

OUTAGE_S = 30.0  # the target: Redis stopped for 30 s gives 0 non-2xx for models with ready replicas


class Heartbeats:
    """An agent's heartbeat loop for the harness's replicas: beats every interval, errors ignored."""

    def __init__(self, h: Harness, replicas: list[Replica]) -> None:
        self.h, self.replicas = h, replicas
        self.stop = threading.Event()
        self.beats_after: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.h.settings.registry.heartbeat_interval_s):
            for r in self.replicas:
                try:
                    self.h.reg.heartbeat(r, now=time.time())
                    self.beats_after.append(time.time())
                except Exception:  # noqa: BLE001 - Redis away: the agent's loop logs and beats again later
                    pass

    def __enter__(self) -> "Heartbeats":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _traffic(h: Harness, until: threading.Event, statuses: list[int]) -> None:
    while not until.is_set():
        statuses.append(h.complete()[0])
        time.sleep(0.05)


def _metric(h: Harness, name: str) -> float:
    text = request(h.url, path="/metrics")[2].decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_redis_stopped_for_30s_gives_no_non_2xx_for_a_model_with_ready_replicas() -> None:
    """Before: every request while Redis was away got 503 (41 of 218 during a 10 s restart)."""
    with EmbeddedRedis(persist=True) as server:
        h = Harness(server.url)
        try:
            replicas = [h.add(0, Upstream("a")), h.add(1, Upstream("b"))]
            ready = [Replica(r.model, r.revision, r.node, r.slot, endpoint=r.endpoint, state=ReplicaState.READY)
                     for r in replicas]
            with Heartbeats(h, ready) as beats:
                statuses: list[int] = []
                done = threading.Event()
                clients = [threading.Thread(target=_traffic, args=(h, done, statuses)) for _ in range(2)]
                for t in clients:
                    t.start()
                try:
                    time.sleep(1.0)
                    server.stop()
                    during_start = len(statuses)
                    time.sleep(OUTAGE_S / 2)
                    age_mid = _metric(h, "gateway_registry_view_age_seconds")
                    assert request(h.url, path="/readyz")[0] == 200  # routing from the view: still ready
                    time.sleep(OUTAGE_S / 2)
                    during = len(statuses) - during_start
                    server.start()
                    back = time.time()
                    # the heartbeats resume within an interval, and every one is older than the TTL when
                    # Redis returns: the window the heartbeat clock covers
                    deadline = back + 3 * h.settings.registry.heartbeat_ttl_s
                    while time.time() < deadline:
                        time.sleep(0.1)
                finally:
                    done.set()
                    for t in clients:
                        t.join(timeout=30)
            assert any(b > back for b in beats.beats_after)
            bad = [s for s in statuses if not 200 <= s < 300]
            assert during > 50 and not bad, (len(statuses), bad[:10])
            assert age_mid >= OUTAGE_S / 2 - 1
            assert _metric(h, "gateway_registry_view_age_seconds") == 0.0
            assert _metric(h, "gateway_registry_stale_reads_total") > 0
        finally:
            h.close()


def test_the_last_view_is_not_routed_past_its_bound() -> None:
    """Past `stale_view_max_s` the gateway answers 503 with Retry-After and /readyz turns 503."""
    with EmbeddedRedis() as server:
        h = Harness(server.url, stale_view_max_s=1.5)
        try:
            h.add(0, Upstream("s"))
            assert h.complete()[0] == 200
            server.stop()
            first = h.complete()
            assert first[0] == 200 and json.loads(first[2])["served_by"] == "s"
            status, _, body = request(h.url, path="/readyz")
            assert status == 200 and json.loads(body) == {"ready": True, "registry": "stale"}
            deadline = time.time() + 10
            status = 200
            while status == 200 and time.time() < deadline:
                status, headers, _ = h.complete()
                time.sleep(0.05)
            assert status == 503 and "retry-after" in headers
            assert request(h.url, path="/readyz")[0] == 503
        finally:
            h.close()


RULE = stale_view.StalenessRule(max_stale_s=60.0, heartbeat_ttl_s=15.0, retry_interval_s=0.5)


def test_heartbeats_are_judged_in_reachable_time_for_one_ttl_after_an_outage() -> None:
    h = stale_view.read_ok(stale_view.RegistryHealth(), 100.0, RULE)
    assert stale_view.heartbeat_clock(h, 100.0, RULE) == 100.0
    h = stale_view.read_failed(h, 100.5)
    assert stale_view.view_age(h, 120.0) == 20.0
    assert stale_view.may_serve_stale(100.0, 160.0, RULE) and not stale_view.may_serve_stale(100.0, 160.1, RULE)
    assert not stale_view.should_read(h, 100.7, RULE) and stale_view.should_read(h, 101.0, RULE)
    h = stale_view.read_ok(h, 130.0, RULE)  # back after 30 s
    assert h.outage_s == 30.0 and stale_view.view_age(h, 130.0) == 0.0
    assert stale_view.heartbeat_clock(h, 131.0, RULE) == 101.0  # a heartbeat fresh at 100 is fresh until 145
    assert stale_view.heartbeat_clock(h, 145.0, RULE) == 145.0  # one TTL after: the real clock again


def test_an_outage_longer_than_the_bound_shifts_heartbeats_by_the_bound_only() -> None:
    h = stale_view.read_failed(stale_view.read_ok(stale_view.RegistryHealth(), 0.0, RULE), 0.1)
    h = stale_view.read_ok(h, 1000.0, RULE)
    assert h.outage_s == RULE.max_stale_s
    assert stale_view.heartbeat_clock(h, 1001.0, RULE) == 1001.0 - RULE.max_stale_s


