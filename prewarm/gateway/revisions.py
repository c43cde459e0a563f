"""The gateway's revision split: which revision of a model a request goes to, and what it saw of each.

The decision is the pure `prewarm.policy.revisions.choose_revision`; this module feeds it
(the weights a rollout wrote to Redis, read through `registry_view.py` like a routing view:
cached, single-flight, the last value while Redis is away; the revisions with a ready replica in that view; the request's
`X-Prewarm-Revision` and `X-Prewarm-Route-Key` headers) and narrows the routing view to the
chosen revision, so `prewarm.policy.routing` picks a replica of that revision only. It also
counts each user request per revision (Prometheus, and the Redis buckets the rollout's live
comparison reads). Kept out of `server.py`, which only calls `choose` and `observe`.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Mapping

import redis.asyncio as aioredis
from aiohttp import web

from prewarm.core.domain import Replica
from prewarm.core.metrics import Metrics
from prewarm.gateway.registry_view import RegistryViews
from prewarm.policy.revisions import RevisionChoice, RevisionChoiceKind, choose_revision
from prewarm.registry.replicas import RoutingView
from prewarm.registry.rollouts import RevisionStatsBuffer, read_weights

#: A request may name the revision it wants (testing a canary before it has weight).
HEADER_REVISION = "X-Prewarm-Revision"
#: A request may ask to stay on one revision across requests: the same key, the same revision.
HEADER_ROUTE_KEY = "X-Prewarm-Route-Key"
#: Where the chosen revision is kept on the aiohttp request for `observe` (None: no split).
REQUEST_KEY: "web.RequestKey[str | None]" = web.RequestKey("prewarm_revision", str)


def _usable(r: Replica) -> bool:
    return bool(r.endpoint)


def narrow(view: RoutingView, revision: str | None) -> RoutingView:
    """The view with only `revision`'s replicas (None: unchanged)."""
    if revision is None:
        return view
    keep = lambda rs: tuple(r for r in rs if r.revision == revision)  # noqa: E731
    return replace(view, serving=keep(view.serving), warm=keep(view.warm), loading=keep(view.loading))


class RevisionSplit:
    """Revision weights per model (cached), the per-request choice, and per-revision counts."""

    def __init__(self, client: "aioredis.Redis[str]", metrics: Metrics, views: RegistryViews) -> None:
        self.client = client
        self.metrics = metrics
        self.views = views  # the weights are read like a routing view: cached, single-flight, stale while Redis is away
        self.stats = RevisionStatsBuffer()
        self._rng = random.Random()

    async def weights(self, model: str) -> list[tuple[str, float]]:
        return await self.views.value(f"weights:{model}", lambda: read_weights(self.client, model))

    async def choose(self, model: str, view: RoutingView, headers: Mapping[str, str]) -> RevisionChoice:
        """The revision for this request. Warmup traffic names its replica's revision the same way."""
        pinned = headers.get(HEADER_REVISION) or None
        route_key = headers.get(HEADER_ROUTE_KEY) or None
        weights = await self.weights(model)
        if not weights and pinned is None:
            return RevisionChoice(RevisionChoiceKind.ANY, None, "no revision weights recorded")
        ready = {r.revision for r in (*view.serving, *view.warm) if _usable(r)}
        live = ready | {r.revision for r in view.loading}
        return choose_revision(weights, ready, draw=self._rng.random(), pinned=pinned, route_key=route_key, live=live)

    def observe(self, model: str, revision: str | None, status: int, duration_s: float) -> None:
        """Count one answered user request against the revision it was routed to."""
        if revision is None:
            return
        self.metrics.revision_requests.labels(model, revision, str(status)).inc()
        self.stats.add(model, revision, time.time(), status=status, duration_s=duration_s)

    async def flush(self) -> int:
        return await self.stats.flush(self.client)
