"""The count planner's inputs for a pool's dense models in the replay, built as the live loop builds them.

Live, `workers.planning.forecast.inputs` reads a model's fine counters from the gateway
(requests, peak and busy slots in flight, requests that waited), its live replicas and its
measured cold start. The pool replay (`forecasting.fleet.simulate`) has, per step and per
model, the requests that arrived, the replicas on GPU, the requests that waited for a load,
a wake or a slot and those still queued at the step's end; `DenseInputs` keeps those and
builds the same `StepInputs` from them, one fine bucket per replay step (a step's peak in
flight is its rate times a request's service time, `ModelSpec.slots / capacity_rps`, plus
its queue, as the gateway counts queued requests in flight; the replay has no finer
counters), with the p95 of the loads the replay charged the model as its cold start (the
registry's `load_time_p95` of the loads it recorded; the planner's default before the
first), not the catalog's exact time. Each model's `PlannerState` and warm pool are
carried between rounds, as the live loop keeps them per model.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import numpy as np

from forecasting.fleet.catalog import Catalog, Tier
from forecasting.fleet.round import RoundParams, RoundResult
from forecasting.planner import (
    PlannerParams,
    PlannerState,
    ReplicaCounts,
    StepInputs,
    lead_of,
    observed_from_counts,
    recent_span_s,
    refit_due,
)
from prewarm.core.domain import ModelSpec
from prewarm.core.keys import LOADTIMES_KEEP
from prewarm.policy.load_times import load_time_p95



class DenseInputs:
    """What the replay has seen per model, and the count planner's state per dense model."""

    def __init__(self, catalog: Catalog, step_s: float, params: RoundParams, *, cold_start_budget: float) -> None:
        dt = step_s
        self.step_s = dt
        self.params = PlannerParams(bucket_s=dt, fine_bucket_s=dt, interval_s=dt, cold_start_budget=cold_start_budget,
                                    profile_bin_s=params.profile_bin_s, season_s=params.season_s)
        self.window_steps = max(1, int(math.ceil(params.dense_window_s / dt)))
        self.cards = catalog.cards
        m = len(self.cards)
        self.requests = np.zeros((1024, m))
        self.waited = np.zeros((1024, m))
        self.queued = np.zeros((1024, m))
        self.n = 0
        self.live = np.zeros(m, dtype=np.int64)
        self.states: dict[str, PlannerState] = {}
        self.pools: dict[str, int] = {}
        self.specs: dict[str, ModelSpec] = {}
        # per model: its last loads' times (`Registry.load_time_p95`), and per tier its last wakes' and loads'
        # (`Registry.ready_time_p95`), as the registry keeps them
        self.load_s: dict[str, deque[float]] = {}
        self.tier_s: dict[tuple[str, Tier], deque[float]] = {}

    def loaded(self, records: Sequence[tuple[int, Tier, float]]) -> None:
        """Wakes and loads a replayed step started: (model index, the tier it came from, seconds to ready)."""
        for i, tier, seconds in records:
            name = self.cards[i].name
            self.tier_s.setdefault((name, tier), deque(maxlen=LOADTIMES_KEEP)).append(seconds)
            if tier is not Tier.ASLEEP:  # a wake is not a load
                self.load_s.setdefault(name, deque(maxlen=LOADTIMES_KEEP)).append(seconds)

    def load_time_p95(self, name: str) -> float | None:
        return load_time_p95(self.load_s.get(name, ()))

    def tier_p95(self, name: str) -> dict[Tier, float]:
        """The p95 time to ready from each tier `name` was measured from."""
        out = {tier: load_time_p95(self.tier_s.get((name, tier), ())) for tier in (Tier.ASLEEP, Tier.CACHED, Tier.DISK)}
        return {tier: v for tier, v in out.items() if v is not None}

    def observe(self, counts: np.ndarray, replicas: np.ndarray | None, waited: np.ndarray | None,
                queued: np.ndarray | None = None) -> None:
        """A replayed step: requests per model, replicas on GPU, requests that waited, requests queued at its end."""
        if self.n == self.requests.shape[0]:
            self.requests, self.waited, self.queued = (np.concatenate([a, np.zeros_like(a)])
                                                       for a in (self.requests, self.waited, self.queued))
        self.requests[self.n] = counts
        if waited is not None:
            self.waited[self.n] = waited
        if queued is not None:
            self.queued[self.n] = queued
        if replicas is not None:
            self.live = np.asarray(replicas, dtype=np.int64).copy()
        self.n += 1

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps the dense models are chosen over (`dense_models`), oldest first: requests and requests that
        waited, per model."""
        rows = slice(max(0, self.n - self.window_steps), self.n)
        return self.requests[rows], self.waited[rows]

    def inputs(self, i: int, now: float) -> tuple[StepInputs, PlannerState]:
        """Model ``i``'s step inputs at ``now`` (the replay's seconds) from the steps before it, and its state."""
        card, p, dt = self.cards[i], self.params, self.step_s
        spec = self.specs.get(card.name)
        if spec is None:
            spec = self.specs[card.name] = ModelSpec(card.name, "replay", capacity_rps=card.capacity_rps)
        state = self.states.get(card.name, PlannerState())
        cold = self.load_time_p95(card.name)  # None before its first load: the planner's default
        lo = max(0, self.n - int(math.ceil(recent_span_s(state, p, lead_of(p, cold)) / dt)))
        req = self.requests[lo:self.n, i]
        service_s = spec.slots / spec.capacity_rps
        # in flight as the gateway counts it: those being served and those queued for a slot
        observed = observed_from_counts(lo * dt, dt, req, req / dt * service_s + self.queued[lo:self.n, i],
                                        req * service_s, self.waited[lo:self.n, i])
        history = None
        if refit_due(state, now, p):
            lc = max(0, self.n - int(p.history_s // dt))
            history = (lc * dt, dt, self.requests[lc:self.n, i] / dt)
        live = int(self.live[i])
        warm = min(self.pools.get(card.name, 0), live)
        counts = ReplicaCounts(ready=live - warm, loading=0, warm=warm)
        return StepInputs(spec, now, observed, counts, p, cold, history), state

    def carry(self, result: RoundResult) -> None:
        """Keep each dense model's next state and warm pool (the decision's)."""
        self.states.update(result.states)
        self.pools.update({name: d.pool_target for name, d in result.decisions.items()})
