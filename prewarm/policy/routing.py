"""The gateway's routing policy: pure, over a registry view and the gateway's in-flight counts.

Rules (from the field):
1. among ready serving replicas, the one with the fewest requests in flight — unless even
   that one is saturated (`replica_concurrency` requests in flight) and the warm pool has
   room: a burst spills into the warm pool instead of queueing behind busy replicas;
2. with no ready serving replica, a serving replica still loading is used once its load
   progress reaches the warm threshold (70% by default) — the runtime serves it pipelined;
   below the threshold its requests go to the warm pool;
3. signed warmup traffic prefers the warm pool (that is what it keeps warm);
4. nothing usable: `UNAVAILABLE` — the caller holds the request or answers 503, never 500;
5. backpressure: a replica with `replica_limit` requests in flight takes no more; when every
   usable replica is at its limit, `SATURATED` — the caller answers 429 with Retry-After
   rather than queueing without bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

from prewarm.core.domain import LoadPhase, Replica


class RouteOutcome(str, Enum):
    SERVING = "serving"
    LOADING = "loading"  # a serving replica past the warm threshold, still loading its tail
    WARM_POOL = "warm_pool"
    UNAVAILABLE = "unavailable"
    SATURATED = "saturated"  # replicas are ready but every one is at its in-flight limit


@dataclass(frozen=True)
class RouteDecision:
    outcome: RouteOutcome
    replica: Replica | None
    reason: str


def _least_loaded(candidates: Iterable[Replica], inflight: Mapping[str, int]) -> Replica | None:
    best: Replica | None = None
    for r in candidates:
        if best is None or (inflight.get(r.id, 0), r.id) < (inflight.get(best.id, 0), best.id):
            best = r
    return best


def choose_replica(
    serving: Iterable[Replica],
    warm: Iterable[Replica],
    loading: Iterable[Replica],
    inflight: Mapping[str, int],
    *,
    warm_threshold: float = 0.7,
    warmup: bool = False,
    exclude: frozenset[str] = frozenset(),
    replica_concurrency: int | None = None,
    replica_limit: int | None = None,
) -> RouteDecision:
    """Pick the replica for one request. `exclude` holds ids the gateway saw failing (or already tried)."""
    ready_serving = [r for r in serving if r.id not in exclude and r.endpoint]
    ready_warm = [r for r in warm if r.id not in exclude and r.endpoint]
    if replica_limit is not None:
        usable = len(ready_serving) + len(ready_warm)
        ready_serving = [r for r in ready_serving if inflight.get(r.id, 0) < replica_limit]
        ready_warm = [r for r in ready_warm if inflight.get(r.id, 0) < replica_limit]
        if usable and not ready_serving and not ready_warm:
            return RouteDecision(RouteOutcome.SATURATED, None, f"every ready replica has {replica_limit} in flight")

    if warmup:
        target = _least_loaded(ready_warm, inflight) or _least_loaded(ready_serving, inflight)
        if target is not None:
            outcome = RouteOutcome.WARM_POOL if target in ready_warm else RouteOutcome.SERVING
            return RouteDecision(outcome, target, "warmup traffic")
        return RouteDecision(RouteOutcome.UNAVAILABLE, None, "no ready replica for warmup")

    best = _least_loaded(ready_serving, inflight)
    if best is not None:
        if replica_concurrency is not None and inflight.get(best.id, 0) >= replica_concurrency:
            spill = _least_loaded(ready_warm, inflight)
            if spill is not None and inflight.get(spill.id, 0) < replica_concurrency:
                return RouteDecision(RouteOutcome.WARM_POOL, spill, "serving replicas saturated")
        return RouteDecision(RouteOutcome.SERVING, best, "fewest requests in flight")

    in_progress = [
        r for r in loading
        if r.id not in exclude and r.endpoint and r.pool.value == "serving"
        and r.phase not in (LoadPhase.NONE, LoadPhase.EMBEDDINGS)
    ]
    candidate = max(in_progress, key=lambda r: (r.progress, r.id), default=None)
    if candidate is not None and candidate.progress >= warm_threshold:
        return RouteDecision(RouteOutcome.LOADING, candidate, f"loading at {candidate.progress:.0%}")

    pooled = _least_loaded(ready_warm, inflight)
    if pooled is not None:
        why = (
            f"best serving candidate at {candidate.progress:.0%} < {warm_threshold:.0%}"
            if candidate is not None else "no ready serving replica"
        )
        return RouteDecision(RouteOutcome.WARM_POOL, pooled, why)
    return RouteDecision(RouteOutcome.UNAVAILABLE, None, "nothing ready")
