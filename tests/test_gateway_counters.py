"""The gateway's fine counters have the semantics the simulator replays (issue 16).

- Peak requests in flight of a bucket is the SUM over the gateways of each one's peak: two
  real gateway instances, five requests held in flight at each, record 10 (the old shared
  max recorded 5).
- Busy request-seconds are the time integral of the requests in flight, each request's time
  split over the buckets it spans and credited while it is still in flight, not at its end;
  a request the replica refused as invalid leaves none.

Everything runs on the session's real Redis; the two gateways are real `Gateway` servers
proxying to a real HTTP upstream over sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterator

import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web

from prewarm.core import keys
from prewarm.registry.counters import RequestCounter, bucket_start, split_over_buckets
from tests.celery_helpers import wait_for
from tests.httpservers import Upstream
from tests.test_gateway import Harness, request

FINE = keys.FINE_RESOLUTION_S


class HeldUpstream(Upstream):
    """An upstream that holds every request until the test releases them: requests stay in flight
    for as long as the test needs, whatever the machine's speed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.held = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.held += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return await super().handle(request)


@pytest.fixture()
def two_gateways(redis_url: str) -> Iterator[tuple[Harness, Harness]]:
    a = Harness(redis_url, replica_concurrency=16)
    b = Harness(redis_url, replica_concurrency=16)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _flush(counter: RequestCounter, url: str) -> None:
    async def go() -> None:
        client: "aioredis.Redis[str]" = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            await counter.flush(client)
        finally:
            await client.aclose()

    asyncio.run(go())


def test_split_over_buckets_covers_the_interval_once() -> None:
    assert split_over_buckets(1005.0, 1027.0, 10) == [(1000, 5.0), (1010, 10.0), (1020, 7.0)]
    assert split_over_buckets(1010.0, 1020.0, 10) == [(1010, 10.0)]
    assert split_over_buckets(1012.0, 1012.0, 10) == []


def test_peak_in_flight_is_summed_over_two_gateways(two_gateways: tuple[Harness, Harness]) -> None:
    a, b = two_gateways
    up = HeldUpstream("held")
    a.add(0, up)  # one replica in the shared registry: both gateways route to it
    answers: list[int] = []

    def send(h: Harness) -> None:
        answers.append(h.complete()[0])

    threads = [threading.Thread(target=send, args=(h,)) for h in (a, b) for _ in range(5)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: up.held == 10, 30, "10 requests held at the upstream")
        client = a.reg.client

        def summed() -> int | None:
            # the bucket now in progress: every gateway's in-flight level is the floor of its peak there
            start = bucket_start(time.time(), FINE)
            return start if client.get(keys.inflight_peak("m", FINE, start)) == "10" else None

        start = wait_for(summed, 15, lambda: f"peak 10 in the current bucket; keys: "
                         f"{[(k, client.get(k)) for k in client.scan_iter(keys.inflight_peak('m', FINE, 0)[:-1] + '*')]}")
        assert start is not None
        # the sum is of each gateway's own five
        assert sorted(client.hgetall(keys.inflight_peaks("m", FINE, start)).values()) == ["5", "5"]
        assert a.gateway.counter.instance != b.gateway.counter.instance
    finally:
        up.release.set()
        for t in threads:
            t.join(30)
    assert answers == [200] * 10


def test_busy_time_is_split_over_the_buckets_a_request_spans(redis_url: str) -> None:
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
    c = RequestCounter(instance="g1")
    c.begin("m", 1005.0)
    c.end("m", 1027.0, 1005.0)  # 22 s in flight: 5 s, 10 s, 7 s in three buckets, not 22 s in the last
    c.begin("m", 1031.0)
    c.end("m", 1043.0, 1031.0, demand=False)  # refused as invalid: no busy time
    _flush(c, redis_url)
    got = {b: float(client.get(keys.busy("m", FINE, b)) or 0.0) for b in range(1000, 1050, FINE)}
    assert got == pytest.approx({1000: 5.0, 1010: 10.0, 1020: 7.0, 1030: 0.0, 1040: 0.0})
    client.close()


def test_busy_time_of_a_request_still_in_flight_is_credited_as_it_passes(redis_url: str) -> None:
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
    c = RequestCounter(instance="g1")
    began = time.time() - 3 * FINE - 0.5
    c.begin("m", began)
    first = bucket_start(began, FINE)
    _flush(c, redis_url)  # still in flight: its time so far is in the buckets it has passed through
    assert float(client.get(keys.busy("m", FINE, first)) or 0) == pytest.approx(first + FINE - began)
    assert float(client.get(keys.busy("m", FINE, first + FINE)) or 0) == pytest.approx(FINE)
    ended = time.time()
    c.end("m", ended, began)
    _flush(c, redis_url)
    total = sum(float(client.get(keys.busy("m", FINE, b)) or 0) for b in range(first, int(ended) + FINE, FINE))
    assert total == pytest.approx(ended - began)  # credited once: what the first flush wrote is not repeated
    # and the two peaks it left are this gateway's: its part of each bucket's sum
    assert client.hget(keys.inflight_peaks("m", FINE, first), "g1") == "1"
    client.close()


def test_an_engines_level_counts_once_however_many_gateways_report_it(redis_url: str) -> None:
    """The engines' own queue counts every gateway's requests. Folded into each gateway's peak, the sum over
    gateways counted it once per gateway (two gateways reporting a queue of 12 recorded 24); now it is the
    largest level any gateway saw, and the planner reads the larger of it and the gateways' summed peaks."""
    from forecasting.data.history import load_fine_counters

    client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
    model = "engine-level"
    gateways = [RequestCounter(instance="g1"), RequestCounter(instance="g2")]
    for g in gateways:
        for _ in range(3):
            g.begin(model, 2001.0)  # 3 in flight at each gateway: 6 in all
        g.observe(model, 2002.0, 12)  # both see the engines report 12 (every gateway's requests, and queued ones)
        for _ in range(3):
            g.end(model, 2008.0, 2001.0)
        g.observe(model, 2013.0, 4)  # the next bucket: the engines' queue drained to 4
    gateways[1].observe(model, 2004.0, 13)  # a later heartbeat one gateway saw
    for g, n in zip(gateways, (5, 6)):  # ... then 5 and 6 of the gateways' own in flight: 11
        for _ in range(n):
            g.begin(model, 2015.0)
        for _ in range(n):
            g.end(model, 2019.0, 2015.0)
    for g in gateways:
        _flush(g, redis_url)
    _, requests, peak, _, _ = load_fine_counters(client, model, start=2000, end=2020, bucket_s=FINE)
    assert client.get(keys.engine_peak(model, FINE, 2000)) == "13"
    assert list(peak) == [13.0, 11.0]  # not 3 + 13 + 3 + 12; the gateways' own sum where it is larger
    client.close()
