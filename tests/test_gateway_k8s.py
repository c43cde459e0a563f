"""The gateway as the chart runs it in a cluster (issue 18): several gateway pods on one Redis,
in front of upstreams that each hold their own API key. Real gateways over real HTTP, a real
Redis, real upstream servers (`tests.httpservers.Upstream`)."""

from __future__ import annotations

import json
import time

import pytest

from prewarm.core import keys, signing
from prewarm.core.domain import Pool
from tests.test_gateway import SECRET, Harness, _user_count, request


@pytest.fixture()
def two(redis_url: str):  # type: ignore[no-untyped-def]
    a, b = Harness(redis_url), Harness(redis_url)
    yield a, b
    a.close()
    b.close()


def test_a_warmup_request_replayed_on_another_gateway_is_user_traffic(two: tuple[Harness, Harness]) -> None:
    """A captured signed warmup request was warmup once per gateway pod (nonces in each process)."""
    a, b = two
    from tests.httpservers import Upstream

    serving, warm = Upstream("serving"), Upstream("warm")
    a.add(0, serving)
    a.add(5, warm, pool=Pool.WARM)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    hdrs = signing.warmup_headers(SECRET, "POST", "/v1/completions", body, time.time())
    first = request(a.url, "POST", "/v1/completions", raw=body, headers=hdrs)
    replay = request(b.url, "POST", "/v1/completions", raw=body, headers=hdrs)
    assert json.loads(first[2])["served_by"] == "warm"
    assert json.loads(replay[2])["served_by"] == "serving"  # plain user traffic on the other gateway
    assert signing.HEADER not in serving.headers[-1]
    ttl = a.reg.client.ttl(keys.warmup_nonce(hdrs[signing.HEADER_NONCE]))
    assert 0 < ttl <= signing.MAX_SKEW_S + 2  # kept only while its timestamp could still verify
    time.sleep(1.3)  # one counter flush of each gateway
    assert _user_count(a.reg.client) == 1
    fresh = signing.warmup_headers(SECRET, "POST", "/v1/completions", body, time.time())
    assert json.loads(request(b.url, "POST", "/v1/completions", raw=body, headers=fresh)[2])["served_by"] == "warm"
