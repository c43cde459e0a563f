"""Per-model user-request counters in Redis, per time bucket: the forecaster's history.

The gateway counts in memory and flushes once a second with one pipeline (INCRBY and a
retention EXPIRE per bucket), so counting adds no Redis round trip to a request. At the
fine resolution (`keys.FINE_RESOLUTION_S`) it also records, per bucket, the planner's
burst and mean-load signals, with the semantics the simulator replays:

- peak user requests in flight: each gateway's own peak in the bucket, SUMMED over the
  gateways (a small Lua script keeps every gateway's part in a hash and the total beside
  it), so two gateways at 5 each record 10, not 5; beside it, the highest level the
  model's engines reported (their own queues count every gateway's requests), kept as the
  MAXIMUM over gateways: folded into each gateway's peak, it was summed too, and N gateways
  recorded N times an engine's queue. The planner reads the larger of the two;
- busy request-seconds: the time integral of the requests in flight, each request's time
  split over the buckets it spans and credited as it passes (every flush), not at its end,
  so a bucket holds its own load when the planner reads it just after it ends. A request
  the replica refused as invalid (not demand) is refunded: it leaves no busy time.

Counts that cannot be flushed (Redis down) are kept and retried: none is lost while the
gateway lives.
The requests that waited for capacity are counted per fine bucket too: what the
planner's cold-start budget calibrates on (`forecasting.calibration`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import Counter

import redis
import redis.asyncio as aioredis

from prewarm.core import keys

log = logging.getLogger(__name__)


def bucket_start(now: float, resolution_s: int) -> int:
    return int(now // resolution_s) * resolution_s


#: This gateway's peak in one bucket (ARGV[2]) replaces its part in the hash KEYS[2] when higher, and the
#: total KEYS[1] (the sum over gateways) grows by the difference; both keep the TTL ARGV[3].
_PEAK_SUM = """
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local new = tonumber(ARGV[2])
if new > old then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('INCRBY', KEYS[1], new - old)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
"""

#: The engines' level in one bucket (ARGV[1]) replaces KEYS[1] when higher (the maximum over gateways), TTL ARGV[2].
_PEAK_MAX = """
local old = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > old then
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
"""


def split_over_buckets(start: float, end: float, resolution_s: int) -> list[tuple[int, float]]:
    """The parts of the interval [start, end) in each bucket it spans: (bucket start, seconds)."""
    out: list[tuple[int, float]] = []
    b = bucket_start(start, resolution_s)
    while b < end:
        lo, hi = max(start, float(b)), min(end, float(b + resolution_s))
        if hi > lo:
            out.append((b, hi - lo))
        b += resolution_s
    return out


class RequestCounter:
    """One gateway's counters; `instance` names this gateway among those that share the Redis."""

    def __init__(self, resolutions: dict[int, int] | None = None, instance: str | None = None) -> None:
        self.resolutions = resolutions or keys.REQUEST_RESOLUTIONS_S
        self.instance = instance or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._pending: Counter[tuple[str, int, int]] = Counter()
        self.inflight: Counter[str] = Counter()  # user requests in flight per model, now
        self._since: dict[str, float] = {}  # model -> when its busy time was last credited
        self._peak: dict[tuple[str, int], int] = {}  # (model, fine bucket) -> this gateway's peak in flight
        self._busy: dict[tuple[str, int], float] = {}  # (model, fine bucket) -> request-seconds not yet flushed
        self._waited: Counter[tuple[str, int]] = Counter()  # (model, fine bucket) -> requests that waited for capacity
        self._engine: dict[tuple[str, int], int] = {}  # (model, fine bucket) -> the engines' highest reported level

    def add(self, model: str, now: float, n: int = 1) -> None:
        for res in self.resolutions:
            self._pending[(model, res, bucket_start(now, res))] += n

    def _credit(self, model: str, start: float, end: float, weight: float) -> None:
        for b, secs in split_over_buckets(start, end, keys.FINE_RESOLUTION_S):
            self._busy[(model, b)] = self._busy.get((model, b), 0.0) + weight * secs

    def _accrue(self, model: str, now: float) -> None:
        """Credit the busy time of the requests in flight since the last credit, split over buckets."""
        since = self._since.get(model, now)
        if self.inflight[model] and now > since:
            self._credit(model, since, now, float(self.inflight[model]))
        self._since[model] = max(since, now)

    def begin(self, model: str, now: float) -> None:
        """A user request starts: one more in flight (and the bucket's peak follows)."""
        self._accrue(model, now)
        self.inflight[model] += 1
        key = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
        self._peak[key] = max(self._peak.get(key, 0), self.inflight[model])

    def end(self, model: str, now: float, began: float, *, demand: bool = True) -> None:
        """A user request that began at `began` (the time given to `begin`) ends; one that is not
        demand (the replica refused it as invalid) has the busy time it was credited taken back."""
        self._accrue(model, now)
        self.inflight[model] = max(0, self.inflight[model] - 1)
        if not demand:
            self._credit(model, min(began, now), now, -1.0)
        key = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
        self._peak[key] = max(self._peak.get(key, 0), self.inflight[model])

    def waited(self, model: str, now: float) -> None:
        """A user request waited for capacity (a load or a wake) past the threshold, or found none."""
        self._waited[(model, bucket_start(now, keys.FINE_RESOLUTION_S))] += 1

    def observe(self, model: str, now: float, level: int) -> None:
        """A level of requests in flight the model's engines report (every gateway's requests): recorded as the
        bucket's engine peak, the maximum over gateways (`keys.engine_peak`), not into this gateway's own part."""
        if level > 0:
            key = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
            self._engine[key] = max(self._engine.get(key, 0), level)

    async def flush(self, client: "aioredis.Redis[str]") -> int:
        """Write pending counts; on a Redis error keep them for the next flush. Returns buckets written."""
        if not self._pending and not self._peak and not self._busy and not self._waited and not self._engine \
                and not any(self.inflight.values()):
            return 0
        now = time.time()
        for model in [m for m, n in self.inflight.items() if n]:
            self._accrue(model, now)  # the requests still in flight: their time so far, in its buckets
        batch, self._pending = self._pending, Counter()
        peaks, self._peak = self._peak, {}
        busy, self._busy = self._busy, {}
        waited, self._waited = self._waited, Counter()
        engine, self._engine = self._engine, {}
        # a bucket still in progress keeps its in-flight level as the floor of its peak
        for model, n in self.inflight.items():
            if n:
                current = (model, bucket_start(now, keys.FINE_RESOLUTION_S))
                peaks[current] = max(peaks.get(current, 0), n)
        pipe = client.pipeline(transaction=False)
        ttl = self.resolutions.get(keys.FINE_RESOLUTION_S, 2 * 86400)
        fine = keys.FINE_RESOLUTION_S
        for (model, start), peak in peaks.items():
            pipe.eval(_PEAK_SUM, 2, keys.inflight_peak(model, fine, start), keys.inflight_peaks(model, fine, start),
                      self.instance, peak, ttl)
        for (model, start), level in engine.items():
            pipe.eval(_PEAK_MAX, 1, keys.engine_peak(model, fine, start), level, ttl)
        for (model, start), secs in busy.items():
            if abs(secs) < 1e-9:
                continue
            key = keys.busy(model, fine, start)
            pipe.incrbyfloat(key, round(secs, 6))
            pipe.expire(key, ttl)
        for (model, start), n in waited.items():
            key = keys.waited(model, keys.FINE_RESOLUTION_S, start)
            pipe.incrby(key, n)
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
            self._waited.update(waited)
            for k, secs in busy.items():
                self._busy[k] = self._busy.get(k, 0.0) + secs
            for k, v in peaks.items():
                self._peak[k] = max(self._peak.get(k, 0), v)
            for k, v in engine.items():
                self._engine[k] = max(self._engine.get(k, 0), v)
            log.warning("request counters not flushed, kept for retry (%d buckets): %s", len(batch), exc)
            return 0
        return len(batch)


async def announce_demand(client: "aioredis.Redis[str]", model: str, now: float) -> None:
    """Announce demand already recorded again (a request still held for a replica): fresh, not counted twice."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.demand(model), "last", repr(now))
    pipe.expire(keys.demand(model), keys.DEMAND_TTL_S)
    pipe.publish(keys.DEMAND_CHANNEL, model)
    await pipe.execute()


async def demand_met(client: "aioredis.Redis[str]", model: str, now: float) -> None:
    """A held request got a replica: the demand announced until now is met (the planner's scan then starts
    nothing for it; a new unmet request announces afresh)."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.demand(model), "met", repr(now))
    pipe.expire(keys.demand(model), keys.DEMAND_TTL_S)
    await pipe.execute()


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
