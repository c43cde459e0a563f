"""`forecast_and_plan`: the loop that closes — gateway counters → forecast → plan → scale events.

Once per `planner.interval_s` (beat, planner queue), for every planned model:
1. history: the gateway's own per-bucket request counters in Redis
   (`forecasting.data.history.load_redis`), the last `planner.history_s`, without the bucket
   still in progress (it is incomplete, not a dip);
2. forecast: `QuantileForecaster` (p50 and the planning quantile) over `planner.horizon_s`;
   with fewer than `planner.min_history_buckets` buckets the forecaster's flat empirical
   quantiles stand in, and the status says so;
3. plan: the pure `forecasting.planner.plan(ctx, state)` with the live replica counts, the
   nodes' views and the measured cold-start p95; its state is carried in
   `keys.planner_state(model)`;
4. act: `workers.planning.executor.submit_events` (deduplicated by event id; dispatched when due),
   or only logged when `planner.dry_run` is set.
The forecast, the need and the outcome are written to `keys.last_forecast(model)` and to
the `prewarm_forecast_*` metrics (what the stale-plan alert and `prewarm up` read).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from forecasting.data.history import load_redis, rate_series
from forecasting.forecast.models import QuantileForecaster
from forecasting.planner import PlanContext, PlannerParams, PlannerState, ReplicaCounts, plan
from forecasting.data.traces import HistoryError
from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, ModelSpec, ScaleEventKind, check_name
from prewarm.core.errors import InvalidPayload
from prewarm.core.errors import PrewarmError
from prewarm.registry.targets import schedule_fields
from workers.planning.kubernetes import actuator_for, apply_target, events_for_executor, owns_replicas, \
    target_schedule, with_demand_floor
from workers.context import WorkerContext
from workers.planning.executor import live_counts, node_views, submit_events

log = logging.getLogger("prewarm.planner.forecast")


@dataclass(frozen=True)
class ModelPlan:
    model: str
    status: str  # "planned", "cold (n buckets)", "dry_run"
    events: tuple[str, ...]  # ids of the events the plan holds
    new_events: tuple[str, ...]  # ids submitted for the first time
    dropped: int
    need_now: int


def planned_models(ctx: WorkerContext) -> list[ModelSpec]:
    """`planner.models` (model@revision), else every model with a replica, at its latest revision."""
    cap = ctx.settings.planner.capacity_rps
    specs: dict[str, ModelSpec] = {}
    for entry in ctx.settings.planner.models:
        name, sep, rev = entry.partition("@")
        if not sep:
            raise InvalidPayload(f"PREWARM_PLANNER_MODELS entries must be model@revision, got {entry!r}")
        specs[name] = ModelSpec(check_name(name, "model"), check_name(rev, "revision"),
                                capacity_rps=cap)
    if specs:
        return list(specs.values())
    for name in ctx.registry.models():
        reps = sorted(ctx.registry.replicas_of(name), key=lambda r: r.updated_at)
        if reps:
            specs[name] = ModelSpec(name, reps[-1].revision, capacity_rps=cap)
    return list(specs.values())


def _state_load(ctx: WorkerContext, model: str) -> PlannerState:
    raw = ctx.client.hgetall(keys.planner_state(model))
    if not raw:
        return PlannerState()
    try:
        return PlannerState(
            below_since=float(raw["below_since"]) if raw.get("below_since") else None,
            last_kind=ScaleEventKind(raw["last_kind"]) if raw.get("last_kind") else None,
            last_at=float(raw["last_at"]) if raw.get("last_at") else None,
        )
    except (KeyError, ValueError):
        log.warning("planner state of %s is unreadable; starting afresh", model)
        return PlannerState()


def _state_save(ctx: WorkerContext, model: str, state: PlannerState) -> None:
    ctx.client.hset(keys.planner_state(model), mapping={
        "below_since": "" if state.below_since is None else repr(state.below_since),
        "last_kind": "" if state.last_kind is None else state.last_kind.value,
        "last_at": "" if state.last_at is None else repr(state.last_at),
    })


def history(ctx: WorkerContext, model: str, *, now: float) -> pd.Series:
    """Requests/s per complete bucket of the model from the gateway's counters (empty if never counted)."""
    p = ctx.settings.planner
    resolutions = sorted(keys.REQUEST_RESOLUTIONS_S)
    resolution = max((r for r in resolutions if p.bucket_s % r == 0), default=resolutions[0])
    end = math.floor(now / p.bucket_s) * p.bucket_s  # the bucket in progress is left out
    first = ctx.client.hget(keys.REQUESTS_FIRST, model)  # before it the gateway counted nothing
    start = end - p.history_s if first is None else max(end - p.history_s, math.floor(float(first) / p.bucket_s) * p.bucket_s)
    if start >= end:
        return pd.Series(dtype=float)
    try:
        frame = load_redis(ctx.client, model, resolution_s=resolution, start=start, end=end)
    except HistoryError as exc:
        log.info("no request history for %s yet: %s", model, exc)
        return pd.Series(dtype=float)
    if frame.empty:
        return pd.Series(dtype=float)
    return rate_series(frame, model, bucket_s=p.bucket_s)


def forecast(ctx: WorkerContext, y: pd.Series, *, now: float) -> tuple[pd.DataFrame, str]:
    """Quantile forecast (req/s) of the buckets from the one in progress to the horizon."""
    p = ctx.settings.planner
    quantiles = tuple(sorted({0.5, p.quantile}))
    horizon = max(1, math.ceil(p.horizon_s / p.bucket_s))
    if len(y) == 0:
        start = math.floor(now / p.bucket_s) * p.bucket_s
        index = pd.Index(start + p.bucket_s * pd.RangeIndex(horizon).to_numpy(dtype=float), name="ts")
        return pd.DataFrame({f"q{q:g}": 0.0 for q in quantiles}, index=index), "cold (no history)"
    model = QuantileForecaster(quantiles=quantiles, bucket_s=float(p.bucket_s), max_horizon=horizon).fit(y)
    status = "planned" if len(y) >= p.min_history_buckets else f"cold ({len(y)} buckets of history)"
    return model.predict(y, horizon), status


def plan_model(ctx: WorkerContext, spec: ModelSpec, *, now: float) -> ModelPlan:
    p = ctx.settings.planner
    params = PlannerParams.from_settings(p)
    y = history(ctx, spec.name, now=now)
    fc, status = forecast(ctx, y, now=now)
    reps = ctx.registry.replicas_of(spec.name)
    counts = live_counts(r for r in reps if r.revision == spec.revision and r.state in LIVE_STATES)
    recent = y[y.index >= now - params.peak_hold_s] if len(y) else y
    pctx = PlanContext(model=spec, forecast=fc, replicas=ReplicaCounts(**counts), now=now, params=params,
                       nodes=None if owns_replicas(ctx.settings.kubernetes) else node_views(ctx),  # the scheduler places pods
                       cold_start_p95_s=ctx.registry.load_time_p95(spec.name),
                       recent_peak_rps=float(recent.max()) if len(recent) else 0.0)
    result, state = plan(pctx, _state_load(ctx, spec.name))
    _state_save(ctx, spec.name, state)
    if p.dry_run:
        new: list[str] = []
        status = "dry_run"
        for ev in result.events:
            log.info("dry run: would submit %s", ev.to_payload())
    else:
        new = submit_events(ctx, events_for_executor(ctx.settings.kubernetes, result.events))
    for d in result.dropped:
        ctx.metrics.dropped_events.labels(spec.name, "budget" if "budget" in d.reason.lower() else "other").inc()
    first = fc.iloc[0]
    col = params.column
    need_now = next((b.need for b in reversed(result.needs) if b.start <= now), result.needs[0].need) \
        if result.needs else 0
    for q in fc.columns:
        ctx.metrics.forecast_requests.labels(spec.name, q.removeprefix("q")).set(float(first[q]))
    ctx.metrics.forecast_timestamp.labels(spec.name).set(now)
    if len(y):
        ctx.metrics.actual_requests.labels(spec.name).set(float(y.iloc[-1]))
    schedule = target_schedule(result, counts["ready"] + counts["loading"], now)
    if owns_replicas(ctx.settings.kubernetes):
        last = ctx.client.hget(keys.demand(spec.name), "last")
        schedule = with_demand_floor(schedule, float(last) if last else None, now)
    if ctx.settings.kubernetes.enabled:
        _apply_to_cluster(ctx, spec.name, schedule[0][1])
    error = _forecast_error(ctx, spec.name, fc, y, now=now)
    if error is not None:
        ctx.metrics.forecast_error.labels(spec.name).set(error)
    live = counts["ready"] + counts["loading"] + counts["warm"]
    ctx.metrics.warmup_cost_ratio.labels(spec.name).set(warm_cost_ratio(live, need_now))
    record: dict[str, Any] = {
        "status": status, "at": repr(now), "revision": spec.revision, "history_buckets": str(len(y)),
        "rps_q0.5": f"{float(first.get('q0.5', float('nan'))):.3f}", f"rps_{col}": f"{float(first[col]):.3f}",
        "need_now": str(need_now), "events": str(len(result.events)), "new_events": str(len(new)),
        "dropped": str(len(result.dropped)), "pool_target": str(result.pool_target),
        "lead_s": f"{result.lead_s:.1f}", "warm_share": f"{result.warm_share:.3f}",
        "plan": json.dumps([ev.to_payload() for ev in result.events])[:20000],
        **schedule_fields(schedule, planned_at=now),
    }
    ctx.client.hset(keys.last_forecast(spec.name), mapping=record)
    log.info("forecast_and_plan %s: %s, need now %d, %d event(s) (%d new), %d dropped", spec.name, status,
             need_now, len(result.events), len(new), len(result.dropped))
    return ModelPlan(spec.name, status, tuple(ev.event_id for ev in result.events), tuple(new),
                     len(result.dropped), need_now)


def _apply_to_cluster(ctx: WorkerContext, model: str, target: int) -> None:
    """Hand the target to Kubernetes (the scale subresource, when the planner owns the count; with KEDA or
    the HPA they read the recorded target); a refusal is logged and counted, never fatal to the plan."""
    cfg = ctx.settings.kubernetes
    if cfg.autoscaling != "none":
        return
    try:
        result = apply_target(actuator_for(cfg), cfg, model, target)
        if result is None:
            return
        log.info("kubernetes %s %s: %d -> %d%s", result.kind.value, result.target, result.before, result.after,
                 " (dry run)" if result.dry_run else "")
    except (PrewarmError, ValueError) as exc:
        log.error("kubernetes target %d for %s not applied: %s", target, model, exc)
        ctx.metrics.dropped_events.labels(model, "kubernetes_error").inc()


def warm_cost_ratio(live: int, need_now: int) -> float:
    """Share of the live replicas beyond the current need: warm pool, early prewarms and holds."""
    return max(0, live - need_now) / live if live else 0.0


def forecast_error(predicted: pd.Series, actual: pd.Series) -> float | None:
    """Absolute error of p50 forecasts against the observed rates of the same buckets, relative to the
    larger of the two totals (so a forecast for a silent stretch scores 1.0, not infinity)."""
    both = pd.concat([predicted.rename("p"), actual.rename("a")], axis=1, join="inner").dropna()
    if both.empty:
        return None
    scale = max(float(both["a"].sum()), float(both["p"].sum()))
    return float((both["p"] - both["a"]).abs().sum() / scale) if scale > 0 else 0.0


def _forecast_error(ctx: WorkerContext, model: str, fc: pd.DataFrame, y: pd.Series, *, now: float) -> float | None:
    """Log this forecast's first bucket and score the logged ones of the last hour against `y`."""
    key = keys.forecast_log(model)
    if "q0.5" in fc.columns and len(fc):
        start = float(fc.index[0])
        pipe = ctx.client.pipeline(transaction=False)
        pipe.zremrangebyscore(key, start, start)  # one prediction per bucket: the latest
        pipe.zadd(key, {f"{start!r}:{float(fc['q0.5'].iloc[0])!r}": start})
        pipe.zremrangebyscore(key, "-inf", now - keys.FORECAST_LOG_S)
        pipe.expire(key, 2 * keys.FORECAST_LOG_S)
        pipe.execute()
    logged = [m.rsplit(":", 1) for m in ctx.client.zrange(key, 0, -1)]
    predicted = pd.Series({float(t): float(v) for t, v in logged}, dtype=float)
    return forecast_error(predicted, y) if len(y) else None


def forecast_and_plan(ctx: WorkerContext, *, now: float) -> list[ModelPlan]:
    out = []
    for spec in planned_models(ctx):
        try:
            out.append(plan_model(ctx, spec, now=now))
        except (HistoryError, ValueError) as exc:
            log.error("forecast_and_plan %s failed: %s", spec.name, exc)
            ctx.client.hset(keys.last_forecast(spec.name), mapping={"status": f"error: {exc}"[:500], "at": repr(now)})
    return out
