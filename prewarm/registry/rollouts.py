"""Rollout state, revision weights and per-revision gateway statistics in Redis.

A rollout's state (`prewarm.policy.rollout.RolloutState`) lives in Redis so that it
survives a planner restart and every process (CLI, planner, `prewarm up`) sees one
truth. Each write of the state writes the gateway's revision weights in the same MULTI,
under a WATCH of the state key: two operators (or an operator and the planner) changing a
rollout at once cannot leave the weights and the state disagreeing, and a second `start`
racing the first finds it and is refused.

The gateway reads the weights (`read_weights`, cached like its registry view) and counts
requests, 5xx answers and latency per revision per fine bucket (`RevisionStatsBuffer`,
flushed with its other counters); the planner reads them back over a pause window
(`RolloutStore.stats`) for the live comparison of canary and stable.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Callable

import redis
import redis.asyncio as aioredis

from prewarm.core import keys
from prewarm.core.errors import RegistryUnavailable
from prewarm.policy.rollout import RevisionStats, RolloutState, weights

log = logging.getLogger(__name__)

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


def parse_weights(raw: str | None) -> list[tuple[str, float]]:
    """The stored weights, or [] (no split) for none or a record that does not parse (logged)."""
    if not raw:
        return []
    try:
        return [(str(r), float(w)) for r, w in json.loads(raw)]
    except (ValueError, TypeError) as exc:
        log.warning("revision weights %r unreadable, routing without a split: %s", raw[:200], exc)
        return []


class RolloutStore:
    """The rollout records of every model (sync: the CLI and the planner worker)."""

    def __init__(self, client: "redis.Redis[str]") -> None:
        self.client = client

    def get(self, model: str) -> RolloutState | None:
        try:
            raw = self.client.get(keys.rollout(model))
        except _REDIS_DOWN as exc:
            raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc
        return RolloutState.from_json(raw) if raw else None

    def models(self) -> list[str]:
        return sorted(self.client.smembers(keys.ROLLOUTS))

    def update(self, model: str, change: Callable[[RolloutState | None], RolloutState]) -> RolloutState:
        """Apply `change` to the stored state and write the result with its weights, atomically.

        `change` may raise (an `InvalidRollout`, say): nothing is written then. Retried when
        another writer changed the state in between (WATCH)."""
        key = keys.rollout(model)
        while True:
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    new = change(RolloutState.from_json(raw) if raw else None)
                    pipe.multi()
                    pipe.set(key, new.to_json())
                    pipe.sadd(keys.ROLLOUTS, model)
                    pipe.set(keys.revision_weights(model), json.dumps(weights(new)))
                    pipe.execute()
                    return new
            except redis.WatchError:
                continue
            except _REDIS_DOWN as exc:
                raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc

    def weights(self, model: str) -> list[tuple[str, float]]:
        return parse_weights(self.client.get(keys.revision_weights(model)))

    def stats(self, model: str, revisions: list[str], *, start: float, end: float) -> dict[str, RevisionStats]:
        """What the gateway counted per revision in the fine buckets from `start` to `end`."""
        res = keys.FINE_RESOLUTION_S
        buckets = range(int(start // res) * res, int(end // res) * res + res, res)
        pipe = self.client.pipeline(transaction=False)
        for b in buckets:
            pipe.hgetall(keys.revision_stats(model, b))
        totals: dict[str, Counter[str]] = {r: Counter() for r in revisions}
        sums: dict[str, float] = {r: 0.0 for r in revisions}
        for row in pipe.execute():
            for field, value in row.items():
                rev, _, what = field.rpartition("|")
                if rev not in totals:
                    continue
                if what == "latency_s":
                    sums[rev] += float(value)
                else:
                    totals[rev][what] += int(value)
        return {r: RevisionStats(requests=totals[r]["requests"], errors=totals[r]["errors"], latency_s=sums[r])
                for r in revisions}

    def known_revisions(self, model: str) -> set[str]:
        """Revisions of `model` some node holds (its agent's `residency`: GPU, asleep, snapshot or disk)."""
        out: set[str] = set()
        nodes = sorted(self.client.smembers(keys.NODES))
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.hget(keys.node_info(node), "residency")
        for raw in pipe.execute():
            try:
                residency = json.loads(raw) if raw else {}
            except ValueError:
                continue
            out |= {k.partition("@")[2] for k in residency if k.partition("@")[0] == model}
        return out


async def read_weights(client: "aioredis.Redis[str]", model: str) -> list[tuple[str, float]]:
    """The gateway's read of a model's revision weights ([] when no rollout ever split it)."""
    try:
        return parse_weights(await client.get(keys.revision_weights(model)))
    except _REDIS_DOWN as exc:
        raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc


class RevisionStatsBuffer:
    """Per-revision requests, errors and latency, counted in memory and flushed once a second."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._latency: dict[tuple[str, int, str], float] = {}

    def add(self, model: str, revision: str, now: float, *, status: int, duration_s: float) -> None:
        b = int(now // keys.FINE_RESOLUTION_S) * keys.FINE_RESOLUTION_S
        self._counts[(model, b, f"{revision}|requests")] += 1
        if status >= 500:
            self._counts[(model, b, f"{revision}|errors")] += 1
        k = (model, b, f"{revision}|latency_s")
        self._latency[k] = self._latency.get(k, 0.0) + max(0.0, duration_s)

    async def flush(self, client: "aioredis.Redis[str]") -> int:
        """Write what was counted; on a Redis error keep it for the next flush."""
        if not self._counts and not self._latency:
            return 0
        counts, self._counts = self._counts, Counter()
        latency, self._latency = self._latency, {}
        pipe = client.pipeline(transaction=False)
        touched = {(m, b) for m, b, _ in counts} | {(m, b) for m, b, _ in latency}
        for (model, b, field), n in counts.items():
            pipe.hincrby(keys.revision_stats(model, b), field, n)
        for (model, b, field), s in latency.items():
            pipe.hincrbyfloat(keys.revision_stats(model, b), field, round(s, 6))
        for model, b in touched:
            pipe.expire(keys.revision_stats(model, b), keys.REVISION_STATS_TTL_S)
        try:
            await pipe.execute()
        except _REDIS_DOWN as exc:
            self._counts.update(counts)
            for k, s in latency.items():
                self._latency[k] = self._latency.get(k, 0.0) + s
            log.warning("revision stats not flushed, kept for retry: %s", exc)
            return 0
        return len(touched)
