"""Per-model user-request counters in Redis, per time bucket: the forecaster's history.

The gateway counts in memory and flushes once a second with one pipeline (INCRBY and a
retention EXPIRE per bucket), so counting adds no Redis round trip to a request. Counts
that cannot be flushed (Redis down) are kept and retried: none is lost while the
gateway lives.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis
import redis.asyncio as aioredis

from prewarm.core import keys

log = logging.getLogger(__name__)


def bucket_start(now: float, resolution_s: int) -> int:
    return int(now // resolution_s) * resolution_s


class RequestCounter:
    def __init__(self, resolutions: dict[int, int] | None = None) -> None:
        self.resolutions = resolutions or keys.REQUEST_RESOLUTIONS_S
        self._pending: Counter[tuple[str, int, int]] = Counter()

    def add(self, model: str, now: float, n: int = 1) -> None:
        for res in self.resolutions:
            self._pending[(model, res, bucket_start(now, res))] += n

    async def flush(self, client: "aioredis.Redis[str]") -> int:
        """Write pending counts; on a Redis error keep them for the next flush. Returns buckets written."""
        if not self._pending:
            return 0
        batch, self._pending = self._pending, Counter()
        pipe = client.pipeline(transaction=False)
        first: dict[str, int] = {}
        for (model, res, start), n in batch.items():
            key = keys.requests(model, res, start)
            pipe.incrby(key, n)
            pipe.expire(key, self.resolutions[res])
            first[model] = min(first.get(model, start), start)
        pipe.sadd(keys.REQUEST_MODELS, *first)
        for model, start in first.items():
            pipe.hsetnx(keys.REQUESTS_FIRST, model, start)
        try:
            await pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            self._pending.update(batch)
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
