"""Counting a trace's past into the gateway's counters, as a gateway that had been running would have.

`prewarm up --history S` (and the closed-loop equivalence test) starts the planner with days
of history so that its daily profile and phase calibration run from its first step. The
history goes through the gateway's own counting code (`prewarm.registry.counters.
RequestCounter`): each past request counted in its buckets and held in flight for its
answer time, its begin and end fed in time order, then one flush. So the history has the
same counter semantics (peak summed over gateways, busy time split over buckets) as what
the real gateway counts during the replay.
"""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis

from prewarm.registry.counters import RequestCounter


async def seed_history(redis_url: str, model: str, times: np.ndarray, service_s: float) -> int:
    """Count requests that arrived at epoch `times`, each in flight for `service_s`; returns how many."""
    if service_s < 0:
        raise ValueError(f"history service time must be >= 0, got {service_s}")
    starts = np.sort(np.asarray(times, dtype=np.float64))
    counter = RequestCounter(instance="history")
    # every begin and end in time order (an end before a begin at the same instant, as the simulator counts)
    at = np.concatenate([starts + service_s, starts])
    kind = np.concatenate([np.zeros(starts.size), np.ones(starts.size)])
    for i in np.lexsort((kind, at)):
        t = float(at[i])
        if kind[i]:
            counter.add(model, t)
            counter.begin(model, t)
        else:
            counter.end(model, t, t - service_s)
    client: "aioredis.Redis[str]" = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        if starts.size and not await counter.flush(client):
            raise RuntimeError(f"the history of {model!r} could not be written to Redis (see the log above)")
    finally:
        await client.aclose()
    return int(starts.size)
