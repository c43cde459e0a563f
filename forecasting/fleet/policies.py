"""Fleet warmth policies the backtest compares: who is kept on GPU at each step.

Each policy sees only the past (the counts of steps already replayed) and answers, at the
start of a step, which models it wants on GPU and which asleep in host memory. The
simulator (`forecasting.fleet.simulate`) loads a cold model on demand when a request
comes (every policy does), charges memory, and counts cold requests.

- `KeepAlive`: unload a model K minutes after its last request (AWS Lambda-like, 10 min);
  ``K`` = one step is the purely reactive policy.
- `HybridHistogram`: Shahrad et al., "Serverless in the Wild" (ATC'20): per-model histogram
  of idle times (1-minute bins, 4 h range); pre-warm at its 5th percentile and keep alive to
  its 99th (10% margins) when the histogram is representative; a standard 4 h keep-alive
  when not; a time-series guess of the next idle time when most idle times exceed the range.
- `SleepTier` (`keepalive_sleep`, `hybrid_histogram_sleep`): either baseline with the
  planner's sleep tier: what it takes off GPU sleeps (LRU within the same host-memory share)
  and is woken on demand, so a comparison with the planner is tool for tool.
- `FleetPlanner`: the live fleet round (`forecasting.fleet.round.fleet_round`: the online
  `ArrivalEstimator` and the pure fleet planner), with node placement and a fleet budget.
- `Oracle`: knows the future; loads each model exactly one load time before its next
  request and unloads it when a reload would cost less than staying: zero cold starts at
  the least memory (the bound to compare against).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

import numpy as np

from forecasting.charges import ACTUATION_S, COLD_START_CV, LOAD_SHARE, WAIT_THRESHOLD_S
from forecasting.fleet.catalog import Catalog, Tier, measured_ready_s
from forecasting.fleet.planner import FleetNode, FleetParams, FleetState
from forecasting.fleet.dense import DenseInputs
from forecasting.fleet.round import RoundParams, RoundState, dense_models, fleet_round, held_models, price_settings, \
    round_settings
from forecasting.planner import PlannerParams
from prewarm.core.planner_settings import PlannerSettings


@dataclass(frozen=True)
class FleetEnv:
    """What a policy may know of the fleet before the replay: catalog, step, nodes."""

    catalog: Catalog
    step_s: float
    n_nodes: int
    node_gpu_gb: float
    node_host_gb: float
    counts: np.ndarray | None = None  # the whole trace: only the oracle may read it
    # the share of host memory sleeping models may hold (the planner's FleetParams.sleep_share; the
    # sleep-enabled baselines keep theirs within the same share)
    sleep_share: float = 0.75
    # putting a model to sleep copies its weights to pinned host memory: 0.1 s + GB / this (4.3 s for 8 GB,
    # 17.9 s for 30 GB measured on an H200, docs/fleet.md); GPU and host memory are both held meanwhile
    sleep_gbps: float = 1.75
    # from the decision (or the first request of a cold model) to its load starting: the dispatch, the queue and
    # the agent's task start, as the single-model replay charges it (`forecasting.charges`); `prewarm up --models`
    # replays its run with the delay it measured (`workers.up.fidelity.demand_delays`)
    actuation_s: float = ACTUATION_S
    # a request that waited longer for a replica's slot is a cold-start hit (the gateway's and the single-model
    # replay's threshold)
    wait_threshold_s: float = WAIT_THRESHOLD_S
    # the share of a load that fills the node's snapshot (`forecasting.charges.copies_ready_s`)
    load_share: float = LOAD_SHARE
    # each load's or wake's time is the catalog's times a seeded lognormal draw of mean 1 and this CV, as the
    # single-model replay spreads its cold starts (0: the catalog's times exactly)
    cold_start_cv: float = COLD_START_CV
    seed: int = 0
    # the HPA that sizes every warm model a policy does not size itself (`forecasting.fleet.capacity.HpaCounts`):
    # the utilisation it targets and its default scale-down window
    hpa_target: float = 0.7
    hpa_scale_down_s: float = 300.0

    def sleep_s(self, mem_gb: np.ndarray | float) -> np.ndarray | float:
        """Seconds to put a model of `mem_gb` to sleep (the copy to host memory)."""
        return 0.1 + np.asarray(mem_gb, dtype=np.float64) / self.sleep_gbps

    @property
    def gpu_capacity_gb(self) -> float:
        return self.n_nodes * self.node_gpu_gb


class FleetPolicy(ABC):
    """A warmth policy over the whole fleet, stepped by the simulator."""

    name: str = "policy"
    # the HPA target the replay sizes this policy's other warm models with (None: `FleetEnv.hpa_target`): a
    # baseline's curve sweeps it, as its knob sweeps its warmth
    hpa_target: float | None = None
    cold_start_budget: float | None = None  # the share of requests the policy sizes its own models on (None: none)

    def reset(self, env: FleetEnv) -> None:
        self.env = env
        m = len(env.catalog)
        self.idle = np.full(m, -1, dtype=np.int64)  # inactive steps since the last active one; -1: never
        # the last request's arrival (s; -inf: never), requests spread evenly over their step as the
        # simulator serves them: idle times are measured on arrivals, not on step multiples
        self.last_arrival = np.full(m, -np.inf)
        self.gap_s = np.full(m, np.nan)  # this step's first arrival minus the previous last one (nan: inactive)

    @abstractmethod
    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(on GPU, asleep) masks wanted for step ``t``."""

    def replicas(self, t: int) -> dict[int, int]:
        """The models (by index) whose replicas on GPU this policy sizes itself for step ``t``, and how many;
        the replay gives every other warm model an HPA's count (`forecasting.fleet.capacity.HpaCounts`)."""
        return {}

    def observe(self, t: int, counts: np.ndarray, gpu: np.ndarray, replicas: np.ndarray | None = None,
                waited: np.ndarray | None = None, queued: np.ndarray | None = None) -> None:
        """Step ``t`` happened: ``counts`` arrived; ``gpu`` was warm (incl. on-demand loads) with ``replicas``
        on GPU each; ``waited`` of the requests waited for a load, a wake or a slot; ``queued`` still wait at its end."""
        dt = self.env.step_s
        active = counts > 0
        first = t * dt + dt / (counts + 1.0)
        self.gap_s = np.where(active, first - self.last_arrival, np.nan)
        self.last_arrival = np.where(active, t * dt + dt * counts / (counts + 1.0), self.last_arrival)
        self.idle = np.where(active, 0, np.where(self.idle >= 0, self.idle + 1, -1))

    def loaded(self, t: int, records: Sequence[tuple[int, Tier, float]]) -> None:
        """Step ``t`` started these wakes and loads: (model index, the tier it came from, seconds from its start to
        ready), a copy's wait for the node's fill included, as the agents record them (`Tier.CACHED`: a replica
        beyond the first, copied from the node's snapshot)."""

    def _none(self) -> np.ndarray:
        return np.zeros(len(self.env.catalog), dtype=bool)


class KeepAlive(FleetPolicy):
    """Keep a model on GPU until ``keep_s`` seconds pass without a request."""

    def __init__(self, keep_s: float = 600.0, name: str = "keepalive") -> None:
        self.keep_s = float(keep_s)
        self.name = name

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        # warm for step t while its last request is less than keep_s old when the step starts (at least
        # the step after a request: the simulator unloads at step boundaries)
        since = t * self.env.step_s - self.last_arrival
        return (self.idle >= 0) & ((self.idle == 0) | (since < self.keep_s)), self._none()


class HybridHistogram(FleetPolicy):
    """The hybrid-histogram keep-alive of "Serverless in the Wild", per model."""

    name = "hybrid_histogram"

    def __init__(self, head_pct: float = 5.0, tail_pct: float = 99.0, range_min: int = 240,
                 cv_min: float = 2.0, oob_share: float = 0.5, min_samples: int = 5, margin: float = 0.1) -> None:
        self.head, self.tail = head_pct, tail_pct
        self.range_min, self.cv_min, self.oob_share = range_min, cv_min, oob_share
        self.min_samples, self.margin = min_samples, margin

    def reset(self, env: FleetEnv) -> None:
        super().reset(env)
        m = len(env.catalog)
        self.step_min = env.step_s / 60.0
        self.hist = np.zeros((m, self.range_min + 1))
        self.oob = np.zeros(m)
        self.oob_log_mean = np.zeros(m)
        self.pre = np.zeros(m)  # pre-warm window (minutes)
        self.keep = np.full(m, float(self.range_min))  # keep-alive window (minutes)

    def _windows(self, i: int) -> None:
        h = self.hist[i]
        n = h.sum() + self.oob[i]
        if n >= self.min_samples and self.oob[i] / n > self.oob_share:
            pred = math.exp(self.oob_log_mean[i])  # the next idle time, from past out-of-range ones
            self.pre[i], self.keep[i] = 0.85 * pred, 0.3 * pred
            return
        if h.sum() >= self.min_samples and h.std() / max(h.mean(), 1e-12) >= self.cv_min:
            cdf = np.cumsum(h) / h.sum()
            head = float(np.searchsorted(cdf, self.head / 100.0))
            tail = float(np.searchsorted(cdf, self.tail / 100.0)) + 1.0
            pre = math.floor(head * (1.0 - self.margin))
            self.pre[i], self.keep[i] = pre, math.ceil(tail * (1.0 + self.margin)) - pre
            return
        self.pre[i], self.keep[i] = 0.0, float(self.range_min)

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        idle_min = (self.idle + 1) * self.step_min  # minutes since the last request, at this step's end
        idle_min_start = self.idle * self.step_min
        pre_ok = idle_min >= self.pre  # the pre-warm window is over within this step
        keep_ok = idle_min_start < self.pre + self.keep
        warm_after = (self.pre == 0) | (self.idle > 0)
        return (self.idle >= 0) & pre_ok & keep_ok & warm_after, self._none()

    def observe(self, t: int, counts: np.ndarray, gpu: np.ndarray, replicas: np.ndarray | None = None,
                waited: np.ndarray | None = None, queued: np.ndarray | None = None) -> None:
        active = counts > 0
        # idle times between requests, in minutes, measured on the arrivals (not on step multiples)
        gap_min = np.floor((t * self.env.step_s + self.env.step_s / (counts + 1.0) - self.last_arrival) / 60.0)
        back_to_back = active & (self.idle == 0) & (gap_min < 1)
        self.hist[back_to_back, 0] += 1
        for i in np.flatnonzero(active & (self.idle >= 0) & ~back_to_back):
            it = float(gap_min[i])
            if it <= self.range_min:
                self.hist[i, int(it)] += 1
            else:
                self.oob[i] += 1
                self.oob_log_mean[i] += (math.log(it) - self.oob_log_mean[i]) / self.oob[i]
        for i in np.flatnonzero(~active & (self.idle == 0)):  # going idle: its windows from all it has seen
            self._windows(int(i))
        super().observe(t, counts, gpu)


class SleepTier(FleetPolicy):
    """A baseline given the planner's sleep tier: what it takes off GPU goes to sleep instead of out.

    The inner policy (keep-alive, the hybrid histogram) decides what stays on GPU as before;
    a model it releases from GPU is put to sleep (engine level-1: weights in host memory,
    woken on demand in a fraction of a load), the most recently used first, while the
    sleeping models fit in the same share of host memory the planner may use
    (`FleetEnv.sleep_share`); the least recently used beyond it fall to the page cache or
    disk. Only a model that was on GPU (or already asleep) can sleep.
    """

    def __init__(self, inner: FleetPolicy) -> None:
        self.inner = inner
        self.name = f"{inner.name}_sleep"

    def reset(self, env: FleetEnv) -> None:
        super().reset(env)
        self.inner.reset(env)
        self.mem = env.catalog.mem_array
        self.host_gb = env.n_nodes * env.node_host_gb * env.sleep_share
        self.gpu_prev = self._none()
        self.asleep = self._none()

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        want, _ = self.inner.decide(t)
        cand = ~want & (self.gpu_prev | self.asleep)
        idx = np.flatnonzero(cand)
        idx = idx[np.argsort(-self.last_arrival[idx], kind="stable")]  # most recently used first
        fits = np.cumsum(self.mem[idx]) <= self.host_gb
        asleep = self._none()
        asleep[idx[fits]] = True
        self.asleep = asleep
        return want, asleep.copy()

    def observe(self, t: int, counts: np.ndarray, gpu: np.ndarray, replicas: np.ndarray | None = None,
                waited: np.ndarray | None = None, queued: np.ndarray | None = None) -> None:
        self.inner.observe(t, counts, gpu)
        self.gpu_prev = gpu.copy()
        self.asleep &= ~gpu
        super().observe(t, counts, gpu)


class FleetPlanner(FleetPolicy):
    """The fleet round the live planner runs (`forecasting.fleet.round.fleet_round`: the online `ArrivalEstimator`
    carried in its state, the pure fleet planner, node placement, a fleet budget), fed the counts of the steps
    replayed; ``budget_gb`` is the fleet's average warm GB. Its dense models (`dense_models`, the live round's
    settings) are sized by the count planner on the inputs the live loop builds from a gateway's counters, here
    from the replayed steps (`DenseInputs`); every model it places runs as many replicas as it placed."""

    name = "fleet"

    def __init__(self, budget_gb: float | None = None, lam0: float = 1e-3, *,
                 cold_start_budget: float = PlannerParams.cold_start_budget, **params: Any) -> None:
        """``params``: the round's settings (`RoundParams` fields: `round_settings` gives the live round's) and the
        fleet planner's (`FleetParams` fields)."""
        self.budget_gb, self.lam0 = budget_gb, lam0
        own = {f.name for f in fields(RoundParams)} - {"bucket_s", "fleet"}
        self.round_kw = {k: v for k, v in params.items() if k in own}
        self.params_kw = {k: v for k, v in params.items() if k not in own}
        self.cold_start_budget: float | None = cold_start_budget
        self.dense_budget = cold_start_budget

    def reset(self, env: FleetEnv) -> None:
        super().reset(env)
        kw = {"sleep_share": env.sleep_share} | self.params_kw  # the same host share the sleep baselines get
        fleet = FleetParams(step_s=env.step_s, budget_gb=self.budget_gb, lam0=self.lam0,
                            cold_start_budget=self.cold_start_budget, **kw)
        self.round = RoundParams(bucket_s=env.step_s, fleet=fleet, **self.round_kw)
        self.state = RoundState(planner=FleetState(lam=self.lam0))
        self.dense = DenseInputs(env.catalog, env.step_s, self.round, cold_start_budget=self.dense_budget)
        self.node_names = tuple(f"node-{k}" for k in range(env.n_nodes))
        self.placed: dict[str, tuple[str, ...]] = {}
        self.asleep: dict[str, str] = {}
        self.busy: set[str] = set()
        self.sized: dict[int, int] = {}
        self.names = env.catalog.names
        self.index = {name: i for i, name in enumerate(self.names)}
        self.mem = {c.name: c.mem_gb for c in env.catalog.cards}
        # the catalog the round plans with: the replayed catalog's times until loads and wakes are measured
        self.cards = list(env.catalog.cards)
        self.catalog = env.catalog

    def _nodes(self) -> tuple[FleetNode, ...]:
        resident: dict[str, dict[str, Tier]] = {n: {} for n in self.node_names}
        replicas: dict[str, dict[str, int]] = {n: {} for n in self.node_names}
        for model, node in self.asleep.items():
            resident[node][model] = Tier.ASLEEP
        for model, nodes in self.placed.items():
            for node in nodes:
                resident[node][model] = Tier.GPU
                replicas[node][model] = replicas[node].get(model, 0) + 1
        return tuple(FleetNode(name=n, gpu_gb=self.env.node_gpu_gb, host_gb=self.env.node_host_gb,
                               resident=resident[n], replicas=replicas[n],
                               in_flight={m: 1 for m in self.busy if n in self.placed.get(m, ())})
                     for n in self.node_names)

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        now = t * self.env.step_s
        counts, waited = self.dense.window()
        holding = held_models(self.state.dense, self.dense.states, self.dense.params, now)
        dense = {name: self.dense.inputs(self.index[name], now)
                 for name in dense_models(counts, self.catalog, self.round, holding)}
        result, self.state = fleet_round(counts, self.catalog, self._nodes(), now=now, params=self.round,
                                         state=self.state, dense=dense, waited=waited)
        self.dense.carry(result)
        plan = result.plan
        self.placed = dict(plan.gpu)
        self.asleep = dict(plan.asleep)
        self.sized = {self.index[name]: len(nodes) for name, nodes in plan.gpu.items()}
        gpu = np.array([n in plan.gpu for n in self.names])
        asleep = np.array([n in plan.asleep for n in self.names])
        return gpu, asleep

    def replicas(self, t: int) -> dict[int, int]:
        return self.sized

    def loaded(self, t: int, records: Sequence[tuple[int, Tier, float]]) -> None:
        """Recorded as the registry records them; the round plans with the times they measure, as live."""
        self.dense.loaded(records)
        for i in {i for i, _, _ in records}:
            card = self.env.catalog.cards[i]
            base = {tier: card.time_to_ready(tier) for tier in Tier}
            ready = measured_ready_s(base, self.dense.load_time_p95(card.name), self.dense.tier_p95(card.name))
            self.cards[i] = replace(card, ready_s={"default": ready})
        self.catalog = Catalog(tuple(self.cards))

    def observe(self, t: int, counts: np.ndarray, gpu: np.ndarray, replicas: np.ndarray | None = None,
                waited: np.ndarray | None = None, queued: np.ndarray | None = None) -> None:
        self.dense.observe(counts, replicas, waited, queued)
        self.busy = {self.names[i] for i in np.flatnonzero(counts > 0)}
        on = np.asarray(replicas if replicas is not None else gpu, dtype=np.int64)
        # what the replay evicted or trimmed for capacity is gone
        self.placed = {m: nodes[:on[self.index[m]]] for m, nodes in self.placed.items() if on[self.index[m]] > 0}
        used = {n: 0.0 for n in self.node_names}
        for model, nodes in self.placed.items():
            for node in nodes:
                used[node] += self.mem[model]
        for i in np.flatnonzero(gpu):  # loaded on demand by the simulator: give it a node
            model = self.names[i]
            if model not in self.placed:
                node = min(self.node_names, key=lambda n: used[n])
                used[node] += self.mem[model]
                self.placed[model] = (node,)
                self.asleep.pop(model, None)
        super().observe(t, counts, gpu)


class Oracle(FleetPolicy):
    """Knows every future request: ready exactly at each burst, unloaded whenever reloading is cheaper."""

    name = "oracle"

    def reset(self, env: FleetEnv) -> None:
        super().reset(env)
        if env.counts is None:
            raise ValueError("the oracle needs the trace")
        active = env.counts > 0
        lead = np.array([max(1, int(math.ceil(c.time_to_ready(Tier.DISK) / env.step_s))) for c in env.catalog.cards])
        T, _ = active.shape
        # next active step at or after t, per model (T: none)
        nxt = np.full(active.shape, T, dtype=np.int64)
        nxt_row = np.full(active.shape[1], T, dtype=np.int64)
        for t in range(T - 1, -1, -1):
            nxt_row = np.where(active[t], t, nxt_row)
            nxt[t] = nxt_row
        self.want = (nxt - np.arange(T)[:, None]) <= lead[None, :]

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self.want[t].copy(), self._none()


def fleet_policy_settings(planner: PlannerSettings) -> dict[str, Any]:
    """The `fleet` policy's settings from the `planner` settings group, as the live round reads them: the round's
    (`round_settings`) and its price's (`price_settings`: the cold-start budget its dense models are sized on and
    its price is steered by)."""
    return round_settings(planner) | price_settings(planner)


def make_fleet_policy(name: str, knob: float | None = None, *, hpa_target: float | None = None,
                      **kw: Any) -> FleetPolicy:
    """A policy by name; ``knob`` is its trade-off setting (keep-alive s, tail percentile, budget GB);
    ``hpa_target`` the utilisation of the HPA that sizes the warm models it does not size itself."""
    policy = _policy(name, knob, **kw)
    if hpa_target is not None:
        if not 0 < hpa_target <= 1:
            raise ValueError(f"hpa_target must be within (0, 1], got {hpa_target}")
        policy.hpa_target = hpa_target
    return policy


def _policy(name: str, knob: float | None, **kw: Any) -> FleetPolicy:
    if name == "keepalive":
        return KeepAlive(keep_s=knob if knob is not None else 600.0)
    if name == "reactive":
        return KeepAlive(keep_s=knob if knob is not None else 0.0, name="reactive")
    if name == "hybrid_histogram":
        return HybridHistogram(tail_pct=knob if knob is not None else 99.0, **kw)
    if name == "keepalive_sleep":
        return SleepTier(KeepAlive(keep_s=knob if knob is not None else 600.0))
    if name == "hybrid_histogram_sleep":
        return SleepTier(HybridHistogram(tail_pct=knob if knob is not None else 99.0, **kw))
    if name == "fleet":
        return FleetPlanner(budget_gb=knob, **kw)
    if name == "oracle":
        return Oracle()
    raise ValueError(f"unknown fleet policy {name!r} ({', '.join(FLEET_POLICIES)})")


FLEET_POLICIES = ("keepalive", "keepalive_sleep", "hybrid_histogram", "hybrid_histogram_sleep", "reactive", "fleet",
                  "oracle")
