"""The scaling policies the trace replay compares; each only says how many replicas to keep.

Every policy sees the same `Observation` (the past and the present, never the future) on
its own decision period and returns the number of live replicas it wants; the engine in
`forecasting.sim.simulate` carries that out the same way for all. The exception is `oracle`,
which is handed the future on purpose: it is the reference, not a contender.

- `reactive`: the Kubernetes HPA algorithm on slot utilization (busy + queued requests per
  slot), target 70%, 15 s sync, 10% tolerance, scale-up at once (paying the cold start),
  scale-down to the highest recommendation of the last 300 s (the stabilization window).
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
- `prewarm`: this project's forecaster and planner on the history before each decision
  (refit as history doubles, then every 2 days; forecasts every 15 minutes, plans every
  minute), acting through the HPA: it raises the floor the HPA (15 s sync) may not go
  below, like raising `minReplicas` ahead of a peak. The signal is the peak in-flight
  demand (arrivals spread over the mean service time, from past arrivals only), planned
  with every slot busy: bursts within a minute are what cause cold starts, and a mean
  rate hides them (`signal="mean"` plans the mean rate at the HPA's target instead).
  Three floors, the most of which is kept: the HPA; the peak hold (the replicas for the
  highest in-flight second of the last `peak_hold_s`: LLM bursts go from idle to several
  replicas within seconds, faster than a cold start, and recur within minutes); the
  planner's serving target (a persistence forecast until the model has history). On top,
  the planner's warm pool and the forecast's capacity above the first two floors, both
  within the warm budget (`budgeted_extra`). See `Prewarm` for the why of each part.
- `oracle`: knows the instant-service need second by second; keeps what is needed within
  one cold start ahead. A loose lower bound on GPU time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

from forecasting.planner import PlanContext, PlannerParams, PlannerState, ReplicaCounts, plan
from forecasting.sim.interface import Observation, Policy, PolicyEnv
from prewarm.core.domain import ModelSpec

POLICIES = ("reactive", "fixed_pool", "keepalive", "prewarm", "oracle")


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


class Oracle(Policy):
    """Knows the future need; keeps the most needed within one cold start (+2 s) ahead."""

    name = "oracle"
    period_s = 1.0

    def start(self, env: PolicyEnv) -> int:
        self._need = env.work.need
        cold = env.params.cold_start_s * (1 + 3 * env.params.cold_start_cv)
        self._ahead = int(math.ceil(cold)) + 2
        if not self._need.size:
            self._want: list[int] = []
            return 0
        padded = np.concatenate([self._need, np.zeros(self._ahead - 1, dtype=self._need.dtype)])
        # the most needed in [t, t + ahead): a sliding maximum, computed once
        self._want = np.lib.stride_tricks.sliding_window_view(padded, self._ahead).max(axis=1).tolist()
        return int(self._want[0])

    def decide(self, obs: Observation) -> int:
        t = int(obs.now)
        return self._want[t] if t < len(self._want) else 0


ForecasterFactory = Callable[[], Any]


def budgeted_extra(base: int, pool: int, plan_extra: int, share: float) -> int:
    """Replicas to add on top of `base` (the need the past showed): pool, then forecast extra.

    Warm capacity beyond need may be at most `share` of the total, so on top of `base`
    replicas at most floor(base x share / (1 - share)); the pool comes first (the planner
    sized it against its own need), then the forecast's extra over `base` (`plan_extra`,
    may be negative: nothing to add).
    """
    if share >= 1.0:
        return pool + max(0, plan_extra)
    allowed = int(math.floor(round(base * share / (1.0 - share), 9)))
    kept_pool = min(pool, allowed)
    return kept_pool + max(0, min(plan_extra, allowed - kept_pool))


def default_forecaster(quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> Any:
    from forecasting.forecast.models import QuantileForecaster

    return QuantileForecaster(quantiles=quantiles, bucket_s=60.0, max_horizon=30)


class Prewarm(Policy):
    """Peak hold + forecast plan + budgeted warm pool, on the past only (module docstring).

    Each decision (every `sync_s`) takes the most of three serving floors and adds the pool:

    1. the HPA's recommendation on the mean load (15 s sync, 300 s stabilization): what the
       cluster's own autoscaler would keep anyway;
    2. the peak hold: the replicas the highest per-second in-flight demand of the last
       `peak_hold_s` needs with every slot busy. Request-level LLM traffic comes in bursts
       that go from idle to several replicas' worth within seconds, faster than a cold
       start, and recur within minutes: capacity dropped in a gap is paid back as a cold
       start at the next burst. A mean rate, or the HPA's 300 s window on it, hides this;
    3. the planner's serving target from the forecast of each bucket's peak demand
       (quantile `planner.quantile`): scale-ups a lead ahead of forecast rises, holds
       through forecast dips (the dynamic warmup trigger). Until the forecaster has
       `min_history_buckets` of history the forecast is the persistence forecast (the
       highest bucket peak seen so far, flat), so the plan and its pool run from t=0.

    The planner keeps its own serving count (it plans against what it decided, not against
    replicas the other floors added, which it would otherwise hold for another window).
    The warm pool is the planner's (`warm_pool_size`, or `warm_pool_percent` of the planned
    need, at least one), from t=0. The pool and the forecast's capacity above floors 1-2
    are warm capacity beyond what the past showed was needed, so both are kept within the
    budget (`budgeted_extra`: at most `budget_share` of the total): a service too small to
    afford a whole spare replica has none and relies on the peak hold, and a forecaster
    that over-predicts (a 90th percentile of a bursty per-minute peak is close to its
    maximum) cannot run the bill up. Measured on the Azure code trace (1 h): without the
    peak hold 2.8% of requests wait for a cold start; with it and without the budget on
    the forecast's extra, 1.6x reactive's GPU time instead of 1.2x.
    """

    name = "prewarm"

    def __init__(self, planner: PlannerParams | None = None, forecaster: ForecasterFactory | None = None,
                 sync_s: float = 5.0, plan_every_s: float = 60.0, forecast_every_s: float = 900.0,
                 horizon_buckets: int = 30, min_history_buckets: int = 10, refit_max_s: float = 2 * 86400.0,
                 target: float = 0.7, signal: str = "peak", history_s: float = 8 * 86400.0,
                 planner_settings: Any = None, peak_quantile: float | None = None,
                 peak_hold_s: float | None = None) -> None:
        if planner is None and planner_settings is not None:
            planner = PlannerParams.from_settings(planner_settings)
        if peak_quantile is not None:
            # plan another quantile of the bucket's peak than the settings' (0.5 was tried:
            # cheaper, but it misses bursts on the Azure code trace)
            planner = replace(planner or PlannerParams(), quantile=peak_quantile)
        if signal not in ("peak", "mean"):
            raise ValueError(f"signal must be 'peak' or 'mean', got {signal!r}")
        if peak_hold_s is not None:
            # the live planner's field (`planner.peak_hold_s`), overridden for this replay.
            # 0 disables the peak hold. 480 s: on the Azure code trace 420-600 s all keep cold-start
            # hits at 0.02% (360 s: 0.37%), and each minute more costs ~2% GPU time there
            if peak_hold_s < 0:
                raise ValueError(f"peak_hold_s must be >= 0, got {peak_hold_s}")
            planner = replace(planner or PlannerParams(), peak_hold_s=peak_hold_s)
        self.signal, self.history_s = signal, history_s
        self.params = planner or PlannerParams()
        self.peak_hold_s = self.params.peak_hold_s
        if forecaster is None:
            qs = tuple(sorted({0.5, 0.9, 0.99, self.params.quantile}))
            forecaster = lambda: default_forecaster(qs)  # noqa: E731  (the planning quantile is predicted)
        self.factory = forecaster
        self.period_s, self.plan_every_s, self.forecast_every_s = sync_s, plan_every_s, forecast_every_s
        self.horizon, self.min_hist, self.refit_max_s = horizon_buckets, min_history_buckets, refit_max_s
        self.hpa = Reactive(target=target)  # the HPA keeps its own 15 s sync period
        self.target = target
        self.fits = 0
        self.fit_errors: list[str] = []
        self.clipped = 0  # forecasts clipped to max_over_seen x the highest bucket seen
        self.max_over_seen = 2.0

    def start(self, env: PolicyEnv) -> int:
        self.env = env
        b = self.params.bucket_s
        # "mean": plan the bucket's mean rate at the HPA's target utilization;
        # "peak": plan the bucket's peak in-flight demand (as req/s) with every slot busy
        util = self.target if self.signal == "mean" else 1.0
        cap = env.params.slots * util / env.work.mean_service_s
        self.model = ModelSpec(name="trace", revision="replay", capacity_rps=cap,
                               slots=env.params.slots)
        self.rates: list[float] = []  # req/s per full bucket so far
        S = env.work.mean_service_s
        k = int(math.floor(S))
        self.kernel = np.ones(k + 1)
        self.kernel[-1] = S - k
        self.conc = np.zeros(env.work.counts.size)  # in-flight estimate per past second
        self.conc_n = 0
        self.fitted: Any = None
        self.fit_at_n = 0
        self.fit_at_t = -math.inf
        self.frame: pd.DataFrame | None = None
        self.forecast_t = -math.inf
        self.plan_t = -math.inf
        self.plan_result: Any = None
        self.state = PlannerState()
        self.bucket = b
        self.epoch = env.work.start_epoch
        self.hpa_rec = self.hpa.start(env)
        self.hpa_t = 0.0
        self.hpa_load = 0.0
        # t=0: no past yet; the first minute's load stands in for it, as for every policy
        self.seed_peak = env.initial_load()
        self.plan_serving = max(self.hpa_rec, self.params.min_serving)
        self.pool = 0
        self._plan(0.0)
        return max(self.hpa_rec, self._hold_need()) + self.pool

    def _update_conc(self, now: float) -> None:
        """Extend the in-flight estimate (past arrivals spread over the mean service time)."""
        past = self.env.past_counts(now)
        n = past.size
        if n <= self.conc_n:
            return
        k = self.kernel.size - 1
        lo = max(0, self.conc_n - k)
        seg = past[lo:n].astype(np.float64)
        self.conc[self.conc_n : n] = np.convolve(seg, self.kernel)[: seg.size][self.conc_n - lo :]
        self.conc_n = n

    def _hold_need(self) -> int:
        """Replicas for the highest in-flight second within the last `peak_hold_s`, all slots busy."""
        if self.peak_hold_s <= 0:
            return 0
        n = self.conc_n
        peak = float(self.conc[max(0, n - int(self.peak_hold_s)) : n].max()) if n else self.seed_peak
        return int(math.ceil(round(peak / self.env.params.slots, 9)))

    def _update_history(self, now: float) -> None:
        full = int(now // self.bucket)
        if full > len(self.rates):
            b = int(self.bucket)
            lo, hi = len(self.rates) * b, full * b
            if self.signal == "mean":
                past = self.env.past_counts(now)
                new = past[lo:hi].reshape(-1, b).sum(axis=1) / self.bucket
            else:
                # the bucket's peak in-flight (if served at once), as an equivalent req/s
                new = self.conc[lo:hi].reshape(-1, b).max(axis=1) / self.env.work.mean_service_s
            self.rates.extend(new.tolist())

    def _series(self) -> pd.Series:
        """Full buckets before now, indexed by epoch bucket start (the forecaster's calendar)."""
        idx = self.epoch + np.arange(len(self.rates), dtype=np.float64) * self.bucket
        return pd.Series(self.rates, index=idx, dtype=np.float64)

    def _persistence(self, now: float) -> pd.DataFrame:
        """Before the model can be fitted: the recent peak demand (the peak hold's), flat."""
        if self.signal == "mean":
            past = self.env.past_counts(now)
            recent = past[-int(self.bucket):]
            level = float(recent.mean()) if recent.size else self.seed_peak / self.env.work.mean_service_s
        else:
            n = self.conc_n
            window = int(self.peak_hold_s) if self.peak_hold_s > 0 else int(self.bucket)
            seen = float(self.conc[max(0, n - window) : n].max()) if n else self.seed_peak
            level = seen / self.env.work.mean_service_s
        first = self.epoch + math.floor(now / self.bucket) * self.bucket
        idx = first + np.arange(self.horizon, dtype=np.float64) * self.bucket
        cols = sorted({0.5, 0.9, 0.99, self.params.quantile})
        return pd.DataFrame({f"q{q:g}": np.full(self.horizon, level) for q in cols}, index=idx)

    def _forecast(self, now: float) -> None:
        n = len(self.rates)
        if n < self.min_hist:
            self.frame = None
            return
        y = self._series()
        keep = int(self.history_s // self.bucket)
        # one thread: the boosting's OpenMP pool only contends on a shared machine
        with threadpool_limits(1):
            if self.fitted is None or n >= 2 * self.fit_at_n or now - self.fit_at_t >= self.refit_max_s:
                self.fit_at_n, self.fit_at_t = n, now
                try:
                    self.fitted = self.factory().fit(y.iloc[-keep:])
                    self.fits += 1
                except ValueError as exc:
                    # as a deployment would: keep the last model (or the persistence forecast) and say so
                    self.fit_errors.append(f"t={now:.0f}s: {exc}")
                    if self.fitted is None:
                        self.frame = None
                        return
            frame = self.fitted.predict(y.iloc[-keep:], self.horizon)
        # a guard a deployment needs too: a forecast above twice the highest demand ever
        # seen is a model error (e.g. after outage gaps), not a plan; clip it and count it
        bound = self.max_over_seen * max(self.rates)
        if bound > 0 and float(frame.to_numpy().max()) > bound:
            self.clipped += 1
            frame = frame.clip(upper=bound)
        self.frame = frame
        self.forecast_t = now

    def _plan(self, now: float) -> None:
        """One planning round against the planner's own serving count; updates it and the pool."""
        frame = self.frame if self.frame is not None else self._persistence(now)
        ctx = PlanContext(self.model, frame, ReplicaCounts(ready=self.plan_serving, loading=0, warm=self.pool),
                          self.epoch + now, self.params, cold_start_p95_s=self.env.params.cold_start_s)
        self.plan_result, self.state = plan(ctx, self.state)
        self.plan_live = self.plan_serving
        self.pool = self.plan_result.pool_target
        self.plan_t = now

    def decide(self, obs: Observation) -> int:
        now = obs.now
        # the HPA floor: re-evaluated on its own sync period, on the load averaged over it
        self.hpa_load += obs.load_mean * obs.period_s
        if now - self.hpa_t >= self.hpa.period_s:
            span = now - self.hpa_t
            hobs = Observation(now, obs.ready, obs.loading, self.hpa_load / span, obs.arrivals, span)
            self.hpa_rec = self.hpa.recommend(hobs, current=max(self.hpa_rec, 1))
            self.hpa_t, self.hpa_load = now, 0.0
        self._update_conc(now)
        self._update_history(now)
        if len(self.rates) >= self.min_hist and (self.frame is None or now - self.forecast_t >= self.forecast_every_s):
            self._forecast(now)
        if now - self.plan_t >= self.plan_every_s:
            self._plan(now)
        self.plan_serving = max(0, self.plan_result.serving_target(self.plan_live, self.epoch + now))
        base = max(self.hpa_rec, self._hold_need())
        return base + budgeted_extra(base, self.pool, self.plan_serving - base, self.params.budget_share)


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy by name (one of `POLICIES`)."""
    classes: dict[str, Callable[..., Policy]] = {
        "reactive": Reactive, "fixed_pool": FixedPool, "keepalive": KeepAlive, "prewarm": Prewarm, "oracle": Oracle,
    }
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return classes[name](**kw)
