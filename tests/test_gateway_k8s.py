"""The gateway as the chart runs it in a cluster (issue 18): several gateway pods on one Redis,
in front of upstreams that each hold their own API key. Real gateways over real HTTP, a real
Redis, real upstream servers (`tests.httpservers.Upstream`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from prewarm.core import keys, signing
from prewarm.core.domain import Pool, Replica, ReplicaState
from prewarm.core.errors import InvalidPayload
from prewarm.core.settings import KubernetesSettings
from tests.httpservers import Upstream
from tests.test_gateway import SECRET, Harness, _user_count, request


@pytest.fixture()
def two(redis_url: str):
    a, b = Harness(redis_url), Harness(redis_url)
    yield a, b
    a.close()
    b.close()


def test_a_warmup_request_replayed_on_another_gateway_is_user_traffic(two: tuple[Harness, Harness]) -> None:
    """A captured signed warmup request was warmup once per gateway pod (nonces in each process)."""
    a, b = two
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


def _ready(h: Harness, slot: int, up: Upstream, auth_ref: str = "") -> Replica:
    r = Replica("m", "r1", "n1", slot, endpoint=h.upstream(up), auth_ref=auth_ref)
    now = time.time()
    h.reg.register(r, now=now)
    for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        h.reg.transition(r.id, s, now=now)
    return r


@pytest.fixture()
def keyed(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A gateway holding the runtimes' key and, as the chart mounts it, one pod Secret's key."""
    monkeypatch.setenv("PREWARM_RUNTIME_API_KEY", "runtime-key")
    (tmp_path / "vllm-llama").mkdir()
    (tmp_path / "vllm-llama" / "api-key").write_text("pod-key\n")  # a mounted Secret ends its file as it was written
    h = Harness(redis_url, upstream_keys_dir=str(tmp_path))
    yield h
    h.close()


def test_each_upstream_gets_its_own_api_key(keyed: Harness) -> None:
    """A vLLM pod started with its own --api-key answered 401 to every user request (issue 18)."""
    builtin, vllm = Upstream("builtin", api_key="runtime-key"), Upstream("vllm", api_key="pod-key")
    _ready(keyed, 0, builtin)
    _ready(keyed, 1, vllm, auth_ref="vllm-llama/api-key")
    rec = keyed.reg.get(Replica("m", "r1", "n1", 1).id)
    assert rec is not None and rec.auth_ref == "vllm-llama/api-key"  # a reference, no key
    assert "pod-key" not in json.dumps(keyed.reg.client.hgetall(keys.replica(Replica("m", "r1", "n1", 1).id)))
    served = []
    for _ in range(2):  # each replica in turn: the one that served is drained
        status, _, body = keyed.complete(headers={"Authorization": "Bearer client-token"})
        assert status == 200, body
        served.append(json.loads(body)["served_by"])
        slot = 0 if served[-1] == "builtin" else 1
        keyed.reg.transition(Replica("m", "r1", "n1", slot).id, ReplicaState.DRAINING, now=time.time())
        time.sleep(0.05)  # the gateway's view refresh
    assert sorted(served) == ["builtin", "vllm"]
    assert {h["Authorization"] for h in builtin.headers} == {"Bearer runtime-key"}
    assert {h["Authorization"] for h in vllm.headers} == {"Bearer pod-key"}  # never the client's own token


def test_a_refused_or_missing_key_is_a_502_that_still_counts_as_demand(keyed: Harness) -> None:
    wrong = Upstream("wrong", api_key="rotated-key")
    _ready(keyed, 0, wrong, auth_ref="vllm-llama/api-key")
    status, _, body = keyed.complete()
    assert status == 502 and json.loads(body)["error"]["code"] == "upstream_auth"
    assert "vllm-llama/api-key" in json.loads(body)["error"]["message"]
    assert wrong.headers and not wrong.received  # it refused the request: nothing was served
    keyed.reg.transition(Replica("m", "r1", "n1", 0).id, ReplicaState.DRAINING, now=time.time())
    unheld = Upstream("unheld", api_key="x")
    _ready(keyed, 2, unheld, auth_ref="other-secret/api-key")
    time.sleep(0.05)
    status, _, body = keyed.complete()
    assert status == 502 and "other-secret/api-key" in json.loads(body)["error"]["message"]
    assert unheld.headers == []  # the gateway sends no key it does not hold, and no wrong one
    time.sleep(1.3)  # one counter flush
    assert _user_count(keyed.reg.client) == 2  # the planner still sees the demand


def test_a_key_reference_cannot_leave_the_keys_directory() -> None:
    for bad in ("../etc/passwd", "secret/..", "Secret/key", "/abs/key", "a/b/c", "noslash"):
        with pytest.raises(InvalidPayload, match="<secret name>/<key>"):
            Replica("m", "r1", "n1", 0, auth_ref=bad)
    with pytest.raises(ValidationError, match="<secret name>/<key>"):
        KubernetesSettings(pod_api_key_ref="../x")
