"""The replica registry in Redis: what exists, in which state, and what may take traffic.

Every state change runs as one Lua script (see `registry_lua`), so the record, the
routing indexes (sorted sets scored by heartbeat expiry) and the audit stream move
together. A ready replica is routable only while its heartbeat is fresh; the reaper
fails those whose heartbeat expired. Writes that may be batched accept a pipeline; reads
take `now` so that callers (and tests) control time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar, cast

import redis
import redis.asyncio as aioredis

from prewarm.core import keys
from prewarm.core.domain import (
    LIVE_STATES,
    TRANSITIONS,
    LoadPhase,
    Pool,
    Replica,
    ReplicaState,
    parse_replica_id,
)
from prewarm.core.errors import IllegalTransition, InvalidPayload, RegistryUnavailable, ReplicaNotFound
from prewarm.registry.replication import ReplicatedWrites
from prewarm.registry.lua import BASELINE_SAMPLE, COUNTS, HEARTBEAT, PROGRESS, REAP, REGISTER, TRANSITION, view_script
from prewarm.core.settings import RegistrySettings
from prewarm.policy.load_times import load_time_p95

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def _wrap_redis_errors(fn: F) -> F:
    """Turn connection-level Redis errors into RegistryUnavailable (temporary, retry later)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _REDIS_DOWN as exc:
            raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc

    return cast(F, wrapper)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[0::2], flat[1::2]))


#: Fields the routing view reads, in the order VIEW returns them (the rest derive from the id).
_VIEW_FIELDS = ("id", "endpoint", "pool", "state", "progress", "phase", "heartbeat_at", "auth_ref")
VIEW = view_script(_VIEW_FIELDS)


@functools.lru_cache(maxsize=4096)
def _parse_row(row: str) -> Replica:
    """Rows change only on a heartbeat or a transition, so parsing is cached by the row's text."""
    fields = dict(zip(_VIEW_FIELDS, row.split("\t")))
    model, revision, node, slot = parse_replica_id(fields["id"])
    return Replica.from_fields({**fields, "model": model, "revision": revision, "node": node, "slot": str(slot)})


def _view_rows(raw: list[list[str]], loads: Mapping[str, str] | None = None) -> RoutingView:
    groups = [tuple(_parse_row(row) for row in rows) for rows in raw]
    live = {r.id for g in groups for r in g}
    engine: dict[str, int] = {}
    for rid, n in (loads or {}).items():
        try:
            if rid in live:
                engine[rid] = max(0, int(n))
        except ValueError:
            continue
    return RoutingView(serving=groups[0], warm=groups[1], loading=groups[2], engine_load=engine)


def _p95(raw: list[str]) -> float | None:
    return load_time_p95(float(v) for v in raw)


def _split_template(template: Callable[[str], str]) -> tuple[str, str]:
    prefix, _, suffix = template("\x00").partition("\x00")
    return prefix, suffix


@dataclass(frozen=True)
class RoutingView:
    """What the gateway needs for one model, read in one round trip."""

    serving: tuple[Replica, ...]
    warm: tuple[Replica, ...]
    loading: tuple[Replica, ...]
    engine_load: Mapping[str, int] = field(default_factory=dict)  # replica id -> running + waiting its engine reports


def push_figure(pipe: "redis.client.Pipeline[str]", key: str, seconds: float) -> None:
    """Queue on `pipe` one measured duration at the head of `key`, the list capped at `LOADTIMES_KEEP`."""
    pipe.lpush(key, repr(float(seconds)))
    pipe.ltrim(key, 0, keys.LOADTIMES_KEEP - 1)


def record_figure(client: "redis.Redis[str]", key: str, seconds: float) -> None:
    """`push_figure` in a transaction of its own."""
    pipe = client.pipeline(transaction=True)
    push_figure(pipe, key, seconds)
    pipe.execute()


def figures(client: "redis.Redis[str]", key: str) -> list[float]:
    """The durations `push_figure` kept under `key`, newest first."""
    return [float(v) for v in client.lrange(key, 0, -1)]


class ReplicaRegistry:
    """Replica records, state transitions, heartbeats and the views built on them."""

    def __init__(self, client: "redis.Redis[str]", settings: RegistrySettings | None = None, *,
                 writes: ReplicatedWrites | None = None) -> None:
        self.client = client
        self.settings = settings or RegistrySettings()
        # With `writes`, a registration returns once the replicas have it too (Redis WAIT): a failover right
        # after cannot lose a replica that was acknowledged (issue 20; `redis.wait_replicas`).
        self._writes = writes
        self._register = client.register_script(REGISTER)
        self._transition = client.register_script(TRANSITION)
        self._heartbeat = client.register_script(HEARTBEAT)
        self._reap = client.register_script(REAP)
        self._progress = client.register_script(PROGRESS)
        self._view = client.register_script(VIEW)
        self._counts = client.register_script(COUNTS)
        self._baseline_sample = client.register_script(BASELINE_SAMPLE)

    # --- keys -------------------------------------------------------------------------
    def _index_keys(self, model: str, node: str, rid: str) -> list[str]:
        return [
            keys.replica(rid),
            keys.model_replicas(model),
            keys.node_replicas(node),
            keys.MODELS,
            keys.NODES,
            keys.ready(model, Pool.SERVING.value),
            keys.ready(model, Pool.WARM.value),
            keys.loading(model),
            keys.HEARTBEATS,
            keys.EVENTS,
        ]

    @property
    def _ttl(self) -> float:
        return self.settings.heartbeat_ttl_s

    @property
    def _gap(self) -> float:
        """A silence (no heartbeat, no reap reached Redis) this long means Redis stalled or restarted.

        A stall shorter than it can expire a replica only if it outlasts `ttl - heartbeat interval`,
        so that is the gap, unless reaps alone (no agent alive) would look like silences: then
        1.5 reaper intervals, and stalls between the two are not told apart (keep the reaper
        interval under two thirds of `ttl - heartbeat interval`, as the defaults do)."""
        s = self.settings
        return max(s.heartbeat_ttl_s - s.heartbeat_interval_s, 1.5 * s.reaper_interval_s)

    # --- writes -----------------------------------------------------------------------
    @_wrap_redis_errors
    def register(self, replica: Replica, *, now: float, pipe: "redis.client.Pipeline[str] | None" = None) -> bool:
        """Create the record (state as given, normally pending). A live duplicate returns False.

        A record in a terminal state (failed, retired) is replaced: the deterministic id is
        reused when a replica is started again. With `pipe`, the script is queued and True returned.
        """
        fields = replica.to_fields()
        argv: list[Any] = [replica.id, now, self._ttl, keys.EVENTS_MAXLEN, replica.model, replica.node]
        for k, v in fields.items():
            if k not in ("created_at", "updated_at", "heartbeat_at"):
                argv += [k, v]
        ks = self._index_keys(replica.model, replica.node, replica.id)
        if pipe is not None:
            self._register(keys=ks, args=argv, client=pipe)
            return True
        if self._writes is not None:
            replicated = self.client.pipeline(transaction=False)
            self._register(keys=ks, args=argv, client=replicated)
            results, _ = self._writes.execute(replicated)
            return bool(results[0])
        return bool(self._register(keys=ks, args=argv))

    @_wrap_redis_errors
    def transition(
        self,
        rid: str,
        to: ReplicaState,
        *,
        now: float,
        reason: str = "",
        expected: ReplicaState | None = None,
    ) -> Replica:
        """Move a replica to `to` atomically; refuses what the state machine does not allow."""
        model, _, node, _ = parse_replica_id(rid)
        allowed_from = [s.value for s, targets in TRANSITIONS.items() if to in targets]
        argv: list[Any] = [
            rid, now, self._ttl, keys.EVENTS_MAXLEN, to.value, reason,
            expected.value if expected else "", int(self.settings.retired_keep_s) or 1, *allowed_from,
        ]
        result = self._transition(keys=self._index_keys(model, node, rid), args=argv)
        status = result[0]
        if status == "notfound":
            raise ReplicaNotFound(f"no replica {rid!r} in the registry")
        if status == "unexpected":
            raise IllegalTransition(f"replica {rid!r} is {result[1]}, expected {expected.value if expected else '?'}")
        if status == "illegal":
            raise IllegalTransition(f"replica {rid!r}: {result[1]} -> {to.value} is not a legal transition")
        return Replica.from_fields(_pairs(result[1:]))

    @_wrap_redis_errors
    def set_progress(self, rid: str, progress: float, phase: LoadPhase, *, now: float) -> bool:
        """Record load progress (0..1) and phase; False when the replica is no longer loading."""
        if not 0.0 <= progress <= 1.0 or math.isnan(progress):
            raise ValueError(f"progress must be within 0..1, got {progress}")
        return bool(self._progress(keys=[keys.replica(rid)], args=[rid, now, repr(float(progress)), phase.value]))

    @_wrap_redis_errors
    def set_endpoint(self, rid: str, endpoint: str, *, now: float) -> None:
        if not self.client.exists(keys.replica(rid)):
            raise ReplicaNotFound(f"no replica {rid!r} in the registry")
        self.client.hset(keys.replica(rid), mapping={"endpoint": endpoint, "updated_at": now})

    @_wrap_redis_errors
    def heartbeat(self, replica: Replica, *, now: float) -> Replica:
        """Refresh a replica's expiry; re-create it from `replica` if Redis lost it.

        Returns the stored record: if its state is failed or retired, the caller must stop hosting it.
        """
        argv: list[Any] = [replica.id, now, self._ttl, keys.EVENTS_MAXLEN, self._gap]
        for k, v in replica.to_fields().items():
            argv += [k, v]
        ks = self._index_keys(replica.model, replica.node, replica.id) + [keys.REGISTRY_ACTIVITY]
        flat = self._heartbeat(keys=ks, args=argv)
        return Replica.from_fields(_pairs(flat))

    @_wrap_redis_errors
    def reap(self, *, now: float) -> list[str]:
        """Fail every live replica whose heartbeat expired; returns their ids.

        Each decision is one script that reads the heartbeat it acts on. After a silence of the
        registry (Redis stalled or restarted: no heartbeat and no reap reached it for `_gap`), no
        replica is reaped until a heartbeat TTL has passed: an agent that lived through the stall
        heartbeats meanwhile, and a reap queued during the stall cannot fail its replicas first.
        """
        reaped = []
        for rid in self.client.zrangebyscore(keys.HEARTBEATS, "-inf", now):
            try:
                model, _, node, _ = parse_replica_id(rid)
            except InvalidPayload:
                self.client.zrem(keys.HEARTBEATS, rid)
                continue
            argv: list[Any] = [rid, now, self._ttl, keys.EVENTS_MAXLEN, self._gap,
                               int(self.settings.retired_keep_s) or 1, "heartbeat expired"]
            outcome = self._reap(keys=self._index_keys(model, node, rid) + [keys.REGISTRY_ACTIVITY], args=argv)
            if outcome == "reaped":
                reaped.append(rid)
            elif outcome == "settling":
                log.info("not reaping %s yet: the registry came back from a silence less than %.0fs ago", rid,
                         self._ttl)
        return reaped

    # --- reads ------------------------------------------------------------------------
    @_wrap_redis_errors
    def get(self, rid: str) -> Replica | None:
        fields = self.client.hgetall(keys.replica(rid))
        return Replica.from_fields(fields) if fields else None

    @_wrap_redis_errors
    def view(self, model: str, *, now: float) -> RoutingView:
        """Ready serving, ready warm and loading replicas of a model with fresh heartbeats."""
        raw = self._view(
            keys=[keys.ready(model, Pool.SERVING.value), keys.ready(model, Pool.WARM.value), keys.loading(model)],
            args=[now, keys.replica("")],
        )
        return _view_rows(raw)

    def ready(self, model: str, pool: Pool, *, now: float) -> list[Replica]:
        v = self.view(model, now=now)
        return list(v.serving if pool is Pool.SERVING else v.warm)

    def loading(self, model: str, *, now: float) -> list[Replica]:
        return list(self.view(model, now=now).loading)

    @_wrap_redis_errors
    def _records(self, ids: Iterable[str]) -> list[Replica]:
        pipe = self.client.pipeline(transaction=False)
        ids = list(ids)
        for rid in ids:
            pipe.hgetall(keys.replica(rid))
        return [Replica.from_fields(f) for f in pipe.execute() if f]

    @_wrap_redis_errors
    def live_on_node(self, node: str) -> list[Replica]:
        """Replicas the registry says are live (not failed/retired) on `node`."""
        recs = self._records(self.client.smembers(keys.node_replicas(node)))
        return [r for r in recs if r.state in LIVE_STATES]

    @_wrap_redis_errors
    def replicas_of(self, model: str) -> list[Replica]:
        return self._records(self.client.smembers(keys.model_replicas(model)))

    @_wrap_redis_errors
    def models(self) -> list[str]:
        return sorted(self.client.smembers(keys.MODELS))

    @_wrap_redis_errors
    def _count_rows(self) -> list[tuple[str, str, str, str]]:
        prefix, suffix = _split_template(keys.model_replicas)
        flat = self._counts(keys=[keys.MODELS], args=[prefix, suffix, keys.replica("")])
        return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]

    def counts(self) -> dict[tuple[str, str, str], int]:
        """Replicas per (model, state, pool), for metrics and the planner."""
        out: dict[tuple[str, str, str], int] = {}
        for model, state, pool, _node in self._count_rows():
            out[(model, state, pool)] = out.get((model, state, pool), 0) + 1
        return out

    def events(self, *, since: str = "-", count: int = 1000) -> list[tuple[str, dict[str, str]]]:
        """Transitions from the audit stream, oldest first, after the stream id `since`."""
        start = since if since == "-" else f"({since}"
        return [(eid, dict(f)) for eid, f in self.client.xrange(keys.EVENTS, min=start, count=count)]

    # --- cold-start durations and latency baselines --------------------------------------
    @_wrap_redis_errors
    def record_load_time(self, model: str, seconds: float, *, revision: str, node_class: str) -> None:
        """One lead of `model@revision` on `node_class`: scale event to validated, image pulls left out."""
        key = keys.load_times(model, revision, node_class)
        pipe = self.client.pipeline(transaction=True)
        push_figure(pipe, key, seconds)
        pipe.sadd(keys.load_time_classes(model), f"{revision}/{node_class}")
        pipe.execute()

    @_wrap_redis_errors
    def load_time_p95(self, model: str, revision: str | None = None, node_class: str | None = None) -> float | None:
        """The p95 lead of each recorded (revision, node class) of `model` that matches (None: any), and of
        those the largest: the scheduler, not the planner, picks the node a new replica lands on, so the lead
        must cover the slowest class it may get. A revision never measured has none (None: the default)."""
        worst: float | None = None
        for pair in sorted(self.client.smembers(keys.load_time_classes(model))):
            rev, _, cls = pair.partition("/")
            if (revision is not None and rev != revision) or (node_class is not None and cls != node_class):
                continue
            p95 = _p95(self.client.lrange(keys.load_times(model, rev, cls), 0, -1))
            if p95 is not None and (worst is None or p95 > worst):
                worst = p95
        return worst

    @_wrap_redis_errors
    def record_image_pull(self, model: str, revision: str, node_class: str, seconds: float) -> None:
        """An image pull a new pod waited for (the first start of its image on a node), kept apart from the lead."""
        record_figure(self.client, keys.image_pulls(model, revision, node_class), seconds)

    @_wrap_redis_errors
    def image_pulls(self, model: str, revision: str, node_class: str) -> list[float]:
        return figures(self.client, keys.image_pulls(model, revision, node_class))

    @_wrap_redis_errors
    def record_ready_time(self, model: str, tier: str, node_class: str, seconds: float) -> None:
        """One measured time to ready from `tier` (asleep / cached / disk): the catalog's per-tier figure."""
        record_figure(self.client, keys.ready_times(model, tier, node_class), seconds)

    @_wrap_redis_errors
    def ready_time_p95(self, model: str, tier: str, node_class: str) -> float | None:
        return _p95(self.client.lrange(keys.ready_times(model, tier, node_class), 0, -1))

    @_wrap_redis_errors
    def baseline(self, model: str, node_class: str, revision: str = "") -> float | None:
        """The warm-latency baseline of `model@revision` on `node_class` (expires: `keys.BASELINE_TTL_S`)."""
        v = self.client.hget(keys.baseline(model, node_class, revision), "latency_s")
        return float(v) if v is not None else None

    @_wrap_redis_errors
    def record_baseline_sample(self, model: str, node_class: str, latency_s: float, revision: str = "", *,
                               samples: int) -> float | None:
        """One validated replica's warm latency towards the baseline of `model@revision` on `node_class`.

        The baseline is the median of the first `samples` recorded (one Lua script: concurrent
        validations agree on one); returns it once it exists, else None. A baseline lives
        `keys.BASELINE_TTL_S`, then the next validations measure it again."""
        if samples < 1:
            raise ValueError(f"baseline samples must be at least 1, got {samples}")
        got = self._baseline_sample(keys=[keys.baseline_samples(model, node_class, revision),
                                          keys.baseline(model, node_class, revision)],
                                    args=[repr(float(latency_s)), samples, keys.BASELINE_TTL_S])
        return None if got is None else float(got)


class AsyncRegistryReader:
    """The gateway's asyncio side of the registry: the one-round-trip routing view and model list."""

    def __init__(self, client: "aioredis.Redis[str]") -> None:
        self.client = client
        self._sha = hashlib.sha1(VIEW.encode()).hexdigest()

    async def view(self, model: str, *, now: float) -> RoutingView:
        """One round trip: the EVALSHA (loaded again when Redis lost the script, e.g. after a restart) and
        the engines' own load counts (`keys.engine_load`) in one pipeline."""
        args = (keys.ready(model, Pool.SERVING.value), keys.ready(model, Pool.WARM.value), keys.loading(model),
                now, keys.replica(""))
        try:
            for attempt in (0, 1):
                pipe = self.client.pipeline(transaction=False)
                pipe.evalsha(self._sha, 3, *args)
                pipe.hgetall(keys.engine_load(model))
                raw, loads = await pipe.execute(raise_on_error=False)
                if isinstance(raw, redis.exceptions.NoScriptError) and attempt == 0:
                    await self.client.script_load(VIEW)
                    continue
                if isinstance(raw, BaseException):
                    raise raw
                break
        except _REDIS_DOWN as exc:
            raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc
        return _view_rows(raw, loads if isinstance(loads, dict) else None)

    async def models(self) -> set[str]:
        try:
            return set(await self.client.smembers(keys.MODELS))
        except _REDIS_DOWN as exc:
            raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc
