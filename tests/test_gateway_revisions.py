"""The gateway's revision split over real HTTP: real upstreams, a real Redis, weights a rollout wrote."""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest
import redis

from prewarm.core import keys
from prewarm.core.domain import LoadPhase, Replica, ReplicaState
from prewarm.gateway.revisions import HEADER_REVISION, HEADER_ROUTE_KEY
from prewarm.registry.rollouts import RolloutStore
from tests.httpservers import Upstream
from tests.test_gateway import Harness, request, served_by


@pytest.fixture()
def gw(redis_url: str) -> Iterator[Harness]:
    h = Harness(redis_url)
    yield h
    h.close()


def add(gw: Harness, rev: str, slot: int, *, ready: bool = True) -> Replica:
    r = Replica("m", rev, "n1", slot, endpoint=gw.upstream(Upstream(f"{rev}-{slot}")))
    now = time.time()
    gw.reg.register(r, now=now)
    for st in ([ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY] if ready else [ReplicaState.LOADING]):
        gw.reg.transition(r.id, st, now=now)
    if not ready:  # past the warm threshold: the routing policy would use it were it not for its revision
        gw.reg.set_progress(r.id, 0.9, LoadPhase.REST, now=now)
    return r


def set_weights(gw: Harness, weights: list[tuple[str, float]]) -> None:
    gw.reg.client.set(keys.revision_weights("m"), json.dumps(weights))
    time.sleep(0.05)  # past the gateway's cache (refresh_interval_s = 0.01)


def revisions_of(gw: Harness, n: int, **kw: object) -> list[str]:
    return [served_by(gw.complete(**kw)).split("-")[0] for _ in range(n)]  # type: ignore[arg-type]


def test_without_weights_any_ready_revision_serves(gw: Harness) -> None:
    add(gw, "r1", 0, ready=False)
    add(gw, "r2", 1)
    assert set(revisions_of(gw, 5)) == {"r2"}  # no rollout: the revision is no routing criterion


def test_a_revision_with_no_weight_gets_nothing_however_ready(gw: Harness) -> None:
    add(gw, "r1", 0)
    add(gw, "r2", 1)
    set_weights(gw, [("r2", 0.0), ("r1", 100.0)])
    assert set(revisions_of(gw, 20)) == {"r1"}


def test_a_weighted_revision_gets_nothing_before_it_is_ready(gw: Harness) -> None:
    add(gw, "r1", 0)
    canary = add(gw, "r2", 1, ready=False)  # loading at 90%
    set_weights(gw, [("r2", 50.0), ("r1", 50.0)])
    assert set(revisions_of(gw, 20)) == {"r1"}
    for st in (ReplicaState.WARMING, ReplicaState.READY):
        gw.reg.transition(canary.id, st, now=time.time())
    time.sleep(0.05)
    assert set(revisions_of(gw, 30)) == {"r1", "r2"}


def test_route_keys_are_sticky_and_a_header_pins_a_revision(gw: Harness) -> None:
    add(gw, "r1", 0)
    add(gw, "r2", 1)
    set_weights(gw, [("r2", 50.0), ("r1", 50.0)])
    for key in ("alice", "bob", "carol", "dave"):
        got = revisions_of(gw, 6, headers={HEADER_ROUTE_KEY: key})
        assert len(set(got)) == 1, (key, got)
    set_weights(gw, [("r2", 0.0), ("r1", 100.0)])
    assert set(revisions_of(gw, 5, headers={HEADER_REVISION: "r2"})) == {"r2"}  # testing a canary with no weight
    status, _, body = gw.complete(headers={HEADER_REVISION: "r7"})
    assert status == 404
    err = json.loads(body)["error"]
    assert err["code"] == "revision_not_found" and "'r7'" in err["message"] and "r1" in err["message"]


def test_requests_are_counted_per_revision(gw: Harness, redis_url: str) -> None:
    add(gw, "r1", 0)
    add(gw, "r2", 1)
    set_weights(gw, [("r2", 50.0), ("r1", 50.0)])
    start = time.time()
    got = revisions_of(gw, 20)
    text = request(gw.url, path="/metrics")[2].decode()
    for rev in ("r1", "r2"):
        line = f'gateway_revision_requests_total{{code="200",model="m",revision="{rev}"}} {float(got.count(rev))}'
        assert line in text
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store = RolloutStore(client)
        deadline = time.time() + 10
        stats = store.stats("m", ["r1", "r2"], start=start, end=time.time())
        while sum(s.requests for s in stats.values()) < 20 and time.time() < deadline:
            time.sleep(0.2)  # the gateway flushes its counters once a second
            stats = store.stats("m", ["r1", "r2"], start=start, end=time.time())
    finally:
        client.close()
    assert {r: s.requests for r, s in stats.items()} == {"r1": got.count("r1"), "r2": got.count("r2")}
    assert all(s.errors == 0 and s.latency_s > 0 for s in stats.values() if s.requests)
