"""Real traffic driven through the gateway: the demo's (and a user's) way to put load on it.

("Replay" in this project is the simulator's trace replay, `forecasting.sim.simulate.replay`.)

Arrival offsets (seconds) are replayed in real time, optionally compressed by
`time_scale`, as OpenAI completion requests; each answer's latency and status are
recorded. A request that waited longer than `wait_threshold_s` is a cold-start hit as
the simulator counts them, so the two can be compared.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection

import aiohttp
import numpy as np

_WORDS = ("deploy", "model", "latency", "tokens", "replica", "cache", "kernel", "batch", "queue", "warm")


def prompt_for(i: int, tokens: int) -> str:
    """A deterministic prompt of roughly `tokens` words."""
    return " ".join(_WORDS[(i + k) % len(_WORDS)] for k in range(max(1, tokens)))


@dataclass
class TrafficStats:
    """Live counters, read by the terminal view while the replay runs."""

    planned: int = 0
    sent: int = 0
    done: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # seconds, of 2xx answers
    waits_over: int = 0  # answers slower than wait_threshold_s (cold-start hits)
    offsets: list[float] = field(default_factory=list)  # replay offset of each 2xx answer
    started_at: float = 0.0

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if 200 <= s < 300)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100) of the answered requests' latencies; nan before any answer."""
        if not self.latencies:
            return float("nan")
        return float(np.percentile(np.asarray(self.latencies), q, method="inverted_cdf"))


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stats: TrafficStats, offset: float,
               wait_threshold_s: float) -> None:
    t0 = time.monotonic()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        stats.errors[type(exc).__name__] += 1
        stats.done += 1
        return
    elapsed = time.monotonic() - t0
    stats.statuses[status] += 1
    stats.done += 1
    if 200 <= status < 300:
        stats.latencies.append(elapsed)
        stats.offsets.append(offset)
        if elapsed > wait_threshold_s:
            stats.waits_over += 1


async def drive(
    gateway_url: str,
    model: str,
    arrivals: Collection[float],
    stats: TrafficStats,
    *,
    time_scale: float = 1.0,
    prompt_tokens: int = 16,
    max_tokens: int = 4,
    wait_threshold_s: float = 0.5,
    timeout_s: float = 120.0,
    stop: asyncio.Event | None = None,
) -> TrafficStats:
    """Send one request per arrival offset; returns when every answer is in (or `stop` is set)."""
    url = gateway_url.rstrip("/") + "/v1/completions"
    stats.planned = len(arrivals)
    stats.started_at = time.monotonic()
    connector = aiohttp.TCPConnector(limit=512)
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for i, offset in enumerate(arrivals):
            due = stats.started_at + float(offset) / time_scale
            delay = due - time.monotonic()
            if delay > 0:
                if stop is not None:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                        break
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(delay)
            elif stop is not None and stop.is_set():
                break
            body = json.dumps({"model": model, "prompt": prompt_for(i, prompt_tokens), "max_tokens": max_tokens}).encode()
            task = asyncio.create_task(_one(session, url, body, stats, float(offset), wait_threshold_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            stats.sent += 1
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s)
    return stats
