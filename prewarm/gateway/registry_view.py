"""The gateway's cached reads of the registry, and its last good view while Redis is away.

Every routing view and the model list are read at most once per `gateway.refresh_interval_s`
and one read per key at a time (single flight). When a read fails because Redis is away
(restarting, failing over to a replica under Sentinel), the last good view is served under
the rule of `prewarm/policy/stale_view.py` (bounded by `gateway.stale_view_max_s`), so a
registry outage does not turn into 503s for models whose replicas are all alive. The age of
the view in use is the `gateway_registry_view_age_seconds` gauge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from prewarm.core.errors import RegistryUnavailable
from prewarm.core.metrics import Metrics
from prewarm.policy import stale_view
from prewarm.registry.replicas import AsyncRegistryReader, RoutingView

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Cached:
    view: RoutingView | None = None
    at: float = 0.0  # monotonic: when it was read (the refresh interval)
    read_at: float | None = None  # wall clock: when it was read (its age while the registry is away)


class RegistryViews:
    """Routing views and the model list, cached, single-flight, and served stale while Redis is away."""

    def __init__(self, reader: AsyncRegistryReader, rule: stale_view.StalenessRule, metrics: Metrics,
                 configured_models: set[str], clock: Callable[[], float] = time.time) -> None:
        self.reader = reader
        self.rule = rule
        self.metrics = metrics
        self.configured_models = configured_models
        self.clock = clock
        self.health = stale_view.RegistryHealth()
        self.views: dict[str, _Cached] = {}
        self.models_cache = _Cached()
        self.models: set[str] = set()
        self.values: dict[str, Any] = {}  # other reads the gateway routes by (a rollout's weights), by key
        self.value_caches: dict[str, _Cached] = {}
        self.reads: dict[str, "asyncio.Future[Any]"] = {}  # registry reads in flight, by key
        metrics.registry_view_age.set_function(lambda: stale_view.view_age(self.health, self.clock()))

    async def _single_flight(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """One registry read per key at a time: callers that find the cache stale while a read
        is in flight wait for that read. Without this, every request in flight when the cache
        expires reads Redis at once, and 200 connections exhaust the client's connection pool
        ("Too many connections" -> 503). Shielded: a client that goes away cancels only its wait."""
        task = self.reads.get(key)
        if task is None:
            task = asyncio.ensure_future(fetch())
            self.reads[key] = task

            def _done(t: "asyncio.Future[Any]") -> None:
                self.reads.pop(key, None)
                if not t.cancelled():
                    t.exception()  # retrieved here too, in case every waiter went away

            task.add_done_callback(_done)
        return await asyncio.shield(task)

    async def _read(self, key: str, cache: _Cached, fresh: bool, fetch: Callable[[float], Awaitable[T]],
                    last: Callable[[], T]) -> T:
        """The cached value, or a new read; while the registry is away, the last good value within the rule."""
        due = fresh or cache.read_at is None or time.monotonic() - cache.at > self.rule.retry_interval_s
        if not due:
            return last()
        now = self.clock()
        if cache.read_at is not None and not stale_view.should_read(self.health, now, self.rule):
            return self._stale(key, cache, now, None, last)

        async def attempt() -> T:
            mono, wall = time.monotonic(), self.clock()
            try:
                value = await fetch(stale_view.heartbeat_clock(self.health, wall, self.rule))
            except RegistryUnavailable:
                self._failed(wall)
                raise
            was_away = self.health.away_since is not None
            self.health = stale_view.read_ok(self.health, self.clock(), self.rule)
            if was_away:
                log.warning("registry reachable again after %.1fs; heartbeats judged %.1fs back for %.0fs",
                            self.health.outage_s, self.health.outage_s, self.rule.heartbeat_ttl_s)
            cache.at, cache.read_at = mono, wall
            return value

        try:
            return await self._single_flight(key, attempt)
        except RegistryUnavailable as exc:
            return self._stale(key, cache, self.clock(), exc, last)

    def _failed(self, now: float) -> None:
        if self.health.away_since is None:
            log.warning("registry unreachable: routing from the last view for up to %.0fs", self.rule.max_stale_s)
        self.health = stale_view.read_failed(self.health, now)

    def _stale(self, key: str, cache: _Cached, now: float, exc: RegistryUnavailable | None, last: Callable[[], T]) -> T:
        if stale_view.may_serve_stale(cache.read_at, now, self.rule):
            self.metrics.registry_stale_reads.labels(key.partition(":")[0]).inc()
            return last()
        if exc is not None:
            raise exc
        raise RegistryUnavailable(f"registry unavailable for {now - (cache.read_at or now):.0f}s: the last view "
                                  f"is older than stale_view_max_s ({self.rule.max_stale_s:.0f}s)", retry_after=1.0)

    async def view(self, model: str, *, fresh: bool = False) -> RoutingView:
        cache = self.views.setdefault(model, _Cached())

        async def fetch(now: float) -> RoutingView:
            view = await self.reader.view(model, now=now)
            cache.view = view
            return view

        def last() -> RoutingView:
            assert cache.view is not None
            return cache.view

        return await self._read(f"view:{model}", cache, fresh, fetch, last)

    async def known_models(self) -> set[str]:
        async def fetch(_now: float) -> set[str]:
            self.models = await self.reader.models() | self.configured_models
            return self.models

        return await self._read("models", self.models_cache, False, fetch, lambda: self.models)

    async def value(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """Any other registry read the gateway routes by (a rollout's revision weights), under the same
        rules as a view: cached for the refresh interval, one read at a time, the last value while Redis is away."""
        cache = self.value_caches.setdefault(key, _Cached())

        async def read(_now: float) -> T:
            value = self.values[key] = await fetch()
            return value

        return await self._read(key, cache, False, read, lambda: self.values[key])
