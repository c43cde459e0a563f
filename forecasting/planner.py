"""The one planner: state and observations in, a decision and the next state out.

`step(inputs, state) -> (decision, state)` is pure (no clock, no I/O, `now` inside the inputs), and it
is the only planner: the live `forecast_and_plan` task and the simulator's `prewarm` policy both call
it, every `interval_s`, with inputs built by the same function (`observed_from_counts`) from the same
per-bucket counters the gateway records (requests and peak requests in flight per fine bucket; request
rate per coarse bucket for the seasonal profile). A backtest therefore scores what ships.

One decision per helper, in order (as Ray Serve's autoscaling policy reads):
0. `calibrate` (`forecasting.calibration`): the staffing margin moves with the requests that
   waited for capacity since the last step against the operator's `cold_start_budget`
   (a feedback term, as adaptive conformal inference moves its quantile on its misses): the
   margin itself (`margin_rule` "integrator", the default) or the level of a quantile of the
   margins past buckets needed ("quantile"; each step records what it sized, `record_sizing`);
1. `lead_of`: the lead is the measured cold-start p95 (the default until one is measured) plus a margin;
2. `forecast_peak` (`forecasting.nowcast`; the season and profile resolution are settings,
   nothing is keyed to a clock): the planning quantile of the peak in-flight
   demand over the next lead, and the quality of the forecaster's recent forecasts;
3. `_mode`: the forecast-quality gate. While the forecaster's recent typical relative error
   (its errors beyond the planning quantile left out: `forecast_peak`) is above
   `error_threshold` (or unknown), scale-downs fall back to reactive behaviour:
   nothing observed within the last `stabilization_s` may be released. Scale-ups stay
   predictive either way;
4. `_serving_target`: the replicas the forecast needs over the lead (`calibration.sizing`: a + margin x
   sqrt(a) of the forecast mean load in flight in predictive mode; in reactive mode of the peak in
   flight, which holds the fluctuation the staffing beta stands for, so the margin counts from
   `queue_beta`), plus any batch job running within it, at least `min_serving`, never below
   what the load so far in the bucket in progress needs while no replica is loading (`Observed.now_load`:
   a rise is met at the next step, not one complete bucket later; while loads run, the backlog they will
   serve is in flight at the gateway, and sized again at every step it started replicas for a queue), never below
   a recommendation whose lead has not passed (`forecasting.holds`), nor, in either mode, below the replicas the
   peaks in flight of the last lead filled (a replica used within a load's time is not released: its return would
   cost that load, and a forecast of the mean released it between peaks and started it again); a predictive fall
   leaves `release_band` of a replica spare (a deadband); in reactive mode (`forecasting.reactive`) a rise is made only
   where the forecast's peak or the load so far fills more than the live replicas unsized, a fall never below what it
   sizes for the largest peak observed within `stabilization_s` (the HPA's stabilization over its own
   recommendations), and a fall within `scale_down_tolerance` of the live replicas is not made;
5. the warm budget (`forecasting.budget`): warm capacity beyond the next bucket's need stays within
   `budget_share` of the planned capacity; what it cuts is reported. The warm pool is a standing cost,
   sized against the plain budget (a stable size, no flapping); early scale-ups and holds before a
   predicted rise may, in predictive mode, spend what calm steps left unspent (the budget holds on
   average over `budget_window_s`, the state carries the account), so a step may pre-warm a rise the forecaster
   learned to expect; in reactive mode it holds at every step; it refuses new replicas, never releases live ones;
   an interruption (`forecasting.interruption`) keeps the live replicas (where only the recent level contradicts
   the fall, what its expected requests need) for at most `interruption_hold_s` (silent: `forecasting.pauses`);
6. `_events`: SCALE_UP / SCALE_DOWN to the target, HOLD only for replicas kept for a rise predicted within the
   lead, the warm pool's events; ids derive from (model, kind, fine bucket, pool): a re-plan deduplicates;
7. `place` (`forecasting.placement`): the one placement rule (snapshot holders first, then the least loaded).

Warm cost has one definition here (`warm_cost`): the share of replica-time above need.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence

import numpy as np

from forecasting import budget, holds, interruption, park, pauses, reactive
from forecasting.batch import BatchJob, batch_replicas, batch_schedule
from forecasting.budget import replicas_needed, warm_cost
from forecasting.calibration import RULES, Sizing, calibrate, record_sizing, sizing
from forecasting.forecast.nowcast import Forecast, Profile, fit_profile, forecast_peak, lead_buckets
from forecasting.placement import place_events
from prewarm.core.domain import ModelSpec, NodeView, Pool, ScaleEvent, ScaleEventKind
from prewarm.core.settings import PlannerSettings

PREDICTIVE = "predictive"
REACTIVE = "reactive"
MODES = (PREDICTIVE, REACTIVE)


@dataclass(frozen=True)
class PlannerParams:
    """Mirror of `prewarm.core.settings.PlannerSettings` (the fields the pure planner reads)."""

    quantile: float = 0.9  # the nowcast's upper quantile the calibrated margin sizes on: not a knob (docs/operating.md)
    headroom: float = 0.0
    lead_margin_s: float = 10.0
    default_cold_start_s: float = 8.7
    stabilization_s: float = 300.0
    scale_down_tolerance: float = 0.1  # reactive mode: a fall of at most this share of live replicas is not made
    release_band: float = 0.25  # predictive mode: a fall leaves this share of a replica spare beyond the sized load
    warm_pool_size: int | None = None
    warm_pool_percent: float = 0.0
    budget_share: float = 0.12
    budget_window_s: float = 3600.0  # the budget holds on average over this (0: at every step)
    bucket_s: float = 60.0  # coarse buckets: the seasonal profile's history
    fine_bucket_s: float = 10.0  # fine buckets: requests and peak in flight, what the nowcast reads
    interval_s: float = 5.0  # cadence of `step` (the beat period of forecast_and_plan; the simulator's too)
    min_serving: int = 1
    queue_beta: float = 1.5  # square-root staffing: slots for a mean load a are a + beta x sqrt(a) (reactive_sized's)
    cold_start_budget: float = 0.001  # share of requests that may wait for capacity (>= 1: no calibration)
    margin_initial: float = 6.0  # the calibrated margin's start: on the safe side until misses are measured
    budget_gain: float = 0.2  # how far the margin (beta) moves when one calibration window's budget is overspent
    budget_calibration_s: float = 3600.0  # the window whose requests the budget's overspend is measured against
    budget_horizon_s: float = 86400.0  # the span the budget's share is meant over: the normaliser's average
    margin_max: float = 40.0  # the calibrated margin stays within [0, margin_max] (its integrator does not wind up)
    margin_rule: str = "integrator"  # how the margin meets the budget: "integrator" or "quantile" (docs/operating.md)
    shortfall_horizon_s: float = 7 * 86400.0  # the quantile rule remembers the margins buckets needed this long
    error_threshold: float = 0.1  # typical relative error of the median above which scale-downs turn reactive
    score_window_s: float = 3600.0  # the recent forecasts scored (and calibrating the quantiles)
    level_s: float = 60.0  # the nowcast's level: the mean of the last minute
    season_s: float = 86400.0  # the period the traffic's shape repeats over (declared; a day unless told)
    profile_bin_s: float = 1800.0  # resolution of the learned seasonal shape (the level of the last minute does the rest)
    profile_refit_s: float = 3600.0
    history_s: float = 3 * 86400.0  # coarse history the profile is learned from
    schedule_horizon_s: float = 3600.0  # how far ahead known batch rises are put in the target schedule
    batch_jobs: tuple[BatchJob, ...] = ()
    park_horizon_s: float = 0.0  # a replica released but needed again within this is parked asleep (0: retired)
    # a fall the profile contradicts is held, not released (`forecasting.interruption`; reasons in docs/operating.md)
    interruption_share: float = 0.1  # requests below this share of the profile's expectation: an interruption
    interruption_min_requests: float = 20.0  # ... judged over recent buckets expecting at least this many
    interruption_hold_s: float = 3600.0  # replicas held at most this long from the start of the fall
    pause_memory: int = 64  # the model's last pauses a silent fall's span is learned from (0: off; `forecasting.pauses`)

    @classmethod
    def from_settings(cls, s: PlannerSettings) -> "PlannerParams":
        """Build from the `planner` settings group: every field it has of the same name, as the field's type."""
        cast: dict[str, Callable[[Any], Any]] = {"float": float, "int": int}
        kw = {f.name: cast.get(str(f.type), lambda v: v)(getattr(s, f.name)) for f in fields(cls)
              if f.name != "batch_jobs" and hasattr(s, f.name)}
        return cls(**kw, batch_jobs=tuple(BatchJob.from_mapping(j) for j in s.batch_jobs))

    def __post_init__(self) -> None:
        if self.margin_rule not in RULES:
            raise ValueError(f"margin_rule {self.margin_rule!r} is not one of {', '.join(RULES)}")


@dataclass(frozen=True)
class ReplicaCounts:
    """The model's replicas now: serving ready, serving loading (incl. warming), warm pool (loading ones too)."""

    ready: int = 0
    loading: int = 0
    warm: int = 0
    # True where the warm pool is not told apart from the serving replicas (a Deployment's pods in a
    # cluster): `ready`/`loading` include it, and the step takes the pool out before it plans serving
    pooled: bool = False
    asleep: int = 0  # parked asleep (level-1 sleep, not live): woken before any new load

    @property
    def live(self) -> int:
        return self.ready + self.loading


@dataclass(frozen=True, eq=False)
class Observed:
    """What the gateway counted per fine bucket, complete buckets only, oldest first; and the load so far in the
    bucket in progress (the gateway credits busy time at every flush: its busy time so far over its elapsed time)."""

    start: float  # epoch second of the first bucket
    bucket_s: float
    requests: np.ndarray  # requests per bucket
    peak: np.ndarray  # peak requests in flight per bucket
    busy: np.ndarray  # request-seconds of the requests that ended in the bucket (mean in flight x bucket_s)
    waited: np.ndarray | None = None  # requests that waited for capacity (a load or a wake) per bucket; None: not counted
    now_load: float | None = None  # mean requests in flight so far in the bucket in progress (None: none elapsed)

    @property
    def inflight(self) -> np.ndarray:
        """Mean requests in flight per bucket."""
        return self.busy / self.bucket_s

    @property
    def end(self) -> float:
        return self.start + self.requests.size * self.bucket_s


@dataclass(frozen=True, eq=False)
class StepInputs:
    model: ModelSpec
    now: float
    observed: Observed
    replicas: ReplicaCounts
    params: PlannerParams = field(default_factory=PlannerParams)
    cold_start_p95_s: float | None = None  # measured; None: params.default_cold_start_s
    profile_history: tuple[float, float, np.ndarray] | None = None  # (start, bucket_s, req/s): only when refit_due
    nodes: tuple[NodeView, ...] | None = None  # None: placement is left to the executor
    wake_p95_s: float | None = None  # measured wake of a parked replica (None: none measured)
    # False: the engine reports no sleep mode on the nodes of its ready replicas (`prewarm.policy.sleep_tier`):
    # no asleep tier, a scale-down retires (parked, the replica would be refused sleep and stay on GPU)
    sleep_tier: bool = True


@dataclass(frozen=True)
class PlannerState:
    """Carried between steps: the learned profile (refit every `profile_refit_s`) and the mode."""

    profile: Profile | None = None
    profile_at: float | None = None
    mode: str = REACTIVE
    mode_since: float | None = None
    warm_avg: float | None = None  # planned warm share, averaged over `budget_window_s` (the budget's account)
    warm_at: float | None = None
    margin: float | None = None  # the staffing margin calibrated on the cold-start budget (None: margin_initial)
    counted_end: float | None = None  # the end of the last fine bucket the calibration has counted
    counted_rate: float | None = None  # requests/s over `budget_horizon_s` (the calibration's normaliser) and
    counted_weight_s: float | None = None  # the decayed seconds of counting it rests on
    quiet_since: float | None = None  # the start of an interruption (`forecasting.interruption`)
    lead_holds: holds.Holds = ()  # recommendations whose lead has not run out (`forecasting.holds`)
    shortfalls: tuple[float, ...] = ()  # requests per bin of the margin their bucket needed (both rules)
    alpha: float | None = None  # the quantile rule: the share of them its margin may leave short (None: the budget)
    sized: tuple[Sizing, ...] = ()  # the recent steps' sizings, to score the coming buckets against
    overspent: bool = False  # a counted step's waits were over the budget: the integrator's margin is uncapped since
    scored_buckets: float = 0.0  # the buckets `shortfalls` holds (decayed as it is)
    pauses: pauses.Pauses = pauses.Pauses()  # the model's remembered pauses (`forecasting.pauses`)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}
                          | {"profile": None if self.profile is None else self.profile.to_dict(),
                             "pauses": self.pauses._asdict()})

    @classmethod
    def from_json(cls, raw: str | None) -> "PlannerState":
        if not raw:
            return cls()
        d, known = json.loads(raw), {f.name for f in fields(cls)}
        p = d.get("profile")
        return cls(**{k: v for k, v in d.items() if k in known}
                   | {"profile": None if p is None else Profile.from_dict(p), "mode": str(d.get("mode", REACTIVE)),
                      "overspent": bool(d.get("overspent", False)),
                      "lead_holds": tuple((float(u), int(n)) for u, n in d.get("lead_holds", ())),
                      "pauses": pauses.from_dict(d.get("pauses") or {}),
                      "shortfalls": tuple(float(x) for x in d.get("shortfalls", ())),
                      "sized": tuple((float(t), float(lead), float(a), float(o))
                                     for t, lead, a, o in d.get("sized", ()))})


@dataclass(frozen=True)
class DroppedEvent:
    event: ScaleEvent
    reason: str


@dataclass(frozen=True)
class Decision:
    events: tuple[ScaleEvent, ...]
    dropped: tuple[DroppedEvent, ...]
    target: int  # serving replicas wanted now
    pool_target: int
    need_next: int  # serving replicas the next fine bucket needs (planning quantile)
    need_lead: int  # the most the lead needs (planning quantile, batch jobs included)
    lead_s: float
    mode: str
    forecast: Forecast
    warm_share: float  # planned warm capacity beyond need, as a share (`warm_cost`)
    schedule: tuple[tuple[float, int], ...] = ()  # later cluster targets already known: (due epoch s, replicas)

    @property
    def cluster_target(self) -> int:
        """Replicas the cluster should run: the serving target plus the warm pool."""
        return self.target + self.pool_target


# -- definitions shared by the planner, the gauges, the report and the simulator ---------------------------------

def event_id(model: ModelSpec, kind: ScaleEventKind, bucket_start: float, pool: Pool) -> str:
    """Deterministic id: the same decision for the same bucket re-planned gives the same id."""
    raw = f"{model.key}|{kind.value}|{int(math.floor(bucket_start))}|{pool.value}"
    return f"{kind.value}-{hashlib.sha1(raw.encode()).hexdigest()[:16]}"


# -- inputs, the same way for the live task and the simulator ----------------------------------------------------

def refit_due(state: PlannerState, now: float, params: PlannerParams) -> bool:
    """Whether this step relearns the seasonal profile (the caller then passes `profile_history`)."""
    return state.profile_at is None or now - state.profile_at >= params.profile_refit_s


def recent_span_s(state: PlannerState, params: PlannerParams, lead_s: float, held: bool = True) -> float:
    """How much fine history a step reads: the scored window or the interruption's recent level (over a silent fall's
    span; `held` False: without it, what the forecaster reads) and window (plus a day while no profile is learned)."""
    hold = _span(state.pauses, params)[0] if held else params.interruption_hold_s
    base = max(params.score_window_s, params.budget_calibration_s, hold + params.stabilization_s) \
        + lead_s + params.level_s + 2 * params.fine_bucket_s
    return base + (params.season_s if state.profile is None else 0.0)


def observed_from_counts(start: float, bucket_s: float, requests: Sequence[float] | np.ndarray,
                         peak: Sequence[float] | np.ndarray, busy: Sequence[float] | np.ndarray,
                         waited: Sequence[float] | np.ndarray | None = None,
                         current: tuple[float, float, float] | None = None) -> Observed:
    """The planner's view of the gateway's fine counters (missing buckets are zero traffic; `waited`:
    the requests that waited for capacity, which the cold-start budget calibrates on; `current`: the
    bucket in progress, (its busy request-seconds so far, its seconds elapsed, its peak in flight so far):
    the mean in flight so far, never above that peak (a planner's clock behind the gateway's would inflate it))."""
    now_load = min(current[0] / current[1], current[2]) if current is not None and current[1] > 0 else None
    return Observed(float(start), float(bucket_s), np.asarray(requests, dtype=np.float64),
                    np.asarray(peak, dtype=np.float64), np.asarray(busy, dtype=np.float64),
                    None if waited is None else np.asarray(waited, dtype=np.float64), now_load)


def _span(c: pauses.Pauses, p: PlannerParams) -> tuple[float, float | None]:  # a silent fall's span, and its alpha
    return pauses.hold_s(c, p.cold_start_budget, p.pause_memory, p.interruption_hold_s, max(p.interruption_hold_s, p.season_s))


def holds_fall(state: PlannerState, params: PlannerParams, now: float) -> bool:
    """Whether `now` is within the span of a fall the last step held replicas through (theirs to release)."""
    return state.quiet_since is not None and now - state.quiet_since <= _span(state.pauses, params)[0]


def lead_of(params: PlannerParams, cold_start_p95_s: float | None) -> float:
    return (cold_start_p95_s if cold_start_p95_s is not None else params.default_cold_start_s) + params.lead_margin_s


# -- the step -----------------------------------------------------------------------------------------------------

def _learn(inp: StepInputs, state: PlannerState) -> PlannerState:
    p = inp.params
    if not refit_due(state, inp.now, p) or inp.profile_history is None:
        return state
    start, bucket, rates = inp.profile_history
    return replace(state, profile=fit_profile(rates, start, bucket, bin_s=p.profile_bin_s, season_s=p.season_s),
                   profile_at=inp.now)


def _forecast(inp: StepInputs, state: PlannerState, lead: float) -> tuple[Forecast, str]:
    """The forecast over `lead` and the mode it puts the planner in. The mean load in flight is what a
    replica's slots serve when the forecast of it is good; while it is not (bursts), the peaks are planned
    and released only reactively."""
    p, obs = inp.params, inp.observed
    kw = dict(horizon=lead_buckets(lead, obs.bucket_s), quantile=p.quantile, window=int(p.score_window_s // obs.bucket_s),
              level_buckets=max(1, int(p.level_s // obs.bucket_s)), profile=state.profile, season_s=p.season_s)
    # the forecaster reads the window it reads without a learned span: its inputs do not depend on the pauses
    cut = max(0, obs.requests.size - int(math.ceil(recent_span_s(state, p, lead, held=False) / obs.bucket_s)))
    start = obs.start + cut * obs.bucket_s
    fc = forecast_peak(obs.inflight[cut:], start, obs.bucket_s, **kw)  # type: ignore[arg-type]
    mode = _mode(fc, p)
    if mode == REACTIVE:
        fc = forecast_peak(obs.peak[cut:], start, obs.bucket_s, **kw)  # type: ignore[arg-type]
    return fc, mode


def _mode(fc: Forecast, p: PlannerParams) -> str:
    """The forecast-quality gate: predictive scale-downs only while recent forecasts were good."""
    return PREDICTIVE if fc.error is not None and fc.error <= p.error_threshold else REACTIVE


def _base_need(inp: StepInputs, before: float, margin: Any) -> int:
    """The replicas the load needed in the last bucket before `before` (a batch run's start): what
    the run's replicas come on top of. Once the run is visible in the gateway's counters the
    forecast holds its load, and the planner takes the larger, never the sum."""
    obs = inp.observed
    k = min(obs.busy.size, int(math.floor((before - obs.start) / obs.bucket_s)))
    if k <= 0:
        return 0
    return replicas_needed(margin(float(obs.inflight[k - 1])), inp.model.slots, inp.params.headroom)


def _serving_target(inp: StepInputs, need_lead: int, mode: str, observed_need: int | None, held: int,
                    used: int | None, banded: int) -> tuple[int, str]:
    p, live = inp.params, inp.replicas.live
    target = max(need_lead, p.min_serving)
    why = f"forecast needs {need_lead} within the lead"
    if mode == PREDICTIVE and target < live and banded > target:  # a fall leaves `release_band` of a replica spare
        target, why = min(live, banded), f"{banded} within {p.release_band:g} of a replica of the load sized"
    if target < live and held > target:  # either mode: a recommendation stands until its lead has passed
        target, why = min(live, held), f"{held} recommended by a step whose lead has not passed"
    if target < live and used is not None and used > target:  # either mode: a replica used within a load's time
        target, why = min(live, used), f"{used} filled by a peak in flight within the lead"
    if mode == REACTIVE and target < live:
        floor = live if observed_need is None else max(observed_need, target)
        if floor > target:
            why = (f"reactive: {floor} observed within {p.stabilization_s:.0f} s" if observed_need is not None
                   else "reactive: less history than the stabilization window")
        target = min(live, floor)
        if target < live and target >= live * (1.0 - p.scale_down_tolerance) - 1e-9:
            why = f"reactive: {live - target} of {live} live is within the {p.scale_down_tolerance:.0%} tolerance"
            target = live
    return target, why


def _parked(inp: StepInputs, events: list[ScaleEvent], state: PlannerState, target: int, lead: float,
            margin: Any) -> list[ScaleEvent]:
    """A serving scale-down whose ready replicas the profile needs again within `park_horizon_s` parks them
    asleep (PARK) instead; its loading ones are still cancelled. What the horizon does not need is released
    by the next step (the parked ones then count as asleep), so PARK and SCALE_DOWN never pick the same."""
    p, obs, counts = inp.params, inp.observed, inp.replicas
    down = next((e for e in events if e.kind is ScaleEventKind.SCALE_DOWN and e.pool is Pool.SERVING), None)
    if down is None or not obs.busy.size or not inp.sleep_tier:
        return events
    level = float(obs.inflight[-max(1, int(p.level_s // obs.bucket_s)):].mean())
    expected = park.need_within(state.profile, level, inp.now, lead, p.park_horizon_s)
    if expected is None:
        return events
    need = replicas_needed(margin(expected), inp.model.slots, p.headroom)
    k = park.park_count(down.replicas, counts.loading, target, counts.asleep, need)
    if k <= 0:
        return events
    bucket = math.floor(inp.now / p.fine_bucket_s) * p.fine_bucket_s
    parked = replace(down, event_id=event_id(inp.model, ScaleEventKind.PARK, bucket, Pool.SERVING),
                     kind=ScaleEventKind.PARK, replicas=k,
                     reason=f"{need} needed again within {p.park_horizon_s:.0f} s: parked asleep, not retired")
    out = [e for e in events if e is not down] + [parked]
    if counts.loading > 0:  # the loading ones are still cancelled (k > 0: the scale-down took them all)
        out.append(replace(down, replicas=counts.loading))
    return out


def _split_pool(counts: ReplicaCounts, pool: int) -> ReplicaCounts:
    """Pods of one Deployment, serving and pool alike: up to `pool` of them are the warm pool (those still
    coming up first), the rest serve. Counted as all serving, the reactive floor would keep them all
    serving and add the pool on top at every step: +pool per Ready pod while history is short."""
    warm = min(pool, counts.live)
    from_loading = min(warm, counts.loading)
    return ReplicaCounts(counts.ready - (warm - from_loading), counts.loading - from_loading, warm)


def _events(inp: StepInputs, target: int, pool: int, need_next: int, need_lead: int, why: str,
            lead: float) -> list[ScaleEvent]:
    m, now, live, warm = inp.model, inp.now, inp.replicas.live, inp.replicas.warm
    bucket = math.floor(now / inp.params.fine_bucket_s) * inp.params.fine_bucket_s

    def make(kind: ScaleEventKind, n: int, pool_: Pool, reason: str) -> ScaleEvent:
        return ScaleEvent(event_id=event_id(m, kind, bucket, pool_), kind=kind, model=m.name, revision=m.revision,
                          at=now, replicas=n, pool=pool_, reason=reason)

    out: list[ScaleEvent] = []
    if target > live:
        out.append(make(ScaleEventKind.SCALE_UP, target - live, Pool.SERVING, f"{why}; live {live}; lead {lead:.1f} s"))
    elif target < live:
        out.append(make(ScaleEventKind.SCALE_DOWN, live - target, Pool.SERVING,
                        f"{why}: {target} of {live} live are enough over the next {lead:.1f} s"))
    # a scale-down cancels replicas still loading before it retires ready ones (the executor's order), so the
    # replicas a HOLD keeps warm are the ready ones left: never one the scale-down of this decision retires
    kept = min(inp.replicas.ready, target)
    if need_lead > need_next and kept > need_next:
        out.append(make(ScaleEventKind.HOLD, kept - max(need_next, inp.params.min_serving), Pool.SERVING,
                        f"the next bucket needs {need_next} but {need_lead} within {lead:.1f} s: keep warm"))
        if out[-1].replicas <= 0:
            out.pop()
    if warm < pool:
        out.append(make(ScaleEventKind.SCALE_UP, pool - warm, Pool.WARM, f"warm pool {warm} < target {pool}"))
    elif warm > pool:
        out.append(make(ScaleEventKind.SCALE_DOWN, warm - pool, Pool.WARM, f"warm pool {warm} > target {pool}"))
    return out


def _placed(inp: StepInputs, events: list[ScaleEvent]) -> tuple[list[ScaleEvent], list[DroppedEvent]]:
    if inp.nodes is None:
        return events, []
    out, dropped = place_events(inp.nodes, inp.model.key, events)
    return out, [DroppedEvent(ev, why) for ev, why in dropped]


def step(inp: StepInputs, state: PlannerState) -> tuple[Decision, PlannerState]:
    """One planning step at `inp.now` (see the module docstring for the order of decisions)."""
    p, slots = inp.params, inp.model.slots
    state = _learn(inp, state)
    obs = inp.observed
    cal = calibrate(obs.requests, obs.waited, obs.peak, obs.start, obs.bucket_s, state, p, slots)
    state, margin_now = replace(state, **cal._asdict()), cal.margin
    # the margin the cold-start budget calibrated, in both modes (every miss counts); a peak's counts from beta
    staffed = sizing(False, margin_now, p.queue_beta)  # a mean load in flight (the gateway's busy time)
    lead = lead_of(p, inp.cold_start_p95_s)
    fc, mode = _forecast(inp, state, lead)
    margin = sizing(mode == REACTIVE, margin_now, p.queue_beta)
    if inp.replicas.asleep and inp.wake_p95_s is not None and inp.wake_p95_s + p.lead_margin_s < lead:
        # parked replicas come back in their measured wake time: a rise they can cover is planned one wake
        # (not one cold start) ahead of it
        if replicas_needed(margin(fc.upper), slots, p.headroom) - inp.replicas.live <= inp.replicas.asleep:
            lead = inp.wake_p95_s + p.lead_margin_s
            fc, mode = _forecast(inp, state, lead)
            margin = sizing(mode == REACTIVE, margin_now, p.queue_beta)
    offset = p.queue_beta if mode == REACTIVE else 0.0  # the quantile rule scores what this step sizes
    scored = p.margin_rule == "quantile" or not state.overspent  # the coming buckets are scored against this step
    if not scored or obs.requests.size:  # a step that saw no bucket sized no load to score the buckets after it on
        state = replace(state, sized=record_sizing(state.sized, inp.now, lead, fc.upper, offset, p) if scored else ())
    batch_lead, fired = batch_replicas(p.batch_jobs, inp.model, inp.now, inp.now + lead)
    batch_next, _ = batch_replicas(p.batch_jobs, inp.model, inp.now, inp.now + obs.bucket_s)
    fc_lead = replicas_needed(sized := margin(fc.upper), slots, p.headroom)  # `sized`: the slots the lead needs
    fc_next = replicas_needed(margin(fc.next_upper), slots, p.headroom)
    # a batch job adds its replicas to the load before it starts (the next bucket's forecast),
    # unless the forecast already covers it: a job the forecaster has learned is not provisioned twice
    base = _base_need(inp, fired, staffed) if batch_lead else 0
    now_need = replicas_needed(staffed(obs.now_load), slots, p.headroom) \
        if obs.now_load is not None and not inp.replicas.loading else 0
    if mode == REACTIVE and not reactive.rise_shown(fc.upper, fc.next_upper, obs.now_load, inp.replicas.live, slots,
                                                    p.headroom):  # the sized forecast holds live replicas, adds none
        fc_lead, fc_next, now_need = (min(n, inp.replicas.live) for n in (fc_lead, fc_next, now_need))
    need_next = max(fc_next, base + batch_next, now_need)  # never below what the load so far in this bucket needs
    need_lead = max(fc_lead, need_next, base + batch_lead)
    floor_next = max(need_next, p.min_serving)
    pool = budget.trim(floor_next, budget.pool_target(p.warm_pool_size, p.warm_pool_percent, need_next), floor_next,
                       p.budget_share)[1]
    if inp.replicas.pooled:
        inp = replace(inp, replicas=_split_pool(inp.replicas, pool))
    used = reactive.observed_need(obs.peak, obs.bucket_s, lead, lambda x: x, slots, p.headroom)  # filled, unsized
    # a predictive fall leaves `release_band` of a replica spare (a deadband at a replica's boundary; at no load, none)
    banded = replicas_needed(sized + p.release_band * slots, slots, p.headroom) if sized > 0 else 0
    observed = reactive.observed_need(obs.peak, obs.bucket_s, p.stabilization_s, margin, slots, p.headroom)
    target, why = _serving_target(inp, need_lead, mode, observed,
                                  holds.held(state.lead_holds, inp.now), used, banded)
    state = replace(state, lead_holds=holds.record(state.lead_holds, inp.now, lead, need_lead))
    why += f" (batch jobs {batch_lead})" if batch_lead else ""
    allowed = budget.allowed_share(state.warm_avg, state.warm_at, inp.now, p.budget_share, p.budget_window_s)
    budget_target, pool, notes = budget.trim(target, pool, floor_next, p.budget_share,
                                             allowed if mode == PREDICTIVE else None, inp.replicas.live)
    dropped: list[DroppedEvent] = []
    if budget_target < target:
        cut = ScaleEvent(event_id=event_id(inp.model, ScaleEventKind.SCALE_UP, inp.now, Pool.SERVING),
                         kind=ScaleEventKind.SCALE_UP, model=inp.model.name, revision=inp.model.revision, at=inp.now,
                         replicas=target - budget_target, reason="warm capacity beyond need")
        dropped.append(DroppedEvent(cut, "; ".join(notes[:1] + notes[-1:]) if notes else "budget"))
    target = budget_target
    # a silent fall's span: the quantile of the model's own pauses the budget affords (`forecasting.pauses`; off at 0)
    paused = pauses.observe(state.pauses, obs.requests, obs.start, obs.bucket_s, p.stabilization_s, p.pause_memory,
                            lead) if p.pause_memory > 0 else state.pauses
    span, alpha = _span(paused, p)
    ran = bool(p.batch_jobs) and batch_replicas(p.batch_jobs, inp.model, inp.now - span, inp.now)[0] > 0
    fall = interruption.interrupted(state.profile, obs.requests, obs.start, obs.bucket_s, p.stabilization_s, p, not ran,
                                    obs.peak)
    if fall is None and pauses.silent_through(paused, state.quiet_since, inp.now, span):
        # a fall that stayed silent past the hour, within the span its pauses ask for: its level read over that span
        fall = interruption.interrupted(state.profile, obs.requests, obs.start, obs.bucket_s, p.stabilization_s,
                                        replace(p, interruption_hold_s=span), not ran, obs.peak)
    quiet_since, held = interruption.hold(state.quiet_since, inp.now, fall is not None, span)
    kept = interruption.held_target(fall, held, quiet_since, span, alpha, p.interruption_hold_s, inp.replicas.live,
                                    lambda expected, peak: replicas_needed(max(margin(peak), peak, pauses.return_peak(
                                        paused, expected, peak, lead, obs.bucket_s, p)), slots, p.headroom))
    if kept is not None and target < kept[0]:
        target, why = kept
    events = _events(inp, target, pool, need_next, need_lead, why, lead)
    if p.park_horizon_s > 0:
        events = _parked(inp, events, state, target, lead, staffed)
    events, placement_dropped = _placed(inp, events)
    if mode != state.mode:
        state = replace(state, mode=mode, mode_since=inp.now)
    forecast_need = max(fc_lead, p.min_serving)
    schedule = (batch_schedule(p.batch_jobs, inp.model, inp.now, lead, p.schedule_horizon_s, forecast_need,
                               _base_need(inp, inp.now, staffed), pool) if p.batch_jobs else ())
    share = warm_cost(target + pool, floor_next)
    decision = Decision(tuple(events), tuple(dropped + placement_dropped), target, pool, need_next, need_lead, lead,
                        mode, fc, share, schedule)
    warm_avg, warm_at = budget.account(state.warm_avg, state.warm_at, inp.now, share, p.budget_window_s)
    return decision, replace(state, warm_avg=warm_avg, warm_at=warm_at, quiet_since=quiet_since, pauses=paused)
