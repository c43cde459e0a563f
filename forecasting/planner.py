"""The planner: turns a demand forecast into scale events, before the demand arrives.

It is a pure policy (`plan(ctx, state) -> (result, state)`, `now` inside the context): no
clock, no I/O, so the same function drives the Celery `forecast_and_plan` task, the
dry-run printer and the trace-replay simulator, and a test can walk it through time.

The rules (issue 4):
- replicas needed per bucket = ceil(forecast quantile / per-replica capacity x (1 + headroom)),
  plus the replicas of any scheduled batch job running in that bucket;
- a rise is met by a SCALE_UP at `bucket start - lead`, lead = the measured cold start p95
  (the configured default until one is measured) + a margin, so replicas are ready in time;
- a fall is acted on only after the stabilization window, and never while the forecast
  rises again within the window plus the lead: those replicas get a HOLD (keep them loaded
  and warm them with synthetic requests: the dynamic warmup trigger);
- a fixed warm pool (a size, or a percentage of the forecast baseline) in pool `warm`;
- a budget: warm capacity beyond need (pool, early prewarms, holds) stays under a share of
  total GPU time; when it binds, the events dropped and the reason are part of the result;
- placement of new replicas: among ready nodes with room, those holding the model's
  snapshot first, then the least loaded.

Event ids are derived from (model, kind, target bucket, pool), so a re-plan of the same
decision yields the same id and the executor can deduplicate.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import pandas as pd
from croniter import croniter

from prewarm.core.domain import ModelSpec, NodeView, Pool, ScaleEvent, ScaleEventKind
from prewarm.core.errors import InvalidPayload
from prewarm.core.settings import PlannerSettings


@dataclass(frozen=True)
class BatchJob:
    """A scheduled batch job: at each cron time it needs `replicas` more for `duration_s`."""

    cron: str
    model: str  # a model name or a model key (name@revision)
    replicas: int
    duration_s: float
    name: str = ""

    def __post_init__(self) -> None:
        if not croniter.is_valid(self.cron):
            raise InvalidPayload(f"batch job {self.name or self.model!r}: invalid cron expression {self.cron!r}")
        if self.replicas <= 0:
            raise InvalidPayload(f"batch job {self.name or self.model!r}: replicas must be > 0, got {self.replicas}")
        if self.duration_s <= 0:
            raise InvalidPayload(f"batch job {self.name or self.model!r}: duration_s must be > 0, got {self.duration_s}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "BatchJob":
        try:
            return cls(
                cron=str(data["cron"]),
                model=str(data["model"]),
                replicas=int(data["replicas"]),
                duration_s=float(data["duration_s"]),
                name=str(data.get("name", "")),
            )
        except KeyError as exc:
            raise InvalidPayload(f"batch job is missing field {exc.args[0]!r}") from exc

    def applies_to(self, model: ModelSpec) -> bool:
        return self.model in (model.name, model.key)


@dataclass(frozen=True)
class PlannerParams:
    """Mirror of `prewarm.core.settings.PlannerSettings` (the fields the pure planner reads)."""

    quantile: float = 0.9
    headroom: float = 0.1
    lead_margin_s: float = 10.0
    default_cold_start_s: float = 8.7
    stabilization_s: float = 300.0
    warm_pool_size: int | None = None
    warm_pool_percent: float = 10.0
    budget_share: float = 0.12
    bucket_s: float = 60.0
    min_serving: int = 1  # never plan fewer serving replicas than this
    peak_hold_s: float = 480.0  # the observed peak of this long ago still floors the need (bursts recur)
    batch_jobs: tuple[BatchJob, ...] = ()

    @classmethod
    def from_settings(cls, s: PlannerSettings) -> "PlannerParams":
        """Build from the `planner` settings group."""
        return cls(
            quantile=s.quantile,
            headroom=s.headroom,
            lead_margin_s=s.lead_margin_s,
            default_cold_start_s=s.default_cold_start_s,
            stabilization_s=s.stabilization_s,
            warm_pool_size=s.warm_pool_size,
            warm_pool_percent=s.warm_pool_percent,
            budget_share=s.budget_share,
            bucket_s=float(s.bucket_s),
            batch_jobs=tuple(BatchJob.from_mapping(j) for j in s.batch_jobs),
            peak_hold_s=float(s.peak_hold_s),
            min_serving=int(s.min_serving),
        )

    @property
    def column(self) -> str:
        return f"q{self.quantile:g}"


@dataclass(frozen=True)
class ReplicaCounts:
    """The model's replicas now: serving ready, serving loading (incl. warming), warm pool."""

    ready: int = 0
    loading: int = 0
    warm: int = 0

    @property
    def live(self) -> int:
        return self.ready + self.loading


@dataclass(frozen=True)
class PlanContext:
    model: ModelSpec
    forecast: pd.DataFrame  # index: bucket start (epoch or trace seconds); columns "q0.5", "q0.9", ... req/s
    replicas: ReplicaCounts
    now: float
    params: PlannerParams = field(default_factory=PlannerParams)
    nodes: tuple[NodeView, ...] | None = None  # None: placement is left to the executor
    cold_start_p95_s: float | None = None  # measured; None: params.default_cold_start_s
    recent_peak_rps: float = 0.0  # highest observed rate in the last params.peak_hold_s: a floor under demand


@dataclass(frozen=True)
class PlannerState:
    """Carried between calls: when need first fell below the live count, the last decision."""

    below_since: float | None = None
    last_kind: ScaleEventKind | None = None
    last_at: float | None = None


@dataclass(frozen=True)
class BucketNeed:
    start: float
    demand_rps: float  # the planning quantile of the forecast
    need: int  # serving replicas needed in the bucket (batch jobs included)
    batch: int = 0  # of which for batch jobs


@dataclass(frozen=True)
class DroppedEvent:
    event: ScaleEvent
    reason: str


@dataclass(frozen=True)
class PlanResult:
    events: tuple[ScaleEvent, ...]
    dropped: tuple[DroppedEvent, ...]
    needs: tuple[BucketNeed, ...]
    lead_s: float
    pool_target: int
    warm_share: float  # planned warm capacity beyond need / planned GPU time over the horizon

    def serving_target(self, live: int, t: float) -> int:
        """The serving count once every serving event due at or before `t` is carried out."""
        target = live
        for ev in self.events:
            if ev.pool is not Pool.SERVING or ev.at > t:
                continue
            if ev.kind is ScaleEventKind.SCALE_UP:
                target += ev.replicas
            elif ev.kind is ScaleEventKind.SCALE_DOWN:
                target -= ev.replicas
        return target


def event_id(model: ModelSpec, kind: ScaleEventKind, bucket_start: float, pool: Pool) -> str:
    """Deterministic id: the same decision for the same bucket re-planned gives the same id."""
    raw = f"{model.key}|{kind.value}|{int(math.floor(bucket_start))}|{pool.value}"
    return f"{kind.value}-{hashlib.sha1(raw.encode()).hexdigest()[:16]}"


def replicas_needed(demand_rps: float, capacity_rps: float, headroom: float) -> int:
    """ceil(demand / capacity x (1 + headroom)); no demand needs no replica."""
    if not demand_rps > 0:
        return 0
    # round away float noise (e.g. 0.1 * 3 = 0.30000000000000004 must not round up to 1 more)
    return int(math.ceil(round(demand_rps / capacity_rps * (1.0 + headroom), 9)))


def _batch_extra(params: PlannerParams, model: ModelSpec, starts: Sequence[float], bucket_s: float) -> list[int]:
    extra = [0] * len(starts)
    if not starts:
        return extra
    lo, hi = starts[0], starts[-1] + bucket_s
    for job in params.batch_jobs:
        if not job.applies_to(model):
            continue
        it = croniter(job.cron, datetime.fromtimestamp(lo - job.duration_s, tz=timezone.utc))
        while True:
            fire = float(it.get_next(float))
            if fire >= hi:
                break
            end = fire + job.duration_s
            for i, s in enumerate(starts):
                if s < end and s + bucket_s > fire:
                    extra[i] += job.replicas
    return extra


def _needs(ctx: PlanContext) -> list[BucketNeed]:
    p = ctx.params
    col = p.column
    if col not in ctx.forecast.columns:
        raise InvalidPayload(
            f"forecast has no column {col!r} for planning quantile {p.quantile}; columns: {list(ctx.forecast.columns)}"
        )
    if len(ctx.forecast) == 0:
        raise InvalidPayload("forecast is empty: nothing to plan from")
    starts = [float(s) for s in ctx.forecast.index]
    demand = [float(v) for v in ctx.forecast[col].to_numpy()]
    extra = _batch_extra(p, ctx.model, starts, p.bucket_s)
    out = []
    for s, d, b in zip(starts, demand, extra):
        d = max(d, ctx.recent_peak_rps)  # what just happened may happen again: the peak hold
        n = max(replicas_needed(d, ctx.model.capacity_rps, p.headroom), p.min_serving)
        out.append(BucketNeed(start=s, demand_rps=d, need=n + b, batch=b))
    return out


def _place(nodes: tuple[NodeView, ...], model: ModelSpec, n: int, used: dict[str, int]) -> tuple[str, ...]:
    """Pick a node for each of `n` replicas: snapshot holders first, then the least loaded."""
    chosen: list[str] = []
    for _ in range(n):
        best: tuple[tuple[int, float, str], NodeView] | None = None
        for node in nodes:
            taken = used.get(node.name, 0)
            if not node.ready or node.free_slots - taken <= 0:
                continue
            load = (node.replicas + taken) / max(1, node.replica_slots)
            key = (0 if model.key in node.snapshots else 1, load, node.name)
            if best is None or key < best[0]:
                best = (key, node)
        if best is None:
            break
        used[best[1].name] = used.get(best[1].name, 0) + 1
        chosen.append(best[1].name)
    return tuple(chosen)


def plan(ctx: PlanContext, state: PlannerState) -> tuple[PlanResult, PlannerState]:
    """One planning round at `ctx.now`: the events to carry out, what was dropped, and why."""
    p, m, now = ctx.params, ctx.model, ctx.now
    lead = (ctx.cold_start_p95_s if ctx.cold_start_p95_s is not None else p.default_cold_start_s) + p.lead_margin_s
    needs = _needs(ctx)
    # the bucket in progress (or the first forecast one if the forecast starts later)
    cur = 0
    for i, b in enumerate(needs):
        if b.start <= now:
            cur = i
    upcoming = needs[cur:]
    need_now = upcoming[0].need
    live = ctx.replicas.live
    horizon_end = needs[-1].start + p.bucket_s
    events: list[ScaleEvent] = []
    extras: list[tuple[ScaleEvent, float]] = []  # (event, replica-seconds beyond need)

    def make(kind: ScaleEventKind, at: float, n: int, bucket: float, pool: Pool, reason: str) -> ScaleEvent:
        return ScaleEvent(
            event_id=event_id(m, kind, bucket, pool), kind=kind, model=m.name, revision=m.revision,
            at=at, replicas=n, pool=pool, reason=reason,
        )

    # 1. scale-ups, ready by each rise
    planned = live
    for b in upcoming:
        if b.need > planned:
            at = max(now, b.start - lead)
            why = f"forecast {p.column}={b.demand_rps:.3g} req/s" + (f" + batch {b.batch}" if b.batch else "")
            ev = make(ScaleEventKind.SCALE_UP, at, b.need - planned, b.start, Pool.SERVING,
                      f"{why} needs {b.need} replicas from {b.start:.0f}; lead {lead:.1f} s")
            events.append(ev)
            extras.append((ev, ev.replicas * max(0.0, b.start - at)))
            planned = b.need

    # 2. scale-down after stabilization, or hold through a dip
    new_state = state
    if need_now < live:
        below_since = state.below_since if state.below_since is not None else now
        next_since: float | None = below_since
        window_end = now + p.stabilization_s + lead
        in_window = [b for b in upcoming if b.start < window_end]
        future_max = max(b.need for b in in_window)
        if future_max > need_now:
            held = min(live, future_max) - need_now
            rise_at = next(b.start for b in in_window if b.need == future_max)
            ev = make(ScaleEventKind.HOLD, now, held, upcoming[0].start, Pool.SERVING,
                      f"need falls to {need_now} but the forecast rises to {future_max} by {rise_at:.0f} "
                      f"(within stabilization {p.stabilization_s:.0f} s + lead {lead:.1f} s): keep {held} warm")
            events.append(ev)
            extras.append((ev, held * max(p.bucket_s, rise_at - now)))
        if now - below_since >= p.stabilization_s and future_max < live:
            ev = make(ScaleEventKind.SCALE_DOWN, now, live - future_max, upcoming[0].start, Pool.SERVING,
                      f"need {need_now} < live {live} for {now - below_since:.0f} s "
                      f"(stabilization {p.stabilization_s:.0f} s); no rise above {future_max} within "
                      f"{p.stabilization_s + lead:.0f} s")
            events.append(ev)
            next_since = None if future_max <= need_now else below_since
        new_state = replace(state, below_since=next_since)
    else:
        new_state = replace(state, below_since=None)

    # 3. the fixed warm pool
    if p.warm_pool_size is not None:
        pool_target = p.warm_pool_size
    elif p.warm_pool_percent > 0:
        pool_target = max(1, math.ceil(round(p.warm_pool_percent / 100.0 * need_now, 9)))
    else:
        pool_target = 0
    pool_events: list[ScaleEvent] = []
    if ctx.replicas.warm < pool_target:
        pool_events.append(make(ScaleEventKind.SCALE_UP, now, pool_target - ctx.replicas.warm, upcoming[0].start,
                                Pool.WARM, f"warm pool {ctx.replicas.warm} < target {pool_target}"))
    elif ctx.replicas.warm > pool_target:
        pool_events.append(make(ScaleEventKind.SCALE_DOWN, now, ctx.replicas.warm - pool_target, upcoming[0].start,
                                Pool.WARM, f"warm pool {ctx.replicas.warm} > target {pool_target}"))

    # 4. the budget: warm capacity beyond need under budget_share of planned GPU time
    span = max(p.bucket_s, horizon_end - now)
    need_cost = sum(b.need * p.bucket_s for b in upcoming)
    pool_cost = pool_target * span
    extra_cost = pool_cost + sum(c for _, c in extras)
    dropped: list[DroppedEvent] = []

    def share() -> float:
        total = need_cost + extra_cost
        return extra_cost / total if total > 0 else 0.0

    # drop the costliest optional capacity first: holds, then the pool, replica by replica
    for ev, cost in sorted(((e, c) for e, c in extras if e.kind is ScaleEventKind.HOLD), key=lambda x: -x[1]):
        if share() <= p.budget_share:
            break
        before = share()
        extra_cost -= cost
        events.remove(ev)
        dropped.append(DroppedEvent(ev, f"budget: warm capacity {before:.1%} of planned GPU time > "
                                        f"{p.budget_share:.0%}; the hold costs {cost / 3600:.2f} replica-hours"))
    kept_pool = pool_target
    while kept_pool > 0 and share() > p.budget_share:
        before = share()
        kept_pool -= 1
        extra_cost -= span
        dropped.append(DroppedEvent(
            make(ScaleEventKind.SCALE_UP, now, 1, upcoming[0].start, Pool.WARM, "warm pool replica"),
            f"budget: warm capacity {before:.1%} of planned GPU time > {p.budget_share:.0%}; "
            f"warm pool cut to {kept_pool}"))
    if kept_pool != pool_target:
        pool_events = []
        if ctx.replicas.warm < kept_pool:
            pool_events.append(make(ScaleEventKind.SCALE_UP, now, kept_pool - ctx.replicas.warm, upcoming[0].start,
                                    Pool.WARM, f"warm pool {ctx.replicas.warm} < target {kept_pool} (budget)"))
        elif ctx.replicas.warm > kept_pool:
            pool_events.append(make(ScaleEventKind.SCALE_DOWN, now, ctx.replicas.warm - kept_pool, upcoming[0].start,
                                    Pool.WARM, f"warm pool {ctx.replicas.warm} > target {kept_pool} (budget)"))
        pool_target = kept_pool
    events.extend(pool_events)

    # 5. placement of new replicas
    if ctx.nodes is not None:
        used: dict[str, int] = {}
        placed: list[ScaleEvent] = []
        for ev in events:
            if ev.kind is not ScaleEventKind.SCALE_UP:
                placed.append(ev)
                continue
            nodes = _place(ctx.nodes, m, ev.replicas, used)
            if len(nodes) < ev.replicas:
                missing = ev.replicas - len(nodes)
                dropped.append(DroppedEvent(replace(ev, replicas=missing),
                                            f"placement: no ready node with room for {missing} of {ev.replicas}"))
            if nodes:
                placed.append(replace(ev, replicas=len(nodes), nodes=nodes))
        events = placed

    events.sort(key=lambda e: (e.at, e.pool.value, e.kind.value))
    if events:
        new_state = replace(new_state, last_kind=events[0].kind, last_at=events[0].at)
    result = PlanResult(tuple(events), tuple(dropped), tuple(needs), lead, pool_target, share())
    return result, new_state
