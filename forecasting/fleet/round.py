"""One planning round for a whole fleet, cheap enough for a thousand models per interval.

Refitting a gradient-boosting forecaster per model per round costs a fit per model (tens
to hundreds of milliseconds each): a thousand models would not fit in a 60 s round on two
cores. A round here shares what can be shared:

- every model's warmth outlook comes from one vectorised `ArrivalEstimator` over all
  series at once (idle-time hazards shrunk toward the histogram pooled over the fleet:
  one shared model for the sparse series), carried in the round's state and fed only the
  buckets completed since the last round; rebuilt from the history passed when the state
  has none (a restarted planner), the models changed, or the history does not reach back
  to what it last saw. The replay (`forecasting.fleet.policies.FleetPlanner`) and the live
  round (`workers.planning.fleet`) call this same function, so the replay scores what
  ships;
- only the dense models (the busiest, above ``dense_rps``, at most ``max_dense``) get
  their own quantile forecaster, and each is refit at most every ``refit_every_s``; between
  refits the fitted model predicts from the latest history (a prediction, not a fit);
- the long tail's forecast is the estimator's outlook: no model of its own.

Then the pure fleet planner decides every model's tier and node in one pass, with the
dense models' replica counts from their forecasts. Pure: history, nodes and `now` are
passed in; the fitted forecasters travel in the state.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd

from forecasting.fleet.catalog import Catalog
from forecasting.fleet.estimate import ArrivalEstimator
from forecasting.fleet.planner import FleetContext, FleetNode, FleetParams, FleetPlan, FleetState, plan_fleet


@dataclass(frozen=True)
class RoundParams:
    """Knobs of a fleet round (``bucket_s``: the history's bucket and the planner's step)."""

    bucket_s: float = 60.0
    horizon: int = 15
    quantile: float = 0.9
    headroom: float = 1.2
    dense_rps: float = 1.0
    max_dense: int = 32
    refit_every_s: float = 3600.0
    max_refits: int = 4  # fits per round at most (the stalest first), so refits never pile into one round
    fleet: FleetParams = field(default_factory=FleetParams)


@dataclass
class RoundState:
    """Fitted forecasters of the dense models (with their fit time), the planner's memory price, and the
    arrival estimator with the models it is over and the end (epoch s) of the last bucket it has seen."""

    forecasters: dict[str, Any] = field(default_factory=dict)
    fitted_at: dict[str, float] = field(default_factory=dict)
    planner: FleetState = field(default_factory=FleetState)
    estimator: ArrivalEstimator | None = None
    models: tuple[str, ...] = ()
    seen_to: float | None = None


@dataclass(frozen=True)
class RoundResult:
    plan: FleetPlan
    dense: tuple[str, ...]
    replicas: Mapping[str, int]
    refits: int
    rate: np.ndarray


def default_forecaster(quantile: float, bucket_s: float, horizon: int) -> Any:
    """The dense models' forecaster: `QuantileForecaster` (single thread)."""
    from forecasting.forecast.models import QuantileForecaster

    return QuantileForecaster(quantiles=tuple(sorted({0.5, quantile})), bucket_s=bucket_s, max_horizon=horizon,
                              max_iter=40, max_train_rows=3000)


def estimator_from_history(counts: np.ndarray, bucket_s: float) -> ArrivalEstimator:
    """An estimator that has seen ``counts[t, model]`` (requests per bucket), oldest first."""
    est = ArrivalEstimator(counts.shape[1], bucket_s)
    for row in counts:
        est.observe(row)
    return est


def _estimator(counts: np.ndarray, end: float, bucket_s: float, models: tuple[str, ...],
               state: RoundState) -> ArrivalEstimator:
    """The state's estimator fed the buckets of ``counts`` (ending at ``end``) it has not seen, or one rebuilt
    from ``counts`` where it cannot be carried on (none yet, other models, or a gap in what it saw)."""
    seen = state.seen_to
    if state.estimator is not None and seen is not None and state.models == models:
        new = int(round((end - seen) / bucket_s))
        if 0 <= new <= counts.shape[0]:
            est = copy.deepcopy(state.estimator)  # the state passed in is left as it was (pure)
            for row in counts[counts.shape[0] - new:]:
                est.observe(row)
            return est
    return estimator_from_history(counts, bucket_s)


def fleet_round(counts: np.ndarray, catalog: Catalog, nodes: tuple[FleetNode, ...], *, now: float,
                params: RoundParams, state: RoundState,
                make_forecaster: Callable[[float, float, int], Any] = default_forecaster) -> tuple[RoundResult, RoundState]:
    """Plan every model of ``catalog`` from ``counts`` (complete buckets up to ``now``), in one pass."""
    if counts.ndim != 2 or counts.shape[1] != len(catalog):
        raise ValueError(f"counts must be [buckets, {len(catalog)} models], got {counts.shape}")
    bucket = params.bucket_s
    end = math.floor(now / bucket) * bucket
    models = tuple(catalog.names)
    est = _estimator(counts, end, bucket, models, state)
    out = est.outlook()
    recent = counts[-max(1, int(3600 / bucket)):].mean(axis=0) / bucket if counts.size else np.zeros(len(catalog))
    busy = np.argsort(-recent, kind="stable")[:params.max_dense]
    dense = [int(i) for i in busy if recent[i] >= params.dense_rps]
    forecasters = {k: v for k, v in state.forecasters.items() if k in {catalog.cards[i].name for i in dense}}
    fitted_at = {k: v for k, v in state.fitted_at.items() if k in forecasters}
    replicas: dict[str, int] = {}
    refits = 0
    start = end - bucket * counts.shape[0]
    index = pd.Index(start + bucket * np.arange(counts.shape[0], dtype=float), name="ts")
    due = sorted((fitted_at.get(catalog.cards[i].name, -math.inf), i) for i in dense
                 if now - fitted_at.get(catalog.cards[i].name, -math.inf) >= params.refit_every_s)
    refit = {i for _, i in due[:params.max_refits]}
    hour = max(1, int(3600 / bucket))
    for i in dense:
        card = catalog.cards[i]
        y = pd.Series(counts[:, i] / bucket, index=index)
        if i in refit:
            forecasters[card.name] = make_forecaster(params.quantile, bucket, params.horizon).fit(y)
            fitted_at[card.name] = now
            refits += 1
        model = forecasters.get(card.name)
        if model is not None:
            fc = model.predict(y, params.horizon)
            col = f"q{params.quantile:g}"
            peak = float(fc[col].max()) if col in fc.columns else float(fc.iloc[:, -1].max())
        else:  # not fitted yet (its turn comes): the last hour's peak stands in
            peak = float(counts[-hour:, i].max() / bucket)
        replicas[card.name] = max(1, int(math.ceil(peak * params.headroom / card.capacity_rps - 1e-9)))
    ctx = FleetContext(now=now, catalog=catalog, nodes=nodes, rate=out.rate, burst_requests=out.burst_requests,
                       params=params.fleet, replicas=replicas)
    plan, planner_state = plan_fleet(ctx, state.planner)
    result = RoundResult(plan=plan, dense=tuple(catalog.cards[i].name for i in dense), replicas=replicas,
                         refits=refits, rate=out.rate)
    return result, RoundState(forecasters=forecasters, fitted_at=fitted_at, planner=planner_state, estimator=est,
                              models=models, seen_to=end)
