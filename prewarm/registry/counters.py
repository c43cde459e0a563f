"""Per-model user-request counters in Redis, per time bucket: the forecaster's history.

The gateway counts in memory and flushes once a second with one pipeline (INCRBY and a
retention EXPIRE per bucket), so counting adds no Redis round trip to a request. At the
fine resolution (`keys.FINE_RESOLUTION_S`) it also records the peak of user requests in
flight per bucket (a max across gateways, by a small Lua script) and the request-seconds
of the requests that ended in it: the planner's burst and mean-load signals. Counts
that cannot be flushed (Redis down) are kept and retried: none is lost while the
gateway lives.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import redis
import redis.asyncio as aioredis

from prewarm.core import keys

log = logging.getLogger(__name__)


def bucket_start(now: float, resolution_s: int) -> int:
    return int(now // resolution_s) * resolution_s


#: SET the key to ARGV[1] when it is higher than what is there (the peak across gateways), with a TTL.
_MAX = """
local v = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > v then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
"""


class RequestCounter:
    def __init__(self, resolutions: dict[int, int] | None = None) -> None:
        self.resolutions = resolutions or keys.REQUEST_RESOLUTIONS_S
        self._pending: Counter[tuple[str, int, int]] = Counter()
        self.inflight: Counter[str] = Counter()  # user requests in flight per model, now
        self._peak: dict[tuple[str, int], int] = {}  # (model, fine bucket) -> peak in flight
        self._busy: dict[tuple[str, int], float] = {}  # (model, fine bucket) -> request-seconds ended

    def add(self, model: str, now: float, n: int = 1) -> None:
        for res in self.resolutions:
            self._pending[(model, res, bucket_start(now, res))] += n

    def begin(self, model: str, now: float) -> None:
        """A user request starts: one more in flight (and the bucket's peak follows)."""
        self.inflight[model] += 1
        key = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
        self._peak[key] = max(self._peak.get(key, 0), self.inflight[model])

    def end(self, model: str, now: float, duration_s: float) -> None:
        """A user request ends after `duration_s` in flight."""
        self.inflight[model] = max(0, self.inflight[model] - 1)
        b = bucket_start(now, keys.FINE_RESOLUTION_S)
        self._busy[(model, b)] = self._busy.get((model, b), 0.0) + max(0.0, duration_s)
        key = (model, b)
        self._peak[key] = max(self._peak.get(key, 0), self.inflight[model])

    def observe(self, model: str, now: float, level: int) -> None:
        """A level of requests in flight seen elsewhere (the engines' own counts): the bucket's peak follows it."""
        if level > 0:
            key = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
            self._peak[key] = max(self._peak.get(key, 0), level)

    async def flush(self, client: "aioredis.Redis[str]") -> int:
        """Write pending counts; on a Redis error keep them for the next flush. Returns buckets written."""
        if not self._pending and not self._peak and not self._busy:
            return 0
        batch, self._pending = self._pending, Counter()
        peaks, self._peak = self._peak, {}
        busy, self._busy = self._busy, {}
        # a bucket still in progress keeps its in-flight level as the floor of its peak
        for model, n in self.inflight.items():
            if n:
                peaks.setdefault((model, bucket_start(time.time(), keys.FINE_RESOLUTION_S)), n)
        pipe = client.pipeline(transaction=False)
        ttl = self.resolutions.get(keys.FINE_RESOLUTION_S, 2 * 86400)
        for (model, start), peak in peaks.items():
            pipe.eval(_MAX, 1, keys.inflight_peak(model, keys.FINE_RESOLUTION_S, start), peak, ttl)
        for (model, start), secs in busy.items():
            key = keys.busy(model, keys.FINE_RESOLUTION_S, start)
            pipe.incrbyfloat(key, round(secs, 6))
            pipe.expire(key, ttl)
        first: dict[str, int] = {}
        for (model, res, start), n in batch.items():
            key = keys.requests(model, res, start)
            pipe.incrby(key, n)
            pipe.expire(key, self.resolutions[res])
            first[model] = min(first.get(model, start), start)
        if first:
            pipe.sadd(keys.REQUEST_MODELS, *first)
        for model, start in first.items():
            pipe.hsetnx(keys.REQUESTS_FIRST, model, start)
        try:
            await pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            self._pending.update(batch)
            for k, secs in busy.items():
                self._busy[k] = self._busy.get(k, 0.0) + secs
            for k, v in peaks.items():
                self._peak[k] = max(self._peak.get(k, 0), v)
            log.warning("request counters not flushed, kept for retry (%d buckets): %s", len(batch), exc)
            return 0
        return len(batch)


async def record_demand(client: "aioredis.Redis[str]", model: str, now: float) -> None:
    """Record unmet demand for a model (nothing ready) and announce it: scale from zero."""
    key = keys.demand(model)
    pipe = client.pipeline(transaction=True)
    pipe.hincrby(key, "count", 1)
    pipe.hset(key, "last", repr(now))
    pipe.hsetnx(key, "first", repr(now))
    pipe.expire(key, keys.DEMAND_TTL_S)
    pipe.publish(keys.DEMAND_CHANNEL, model)
    await pipe.execute()
