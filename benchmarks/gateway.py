"""Gateway benchmark: the cost of a routing decision and of the proxy hop.

- `lookups_per_s`, `lookup_p99_ms`: routing decisions (registry view + pure policy) from
  one asyncio client against a real Redis, back to back;
- `redis_ping_per_s`: the same client doing PING in the same run; `lookup_vs_ping` is the
  ratio (a lookup costing one round trip scores ~1, two round trips ~0.5);
- `proxy_overhead_p99_ms`: p99 of requests through a real `prewarm gateway` process minus
  p99 of the same requests sent straight to the same upstream, interleaved in one run.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import redis.asyncio as aioredis

from benchmarks.common import parser, percentile, prewarm_process, report, wait_http
from prewarm.core.domain import Pool, Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port, stop_process
from prewarm.registry.replicas import AsyncRegistryReader, ReplicaRegistry
from prewarm.policy.routing import choose_replica


def populate(url: str, upstream: str, stop: threading.Event) -> threading.Thread:
    """Register six replicas (four ready serving, one loading, one warm) and heartbeat them
    from a thread, as their agents would, until `stop` is set."""
    reg = ReplicaRegistry(redis.Redis.from_url(url, decode_responses=True))
    now = time.time()
    hosted = []
    for slot in range(6):
        r = Replica("bench", "r1", f"n{slot % 3}", slot, endpoint=upstream, pool=Pool.WARM if slot == 5 else Pool.SERVING)
        reg.register(r, now=now)
        states = [ReplicaState.LOADING] if slot == 4 else [ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY]
        for s in states:
            r = reg.transition(r.id, s, now=now)
        hosted.append(r)

    def beat() -> None:
        while not stop.wait(reg.settings.heartbeat_interval_s):
            for r in hosted:
                reg.heartbeat(r, now=time.time())
        reg.client.close()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


async def lookups(url: str, seconds: float) -> tuple[list[float], list[float]]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    reader = AsyncRegistryReader(client)
    lat_lookup: list[float] = []
    lat_ping: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # interleave in small blocks so both see the same machine state
        for _ in range(200):
            t = time.perf_counter()
            v = await reader.view("bench", now=time.time())
            choose_replica(v.serving, v.warm, v.loading, {})
            lat_lookup.append(time.perf_counter() - t)
        for _ in range(200):
            t = time.perf_counter()
            await client.ping()
            lat_ping.append(time.perf_counter() - t)
    await client.aclose()
    return lat_lookup, lat_ping


def timed_posts(port: int, n: int, body: bytes) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"port {port} answered {resp.status}")
        out.append(time.perf_counter() - t)
    conn.close()
    return out


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    seconds = 3.0 if args.quick else 15.0
    rounds = 10 if args.quick else 40
    with EmbeddedRedis() as server:
        up_port, gw_port = free_port(), free_port()
        upstream = subprocess.Popen([sys.executable, str(Path(__file__).with_name("echo_upstream.py")), str(up_port)])
        gateway = prewarm_process(
            ["gateway", "--port", str(gw_port)],
            {"PREWARM_REDIS_URL": server.url, "PREWARM_GATEWAY_HOST": "127.0.0.1"},
        )
        beating = threading.Event()
        try:
            wait_http(f"http://127.0.0.1:{up_port}/healthz")
            wait_http(f"http://127.0.0.1:{gw_port}/healthz")
            populate(server.url, f"http://127.0.0.1:{up_port}", beating)
            lat_lookup, lat_ping = asyncio.run(lookups(server.url, seconds))
            body = json.dumps({"model": "bench", "prompt": "hello", "max_tokens": 1}).encode()
            timed_posts(gw_port, 200, body)  # warm both paths
            timed_posts(up_port, 200, body)
            direct: list[float] = []
            via: list[float] = []
            for _ in range(rounds):
                direct += timed_posts(up_port, 100, body)
                via += timed_posts(gw_port, 100, body)
        finally:
            beating.set()
            stop_process(gateway)
            stop_process(upstream)
    lookup_time = sum(lat_lookup)
    ping_time = sum(lat_ping)
    result = {
        "lookups_per_s": len(lat_lookup) / lookup_time,
        "lookup_p99_ms": percentile(lat_lookup, 99) * 1000,
        "redis_ping_per_s": len(lat_ping) / ping_time,
        "lookup_vs_ping": (len(lat_lookup) / lookup_time) / (len(lat_ping) / ping_time),
        "proxy_p99_ms": percentile(via, 99) * 1000,
        "direct_p99_ms": percentile(direct, 99) * 1000,
        "proxy_overhead_p99_ms": (percentile(via, 99) - percentile(direct, 99)) * 1000,
        "proxy_overhead_p50_ms": (percentile(via, 50) - percentile(direct, 50)) * 1000,
        "requests_per_path": len(via),
        "quick": args.quick,
    }
    rows = [
        ("lookups_per_s", result["lookups_per_s"], "registry view (1 Lua round trip) + routing policy"),
        ("lookup_p99_ms", result["lookup_p99_ms"], ""),
        ("redis_ping_per_s", result["redis_ping_per_s"], "same client, same run"),
        ("lookup_vs_ping", result["lookup_vs_ping"], "target >= 0.5 (at most two round trips)"),
        ("direct_p99_ms", result["direct_p99_ms"], "client -> upstream"),
        ("proxy_p99_ms", result["proxy_p99_ms"], "client -> gateway process -> upstream"),
        ("proxy_overhead_p99_ms", result["proxy_overhead_p99_ms"], "target < 2 ms"),
        ("proxy_overhead_p50_ms", result["proxy_overhead_p50_ms"], ""),
    ]
    report("prewarm gateway benchmark", rows, result, args.json)


if __name__ == "__main__":
    main()
