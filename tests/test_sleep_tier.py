"""The asleep tier where the engine reports it absent: the report's rules, the fleet planner, the parking step.

Pure: `prewarm.policy.sleep_tier`, `forecasting.fleet.planner.plan_fleet` and `forecasting.planner.step`
with the inputs they are given. The live path (an agent publishing its engines' answers, the planner
reading them) is tests/test_sleep_report_live.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_ready_s
from forecasting.fleet.planner import ActionKind, FleetContext, FleetNode, FleetParams, FleetState, plan_fleet
from forecasting.planner import PlannerState, ReplicaCounts, step
from prewarm.policy.sleep_tier import can_sleep, parse_report, sleep_report, tier_absent
from tests.test_planner import BASE, _rising_profile, inputs, kinds


# --- the report ------------------------------------------------------------------------------------------

def test_the_report_carries_each_engines_answer_and_leaves_out_an_engine_not_asked() -> None:
    models = {"chat": "vllm", "embed": "builtin"}
    assert sleep_report("builtin", models, {"builtin": True, "vllm": False}) == \
        {"*": True, "chat": False, "embed": True}
    assert sleep_report("builtin", models, {"builtin": True, "vllm": None}) == {"*": True, "embed": True}
    assert sleep_report("vllm", {}, {"builtin": True}) == {}  # the default engine has not answered: nothing


def test_a_model_is_reported_by_name_or_under_the_default_engine_and_unreported_otherwise() -> None:
    report = parse_report('{"*": true, "chat": false}')
    assert can_sleep(report, "chat") is False and can_sleep(report, "chat@r2") is False
    assert can_sleep(report, "other") is True
    assert can_sleep(parse_report('{"chat": false}'), "other") is None
    for bad in (None, "", "not json", "[1]", '{"chat": "no"}'):
        assert parse_report(bad) == {}, bad


def test_the_tier_is_absent_only_where_every_report_on_the_model_says_no() -> None:
    no, yes = {"chat": False}, {"*": True}
    silent: dict[str, bool] = {}
    assert tier_absent([no, no], "chat")
    assert not tier_absent([no, yes], "chat")  # one node where its engine can sleep keeps the tier
    assert not tier_absent([no, silent], "chat")  # a node that says nothing: never assumed absent
    assert not tier_absent([], "chat")


# --- the fleet planner --------------------------------------------------------------------------------------

def _card(name: str, *, sleeps: bool = True) -> ModelCard:
    return ModelCard(name=name, mem_gb=8.0, ready_s={"default": default_ready_s(8.0)}, sleeps=sleeps)


def _round(cards: tuple[ModelCard, ...], nodes: tuple[FleetNode, ...]) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """One round where GPU memory is priced out of reach (nothing stays on GPU) and host memory is free:
    every model on GPU goes to sleep where it may, else is evicted."""
    cat = Catalog(cards)
    ctx = FleetContext(now=0.0, catalog=cat, nodes=nodes, rate=np.full(len(cards), 0.5),
                       burst_requests=np.full(len(cards), 50.0), params=FleetParams())
    plan, _ = plan_fleet(ctx, FleetState(lam=1e9))
    return dict(plan.asleep), sorted((a.kind.value, a.model, a.node) for a in plan.actions)


def test_the_fleet_plans_no_asleep_tier_for_a_model_whose_engine_reports_none() -> None:
    node = FleetNode("n1", gpu_gb=32.0, host_gb=64.0, resident={"b": Tier.GPU, "v": Tier.GPU})
    asleep, actions = _round((_card("b"), _card("v", sleeps=False)), (node,))
    assert asleep == {"b": "n1"}  # the builtin engine's model sleeps; the other one is evicted
    assert actions == [("evict", "v", "n1"), ("sleep", "b", "n1")]
    asleep, actions = _round((_card("b"), _card("v")), (node,))  # reported present: both sleep
    assert asleep == {"b": "n1", "v": "n1"} and {a[0] for a in actions} == {ActionKind.SLEEP.value}


def test_the_fleet_puts_a_model_to_sleep_only_on_a_node_whose_engine_can() -> None:
    cpu = FleetNode("cpu", gpu_gb=32.0, host_gb=64.0, resident={"v": Tier.GPU}, no_sleep=frozenset({"v"}))
    cuda = FleetNode("cuda", gpu_gb=32.0, host_gb=16.0)
    asleep, actions = _round((_card("v"),), (cpu, cuda))
    # never a sleep the cpu node refuses, nor one on a node it does not run on (a sleep is a running engine's)
    assert asleep == {} and actions == [("evict", "v", "cpu")]
    asleep, actions = _round((_card("v"),), (cpu,))
    assert asleep == {} and actions == [("evict", "v", "cpu")]


def test_without_sleep_a_models_fallback_below_gpu_is_the_cache() -> None:
    cat = Catalog((_card("b"), _card("v", sleeps=False)))
    asleep, cached = cat.ready_array(Tier.ASLEEP), cat.ready_array(Tier.CACHED)
    assert asleep[0] < cached[0] and asleep[1] == cached[1]


# --- the single-model planner's parking -----------------------------------------------------------------

@pytest.mark.parametrize("sleep_tier,expected", [
    (True, [("park", "serving", 5)]),
    (False, [("scale_down", "serving", 5)]),  # reported absent: retired, never parked to be refused
])
def test_a_scale_down_parks_only_where_the_engine_can_sleep(sleep_tier: bool,
                                                          expected: list[tuple[str, str, int]]) -> None:
    inp = inputs([40.0] * 400, ready=12, params=replace(BASE, park_horizon_s=3600.0))
    inp = replace(inp, replicas=ReplicaCounts(12, 0, 0), sleep_tier=sleep_tier)
    d, _ = step(inp, PlannerState(profile=_rising_profile(inp.now, 2.0), profile_at=inp.now))
    assert d.target == 7 and kinds(d) == expected


def test_a_model_in_the_page_cache_takes_no_host_memory_from_one_leaving_gpu() -> None:
    """Only a model on GPU (or asleep) can sleep: a cached one planned asleep was a plan the agents cannot carry
    out, and it took the host memory the model leaving GPU needed (that one was evicted instead)."""
    node = FleetNode("n1", gpu_gb=32.0, host_gb=12.0, resident={"c": Tier.CACHED, "g": Tier.GPU})  # 9 GB to sleep in
    asleep, actions = _round((_card("c"), _card("g")), (node,))
    assert asleep == {"g": "n1"} and actions == [("sleep", "g", "n1")]


def test_a_model_leaving_gpu_sleeps_while_host_memory_lasts_whatever_a_wake_saves() -> None:
    """Host memory is a capacity, not a price: a model whose bursts are single requests (a wake spares no more
    of them than a load) still sleeps rather than leaving for the page cache while its node has room."""
    cat = Catalog((_card("a"), _card("b")))
    node = FleetNode("n1", gpu_gb=32.0, host_gb=12.0, resident={"a": Tier.GPU, "b": Tier.GPU})
    ctx = FleetContext(now=0.0, catalog=cat, nodes=(node,), rate=np.array([0.01, 0.5]),
                       burst_requests=np.ones(2), params=FleetParams())
    plan, _ = plan_fleet(ctx, FleetState(lam=1e9))
    assert dict(plan.asleep) == {"b": "n1"}  # one fits: the likelier to be asked for
    assert sorted((a.kind.value, a.model) for a in plan.actions) == [("evict", "a"), ("sleep", "b")]
