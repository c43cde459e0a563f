"""One planning round at a time, across the planner's threads, its pods and `prewarm plan`.

A round reads the registry, plans, and submits events or sends tasks; two rounds that overlap
(one ran past the beat's interval on a slow Redis, or an operator's `prewarm plan` met the
worker's) both read the replicas before either's replicas are registered, and both scale up
for the same need: twice the loads. The round takes a Redis lock (`keys.PLAN_ROUND_LOCK`); a
beat's round that finds it held is skipped, since the next beat plans again. The lock expires
`ttl_s(interval_s)` after it was taken, so a round whose worker died does not stop planning
for longer than that.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import redis
from redis.exceptions import LockError

from prewarm.core import keys

log = logging.getLogger("prewarm.planner.round")

#: The lock's life at the least (s): rounds take milliseconds to seconds; a shorter interval keeps this.
MIN_TTL_S = 30.0


def ttl_s(interval_s: float) -> float:
    """How long the round's lock lasts: three beat intervals, at least `MIN_TTL_S`."""
    return max(MIN_TTL_S, 3.0 * float(interval_s))


@contextmanager
def planning_round(client: "redis.Redis[str]", interval_s: float, *, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold the round's lock while the block runs; yields False (and holds nothing) where another round holds it
    for longer than `wait_s`."""
    lock = client.lock(keys.PLAN_ROUND_LOCK, timeout=ttl_s(interval_s), blocking=wait_s > 0,
                       blocking_timeout=wait_s if wait_s > 0 else None)
    mine = bool(lock.acquire())
    try:
        yield mine
    finally:
        if mine:
            try:
                lock.release()
            except LockError:  # it expired (the round outlasted it) and maybe another round took it
                log.warning("the planning round outlasted its lock (%.0f s)", ttl_s(interval_s))
