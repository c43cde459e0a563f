"""One planning round for a whole pool: every model's count and tier in one pass, cheap enough for a
thousand models per interval.

The dense case (many replicas of one model) and the sparse case (which of many models are
warm) are two regimes of this one decision:

- every model's warmth outlook comes from one vectorised `ArrivalEstimator` over all
  series at once (idle-time hazards shrunk toward the histogram pooled over the fleet:
  one shared model for the sparse series), carried in the round's state and fed only the
  buckets completed since the last round; rebuilt from the history passed when the state
  has none (a restarted planner), the models changed, or the history does not reach back
  to what it last saw. The replay (`forecasting.fleet.policies.FleetPlanner`) and the live
  round (`workers.planning.fleet`) call this same function, so the replay scores what
  ships;
- the dense models (`dense_models`: the busiest, above ``dense_rps`` over ``dense_window_s``,
  then those whose count planner holds their replicas through a fall, `held_models`; at most
  ``max_dense``) are sized by the count planner, `forecasting.planner.step`, on
  the inputs the caller built for them as the single-model loop builds them (the gateway's
  fine counters, the live replicas, the measured cold start): the same step, cold-start
  budget and calibrated margin as a model planned alone, its state carried per model. The
  round asks for that many replicas (serving target plus warm pool) on GPU. A model the last
  round did not size starts its margin's counting afresh: what waited meanwhile (a quiet
  model's burst before any round saw it) was short of no margin (with no last round on
  record, a restarted planner or a dry run, its counting goes on as carried);
- the long tail's forecast is the estimator's outlook: no model of its own; a burst of one of
  them beyond one replica's capacity gets the replicas an HPA would give it (`burst_replicas`).

Then the pure fleet planner (`plan_fleet`) decides every model's tier and node in one pass,
within each node's GPU and host memory and the fleet budget, the dense models' counts
included, the replicas their load needs now (`serving_replicas`) before any model's warmth.
Pure: history, step inputs, nodes and `now` are passed in; states are passed through.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping

import numpy as np

from forecasting.fleet.catalog import Catalog
from forecasting.fleet.estimate import ArrivalEstimator
from forecasting.fleet.planner import FleetContext, FleetNode, FleetParams, FleetPlan, FleetState, plan_fleet
from forecasting.planner import Decision, PlannerParams, PlannerState, StepInputs, holds_fall, step
from prewarm.core.planner_settings import PlannerSettings


@dataclass(frozen=True)
class RoundParams:
    """Knobs of a fleet round (``bucket_s``: the history's bucket and the planner's step)."""

    bucket_s: float = 60.0
    dense_rps: float = 1.0  # a model above this many requests/s over `dense_window_s` is sized by the count planner
    max_dense: int = 32  # ... the busiest this many at most
    dense_window_s: float = 3_600.0  # (`planner.fleet_dense_rps`, `planner.fleet_max_dense`, `planner.fleet_dense_window_s`)
    # the other models' count: their rate over the last `burst_hold_s` at `burst_target` of a replica's capacity, as
    # an HPA sizes (`planner.fleet_burst_target`, `planner.fleet_burst_hold_s`)
    burst_target: float = 0.7
    burst_hold_s: float = 300.0
    profile_bin_s: float = 1_800.0  # the estimator's time-of-day slot: the learned profile's (`planner.profile_bin_s`)
    season_s: float = 86_400.0  # ... and the period its slots repeat over (`planner.season_s`)
    fleet: FleetParams = field(default_factory=FleetParams)


@dataclass
class RoundState:
    """The fleet planner's memory price, and the arrival estimator with the models it is over and the end
    (epoch s) of the last bucket it has seen. (The dense models' count-planner states travel with their
    inputs: the live loop keeps them where a model planned alone keeps its own.)"""

    planner: FleetState = field(default_factory=FleetState)
    estimator: ArrivalEstimator | None = None
    models: tuple[str, ...] = ()
    seen_to: float | None = None
    dense: tuple[str, ...] = ()  # the models the last round sized by the count planner (known once `seen_to` is)


@dataclass(frozen=True)
class RoundResult:
    plan: FleetPlan
    dense: tuple[str, ...]
    replicas: Mapping[str, int]  # dense models: the replicas the count planner asks for; bursting others: `burst_replicas`
    rate: np.ndarray
    decisions: Mapping[str, Decision] = field(default_factory=dict)  # dense models: the count planner's decision
    states: Mapping[str, PlannerState] = field(default_factory=dict)  # ... and its next state


def round_settings(planner: PlannerSettings) -> dict[str, Any]:
    """The round's settings from the `planner` settings group: what the live round reads, for a replay to run with."""
    return {"profile_bin_s": float(planner.profile_bin_s), "season_s": float(planner.season_s),
            "dense_rps": float(planner.fleet_dense_rps), "max_dense": int(planner.fleet_max_dense),
            "dense_window_s": float(planner.fleet_dense_window_s), "burst_target": float(planner.fleet_burst_target),
            "burst_hold_s": float(planner.fleet_burst_hold_s)}


def price_settings(planner: PlannerSettings) -> dict[str, Any]:
    """The fleet planner's price settings from the `planner` settings group (`FleetParams` fields): the cold-start
    budget that steers it, its gain, and the count planner's calibration window and horizon, which its measure of
    an overspend shares."""
    return {"cold_start_budget": float(planner.cold_start_budget), "price_gain": float(planner.fleet_price_gain),
            "calibration_s": float(planner.budget_calibration_s), "horizon_s": float(planner.budget_horizon_s)}


def dense_models(counts: np.ndarray, catalog: Catalog, params: RoundParams,
                 holding: Collection[str] = ()) -> tuple[str, ...]:
    """The models the count planner sizes: the busiest over the last ``dense_window_s`` of ``counts`` (requests
    per bucket, oldest first), at least ``dense_rps``, then those of ``holding`` (`held_models`: the count planner
    holds their replicas through a fall), at most ``max_dense`` in all. A model's rate is over that
    window, or since its first request when that is later: the buckets before its traffic began (a model just deployed,
    the zeros a live history holds before the gateway counted) are not its rate."""
    if not counts.size or params.max_dense <= 0:
        return ()
    window = counts[-max(1, int(params.dense_window_s / params.bucket_s)):]
    active = window > 0
    first = np.where(active.any(axis=0), active.argmax(axis=0), window.shape[0] - 1)
    recent = window.sum(axis=0) / ((window.shape[0] - first) * params.bucket_s)
    busy = np.argsort(-recent, kind="stable")[:params.max_dense]
    chosen = [catalog.cards[int(i)].name for i in busy if recent[i] >= params.dense_rps]
    chosen += [name for name in catalog.names if name in holding and name not in chosen]
    return tuple(chosen[:params.max_dense])


def held_models(last: Collection[str], states: Mapping[str, PlannerState], planner: PlannerParams,
                now: float) -> tuple[str, ...]:
    """Of the models the last round sized (``last``), those whose count planner holds replicas through a fall at
    ``now`` (`forecasting.planner.holds_fall`). They stay with it until it lets them go: a model whose hour went
    quiet left the dense models while its planner held its replicas for the return, and the return (a silent
    client back at 50 requests/s) then met the one replica its outlook gave it (the pool replay of m-large's 40
    busiest clients: 78% of chunk-116's waits)."""
    return tuple(name for name in last if name in states and holds_fall(states[name], planner, now))


def burst_replicas(counts: np.ndarray, catalog: Catalog, params: RoundParams) -> dict[str, int]:
    """The models whose rate over the last ``burst_hold_s`` of ``counts`` needs more than one replica at
    ``burst_target`` of a replica's capacity, and how many: a burst of a model the count planner does not size
    (not dense yet: its hour was quiet) is served by as many replicas as an HPA would give it, not by one."""
    if not counts.size:
        return {}
    recent = counts[-max(1, int(math.ceil(params.burst_hold_s / params.bucket_s))):]
    rate = recent.max(axis=0) / params.bucket_s
    need = np.ceil(rate / (catalog.capacity_array * params.burst_target) - 1e-9)
    return {catalog.cards[int(i)].name: int(need[i]) for i in np.flatnonzero(need > 1)}


def serving_replicas(counts: np.ndarray, catalog: Catalog, replicas: Mapping[str, int],
                     bucket_s: float) -> dict[str, int]:
    """Of the models sized (``replicas``), the replicas their last bucket's rate needs at a replica's full
    capacity: the load now, without a forecast's margin or an HPA's headroom (at most what they are sized)."""
    if not counts.size:
        return {}
    need = np.ceil(counts[-1] / bucket_s / catalog.capacity_array - 1e-9)
    index = catalog.index
    return {m: min(n, int(need[index[m]])) for m, n in replicas.items() if need[index[m]] >= 1}


def estimator_from_history(counts: np.ndarray, params: RoundParams) -> ArrivalEstimator:
    """An estimator that has seen ``counts[t, model]`` (requests per bucket), oldest first."""
    est = ArrivalEstimator(counts.shape[1], params.bucket_s, slot_s=params.profile_bin_s, day_s=params.season_s)
    for row in counts:
        est.observe(row)
    return est


def _new_rows(n: int, end: float, params: RoundParams, models: tuple[str, ...], state: RoundState) -> int | None:
    """How many of the last of ``n`` buckets (ending at ``end``) the last round did not see (None: it saw other
    models, none, or does not reach back to them)."""
    seen = state.seen_to
    if seen is None or state.models != models:
        return None
    new = int(round((end - seen) / params.bucket_s))
    return new if 0 <= new <= n else None


def _estimator(counts: np.ndarray, new: int | None, params: RoundParams, state: RoundState) -> ArrivalEstimator:
    """The state's estimator fed the ``new`` last buckets of ``counts`` it has not seen, or one rebuilt from
    ``counts`` where it cannot be carried on (none yet, other models, or a gap in what it saw)."""
    if state.estimator is not None and new is not None:
        est = copy.deepcopy(state.estimator)  # the state passed in is left as it was (pure)
        for row in counts[counts.shape[0] - new:]:
            est.observe(row)
        return est
    return estimator_from_history(counts, params)


def _observed(counts: np.ndarray, waited: np.ndarray | None, new: int | None, planned: np.ndarray,
              bucket_s: float) -> tuple[float, float, float] | None:
    """(requests, requests that waited, seconds) of the ``planned`` models over the ``new`` last buckets: what
    the fleet planner's price is steered by (None: no counter, or nothing new since the last round). Planned: the
    models the round sizes no count for (not dense, not bursting); their waits are for a load or a wake, which
    warmth prevents. A sized model's wait for a slot is its count's, and warmth does not prevent it."""
    if waited is None or not new:
        return None
    rows = slice(counts.shape[0] - new, None)
    return float(counts[rows][:, planned].sum()), float(waited[rows][:, planned].sum()), new * bucket_s


def fleet_round(counts: np.ndarray, catalog: Catalog, nodes: tuple[FleetNode, ...], *, now: float,
                params: RoundParams, state: RoundState,
                dense: Mapping[str, tuple[StepInputs, PlannerState]] | None = None,
                waited: np.ndarray | None = None) -> tuple[RoundResult, RoundState]:
    """Plan every model of ``catalog`` from ``counts`` (complete buckets up to ``now``), in one pass; the models
    of ``dense`` (`dense_models`, with the count planner's inputs and state each) sized by `step`. ``waited``
    (the same shape: requests that waited for capacity, the gateway's counter) steers the memory price by the
    cold-start budget; only its buckets the last round did not see are read."""
    if counts.ndim != 2 or counts.shape[1] != len(catalog):
        raise ValueError(f"counts must be [buckets, {len(catalog)} models], got {counts.shape}")
    if waited is not None and waited.shape != counts.shape:
        raise ValueError(f"waited must be shaped as counts {counts.shape}, got {waited.shape}")
    unknown = sorted(set(dense or {}) - set(catalog.names))
    if unknown:
        raise ValueError(f"dense models not in the catalog: {', '.join(unknown)}")
    bucket = params.bucket_s
    end = math.floor(now / bucket) * bucket
    models = tuple(catalog.names)
    new = _new_rows(counts.shape[0], end, params, models, state)
    est = _estimator(counts, new, params, state)
    out = est.outlook()
    decisions: dict[str, Decision] = {}
    states: dict[str, PlannerState] = {}
    replicas: dict[str, int] = {name: n for name, n in burst_replicas(counts, catalog, params).items()
                                if name not in (dense or {})}
    known = state.seen_to is not None  # a round before this one recorded which models it sized
    for name, (inp, planner_state) in (dense or {}).items():
        if known and name not in state.dense:  # its margin sized none of the buckets since: not its misses
            planner_state = replace(planner_state, counted_end=None)
        decisions[name], states[name] = step(inp, planner_state)
        replicas[name] = max(1, decisions[name].cluster_target)
    ctx = FleetContext(now=now, catalog=catalog, nodes=nodes, rate=out.rate, burst_requests=out.burst_requests,
                       params=params.fleet, replicas=replicas,
                       serving=serving_replicas(counts, catalog, replicas, bucket),
                       observed=_observed(counts, waited, new, ~np.isin(models, tuple(replicas)), bucket))
    plan, planner_state_ = plan_fleet(ctx, state.planner)
    result = RoundResult(plan=plan, dense=tuple(dense or {}), replicas=replicas, rate=out.rate,
                         decisions=decisions, states=states)
    return result, RoundState(planner=planner_state_, estimator=est, models=models, seen_to=end, dense=result.dense)
