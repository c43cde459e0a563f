"""A Redis restart with its data loses nothing the planner needs (issue 13).

Helm and compose used to run Redis with `--save "" --appendonly no`: any restart or failover
lost the forecast history (the gateway's request counters), the planner's state, planned
events, load times and latency baselines. They now run it with an append-only file, as
`EmbeddedRedis(persist=True)` does here: a real `redis-server` restarted on the same port and
directory while a real gateway serves traffic (real HTTP upstream as the replica).

What must come back: every key written before the restart, with a value at least as large for
the counters (traffic goes on) and equal for everything else; and the request counters
afterwards hold every request the gateway answered with 200, those of the outage included
(the gateway keeps counts it could not flush and writes them once Redis is back).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import redis

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import GatewaySettings, RedisSettings, RegistrySettings, Settings, WarmupSettings
from prewarm.gateway.server import Gateway
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.replicas import ReplicaRegistry
from tests.httpservers import AppThread, Upstream


def _snapshot(client: "redis.Redis[str]") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in client.scan_iter("*"):
        kind = client.type(key)
        if kind == "string":
            out[key] = client.get(key)
        elif kind == "hash":
            out[key] = client.hgetall(key)
        elif kind == "list":
            out[key] = client.lrange(key, 0, -1)
        elif kind == "set":
            out[key] = client.smembers(key)
        elif kind == "zset":
            out[key] = dict(client.zrange(key, 0, -1, withscores=True))
        elif kind == "stream":
            out[key] = client.xlen(key)
    return out


def _user_requests(client: "redis.Redis[str]", model: str) -> int:
    prefix = keys.requests(model, 60, 0).rsplit(":", 1)[0]
    return sum(int(client.get(k) or 0) for k in client.scan_iter(prefix + ":*"))


def test_redis_restarted_with_its_data_under_traffic_loses_nothing() -> None:
    server = EmbeddedRedis(persist=True).start()
    client: "redis.Redis[str]" = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=5)
    upstream = AppThread(Upstream("u").app()).start()
    settings = Settings(
        redis=RedisSettings(url=server.url, socket_timeout_s=1, connect_timeout_s=0.5),
        gateway=GatewaySettings(refresh_interval_s=0.2),
        registry=RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3600.0),
        warmup=WarmupSettings(secret="s"),
    )
    gateway = AppThread(Gateway(settings).app()).start()
    stop = threading.Event()
    answers: list[int] = []

    def traffic() -> None:
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                answers.append(resp.status)
            except OSError:
                answers.append(0)
            finally:
                conn.close()
            time.sleep(0.02)

    try:
        reg = ReplicaRegistry(client, settings.registry)
        rep = Replica("m", "r1", "n1", 0, endpoint=upstream.url)
        now = time.time()
        reg.register(rep, now=now)
        for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
            reg.transition(rep.id, s, now=now)
        # what the planner reads besides the counters (written as the workers write them)
        reg.record_load_time("m", 3.25, revision="r1", node_class="cpu")
        reg.record_baseline_sample("m", "cpu", 0.042, samples=1)
        client.hset(keys.planner_state("m"), mapping={"state": json.dumps({"held_until": now + 600})})
        client.hset(keys.planned_event("ev-1"), mapping={"event": json.dumps({"id": "ev-1"}), "status": "planned"})
        client.zadd(keys.PLANNED_EVENTS, {"ev-1": now + 300})

        worker = threading.Thread(target=traffic, daemon=True)
        worker.start()
        time.sleep(2.5)  # two counter flushes
        before = _snapshot(client)
        assert _user_requests(client, "m") > 0
        server.stop()  # SIGTERM: the append-only file is written out
        time.sleep(1.0)  # traffic meets a gateway without Redis
        server.start()  # same port, same directory
        time.sleep(2.0)
        stop.set()
        worker.join(20)
        time.sleep(1.5)  # the counts kept during the outage are flushed
        after = _snapshot(client)

        lost = sorted(set(before) - set(after))
        assert not lost, f"keys lost over the restart: {lost}"
        for key, value in before.items():
            if key.startswith(f"{keys.PREFIX}:requests:") and isinstance(value, str):
                assert int(after[key]) >= int(value), (key, value, after[key])
            elif key.startswith((f"{keys.PREFIX}:busy:", f"{keys.PREFIX}:inflight:")) and isinstance(value, str):
                # the planner's fine counters of the bucket in progress only grow (busy time, peak in flight)
                assert float(after[key]) >= float(value), (key, value, after[key])
            elif key in (keys.HEARTBEATS, keys.EVENTS, keys.REGISTRY_ACTIVITY) or key.startswith(
                    f"{keys.PREFIX}:ready:") or key == keys.replica(rep.id) or key.startswith("_kombu"):
                continue  # live: refreshed by traffic and heartbeats
            else:
                assert after[key] == value, (key, value, after[key])
        assert reg.load_time_p95("m", "r1", "cpu") == 3.25 and reg.baseline("m", "cpu") == 0.042
        served = answers.count(200)
        assert served > 0, sorted(set(answers))
        counted = _user_requests(client, "m")
        assert counted >= served, f"{served} requests answered 200, {counted} counted"
        rec = reg.get(rep.id)
        assert rec is not None and rec.state is ReplicaState.READY
    finally:
        stop.set()
        gateway.stop()
        upstream.stop()
        client.close()
        server.close()
