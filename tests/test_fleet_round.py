"""The pool's one round (`forecasting.fleet.round`): count and tier of every model at once.

The dense models' counts are the count planner's (`forecasting.planner.step`, the same step,
budget and margin as a model planned alone), placed by the fleet planner with every other
model's tier. The live planner and the replay call the same `fleet_round`; the live one
reads a day of history per round, the replay passes the last hour. Carried on, the arrival
estimator must decide as one rebuilt from the whole history would, leave the state it was
given as it was, and be rebuilt where it cannot be carried on.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from forecasting.fleet.catalog import Catalog, ModelCard
from forecasting.fleet.planner import FleetNode, FleetParams, FleetState
from forecasting.fleet.round import (
    RoundParams,
    RoundState,
    burst_replicas,
    dense_models,
    estimator_from_history,
    fleet_round,
    held_models,
)
from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec

STEP = 60.0


def _fleet(n_steps: int = 240, seed: int = 3) -> tuple[np.ndarray, Catalog, tuple[FleetNode, ...], RoundParams]:
    rng = np.random.default_rng(seed)
    # sparse models of different habits: a timer every 7 steps, bursts, a rare one, a steady one
    counts = np.zeros((n_steps, 5))
    counts[::7, 0] = 3
    counts[:, 1] = rng.poisson(0.15, n_steps) * rng.integers(1, 20, n_steps)
    counts[rng.random(n_steps) < 0.02, 2] = 1
    counts[:, 3] = rng.poisson(4.0, n_steps)
    counts[n_steps // 2:, 4] = rng.poisson(0.5, n_steps - n_steps // 2)
    catalog = Catalog(tuple(ModelCard(name=f"m{i}", mem_gb=mem) for i, mem in enumerate((16, 40, 24, 80, 16))))
    nodes = (FleetNode("a", gpu_gb=80.0, host_gb=120.0), FleetNode("b", gpu_gb=80.0, host_gb=120.0))
    params = RoundParams(bucket_s=STEP, max_dense=0, fleet=FleetParams(step_s=STEP, budget_gb=60.0))
    return counts, catalog, nodes, params


def test_a_carried_estimator_decides_as_one_rebuilt_from_the_whole_history() -> None:
    counts, catalog, nodes, params = _fleet()
    carried = RoundState()
    for t in range(1, counts.shape[0] + 1):
        window = counts[max(0, t - 60):t]  # what the replay passes: the last hour
        rebuilt, _ = fleet_round(counts[:t], catalog, nodes, now=t * STEP, params=params,
                                 state=RoundState(planner=carried.planner))
        before = carried.estimator
        snapshot = None if before is None else (before.hist.copy(), before.idle.copy(), before.steps_seen)
        result, carried = fleet_round(window, catalog, nodes, now=t * STEP, params=params, state=carried)
        np.testing.assert_allclose(result.rate, rebuilt.rate)
        assert result.plan.gpu == rebuilt.plan.gpu and result.plan.asleep == rebuilt.plan.asleep
        assert carried.seen_to == t * STEP and carried.estimator is not None
        assert carried.estimator.steps_seen == t
        if snapshot is not None:  # the state passed in was left as it was
            assert before is not None and before.steps_seen == snapshot[2]
            np.testing.assert_array_equal(before.hist, snapshot[0])
            np.testing.assert_array_equal(before.idle, snapshot[1])


def test_an_estimator_that_cannot_be_carried_on_is_rebuilt_from_the_history_passed() -> None:
    counts, catalog, nodes, params = _fleet()
    _, state = fleet_round(counts[:100], catalog, nodes, now=100 * STEP, params=params, state=RoundState())
    # a gap: the history passed starts after the last bucket the estimator saw (a planner down for an hour)
    later = counts[160:220]
    gap, _ = fleet_round(later, catalog, nodes, now=220 * STEP, params=params, state=state)
    np.testing.assert_allclose(gap.rate, estimator_from_history(later, params).outlook().rate)
    # other models: the estimator's rows would belong to others
    other = Catalog(tuple(ModelCard(name=f"x{i}", mem_gb=16) for i in range(5)))
    renamed, _ = fleet_round(counts[:120], other, nodes, now=120 * STEP, params=params, state=state)
    np.testing.assert_allclose(renamed.rate, estimator_from_history(counts[:120], params).outlook().rate)
    # the same round again (nothing new): nothing is observed twice
    again, carried = fleet_round(counts[:100], catalog, nodes, now=100 * STEP, params=params, state=state)
    assert carried.estimator is not None and carried.estimator.steps_seen == 100
    np.testing.assert_allclose(again.rate, estimator_from_history(counts[:100], params).outlook().rate)


def test_the_replay_plans_with_the_live_round() -> None:
    """The replay's `fleet` policy is the live round: its plans are fleet_round's on the same counts."""
    from forecasting.fleet.policies import FleetEnv, FleetPlanner

    counts, catalog, nodes, params = _fleet(120)
    env = FleetEnv(catalog=catalog, step_s=STEP, n_nodes=2, node_gpu_gb=80.0, node_host_gb=120.0)
    policy = FleetPlanner(budget_gb=60.0)
    policy.reset(env)
    state = RoundState(planner=FleetState(lam=policy.lam0))
    for t in range(counts.shape[0]):
        nodes_now = policy._nodes()
        gpu, asleep = policy.decide(t)
        result, state = fleet_round(counts[max(0, t - 60):t], catalog, nodes_now, now=t * STEP,
                                    params=policy.round, state=state)
        assert [n for n, on in zip(catalog.names, gpu) if on] == sorted(result.plan.gpu, key=catalog.names.index)
        assert [n for n, s in zip(catalog.names, asleep) if s] == sorted(result.plan.asleep, key=catalog.names.index)
        policy.observe(t, counts[t], gpu)


def _busy_inputs(name: str, in_flight: float, now: float, ready: int = 1) -> StepInputs:
    """A dense model's step inputs: an hour of 10 s buckets with `in_flight` requests in flight on average."""
    n = 360
    requests = np.full(n, in_flight * 10.0)
    observed = observed_from_counts(now - n * 10.0, 10.0, requests, np.full(n, in_flight * 1.3),
                                    np.full(n, in_flight * 10.0), np.zeros(n))
    return StepInputs(ModelSpec(name=name, revision="r", slots=8), now, observed, ReplicaCounts(ready=ready))


def test_the_dense_models_are_the_busiest_above_the_threshold() -> None:
    counts, catalog, _, _ = _fleet()
    params = RoundParams(bucket_s=STEP, dense_rps=0.05, max_dense=1)
    assert dense_models(counts, catalog, params) == ("m3",)  # Poisson(4) a minute: the busiest
    assert dense_models(counts, catalog, RoundParams(bucket_s=STEP, dense_rps=0.015)) == ("m3", "m1")
    assert dense_models(counts, catalog, RoundParams(bucket_s=STEP, max_dense=0)) == ()
    assert dense_models(counts[:0], catalog, params) == ()
    # a model whose traffic began two minutes ago, at 3 requests a second: its rate is since then, not the hour's
    fresh = np.zeros_like(counts)
    fresh[-2:, 2] = 180
    assert dense_models(fresh, catalog, RoundParams(bucket_s=STEP)) == ("m2",)


def test_a_dense_models_count_is_the_count_planners_and_its_budget_steers_it() -> None:
    """The round asks for what `step` decides for the model alone (serving target plus warm pool), places that
    many replicas within node memory, and passes the step's next state back; a margin the cold-start budget
    has calibrated higher asks for more."""
    counts, catalog, nodes, _ = _fleet()
    nodes = (FleetNode("a", gpu_gb=640.0, host_gb=120.0), FleetNode("b", gpu_gb=640.0, host_gb=120.0))
    params = RoundParams(bucket_s=STEP, fleet=FleetParams(step_s=STEP))
    now = counts.shape[0] * STEP
    inp = _busy_inputs("m3", in_flight=40.0, now=now)
    alone, alone_state = step(inp, PlannerState())
    result, _ = fleet_round(counts, catalog, nodes, now=now, params=params, state=RoundState(),
                            dense={"m3": (inp, PlannerState())})
    assert result.dense == ("m3",) and alone.cluster_target >= 5
    assert result.replicas["m3"] == alone.cluster_target == len(result.plan.gpu["m3"])
    assert result.states["m3"] == alone_state and result.decisions["m3"].target == alone.target
    wary = PlannerState(margin=12.0, counted_end=now)  # the budget's feedback raised the margin
    more, _ = fleet_round(counts, catalog, nodes, now=now, params=params, state=RoundState(),
                          dense={"m3": (inp, wary)})
    assert more.replicas["m3"] > result.replicas["m3"]
    # node memory bounds it: two 160 GB nodes hold four of its 80 GB replicas at most, whatever it asks
    small = (FleetNode("a", gpu_gb=160.0, host_gb=120.0), FleetNode("b", gpu_gb=160.0, host_gb=120.0))
    capped, _ = fleet_round(counts, catalog, small, now=now, params=params, state=RoundState(),
                            dense={"m3": (inp, PlannerState())})
    assert capped.replicas["m3"] == alone.cluster_target and 1 <= len(capped.plan.gpu["m3"]) <= 4
    assert capped.plan.gpu_gb <= 320.0


def test_a_model_back_in_the_dense_set_does_not_count_the_misses_from_before_as_its_margins() -> None:
    """A model the last round did not size by the count planner (sparse, or not yet dense) had no margin applied:
    the requests that waited meanwhile (a burst's first minute, before any round saw it) are not its margin's
    misses, so its counting starts afresh. Sized last round, the same waits raise its margin."""
    counts, catalog, nodes, _ = _fleet()
    params = RoundParams(bucket_s=STEP, fleet=FleetParams(step_s=STEP))
    now = counts.shape[0] * STEP
    inp = _busy_inputs("m3", in_flight=40.0, now=now)
    waited = np.zeros(inp.observed.requests.size)
    waited[-6:] = 200.0  # the last minute's requests all waited
    inp = replace(inp, observed=replace(inp.observed, waited=waited))
    counted = PlannerState(margin=6.0, counted_end=now - 600.0)
    last = now - STEP  # the last round's end

    def after(state: RoundState) -> tuple[PlannerState, RoundState]:
        result, carried = fleet_round(counts, catalog, nodes, now=now, params=params, state=state,
                                      dense={"m3": (inp, counted)})
        return result.states["m3"], carried

    was_dense, _ = after(RoundState(seen_to=last, dense=("m3",)))
    assert was_dense.margin is not None and was_dense.margin > 6.0
    was_not, carried = after(RoundState(seen_to=last))
    assert was_not.margin == 6.0 and was_not.counted_end == now
    assert carried.dense == ("m3",)  # the next round counts its misses
    # no round on record (a restarted planner, `prewarm plan --dry-run`): its counting goes on as carried
    unknown, _ = after(RoundState())
    assert unknown.margin == was_dense.margin


def test_a_model_whose_count_planner_holds_a_fall_stays_dense_until_it_lets_go() -> None:
    """A dense model gone quiet falls below the dense rate within its window; while its count planner holds its
    replicas through that fall (within the span its pauses ask for) it stays with the count planner, whose hold it
    is, and leaves once the span has passed. Dropped at once, its return met the one replica its outlook gave it."""
    counts, catalog, _, _ = _fleet()
    params = RoundParams(bucket_s=STEP, dense_rps=0.05)
    quiet = counts.copy()
    quiet[:, 3] = 0.0  # m3's hour went silent
    assert "m3" not in dense_models(quiet, catalog, params)
    planner = PlannerParams()
    now = quiet.shape[0] * STEP
    states = {"m3": PlannerState(quiet_since=now - 1_800.0), "m1": PlannerState()}
    holding = held_models(("m3", "m1"), states, planner, now)
    assert holding == ("m3",)  # m1's planner holds nothing
    assert dense_models(quiet, catalog, params, holding)[-1] == "m3"
    assert held_models(("m1",), states, planner, now) == ()  # not sized last round: not its planner's hold
    # past the span (the default hold, no pause remembered), the fleet round plans it by its outlook again
    assert held_models(("m3",), states, planner, now + planner.interruption_hold_s) == ()
    # the busiest come first: a held model does not push one out past max_dense
    assert dense_models(counts, catalog, RoundParams(bucket_s=STEP, dense_rps=0.05, max_dense=1), ("m0",)) == ("m3",)


def test_a_dense_model_not_in_the_catalog_is_refused_by_name() -> None:
    counts, catalog, nodes, params = _fleet()
    import pytest

    with pytest.raises(ValueError, match="dense models not in the catalog: ghost"):
        fleet_round(counts, catalog, nodes, now=counts.shape[0] * STEP, params=params, state=RoundState(),
                    dense={"ghost": (_busy_inputs("ghost", 5.0, counts.shape[0] * STEP), PlannerState())})


def test_a_dense_models_replicas_share_nodes_and_only_the_surplus_leaves() -> None:
    """Three replicas of m3 run on node a. Asked for two, the fleet planner keeps two there and evicts one (no
    load); asked for five, it keeps the three and loads two more, on the node without one first."""
    from forecasting.fleet.planner import ActionKind, FleetContext, plan_fleet
    from forecasting.fleet.catalog import Tier

    _, catalog, _, _ = _fleet()
    nodes = (FleetNode("a", gpu_gb=640.0, host_gb=0.0, resident={"m3": Tier.GPU}, replicas={"m3": 3}),
             FleetNode("b", gpu_gb=640.0, host_gb=0.0))

    def plan(want: int) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
        ctx = FleetContext(now=0.0, catalog=catalog, nodes=nodes, rate=np.zeros(5), burst_requests=np.ones(5),
                           params=FleetParams(step_s=STEP), replicas={"m3": want})
        out, _ = plan_fleet(ctx, FleetState(lam=1.0))
        return out.gpu["m3"], [(a.kind.value, a.node) for a in out.actions if a.model == "m3"]

    kept, actions = plan(2)
    assert kept == ("a", "a") and actions == [(ActionKind.EVICT.value, "a")]
    kept, actions = plan(5)
    assert sorted(kept) == ["a", "a", "a", "b", "b"] and actions == [("load", "b"), ("load", "b")]
    kept, actions = plan(3)
    assert kept == ("a", "a", "a") and actions == []


def test_a_burst_of_a_model_not_dense_gets_the_replicas_an_hpa_would_give_it() -> None:
    counts, catalog, nodes, _ = _fleet()
    params = RoundParams(bucket_s=STEP, fleet=FleetParams(step_s=STEP))
    burst = counts.copy()
    burst[-2:, 0] = 30.0 * STEP  # a timer model's batch: 30 requests a second for two minutes, quiet before
    assert "m0" not in dense_models(burst[:-2], catalog, params)
    assert burst_replicas(burst, catalog, params) == {"m0": math.ceil(30.0 / (10.0 * 0.7))}
    big = (FleetNode("a", gpu_gb=200.0, host_gb=120.0), FleetNode("b", gpu_gb=200.0, host_gb=120.0))
    result, _ = fleet_round(burst, catalog, big, now=burst.shape[0] * STEP, params=params, state=RoundState())
    assert len(result.plan.gpu["m0"]) == 5
    # the count holds over the hold window, then falls back to the tier's one replica
    later = np.concatenate([burst, np.zeros((6, burst.shape[1]))])
    assert burst_replicas(later[:-2], catalog, params) == {"m0": 5}
    assert burst_replicas(later, catalog, params) == {}


@pytest.mark.parametrize("budget", [0.05, 0.005])
def test_the_cold_start_budget_holds_the_share_of_a_sparse_pool_at_a_fine_step(budget: float) -> None:
    """Thirty sparse models (0.003-0.3 requests/s, none dense), room for all, 10 s steps (the live round's counters
    are 10 s): the planner without a memory budget holds the share of requests that wait for a load or a wake at
    its cold-start budget, whatever the step. Its price of warmth held at `lam0` instead (before the budget
    steered it), the share was what that constant gave: the same for either budget."""
    from forecasting.fleet.catalog import default_catalog
    from forecasting.fleet.policies import FleetEnv, FleetPlanner
    from forecasting.fleet.simulate import simulate
    from forecasting.fleet.traces import FleetTrace

    rng = np.random.default_rng(0)
    m, step = 30, 10.0
    rates = 10 ** rng.uniform(-2.5, -0.5, m)
    counts = rng.poisson(np.tile(rates * step, (int(1.5 * 86_400 / step), 1))).astype(float)
    trace = FleetTrace(names=tuple(f"m{i}" for i in range(m)), counts=counts, step_s=step, source="sparse", kind="counts")
    env = FleetEnv(catalog=default_catalog(trace.names), step_s=step, n_nodes=2, node_gpu_gb=640.0, node_host_gb=1024.0)
    policy = FleetPlanner(cold_start_budget=budget)
    score = simulate(trace, policy, env, score_after_s=43_200.0)
    assert policy.cold_start_budget == budget
    assert 0.5 <= score.cold_share / budget <= 1.25, score


def test_the_price_answers_for_the_waits_of_models_no_count_is_sized_for() -> None:
    """The price is steered by the waits warmth prevents: those of models the round sizes no count for. A model
    bursting beyond a replica (`burst_replicas`) has a count; its requests that waited for a slot are that count's,
    and they do not move the price (counted, on the shared pool they drove it down for nothing: 0.2346% waited at
    1,471,845 GB·h, against 0.2377% at 1,161,727 without them). A sparse model's waits do."""
    counts, catalog, nodes, params = _fleet(120)
    counts[-5:, 3] = 2_000  # m3 bursts: 33 requests/s, several replicas' worth
    counts[-1, 1] = max(counts[-1, 1], 4.0)  # m1, sparse, has requests in the last bucket
    params = replace(params, fleet=FleetParams(step_s=STEP, cold_start_budget=0.01))
    assert "m3" in burst_replicas(counts, catalog, params) and "m1" not in burst_replicas(counts, catalog, params)
    _, state = fleet_round(counts[:-1], catalog, nodes, now=(counts.shape[0] - 1) * STEP, params=params,
                           state=RoundState())
    probe, _ = fleet_round(counts, catalog, nodes, now=counts.shape[0] * STEP, params=params, state=state)
    dens = probe.plan.density[probe.plan.density > 0]
    state = replace(state, planner=FleetState(lam=float(np.sqrt(dens.min() * dens.max()))))  # within the densities

    def price(waited_model: int | None) -> float:
        waited = np.zeros_like(counts)
        if waited_model is not None:
            waited[-1, waited_model] = counts[-1, waited_model] / 2
        _, after = fleet_round(counts, catalog, nodes, now=counts.shape[0] * STEP, params=params, state=state,
                               waited=waited)
        return after.planner.lam

    calm = price(None)
    assert price(3) == calm  # the bursting model's slot waits: its count's
    assert price(1) < calm  # a sparse model's waits: warmth's
