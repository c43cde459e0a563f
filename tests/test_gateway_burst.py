"""The gateway under a burst of concurrent requests: no 503 from its own Redis reads.

Found by benchmarks/load.py: with 200 connections, every request in flight when the
routing view went stale read Redis at once, the asyncio client's pool (100 connections)
ran out ("Too many connections"), and those requests got 503 "registry unavailable".
The gateway now lets one read per key run at a time and makes the others wait for it.
Real Redis, a real upstream server, the real gateway app, real HTTP.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import redis

from prewarm.core.domain import Replica, ReplicaState
from prewarm.gateway.server import Gateway
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import GatewaySettings, RedisSettings, RegistrySettings, Settings, WarmupSettings
from tests.httpservers import AppThread, Upstream

BURST = 250  # above the asyncio Redis client's default pool of 100 connections


def test_a_burst_above_the_redis_pool_size_gets_no_503(redis_url: str) -> None:
    settings = Settings(
        redis=RedisSettings(url=redis_url),
        gateway=GatewaySettings(refresh_interval_s=0.01, replica_queue_limit=1000),  # the pool, not backpressure
        registry=RegistrySettings(),
        warmup=WarmupSettings(secret="s"),
    )
    upstream = AppThread(Upstream("u", delay_s=0.02).app()).start()
    gateway = Gateway(settings)
    server = AppThread(gateway.app()).start()
    reg = ReplicaRegistry(redis.Redis.from_url(redis_url, decode_responses=True), settings.registry)
    try:
        r = Replica("m", "r1", "n1", 0, endpoint=upstream.url)
        now = time.time()
        reg.register(r, now=now)
        for state in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
            reg.transition(r.id, state, now=now)

        async def burst() -> list[int]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                async def one() -> int:
                    async with session.post(f"{server.url}/v1/completions",
                                            json={"model": "m", "prompt": "hi", "max_tokens": 1}) as resp:
                        await resp.read()
                        return resp.status

                codes: list[int] = []
                for _ in range(2):  # the first burst meets an empty cache, the second a stale one
                    codes += await asyncio.gather(*(one() for _ in range(BURST)))
                    await asyncio.sleep(0.05)
                return codes

        codes = asyncio.run(burst())
        assert {c: codes.count(c) for c in set(codes)} == {200: 2 * BURST}
    finally:
        server.stop()
        upstream.stop()
        reg.client.close()
