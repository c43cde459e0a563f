"""Clients' API keys at the gateway (issue 20: a fair share per client means nothing if a client can
name itself anew with every request). A real gateway over HTTP, a real Redis, real upstreams."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prewarm.core import signing
from prewarm.gateway.client_auth import ClientKeys
from tests.httpservers import Upstream
from tests.test_gateway import SECRET, Harness, request, served_by


def _keys(tmp_path: Path, **clients: str) -> Path:
    d = tmp_path / "client-keys"
    d.mkdir(exist_ok=True)
    for f in d.iterdir():
        if f.is_file():
            f.unlink()
    for name, key in clients.items():
        (d / name).write_text(key + "\n")
    (d / "..data").mkdir(exist_ok=True)  # what a mounted Secret also holds: not a client
    return d


def test_without_a_known_key_a_user_request_is_401_and_not_demand(redis_url: str, tmp_path: Path) -> None:
    h = Harness(redis_url, client_keys_dir=str(_keys(tmp_path, team_a="sk-a", team_b="sk-b")),
                client_keys_refresh_s=0.2)
    try:
        up = Upstream("m")
        h.add(0, up)
        for headers in ({}, {"Authorization": "Bearer sk-invented"}, {"Authorization": "Basic sk-a"}):
            status, hdrs, body = h.complete(headers=headers)
            assert status == 401, (headers, status, body)
            assert json.loads(body)["error"]["code"] == "invalid_api_key" and hdrs["www-authenticate"] == "Bearer"
        assert up.received == []  # refused before anything was done for it
        assert served_by(h.complete(headers={"Authorization": "Bearer sk-a"})) == "m"
        assert served_by(h.complete(headers={"Authorization": "bearer sk-b"})) == "m"
        assert all("sk-" not in hv for hd in up.headers for hv in hd.values())  # a client's key never passes on

        # a signed warmup request carries its own proof
        raw = json.dumps({"model": "m", "prompt": "hi"}).encode()
        warm = signing.warmup_headers(SECRET, "POST", "/v1/completions", raw, time.time())
        assert request(h.url, "POST", "/v1/completions", raw=raw, headers=warm)[0] == 200

        # rotation: the directory is read again, a new key works and a removed one stops working
        _keys(tmp_path, team_b="sk-b", team_c="sk-c")
        time.sleep(0.3)
        assert h.complete(headers={"Authorization": "Bearer sk-c"})[0] == 200
        assert h.complete(headers={"Authorization": "Bearer sk-a"})[0] == 401
    finally:
        h.close()


def test_a_known_key_is_one_client_whatever_its_address(tmp_path: Path) -> None:
    keys = ClientKeys(str(_keys(tmp_path, team_a="sk-a")), refresh_s=60)
    assert keys.enabled and keys.client("Bearer sk-a") == "team_a" and keys.client("Bearer  sk-a ") == "team_a"
    assert keys.client("Bearer sk-b") is None and keys.client(None) is None and keys.client("sk-a") is None
    assert not ClientKeys(None).enabled
    (tmp_path / "client-keys" / "team_a").unlink()
    assert keys.client("Bearer sk-a") == "team_a"  # read again only after refresh_s
