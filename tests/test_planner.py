"""The planner's rules, table-driven, with `now` passed in and state carried through loops."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from forecasting.planner import (
    BatchJob,
    PlanContext,
    PlannerParams,
    PlannerState,
    ReplicaCounts,
    event_id,
    plan,
    replicas_needed,
)
from prewarm.core.domain import ModelSpec, NodeView, Pool, ScaleEventKind
from prewarm.core.errors import InvalidPayload
from prewarm.core.settings import PlannerSettings

MODEL = ModelSpec(name="m", revision="r1", capacity_rps=10.0)
# no pool, no budget limit: isolate the serving rules
BASE = PlannerParams(warm_pool_percent=0.0, budget_share=1.0, lead_margin_s=10.0, default_cold_start_s=20.0)


def frame(values: list[float], start: float = 0.0, bucket: float = 60.0, col: str = "q0.9") -> pd.DataFrame:
    idx = [start + i * bucket for i in range(len(values))]
    return pd.DataFrame({"q0.5": [v / 2 for v in values], col: values, "q0.99": [v * 1.5 for v in values]}, index=idx)


def ctx(values: list[float], now: float, ready: int, loading: int = 0, warm: int = 0, **kw: object) -> PlanContext:
    params = kw.pop("params", BASE)
    return PlanContext(MODEL, frame(values), ReplicaCounts(ready, loading, warm), now, params, **kw)  # type: ignore[arg-type]


def kinds(result: object) -> list[tuple[str, str, int]]:
    return [(e.kind.value, e.pool.value, e.replicas) for e in result.events]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "demand,capacity,headroom,expected",
    [(0.0, 10, 0.1, 0), (10.0, 10, 0.0, 1), (10.0, 10, 0.1, 2), (27.0, 10, 0.1, 3), (30.0, 10, 0.0, 3),
     (3.0, 10, 0.0, 1), (100.0, 4, 0.25, 32)],
)
def test_replicas_needed(demand: float, capacity: float, headroom: float, expected: int) -> None:
    assert replicas_needed(demand, capacity, headroom) == expected


@pytest.mark.parametrize(
    "values,ready,expected_at,expected_n",
    [
        # the rise is at bucket 3 (t=180): lead 30 s -> up at 150
        ([5, 5, 5, 25, 25], 1, 150.0, 2),
        # a rise in the current bucket: now
        ([25, 25], 1, 0.0, 2),
        # enough live: nothing
        ([5, 5, 25], 3, None, 0),
    ],
)
def test_scale_up_at_need_minus_lead(values: list[float], ready: int, expected_at: float | None, expected_n: int) -> None:
    res, _ = plan(ctx(values, now=0.0, ready=ready), PlannerState())
    ups = [e for e in res.events if e.kind is ScaleEventKind.SCALE_UP]
    if expected_at is None:
        assert ups == []
    else:
        assert [(e.at, e.replicas) for e in ups][0] == (expected_at, expected_n)
    assert res.lead_s == 30.0


def test_measured_cold_start_sets_lead() -> None:
    res, _ = plan(ctx([5, 5, 5, 25], now=0.0, ready=1, cold_start_p95_s=50.0), PlannerState())
    assert res.lead_s == 60.0
    assert res.events[0].at == 120.0


def test_recent_peak_floors_the_need() -> None:
    """A burst just seen (and not forecast) keeps capacity for it: the peak hold."""
    quiet = [5.0, 5.0, 5.0]
    res, _ = plan(ctx(quiet, now=0.0, ready=1), PlannerState())
    assert [b.need for b in res.needs] == [1, 1, 1]
    res, _ = plan(ctx(quiet, now=0.0, ready=1, recent_peak_rps=35.0), PlannerState())
    assert [b.need for b in res.needs] == [4, 4, 4]
    ups = [e for e in res.events if e.kind is ScaleEventKind.SCALE_UP]
    assert [(e.at, e.replicas) for e in ups] == [(0.0, 3)]


def test_staircase_ups_are_incremental() -> None:
    res, _ = plan(ctx([5, 15, 25, 35], now=0.0, ready=1), PlannerState())
    assert [(e.at, e.replicas) for e in res.events] == [(30.0, 1), (90.0, 1), (150.0, 1)]


def test_scale_down_waits_for_stabilization_state_carried() -> None:
    # need drops from 4 to 1 and stays: the scale-down comes only after 300 s
    state = PlannerState()
    seen = []
    ready = 4
    for now in range(0, 420, 60):
        res, state = plan(ctx([5.0] * 30, now=float(now), ready=ready, params=BASE), state)
        seen.append((now, [e.kind for e in res.events]))
        ready = res.serving_target(ready, float(now))  # carry the events out
    assert ready == 1
    downs = [now for now, ks in seen if ScaleEventKind.SCALE_DOWN in ks]
    assert downs and downs[0] == 300
    assert state.below_since is None  # the fall was acted on


def test_hold_when_forecast_rises_within_window_plus_lead() -> None:
    # now=0, need 1 now, rises to 3 at t=240 (< 300 + 30): hold 2, never scale down
    values = [5, 5, 5, 5, 25, 25, 25]
    state = PlannerState(below_since=-1000.0)  # well past stabilization
    res, state = plan(ctx(values, now=0.0, ready=3), state)
    assert kinds(res) == [("hold", "serving", 2)]
    assert "rises to 3" in res.events[0].reason


def test_rise_beyond_window_allows_scale_down() -> None:
    values = [5] * 7 + [25] * 3  # the rise at 420 > 330
    res, _ = plan(ctx(values, now=0.0, ready=3), PlannerState(below_since=-1000.0))
    assert ("scale_down", "serving", 2) in kinds(res)


def test_partial_hold_and_down() -> None:
    # live 5, need 1 now, rises to 3 inside the window: keep 3 (hold 2), drop 2
    values = [5, 5, 25, 25]
    res, _ = plan(ctx(values, now=0.0, ready=5), PlannerState(below_since=-1000.0))
    assert sorted(kinds(res)) == [("hold", "serving", 2), ("scale_down", "serving", 2)]


@pytest.mark.parametrize(
    "size,percent,need_rps,expected",
    [(None, 10.0, 5.0, 1), (None, 10.0, 250.0, 3), (2, 10.0, 250.0, 2), (None, 0.0, 250.0, 0)],
)
def test_warm_pool_target(size: int | None, percent: float, need_rps: float, expected: int) -> None:
    params = replace(BASE, warm_pool_size=size, warm_pool_percent=percent, headroom=0.0)
    res, _ = plan(ctx([need_rps] * 5, now=0.0, ready=30, params=params), PlannerState())
    assert res.pool_target == expected
    warm = [e for e in res.events if e.pool is Pool.WARM]
    assert [(e.kind, e.replicas) for e in warm] == ([(ScaleEventKind.SCALE_UP, expected)] if expected else [])


def test_warm_pool_shrinks_when_too_big() -> None:
    params = replace(BASE, warm_pool_size=1)
    res, _ = plan(ctx([5.0] * 5, now=0.0, ready=1, warm=3, params=params), PlannerState())
    assert [(e.kind, e.pool, e.replicas) for e in res.events] == [(ScaleEventKind.SCALE_DOWN, Pool.WARM, 2)]


def test_batch_job_prescaled_before_cron_time() -> None:
    # daily job at 00:10 UTC (t=600 from epoch 0), needs 4 replicas for 120 s
    job = BatchJob(cron="10 0 * * *", model="m", replicas=4, duration_s=120.0, name="nightly")
    params = replace(BASE, batch_jobs=(job,))
    res, _ = plan(ctx([5.0] * 15, now=0.0, ready=1, params=params), PlannerState())
    ups = [e for e in res.events if e.kind is ScaleEventKind.SCALE_UP]
    assert [(e.at, e.replicas) for e in ups] == [(570.0, 4)]
    assert "batch 4" in ups[0].reason
    assert [b.need for b in res.needs][9:13] == [1, 5, 5, 1]


def test_batch_job_other_model_ignored_and_bad_cron_refused() -> None:
    job = BatchJob(cron="10 0 * * *", model="other", replicas=4, duration_s=120.0)
    res, _ = plan(ctx([5.0] * 15, now=0.0, ready=1, params=replace(BASE, batch_jobs=(job,))), PlannerState())
    assert res.events == ()
    with pytest.raises(InvalidPayload, match="invalid cron"):
        BatchJob(cron="not a cron", model="m", replicas=1, duration_s=1)


def test_budget_drops_holds_and_pool_and_says_why() -> None:
    params = replace(BASE, budget_share=0.12, warm_pool_percent=10.0)
    values = [5, 5, 5, 25, 25]
    res, _ = plan(ctx(values, now=0.0, ready=3, params=params), PlannerState(below_since=-1000.0))
    assert res.dropped, "the budget should bind: a 2-replica hold and a pool on a 1-replica need"
    reasons = " ".join(d.reason for d in res.dropped)
    assert "budget" in reasons and "12%" in reasons
    assert {d.event.kind for d in res.dropped} >= {ScaleEventKind.HOLD}
    assert res.warm_share <= 0.12 + 1e-9


def test_budget_does_not_bind_with_room() -> None:
    params = replace(BASE, budget_share=0.12, warm_pool_percent=10.0)
    res, _ = plan(ctx([305.0] * 60, now=0.0, ready=34, params=params), PlannerState())
    assert res.dropped == ()
    assert res.pool_target == 4  # ceil(10% of 34); 4 / 38 = 10.5% <= 12%


@pytest.mark.parametrize(
    "nodes,expected",
    [
        # the snapshot holder wins even when more loaded
        ((NodeView("a", replica_slots=4, replicas=0), NodeView("b", replica_slots=4, replicas=2, snapshots=frozenset({"m@r1"}))),
         ("b", "b")),
        # no snapshot anywhere: least loaded first, spreading
        ((NodeView("a", replica_slots=4, replicas=3), NodeView("b", replica_slots=4, replicas=1)), ("b", "b")),
        # a full node and a not-ready node are skipped
        ((NodeView("a", replica_slots=1, replicas=1, snapshots=frozenset({"m@r1"})), NodeView("b", ready=False),
          NodeView("c", replica_slots=2)), ("c", "c")),
    ],
)
def test_placement(nodes: tuple[NodeView, ...], expected: tuple[str, ...]) -> None:
    res, _ = plan(ctx([25.0], now=0.0, ready=1, nodes=nodes), PlannerState())
    assert res.events[0].nodes == expected


def test_placement_without_room_drops_with_reason() -> None:
    res, _ = plan(ctx([35.0], now=0.0, ready=1, nodes=(NodeView("a", replica_slots=2, replicas=1),)), PlannerState())
    assert res.events[0].replicas == 1 and res.events[0].nodes == ("a",)
    assert res.dropped[0].event.replicas == 2 and "no ready node with room" in res.dropped[0].reason


def test_event_ids_stable_across_replans() -> None:
    values = [5, 5, 5, 25, 25]
    a, _ = plan(ctx(values, now=0.0, ready=1), PlannerState())
    b, _ = plan(ctx(values, now=20.0, ready=1), PlannerState())
    assert a.events[0].event_id == b.events[0].event_id
    assert a.events[0].event_id == event_id(MODEL, ScaleEventKind.SCALE_UP, 180.0, Pool.SERVING)
    assert event_id(MODEL, ScaleEventKind.SCALE_UP, 180.0, Pool.WARM) != a.events[0].event_id


def test_replan_after_execution_adds_nothing() -> None:
    values = [5, 5, 5, 25, 25]
    a, _ = plan(ctx(values, now=150.0, ready=1), PlannerState())
    assert a.serving_target(1, 150.0) == 3
    b, _ = plan(ctx(values, now=160.0, ready=1, loading=2), PlannerState())
    assert [e for e in b.events if e.kind is ScaleEventKind.SCALE_UP] == []


def test_missing_quantile_column_is_named() -> None:
    with pytest.raises(InvalidPayload, match="q0.95"):
        plan(ctx([5.0], now=0.0, ready=1, params=replace(BASE, quantile=0.95)), PlannerState())


def test_params_from_settings() -> None:
    s = PlannerSettings(batch_jobs=[{"cron": "0 2 * * *", "model": "m", "replicas": 2, "duration_s": 600}])
    p = PlannerParams.from_settings(s)
    assert p.quantile == s.quantile and p.stabilization_s == 300.0 and p.budget_share == 0.12
    assert p.batch_jobs[0].replicas == 2
