"""The pool replay (`forecasting.fleet.simulate`): several replicas of a busy model, charged and served.

A warm model runs as many replicas as its sizer gives it: the fleet planner's own count
for the models it places (the count planner's for its dense models), else an HPA on the
rate it saw. Each replica is charged its memory; requests that wait longer than the
threshold for a ready replica's slot are cold, as a request that waits for a load is.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np
import pytest

from forecasting.fleet import policies as fleet_policies
from forecasting.fleet.capacity import HpaCounts, capacity_waits, throughput_gb
from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_ready_s
from forecasting.fleet.policies import FleetEnv, FleetPlanner, make_fleet_policy
from forecasting.fleet.simulate import simulate
from forecasting.fleet.traces import FleetTrace
from forecasting.planner import PlannerState, StepInputs

STEP = 60.0


def _brute(backlog: float, lam: float, mu: float, dt: float, thr: float, n: int = 200_000) -> tuple[float, float]:
    """The same fluid queue stepped on a fine grid: (arrivals that waited over `thr`, backlog at the end)."""
    h = dt / n
    q, waited = backlog, 0.0
    for _ in range(n):
        if mu > 0 and q / mu > thr or mu == 0:
            waited += lam * h
        q = max(0.0, q + (lam - mu) * h)
    return waited, q


@pytest.mark.parametrize(("backlog", "lam", "mu"), [
    (0.0, 12.0, 10.0),  # over capacity from an empty queue: waits once the queue passes the threshold
    (40.0, 5.0, 10.0),  # a backlog draining under capacity: the early arrivals wait
    (40.0, 10.0, 10.0),  # a standing queue at capacity: everyone waits
    (2.0, 5.0, 10.0),  # a backlog under the threshold: no one waits over it
    (0.0, 5.0, 10.0),  # under capacity, nothing queued
    (30.0, 5.0, 0.0),  # no ready replica: everyone waits
])
def test_the_step_fluid_queue_counts_who_waits_as_a_fine_grid_does(backlog: float, lam: float, mu: float) -> None:
    waited, _, end = capacity_waits(np.array([backlog]), np.array([lam]), np.array([mu]), STEP, 0.5)
    want_waited, want_end = _brute(backlog, lam, mu, STEP, 0.5)
    assert waited[0] == pytest.approx(want_waited, rel=1e-3, abs=1e-2)
    assert end[0] == pytest.approx(want_end, rel=1e-3, abs=1e-2)


def test_the_hpa_sizes_on_the_rate_it_saw_and_holds_its_scale_down_window() -> None:
    hpa = HpaCounts(np.array([10.0, 10.0]), STEP, target=0.7, scale_down_s=180.0)
    assert hpa.desired().tolist() == [1, 1]  # nothing seen: one replica for a warm model
    hpa.observe(np.array([50.0 * STEP, 0.0]))
    assert hpa.desired().tolist() == [math.ceil(50 / 7), 1]
    for _ in range(2):  # the rate falls: the window keeps the peak for 180 s (three steps)
        hpa.observe(np.array([10.0 * STEP, 0.0]))
        assert hpa.desired().tolist() == [8, 1]
    hpa.observe(np.array([10.0 * STEP, 0.0]))
    assert hpa.desired().tolist() == [2, 1]
    with pytest.raises(ValueError, match="target utilisation"):
        HpaCounts(np.array([10.0]), STEP, target=1.5)


def test_the_pool_is_sized_for_the_replicas_its_busiest_steps_need() -> None:
    counts = np.zeros((100, 2))
    counts[:, 0] = 35.0 * STEP  # 35 req/s at 7 a replica: 5 replicas, 4 beyond the first
    counts[:, 1] = 1.0
    assert throughput_gb(np.array([16.0, 80.0]), np.array([10.0, 10.0]), counts, STEP, target=0.7,
                         q=0.99) == pytest.approx(4 * 16.0)


def _one_busy_model(rates: np.ndarray) -> tuple[FleetTrace, FleetEnv]:
    card = ModelCard(name="busy", mem_gb=16.0, capacity_rps=10.0, ready_s={"default": default_ready_s(16.0)})
    catalog = Catalog((card,))
    trace = FleetTrace(names=("busy",), counts=(rates * STEP)[:, None], step_s=STEP, source="test", kind="test")
    env = FleetEnv(catalog=catalog, step_s=STEP, n_nodes=2, node_gpu_gb=640.0, node_host_gb=1024.0)
    return trace, env


def test_the_hpa_baseline_is_charged_every_replica_and_its_lag_is_counted_as_slot_waits() -> None:
    rates = np.full(240, 20.0)
    rates[97:150] = 55.0  # a rise between two minutes of no grid in particular
    trace, env = _one_busy_model(rates)
    score = simulate(trace, make_fleet_policy("reactive"), env)
    hpa = HpaCounts(np.array([10.0]), STEP)
    charged = 0.0
    for row in trace.counts:
        charged += 16.0 * float(hpa.desired()[0]) * STEP / 3600.0
        hpa.observe(row)
    assert score.warm_gb_h == pytest.approx(charged)
    # the minute the HPA has not seen the rise yet, 55 req/s meet 3 replicas (30 req/s): the queue grows
    assert score.capacity_waited > 0.5 * (55.0 - 30.0) * STEP
    assert score.cold_requests >= score.capacity_waited
    assert score.loads > 1  # the replicas beyond the first are loads too


def test_the_fleet_planner_runs_the_count_planners_replicas_for_its_dense_model(monkeypatch) -> None:
    rng = np.random.default_rng(5)
    rates = 20.0 + 8.0 * np.sin(np.arange(3 * 1440) * 2 * np.pi / 1440) + rng.normal(0.0, 0.5, 3 * 1440)
    trace, env = _one_busy_model(np.maximum(rates, 0.0))
    asked: list[int] = []
    real_round = fleet_policies.fleet_round

    def recording_round(*args, **kw):
        result, state = real_round(*args, **kw)
        asked.append(result.replicas.get("busy", 0))
        return result, state

    monkeypatch.setattr(fleet_policies, "fleet_round", recording_round)
    policy = FleetPlanner()
    score = simulate(trace, policy, env)
    # a model at 20 req/s is dense: from its second step on the count planner sizes it, every step
    assert all(a >= 1 for a in asked[1:]) and len(asked) == trace.n_steps
    assert max(asked) >= 3  # 28 req/s at its daily peak need more than two replicas of 10 req/s
    # what the replay charged is what the count planner asked for, as far as the two nodes have room (its first
    # step sees the queue its one cold replica left, counted in flight as the gateway counts it, and asks for more)
    room = int(2 * 640.0 // 16.0)
    charged = 16.0 * sum(min(max(a, 1), room) for a in asked)
    assert score.warm_gb_h == pytest.approx(charged * STEP / 3600.0)
    assert policy.dense.states["busy"].margin is not None  # the count planner's state is carried per model


def test_a_baselines_hpa_target_buys_fewer_slot_waits_for_more_memory() -> None:
    rates = np.full(240, 20.0)
    rates[97:150] = 55.0
    trace, env = _one_busy_model(rates)
    default = simulate(trace, make_fleet_policy("keepalive_sleep"), env)
    roomy = simulate(trace, make_fleet_policy("keepalive_sleep", hpa_target=0.35), env)
    assert default.hpa_target == env.hpa_target and roomy.hpa_target == 0.35
    assert roomy.warm_gb_h > default.warm_gb_h
    assert roomy.capacity_waited < default.capacity_waited
    with pytest.raises(ValueError, match="hpa_target"):
        make_fleet_policy("reactive", hpa_target=0.0)


def test_the_planners_cold_start_budget_sizes_its_dense_models_and_its_row_says_which() -> None:
    from forecasting.fleet.backtest import FleetSetup, run_fleet_backtest

    rng = np.random.default_rng(7)
    minutes = np.arange(3 * 1440)
    rates = 20.0 + 8.0 * np.sin(minutes * 2 * np.pi / 1440) + rng.normal(0.0, 2.0, minutes.size)
    rates[(minutes % 1440 > 600) & (minutes % 1440 < 611)] += 25.0  # a daily burst off any grid
    trace, env = _one_busy_model(np.maximum(rates, 0.0))
    tight = simulate(trace, FleetPlanner(cold_start_budget=0.001), env)
    loose = simulate(trace, FleetPlanner(cold_start_budget=0.05), env)
    assert loose.warm_gb_h < tight.warm_gb_h and loose.cold_requests > tight.cold_requests

    out = run_fleet_backtest(trace, catalog=env.catalog, setup=FleetSetup(n_nodes=2, score_after_s=86_400.0),
                             policies=("keepalive_sleep", "fleet"),
                             knobs={"keepalive_sleep": (60.0,), "fleet": ()}, hpa_targets=(0.5,),
                             cold_start_budgets=(0.01,))
    rows = {r["policy"]: r for r in out["rows"]}
    assert rows["fleet"]["cold_start_budget"] == 0.001 and rows["keepalive_sleep"]["cold_start_budget"] is None
    assert [p["cold_start_budget"] for p in out["curves"]["fleet"]] == [0.01]
    assert [p["hpa_target"] for p in out["curves"]["keepalive_sleep"]] == [0.7, 0.5]


def test_a_dense_models_inputs_count_its_queue_in_flight_as_the_gateway_does() -> None:
    from forecasting.fleet.dense import DenseInputs
    from forecasting.fleet.round import RoundParams

    trace, env = _one_busy_model(np.full(10, 20.0))
    dense = DenseInputs(env.catalog, STEP, RoundParams(bucket_s=STEP), cold_start_budget=0.001)
    for k in range(10):
        dense.observe(np.array([20.0 * STEP]), np.array([3]), np.array([5.0 * k]), np.array([12.0 * (k == 9)]))
    inputs, state = dense.inputs(0, 10 * STEP)
    service_s = inputs.model.slots / inputs.model.capacity_rps
    assert inputs.observed.peak[-1] == pytest.approx(20.0 * service_s + 12.0)  # served plus queued
    assert inputs.observed.peak[-2] == pytest.approx(20.0 * service_s)
    assert inputs.observed.waited is not None and inputs.observed.waited[-1] == 45.0
    assert inputs.replicas.ready + inputs.replicas.warm == 3
    assert inputs.cold_start_p95_s is None  # no load seen yet: the planner's default, as live before the first
    assert state.margin is None  # a model never planned yet starts from a fresh state
    # the loads the replay charged, as the registry records them; a wake is not a load
    dense.loaded([(0, Tier.CACHED, float(s)) for s in range(1, 21)] + [(0, Tier.ASLEEP, 99.0)])
    assert dense.inputs(0, 10 * STEP)[0].cold_start_p95_s == 19.0
    assert dense.tier_p95("busy") == {Tier.CACHED: 19.0, Tier.ASLEEP: 99.0}


def test_the_pool_replays_planner_learns_its_cold_start_from_the_loads_it_was_charged(monkeypatch) -> None:
    """The count planner of a dense model is told the p95 of the loads the replay charged it (a first load from
    disk, the copies that waited for its fill), not the catalog's time from the page cache."""
    from forecasting.fleet.dense import DenseInputs

    seen: list[float | None] = []
    inputs = DenseInputs.inputs

    def spy(self: DenseInputs, i: int, now: float) -> tuple[StepInputs, PlannerState]:
        got = inputs(self, i, now)
        seen.append(got[0].cold_start_p95_s)
        return got

    monkeypatch.setattr(DenseInputs, "inputs", spy)
    rates = np.full(240, 40.0)
    trace, env = _one_busy_model(rates)
    simulate(trace, FleetPlanner(), replace(env, cold_start_cv=0.0))
    card = env.catalog.cards[0]
    # its first round follows its on-demand load from disk; copies onto the filled node follow, and the p95 of the
    # last loads comes down to theirs as they outnumber it
    assert seen[0] == pytest.approx(card.time_to_ready(Tier.DISK))
    assert seen[-1] == pytest.approx(card.time_to_ready(Tier.CACHED))


class _Sized(fleet_policies.FleetPolicy):
    """Wants the model on GPU with `k` replicas from step `at` (a test policy)."""

    name = "sized"

    def __init__(self, at: int, k: int) -> None:
        self.at, self.k = at, k

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full(1, t >= self.at), self._none()

    def replicas(self, t: int) -> dict[int, int]:
        return {0: self.k} if t >= self.at else {}


def test_a_burst_of_replicas_from_disk_copies_from_the_snapshot_once_the_first_has_filled_it() -> None:
    """A model brought from disk with four replicas: the three beyond the first copy from the node's snapshot after
    the first's transfer has filled it, not at once from a page cache that does not hold the weights yet; a step
    later a replica added to the filled node copies at once."""
    rates = np.zeros(8)
    rates[3:] = 35.0
    trace, env = _one_busy_model(rates)
    env = replace(env, cold_start_cv=0.0)  # the catalog's times exactly
    card = env.catalog.cards[0]
    disk, cached = card.time_to_ready(Tier.DISK), card.time_to_ready(Tier.CACHED)
    score = simulate(trace, _Sized(at=3, k=4), env)
    late = env.actuation_s + disk
    extra = env.actuation_s + env.load_share * disk + cached  # the fill, then the copy
    assert cached < extra < late < STEP
    serving = 1.0 - late / STEP + 3 * (1.0 - extra / STEP)
    c = 35.0 * STEP
    over, _, backlog = capacity_waits(np.zeros(1), np.array([35.0]), np.array([10.0 * serving]), STEP,
                                      env.wait_threshold_s)
    cold_first = max(1.0, c * late / STEP)  # the requests before the first replica is ready wait for its load
    later = 0.0
    for _ in range(4):  # four full replicas from then on (40 req/s for 35): the backlog drains
        w, _, backlog = capacity_waits(backlog, np.array([35.0]), np.array([40.0]), STEP, env.wait_threshold_s)
        later += float(w[0])
    assert score.cold_requests == pytest.approx(max(cold_first, float(over[0])) + later, rel=1e-9)
    assert score.loads == 4


class _Recording(fleet_policies.KeepAlive):
    """Keep-alive of one step (every busy step after an idle one loads again), recording the loads' times."""

    def __init__(self) -> None:
        super().__init__(keep_s=60.0)
        self.times: list[float] = []

    def loaded(self, t: int, records: Sequence[tuple[int, Tier, float]]) -> None:
        self.times.extend(s for _, _, s in records)


def test_the_pool_replay_spreads_its_loads_as_the_single_model_replay_does() -> None:
    """Each load's time is the catalog's times a seeded lognormal draw of mean 1 and CV 0.3
    (`forecasting.charges.COLD_START_CV`, the single-model replay's), not the catalog's time exactly."""
    rates = np.zeros(4000)
    rates[::3] = 0.02  # a request every third minute: the model is loaded from the page cache each time
    trace, env = _one_busy_model(rates)
    policy = _Recording()
    simulate(trace, policy, env)
    times = np.asarray(policy.times[1:])  # the first came from disk
    card = env.catalog.cards[0]
    cached = card.time_to_ready(Tier.CACHED)
    assert times.size > 1000 and times.mean() == pytest.approx(cached, rel=0.05)
    assert times.std() / times.mean() == pytest.approx(env.cold_start_cv, rel=0.1)
    exact = _Recording()
    simulate(trace, exact, replace(env, cold_start_cv=0.0))
    assert exact.times[0] == card.time_to_ready(Tier.DISK) and set(exact.times[1:]) == {cached}


def test_the_pool_replays_planner_plans_with_the_times_its_loads_and_wakes_measured() -> None:
    """The fleet round in the replay plans with the catalog the live round builds (`measured_ready_s`): a load's
    p95 as the time from the cache, each tier's measured p95 over the replayed catalog's times."""
    from forecasting.fleet.catalog import measured_ready_s

    trace, env = _one_busy_model(np.full(10, 1.0))
    policy = FleetPlanner()
    policy.reset(env)
    card = env.catalog.cards[0]
    assert policy.catalog is env.catalog  # nothing measured yet
    policy.loaded(0, [(0, Tier.DISK, 30.0), (0, Tier.CACHED, 12.0), (0, Tier.CACHED, 12.0), (0, Tier.ASLEEP, 0.9)])
    got = policy.catalog.cards[0]
    assert got.time_to_ready(Tier.ASLEEP) == 0.9 and got.time_to_ready(Tier.DISK) == 30.0
    assert got.time_to_ready(Tier.CACHED) == 12.0  # the tier's own p95 over the p95 of all its loads (30 s)
    base = {tier: card.time_to_ready(tier) for tier in Tier}
    assert measured_ready_s(base, 30.0, {}) == base | {Tier.CACHED: 30.0, Tier.DISK: max(base[Tier.DISK], 30.0)}
