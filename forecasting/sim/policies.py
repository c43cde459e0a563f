"""The scaling policies the trace replay compares; each only says how many replicas to keep.

Every policy sees the same `Observation` (the past and the present, never the future) on
its own decision period and returns the number of live replicas it wants; the engine in
`forecasting.sim.simulate` carries that out the same way for all. The exception is `oracle`,
which is handed the future on purpose: it is the reference, not a contender.

- `reactive`: the Kubernetes HPA algorithm on slot utilization (busy + queued requests per
  slot), target 70%, 15 s sync, 10% tolerance, scale-up at once (paying the cold start),
  scale-down to the highest recommendation of the last 300 s (the stabilization window).
- `reactive_sized`: the forecast-free ablation of `prewarm`: the planner's own square-root
  sizing and 10 s cadence over the last observation, a 60 s scale-down window (see the class).
- `fixed_pool`: reactive plus a warm pool of 10% of its recommendation (at least one).
- `keepalive`: the hybrid histogram policy of "Serverless in the Wild" (Shahrad et al.,
  USENIX ATC'20), adapted from function instances to replica counts: replica level k
  (the k-th replica) is "invoked" while the HPA recommendation is >= k; each level keeps
  a histogram of its idle times (1-minute bins over 4 hours). When the histogram is
  representative (enough samples, bin-count CV >= 2), a level that goes idle is unloaded
  and loaded again one cold start before the head (5th percentile, -10%) of its idle
  times, and kept until the tail (99th percentile, +10%); otherwise it is kept alive for
  a fixed window (the paper's conservative fallback: the histogram range, 4 hours). The
  paper's ARIMA branch for idle times beyond the range is replaced by that fallback.
- `prewarm`: the shipped planner (`forecasting.planner.step`), called every `interval_s`
  with inputs built from the counters a gateway would have recorded by then (requests and
  peak requests in flight per fine bucket, the coarse rate for the seasonal profile),
  exactly as the live `forecast_and_plan` builds them. Nothing else: no simulated HPA
  floor, no peak hold; what the planner decides is what the replay keeps.
- `prewarm_fixed_margin` (an ablation, run only when named): `prewarm` with its cold-start
  budget's feedback off and its staffing margin fixed (`margin`). Against `prewarm` at equal
  share it says what the feedback costs or buys; against `reactive_sized` at the same margin,
  what the forecast buys with the feedback out of the way.
- `oracle`: knows the instant-service need second by second; keeps what is needed within
  one cold start ahead. A loose lower bound on GPU time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from forecasting.calibration import sizing
from forecasting.planner import (
    Decision,
    PlannerParams,
    PlannerState,
    ReplicaCounts,
    StepInputs,
    lead_of,
    observed_from_counts,
    recent_span_s,
    refit_due,
    step,
)
from forecasting.budget import replicas_needed
from forecasting.sim.interface import Observation, Policy, PolicyEnv
from forecasting.sim.loads import cold_start_p95
from forecasting.sim.workload import SimParams
from prewarm.core.domain import ModelSpec

POLICIES = ("reactive", "reactive_sized", "fixed_pool", "keepalive", "prewarm", "oracle")
ABLATIONS = ("prewarm_fixed_margin",)  # replayed only when named
KNOWN = POLICIES + ABLATIONS


class Reactive(Policy):
    """HPA: desired = ceil(load / (slots x target)), tolerance, scale-down stabilization."""

    name = "reactive"

    def __init__(self, target: float = 0.7, sync_s: float = 15.0, stabilization_s: float = 300.0,
                 tolerance: float = 0.1, min_replicas: int = 1) -> None:
        self.target, self.period_s, self.stabilization_s = target, sync_s, stabilization_s
        self.tolerance, self.min_replicas = tolerance, min_replicas
        self._recs: deque[tuple[float, int]] = deque()
        self._slots = 8

    def start(self, env: PolicyEnv) -> int:
        self._slots = env.params.slots
        self._recs.clear()
        return self._raw(env.initial_load(), 0)

    def _raw(self, load: float, current: int) -> int:
        per = self._slots * self.target
        if current > 0 and abs(load / (current * per) - 1.0) <= self.tolerance:
            return current
        return max(self.min_replicas, math.ceil(round(load / per, 9)))

    def recommend(self, obs: Observation, current: int | None = None) -> int:
        """The HPA's recommendation; `current` defaults to the live replicas."""
        current = obs.ready + obs.loading if current is None else current
        rec = self._raw(obs.load_mean, current)
        self._recs.append((obs.now, rec))
        while self._recs and self._recs[0][0] < obs.now - self.stabilization_s:
            self._recs.popleft()
        if rec >= current:
            return rec
        return min(current, max(r for _, r in self._recs))

    def decide(self, obs: Observation) -> int:
        return self.recommend(obs)


class FixedPool(Reactive):
    """Reactive plus `percent` of its recommendation kept warm (at least `minimum`)."""

    name = "fixed_pool"

    def __init__(self, percent: float = 10.0, minimum: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.percent, self.minimum = percent, minimum

    def _pool(self, n: int) -> int:
        return max(self.minimum, math.ceil(round(self.percent / 100.0 * n, 9)))

    def start(self, env: PolicyEnv) -> int:
        self._serving = super().start(env)
        return self._serving + self._pool(self._serving)

    def decide(self, obs: Observation) -> int:
        # the HPA scales the serving replicas; the pool rides on top
        self._serving = self.recommend(obs, current=self._serving)
        return self._serving + self._pool(self._serving)


@dataclass
class _Level:
    idle_since: float | None = None
    bins: np.ndarray = field(default_factory=lambda: np.zeros(240))
    samples: int = 0
    oob: int = 0
    window: tuple[float, float] = (0.0, 0.0)  # (load at, keep until), relative to idle_since


class KeepAlive(Policy):
    """Hybrid histogram keep-alive per replica level (see the module docstring)."""

    name = "keepalive"

    def __init__(self, target: float = 0.7, sync_s: float = 15.0, bin_s: float = 60.0, bins: int = 240,
                 head: float = 0.05, tail: float = 0.99, margin: float = 0.1, min_samples: int = 10,
                 cv_threshold: float = 2.0, fixed_keepalive_s: float = 4 * 3600.0) -> None:
        self.target, self.period_s = target, sync_s
        self.bin_s, self.nbins, self.head, self.tail, self.margin = bin_s, bins, head, tail, margin
        self.min_samples, self.cv_threshold, self.fixed_keepalive_s = min_samples, cv_threshold, fixed_keepalive_s
        self.levels: list[_Level] = []
        self._slots = 8
        self._cold = 8.7

    def start(self, env: PolicyEnv) -> int:
        self._slots, self._cold = env.params.slots, env.params.cold_start_s
        self.levels = []
        return max(1, math.ceil(round(env.initial_load() / (self._slots * self.target), 9)))

    def windows(self, lv: _Level) -> tuple[float, float]:
        """(pre-warm load time, keep-alive end) after an idle start, from the level's histogram."""
        counts = lv.bins
        representative = lv.samples >= self.min_samples and lv.oob <= lv.samples - lv.oob
        if representative:
            mean = counts.mean()
            representative = mean > 0 and counts.std() / mean >= self.cv_threshold
        if not representative:
            return 0.0, self.fixed_keepalive_s
        cdf = np.cumsum(counts) / counts.sum()
        head_edge = float(np.searchsorted(cdf, self.head)) * self.bin_s  # lower edge of the head bin
        tail_edge = float(np.searchsorted(cdf, self.tail) + 1) * self.bin_s  # upper edge of the tail bin
        prewarm = head_edge * (1 - self.margin)
        keep_until = tail_edge * (1 + self.margin)
        if prewarm <= self._cold:
            return 0.0, keep_until  # too close to unload and reload: keep it
        return prewarm - self._cold, keep_until

    def decide(self, obs: Observation) -> int:
        active = max(1, math.ceil(round(obs.load_mean / (self._slots * self.target), 9)))
        while len(self.levels) < active:
            self.levels.append(_Level())
        want = 0
        for k, lv in enumerate(self.levels, start=1):
            if k <= active:
                if lv.idle_since is not None:
                    idle = obs.now - lv.idle_since
                    b = int(idle // self.bin_s)
                    if b < self.nbins:
                        lv.bins[b] += 1
                    else:
                        lv.oob += 1
                    lv.samples += 1
                    lv.idle_since = None
                want += 1
                continue
            if lv.idle_since is None:
                lv.idle_since = obs.now
                lv.window = self.windows(lv)
            since = obs.now - lv.idle_since
            load_at, keep_until = lv.window
            if load_at == 0.0 and since < keep_until or load_at > 0.0 and load_at <= since < keep_until:
                want += 1
        return want


class ReactiveSized(Policy):
    """The forecast-free ablation: the planner's own sizing and cadence with the forecast replaced by the last observation.

    Every `interval_s` (the planner's beat) it takes the mean requests in flight since its last
    decision (busy + queued, what the gateway's busy time per fine bucket says) as the load `a`,
    and keeps the planner's square-root staffing of it, `a + queue_beta x sqrt(a)` slots (with
    the planner's headroom and `min_serving`). No profile, no phase logic, no quantiles, nothing
    learned. A scale-down waits until the need has stayed lower for `window_s` (it would flap
    on every bucket otherwise); a scale-up acts at once. It answers "what does the forecast
    add": what prewarm gains over it is the forecast's, what it gains over `reactive` is sizing.
    """

    name = "reactive_sized"

    def __init__(self, planner: PlannerParams | None = None, planner_settings: Any = None, window_s: float = 60.0,
                 **overrides: Any) -> None:
        if planner is None:
            planner = PlannerParams.from_settings(planner_settings) if planner_settings is not None else PlannerParams()
        self.params = replace(planner, **overrides) if overrides else planner
        if window_s < 0:
            raise ValueError(f"reactive_sized window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self.period_s = self.params.interval_s
        self._needs: deque[tuple[float, int]] = deque()
        self._slots = 8

    def _need(self, load: float) -> int:
        p = self.params
        sized = load + p.queue_beta * math.sqrt(max(load, 0.0))
        return max(p.min_serving, replicas_needed(sized, self._slots, p.headroom))

    def start(self, env: PolicyEnv) -> int:
        self._slots = env.params.slots
        self._needs.clear()
        return self._need(env.initial_load())

    def decide(self, obs: Observation) -> int:
        need = self._need(obs.load_mean)
        self._needs.append((obs.now, need))
        while self._needs and self._needs[0][0] < obs.now - self.window_s:
            self._needs.popleft()
        live = obs.ready + obs.loading
        if need >= live:
            return need
        return min(live, max(n for _, n in self._needs))


class Oracle(Policy):
    """Knows the future need; starts each replica one worst-case load (+2 s) before the need reaches it.

    A replica's worst-case load is the slowest cold start plus, for each replica ahead of it on its node, one more
    weight transfer (a node's transfers are ordered or share its bandwidth, `forecasting.sim.loads`; credited
    snapshot copies take `snapshot_ratio` of one). Replicas pack nodes in start order, so the j-th replica of the
    need is ((j - 1) mod gpus_per_node)-th in its node's line when the nodes fill from the first (replicas retired
    in between can leave free GPUs that put more in one line, docs/simulator.md): its lead
    is read from that position, and a step that needs a node's worth of replicas at once starts them earlier.
    """

    name = "oracle"
    period_s = 1.0

    def start(self, env: PolicyEnv) -> int:
        need = env.work.need
        self._want: list[int] = oracle_want(need, env.params).tolist() if need.size else []
        return int(self._want[0]) if self._want else 0

    def decide(self, obs: Observation) -> int:
        t = int(obs.now)
        return self._want[t] if t < len(self._want) else 0


def oracle_want(need: np.ndarray, params: SimParams) -> np.ndarray:
    """The replicas the oracle keeps live each second: the largest j that its lead (`Oracle`) sees needed."""
    cold = max(params.cold_starts_s) if params.cold_starts_s else params.cold_start_s * (1 + 3 * params.cold_start_cv)
    gpn = params.gpus_per_node
    transfer = cold * params.load_share * (params.snapshot_ratio if params.snapshot_ratio is not None else 1.0)
    want = np.zeros(need.size, dtype=np.int64)
    for q in range(gpn):  # the replicas with q ahead of them on their node: j = q + 1, q + 1 + gpn, ...
        ahead = int(math.ceil(cold + q * transfer + params.actuation_delay_s)) + 2
        padded = np.concatenate([need, np.zeros(ahead - 1, dtype=need.dtype)])
        most = np.lib.stride_tricks.sliding_window_view(padded, ahead).max(axis=1).astype(np.int64)
        top = most - np.mod(most - 1 - q, gpn)  # the largest j <= most at node position q
        want = np.maximum(want, np.where(most >= q + 1, top, 0))
    return want


class Prewarm(Policy):
    """The shipped planner (`forecasting.planner.step`) on the counters a gateway would have recorded.

    Every `interval_s` (the live beat period) it builds the step's inputs exactly as the
    live `forecast_and_plan` does (`forecasting.planner.observed_from_counts` over the
    complete fine buckets before now: requests and peak requests in flight; the busy time so
    far in the bucket in progress; the coarse request rates for the seasonal profile when a
    refit is due), with the replica counts
    the replay has now, and keeps what the decision says: the serving target plus the warm
    pool. No other floor: no simulated HPA, no peak hold. `record=True` keeps every
    decision (the equivalence test compares them with the live path's).
    """

    name = "prewarm"

    def __init__(self, planner: PlannerParams | None = None, planner_settings: Any = None, record: bool = False,
                 plan_from_s: float = 0.0, model_name: str = "trace", **overrides: Any) -> None:
        if planner is None:
            planner = PlannerParams.from_settings(planner_settings) if planner_settings is not None else PlannerParams()
        self.params = replace(planner, **overrides) if overrides else planner
        self.period_s = self.params.interval_s
        self.record = record
        # the planner's first step (trace seconds): before it the replay keeps its starting replicas, as when
        # a live planner started after the traffic it plans from (`prewarm up --history`). That planner starts
        # on an empty stack, so from its first step on it sees only its own replicas: those the replay held
        # before (`inherited`) serve until its own are ready, then go
        self.plan_from_s = plan_from_s
        self.inherited: int | None = None
        self.model_name = model_name  # the planned model's name: batch jobs apply to the model they name
        self.decisions: list[tuple[float, ReplicaCounts, Decision]] = []
        self.modes: dict[str, int] = {}

    def start(self, env: PolicyEnv) -> int:
        self.env = env
        w, p = env.work, self.params
        fb, cb = int(p.fine_bucket_s), int(p.bucket_s)
        peak = w.peak if w.peak is not None else w.counts * w.mean_service_s
        nf = w.counts.size // fb
        self.fine_req = w.counts[: nf * fb].reshape(nf, fb).sum(axis=1)
        self.fine_peak = peak[: nf * fb].reshape(nf, fb).max(axis=1)
        self.peak_s = peak  # per second: the peak so far of the bucket in progress
        # busy seconds per fine bucket: estimated from the arrivals until the replay has observed the bucket
        busy = w.busy if w.busy is not None else w.counts * w.mean_service_s
        self.fine_busy = busy[: nf * fb].reshape(nf, fb).sum(axis=1).astype(np.float64)
        self.fine_waited = np.zeros(nf)  # requests that waited for capacity: filled as the replay observes them
        nc = w.counts.size // cb
        self.coarse_rate = w.counts[: nc * cb].reshape(nc, cb).sum(axis=1) / cb
        self.epoch = w.start_epoch
        self.slots = env.params.slots
        self.model = ModelSpec(name=self.model_name, revision="replay", slots=self.slots)
        # what the planner knows of cold starts: the running p95 of those it has seen (the live registry's
        # load_time_p95; the default before the first), or, with planner_cold_start="exact", the model's own p95
        self.running_cold = env.params.planner_cold_start == "running"
        self.cold_p95: float | None = None if self.running_cold else cold_start_p95(env.params)
        self.state = PlannerState()
        self.pool = 0
        self.decisions = []
        self.modes = {}
        self.inherited = None
        self._replayed_bucket = -1
        # as if it had been running, as every policy starts: the first minute's load sized as its first step sizes
        # a load, with the margin it starts from (sized without it, the replay handed it fewer replicas than any
        # baseline starts with, and counted the waits of that start as its misses)
        staffed = sizing(False, p.margin_initial, p.queue_beta)
        return max(p.min_serving, replicas_needed(staffed(env.initial_load()), self.slots, p.headroom))

    def _observe(self, obs: Observation) -> None:
        """The time since the last decision, as the gateway counts it: requests in flight include those
        waiting for a slot, so a shortfall shows as load (and its backlog gets capacity) — the replay's own
        mean of busy + queued requests, credited to the fine bucket that span lies in, when the decision
        period divides the fine bucket (the live demo plans every 5 s on 10 s buckets); otherwise the
        estimate from the arrivals stays."""
        fb, per = self.params.fine_bucket_s, obs.period_s
        start = obs.now - per
        if per <= 0 or start < -1e-9 or abs(round(fb / per) * per - fb) > 1e-9:
            return
        k = int(math.floor(start / fb + 1e-9))
        if not 0 <= k < self.fine_busy.size or int(math.floor((obs.now - 1e-9) / fb)) != k:
            return  # the span straddles two buckets: decisions are not on the period's grid
        if k != self._replayed_bucket:
            self.fine_busy[k] = 0.0  # the first span of this bucket: the replay's figures replace the estimate
            self._replayed_bucket = k
        self.fine_busy[k] += obs.load_mean * per
        # the waits seen since the last decision, in the bucket that just ended (any cadence)
        kw = int(math.ceil(round(obs.now / fb, 9))) - 1
        if 0 <= kw < self.fine_waited.size:
            self.fine_waited[kw] += obs.waited

    def inputs(self, now: float, ready: int, loading: int) -> StepInputs:
        """The step's inputs at `now` (trace seconds), from the past only: what the live task reads from Redis."""
        p = self.params
        fb, cb = p.fine_bucket_s, p.bucket_s
        lead = lead_of(p, self.cold_p95)
        nb = min(int(now // fb), self.fine_req.size)
        lo = max(0, nb - int(math.ceil(recent_span_s(self.state, p, lead) / fb)))
        # the bucket in progress: the busy time the replay has credited to it so far, as the gateway's flushes have
        current = None
        if self._replayed_bucket == nb < self.fine_busy.size:
            first = int(nb * fb)  # the peak so far: the seconds begun since the bucket began (one at least)
            current = (float(self.fine_busy[nb]), now - nb * fb, float(self.peak_s[first: max(first + 1, int(now))].max()))
        observed = observed_from_counts(self.epoch + lo * fb, fb, self.fine_req[lo:nb], self.fine_peak[lo:nb],
                                        self.fine_busy[lo:nb], self.fine_waited[lo:nb], current)
        history = None
        if refit_due(self.state, self.epoch + now, p):
            nc = min(int(now // cb), self.coarse_rate.size)
            lc = max(0, nc - int(p.history_s // cb))
            history = (self.epoch + lc * cb, cb, self.coarse_rate[lc:nc])
        live = ready + loading
        warm = min(self.pool, live)
        counts = ReplicaCounts(ready=max(0, ready - warm), loading=loading, warm=warm)
        return StepInputs(self.model, self.epoch + now, observed, counts, p, self.cold_p95, history)

    def decide(self, obs: Observation) -> int:
        self._observe(obs)
        if self.running_cold:
            self.cold_p95 = obs.cold_start_p95_s
        if obs.now < self.plan_from_s:
            return obs.ready + obs.loading
        if self.inherited is None:
            self.inherited = obs.ready + obs.loading if self.plan_from_s > 0 else 0
        own = max(0, obs.ready + obs.loading - self.inherited)
        loading = min(obs.loading, own)
        inputs = self.inputs(obs.now, own - loading, loading)
        decision, self.state = step(inputs, self.state)
        self.pool = decision.pool_target
        self.modes[decision.mode] = self.modes.get(decision.mode, 0) + 1
        if self.record:
            self.decisions.append((obs.now, inputs.replicas, decision))
        want = decision.target + decision.pool_target
        if self.inherited and (own - loading >= want or (own > 0 and loading == 0)):
            self.inherited = 0  # the planner's own replicas are ready: the ones held before it go
        return want + self.inherited


class PrewarmFixedMargin(Prewarm):
    """`prewarm` without its budget's feedback: the staffing margin stays at `margin` (no cold-start budget)."""

    name = "prewarm_fixed_margin"

    def __init__(self, margin: float = PlannerParams().margin_initial, **kw: Any) -> None:
        super().__init__(**kw, cold_start_budget=1.0, margin_initial=float(margin))


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy by name (one of `KNOWN`: the `POLICIES` and the `ABLATIONS`)."""
    classes: dict[str, Callable[..., Policy]] = {
        "reactive": Reactive, "reactive_sized": ReactiveSized, "fixed_pool": FixedPool, "keepalive": KeepAlive, "prewarm": Prewarm,
        "prewarm_fixed_margin": PrewarmFixedMargin, "oracle": Oracle,
    }
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(KNOWN)}")
    return classes[name](**kw)
