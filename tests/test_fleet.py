"""The fleet: trace readers, catalog, estimator, the pure fleet planner and the multi-model backtest."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecasting.fleet.backtest import FleetSetup, resample, run_fleet_backtest
from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_catalog, load_catalog
from forecasting.fleet.estimate import ArrivalEstimator
from forecasting.fleet.planner import ActionKind, FleetContext, FleetNode, FleetParams, FleetState, plan_fleet, steer
from forecasting.fleet.policies import FleetEnv, HybridHistogram, KeepAlive, Oracle
from forecasting.fleet.round import serving_replicas
from forecasting.fleet.simulate import simulate
from forecasting.fleet.traces import FleetTrace, is_fleet_trace, load_fleet, read_azure_functions, read_request_log
from forecasting.data.traces import HistoryError

FIX = Path(__file__).parent / "fixtures" / "fleet"
AZURE = [FIX / "azure_functions_d01.csv", FIX / "azure_functions_d02.csv"]


# --- readers ---------------------------------------------------------------------------------
def test_client_rates_become_counts_per_window() -> None:
    tr = load_fleet([FIX / "client_rates.csv"])
    assert tr.kind == "client_rates" and tr.step_s == 600.0
    assert set(tr.names) == {"client-dense", "client-periodic", "client-sparse", "client-rare"}
    rare = tr.counts[:, tr.names.index("client-rare")]
    assert np.flatnonzero(rare).tolist() == [40, 41, 200]
    assert rare[40] == pytest.approx(0.05 * 600)
    assert (tr.counts[:, tr.names.index("client-dense")] > 0).all()


def test_azure_functions_read_by_name_whatever_the_column_order() -> None:
    tr = read_azure_functions(AZURE)
    assert tr.kind == "azure_functions" and tr.step_s == 60.0 and tr.n_steps == 2 * 1440
    # day 2 names its minutes minute_N and puts the hashes in reverse order: same apps, same totals
    import pandas as pd

    d1, d2 = (pd.read_csv(p) for p in AZURE)
    assert tr.n_models == d1["HashApp"].nunique()
    assert tr.counts[:1440].sum() == d1[[str(m) for m in range(1, 1441)]].to_numpy().sum()
    assert tr.counts[1440:].sum() == d2[[f"minute_{m}" for m in range(1, 1441)]].to_numpy().sum()
    per_function = read_azure_functions(AZURE, unit="function")
    assert per_function.n_models == len(d1) and per_function.total_requests == tr.total_requests


def test_request_log_with_user_named_columns() -> None:
    tr = read_request_log(FIX / "genai_requests.csv", time_column="gmt_create",
                          model_column="checkpoint_model_version_id", step_s=60)
    import pandas as pd

    rows = pd.read_csv(FIX / "genai_requests.csv")
    assert tr.names == ("ckpt-a", "ckpt-b", "ckpt-c")
    assert tr.total_requests == len(rows)
    assert tr.counts[:, 0].sum() == (rows["checkpoint_model_version_id"] == "ckpt-a").sum()
    with pytest.raises(HistoryError, match="no column"):
        read_request_log(FIX / "genai_requests.csv", time_column="ts", model_column="checkpoint_model_version_id")


def test_format_detection() -> None:
    assert is_fleet_trace(AZURE[0]) and is_fleet_trace(FIX / "client_rates.csv")
    assert not is_fleet_trace(FIX / "genai_requests.csv")
    with pytest.raises(HistoryError, match="time-column"):
        load_fleet([FIX / "genai_requests.csv"])


def test_resample_keeps_requests() -> None:
    tr = load_fleet([FIX / "client_rates.csv"])
    fine = resample(tr, 60.0)
    assert fine.n_steps == tr.n_steps * 10 and fine.total_requests == pytest.approx(tr.total_requests)
    assert resample(fine, 600.0).total_requests == pytest.approx(tr.total_requests)


# --- catalog ---------------------------------------------------------------------------------
def test_catalog_defaults_are_stable_and_tiers_ordered(tmp_path: Path) -> None:
    a, b = default_catalog(["m1", "m2", "m3"]), default_catalog(["m3", "m1"])
    assert a.card("m1").mem_gb == b.card("m1").mem_gb
    for c in a.cards:
        times = [c.time_to_ready(t) for t in Tier]
        assert times == sorted(times) and times[0] == 0.0
    measured = a.with_measured("m1", "h100", Tier.ASLEEP, 0.9)
    assert measured.card("m1").time_to_ready(Tier.ASLEEP, "h100") == 0.9
    (tmp_path / "cat.json").write_text(json.dumps({"models": [{"name": "m2", "mem_gb": 5, "priority": 3}]}))
    loaded = load_catalog(tmp_path / "cat.json", ["m1", "m2"])
    assert loaded.names == ("m1", "m2") and loaded.card("m2").priority == 3.0


# --- estimator -------------------------------------------------------------------------------
def test_estimator_learns_a_period_and_bridges_the_gap() -> None:
    est = ArrivalEstimator(2, 60.0, slot_s=600.0, day_s=86_400.0)
    for t in range(600):
        est.observe(np.array([1.0 if t % 10 == 0 else 0.0, 0.0]))
    out = est.outlook()  # idle 9 steps into a period of 10: the next step is the arrival
    assert out.rate[0] > 0.5
    assert out.rate[1] == 0.0 and out.p_next[1] == 0.0  # never seen: nothing to warm
    est.observe(np.array([1.0, 0.0]))
    est.observe(np.array([0.0, 0.0]))
    assert est.outlook().rate[0] > 1.0 / 12  # one idle step in: worth staying warm until the next tick


def test_estimator_fades_past_every_gap_it_has_seen() -> None:
    """A model idle far longer than any gap of the fleet: a small chance (about 1/idle), never 1."""
    est = ArrivalEstimator(2, 60.0, slot_s=600.0, day_s=86_400.0)
    est.observe(np.array([0.0, 1.0]))
    for t in range(300):
        est.observe(np.array([1.0, 0.0]))  # model 0 busy every step: the fleet has no gaps at all
    out = est.outlook()
    assert out.rate[1] < 0.05 and out.p_next[1] < 0.05
    assert out.rate[0] > 0.9


# --- planner ---------------------------------------------------------------------------------
def _ctx(rate: list[float], nodes: tuple[FleetNode, ...], budget: float | None = None,
         mems: tuple[float, ...] = (40.0, 40.0, 40.0)) -> FleetContext:
    cat = Catalog(tuple(ModelCard(name=f"m{i}", mem_gb=m) for i, m in enumerate(mems)))
    return FleetContext(now=0.0, catalog=cat, nodes=nodes, rate=np.array(rate), burst_requests=np.full(len(mems), 10.0),
                        params=FleetParams(step_s=60.0, budget_gb=budget))


def test_planner_keeps_the_best_density_within_node_memory() -> None:
    nodes = (FleetNode("a", gpu_gb=80.0, host_gb=100.0), FleetNode("b", gpu_gb=40.0, host_gb=0.0))
    plan, _ = plan_fleet(_ctx([0.9, 0.5, 0.1], nodes), FleetState(lam=0.0))
    assert sum(len(v) for v in plan.gpu.values()) == 3  # 120 GB of 120
    plan, _ = plan_fleet(_ctx([0.9, 0.5, 0.1], nodes, mems=(40.0, 40.0, 60.0)), FleetState(lam=0.0))
    assert set(plan.gpu) == {"m0", "m1"} and plan.gpu_gb <= 120.0
    assert plan.asleep == {}  # m2 runs nowhere: no engine to put to sleep (a sleep is a running engine's)
    ran = (FleetNode("a", gpu_gb=80.0, host_gb=100.0, resident={"m2": Tier.GPU}), nodes[1])
    plan, _ = plan_fleet(_ctx([0.9, 0.5, 0.1], ran, mems=(40.0, 40.0, 60.0)), FleetState(lam=0.0))
    assert set(plan.gpu) == {"m0", "m1"} and plan.asleep == {"m2": "a"}  # the next best sleeps where it ran
    assert ("sleep", "m2", "a") in {(a.kind.value, a.model, a.node) for a in plan.actions}


def test_planner_never_evicts_a_replica_with_requests_in_flight() -> None:
    node = FleetNode("a", gpu_gb=80.0, host_gb=0.0, resident={"m2": Tier.GPU}, in_flight={"m2": 3})
    plan, _ = plan_fleet(_ctx([0.9, 0.8, 0.0], (node,)), FleetState(lam=1e-6))
    assert plan.gpu["m2"] == ("a",) and set(plan.gpu) == {"m0", "m2"}
    idle = FleetNode("a", gpu_gb=80.0, host_gb=0.0, resident={"m2": Tier.GPU})
    plan, _ = plan_fleet(_ctx([0.9, 0.8, 0.0], (idle,)), FleetState(lam=1e-6))
    assert "m2" not in plan.gpu
    assert any(a.kind == ActionKind.EVICT and a.model == "m2" for a in plan.actions)


def test_requests_in_flight_keep_a_model_not_every_replica_of_it() -> None:
    """A busy model spread over three nodes, its count planner now asking for one replica: one stays (where the
    most requests are in flight), the others go. Keeping every replica with requests in flight ratcheted a dense
    model's count up to one per node while it was busy (ServeGen m-large clients, 4 days: 434,955 requests
    waited at 379,442 GB·h; keeping one, 63,854 at 279,886 GB·h)."""
    nodes = tuple(FleetNode(n, gpu_gb=80.0, host_gb=0.0, resident={"m0": Tier.GPU}, in_flight={"m0": k})
                  for n, k in (("a", 2), ("b", 5), ("c", 1)))
    ctx = replace(_ctx([1.0, 0.0, 0.0], nodes), replicas={"m0": 1})
    plan, _ = plan_fleet(ctx, FleetState(lam=1e-6))
    assert plan.gpu["m0"] == ("b",)
    assert {(a.kind, a.node) for a in plan.actions if a.model == "m0"} == {(ActionKind.EVICT, "a"),
                                                                           (ActionKind.EVICT, "c")}
    plan, _ = plan_fleet(replace(ctx, replicas={"m0": 3}), FleetState(lam=1e-6))
    assert sorted(plan.gpu["m0"]) == ["a", "b", "c"]  # asked for: kept where they run, nothing moves
    assert not [a for a in plan.actions if a.model == "m0"]


def test_the_load_now_comes_before_any_models_warmth() -> None:
    """A full pool: a dense model whose load needs two replicas now, and an idle model worth keeping warm. The
    second replica serving the load goes first (its requests wait for certain without it); the idle model's
    warmth gets what is left. Beyond the load now, the replicas the dense model's forecast needs come before an
    idle model's warmth too: they are sized on the cold-start budget for the many requests they serve (warmth
    first, the shared pool's warm sparse models took the memory of its dense models' margins: 0.2496% of its
    requests waited over 14 days, against 0.2346% with the margin first, at the same memory-time, the price then
    answering for the bursting models' slot waits too)."""
    nodes = (FleetNode("a", gpu_gb=80.0, host_gb=0.0, resident={"m0": Tier.GPU, "m1": Tier.GPU}),)
    base = replace(_ctx([1.0, 0.9, 0.0], nodes), replicas={"m0": 3})
    plan, _ = plan_fleet(replace(base, serving={"m0": 2}), FleetState(lam=1e-6))
    assert plan.gpu == {"m0": ("a", "a")}
    plan, _ = plan_fleet(base, FleetState(lam=1e-6))  # no load to serve beyond one replica: the forecast's first
    assert plan.gpu == {"m0": ("a", "a")}
    plan, _ = plan_fleet(replace(base, replicas={"m0": 1}), FleetState(lam=1e-6))  # ... and warmth within what is left
    assert plan.gpu == {"m0": ("a",), "m1": ("a",)}


def test_serving_replicas_are_the_last_buckets_rate_at_full_capacity() -> None:
    cat = Catalog(tuple(ModelCard(name=f"m{i}", mem_gb=10.0, capacity_rps=10.0) for i in range(4)))
    counts = np.array([[9000.0, 0.0, 0.0, 600.0], [1500.0, 700.0, 30.0, 0.0]])  # the last minute: 25, 11.7, 0.5, 0 req/s
    assert serving_replicas(counts, cat, {"m0": 2, "m1": 5, "m2": 4, "m3": 3}, 60.0) == {"m0": 2, "m1": 2, "m2": 1}
    assert serving_replicas(np.zeros((0, 4)), cat, {"m0": 2}, 60.0) == {}


def test_planner_price_tracks_the_fleet_budget() -> None:
    nodes = (FleetNode("a", gpu_gb=200.0, host_gb=0.0),)
    state = FleetState(lam=1e-6)
    used = []
    for _ in range(200):
        plan, state = plan_fleet(_ctx([0.9, 0.5, 0.1], nodes, budget=60.0), state)
        used.append(plan.gpu_gb)
    assert np.mean(used[100:]) <= 60.0 * 1.25 and state.lam > 1e-6
    assert set(plan_fleet(_ctx([0.9, 0.5, 0.1], nodes, budget=60.0), state)[0].gpu) <= {"m0", "m1"}


# --- backtest --------------------------------------------------------------------------------
def test_simulated_policies_order_as_expected() -> None:
    tr = read_azure_functions(AZURE)
    cat = default_catalog(tr.names)
    env = FleetEnv(catalog=cat, step_s=60.0, n_nodes=1, node_gpu_gb=cat.total_gb(), node_host_gb=512.0,
                   counts=tr.counts)
    short = simulate(tr, KeepAlive(60.0, name="reactive"), env, score_after_s=86_400)
    long = simulate(tr, KeepAlive(3600.0), env, score_after_s=86_400)
    oracle = simulate(tr, Oracle(), env, score_after_s=86_400)
    hh = simulate(tr, HybridHistogram(), env, score_after_s=86_400)
    assert long.cold_share < short.cold_share and long.warm_gb_h > short.warm_gb_h
    assert oracle.cold_share == 0.0 and oracle.warm_gb_h < long.warm_gb_h
    assert hh.requests == short.requests == tr.counts[1440:].sum()
    assert short.wasted_gb_h <= short.warm_gb_h


def test_fleet_backtest_runs_every_policy_and_the_curve(tmp_path: Path) -> None:
    tr = load_fleet(AZURE)
    out = run_fleet_backtest(tr, setup=FleetSetup(capacity_share=0.5, score_after_s=86_400))
    names = [r["policy"] for r in out["rows"]]
    assert names == ["keepalive", "keepalive_sleep", "hybrid_histogram", "hybrid_histogram_sleep", "reactive",
                     "oracle", "fleet"]
    assert set(out["curves"]) == {"keepalive", "keepalive_sleep", "hybrid_histogram", "hybrid_histogram_sleep", "fleet"}
    rows = {r["policy"]: r for r in out["rows"]}
    assert all(r["starts"] == r["loads"] + r["wakes"] for r in out["rows"])
    assert rows["keepalive_sleep"]["sleeps"] > 0 and rows["keepalive"]["sleeps"] == 0
    assert rows["keepalive_sleep"]["wakes"] > 0 and rows["keepalive"]["wakes"] == 0
    eq = out["at_equal"]
    assert eq["cold_share_at_equal_warm_gb_h"]["fleet"] == rows["fleet"]["cold_share"]
    assert set(eq["warm_gb_h_at_equal_cold_share"]) == set(names)
    fleet = out["rows"][-1]
    assert fleet["warm_gb_h"] <= out["target"]["hybrid_warm_gb_h"] * 1.0001
    assert all(r["avg_warm_gb"] <= out["fleet"]["gpu_capacity_gb"] + 1e-6 for r in out["rows"])
    from forecasting.fleet.report import plot_curves, table_lines

    assert plot_curves(out, tmp_path / "curve.png").stat().st_size > 0
    assert len(table_lines(out, markdown=True)) == 2 + len(out["rows"])


def test_backtest_cli_reads_a_request_log(capsys: pytest.CaptureFixture[str]) -> None:
    from prewarm.cli import main

    rc = main(["backtest", str(FIX / "genai_requests.csv"), "--time-column", "gmt_create",
               "--model-column", "checkpoint_model_version_id", "--no-curve", "--nodes", "1", "--node-gpu-gb", "40",
               "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["models"] == 3 and {r["policy"] for r in result["rows"]} >= {"fleet", "oracle", "hybrid_histogram"}


def test_the_pool_replays_at_the_planners_fine_bucket_unless_told(capsys: pytest.CaptureFixture[str],
                                                                    clean_env: pytest.MonkeyPatch) -> None:
    """Live, the round sizes its dense models on the gateway's fine counters: the replay decides at that step."""
    from prewarm.cli import main

    def step(*flags: str) -> float:
        assert main(["backtest", str(FIX / "client_rates.csv"), "--no-curve", "--json", "--policies", "keepalive",
                     "--jobs", "1", *flags]) == 0
        return float(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_s"])

    assert step() == 10.0
    assert step("--step", "60") == 60.0
    clean_env.setenv("PREWARM_PLANNER_FINE_BUCKET_S", "20")
    assert step() == 20.0


def test_fleet_trace_head_keeps_the_busiest() -> None:
    tr = FleetTrace(("a", "b", "c"), np.array([[1.0, 5.0, 0.0], [0.0, 5.0, 2.0]]), 60.0, "x", "test")
    assert tr.head(2).names == ("b", "c")


def test_one_client_of_a_fleet_trace_is_a_rate_trace_with_zeros_where_it_sent_nothing() -> None:
    fleet = load_fleet([FIX / "client_rates.csv"])
    rare = fleet.client("client-rare")
    assert rare.window_s == 600.0 and rare.rate.size == fleet.n_steps and rare.source.endswith(":client-rare")
    assert np.flatnonzero(rare.rate).tolist() == [40, 41, 200] and rare.rate[40] == pytest.approx(0.05)
    assert rare.window_start_s[:3].tolist() == [0.0, 600.0, 1200.0]
    assert fleet.client("client-rare", limit_s=41 * 600.0 - 1.0).rate.size == 41  # the window begun is kept
    with pytest.raises(HistoryError, match="no model 'nope'"):
        fleet.client("nope")


def test_the_memory_price_is_steered_by_the_cold_start_budget() -> None:
    """Without a memory budget the price of warmth is an integrator of the cold-start budget's overspend: requests
    that waited beyond the budget lower it (more models stay warm), calm raises it, by `price_gain` e-folds per
    calibration window's budget; it stays within the densities' range (no wind-up beyond a decision)."""
    params = FleetParams(step_s=60.0, cold_start_budget=0.01, price_gain=1.0, calibration_s=3600.0)
    dens = np.array([10.0, 1.0, 0.01, 0.0])
    state = FleetState(lam=1.0)
    # an hour at 1 request/s: 36 waited of 3,600 is the budget; 72 overspends it by one window's budget
    over = steer(state, params, (3600.0, 72.0, 3600.0), dens)
    assert over.lam == pytest.approx(math.exp(-1.0)) and over.counted_rate == pytest.approx(1.0)
    assert steer(state, params, (3600.0, 36.0, 3600.0), dens).lam == pytest.approx(1.0)  # the budget, spent
    calm = steer(state, params, (3600.0, 0.0, 3600.0), dens)
    assert calm.lam == pytest.approx(math.e)
    assert steer(state, params, (3600.0, 3600.0, 3600.0), dens).lam == 0.01  # at the lowest density: every model warm
    assert steer(FleetState(lam=9.0), params, (36_000.0, 0.0, 36_000.0), dens).lam == pytest.approx(10.0)  # just above the highest
    assert steer(state, params, None, dens) == state  # nothing counted since the last round
    assert steer(state, replace(params, budget_gb=100.0), (3600.0, 72.0, 3600.0), dens) == state  # a memory budget steers it
    assert steer(state, replace(params, cold_start_budget=None), (3600.0, 72.0, 3600.0), dens) == state
    # the round uses the steered price: a model whose density is below the old price but above the new one is kept
    nodes = (FleetNode("a", gpu_gb=120.0, host_gb=0.0),)
    ctx = replace(_ctx([0.9, 0.5, 0.02], nodes), params=params)
    kept, _ = plan_fleet(ctx, FleetState(lam=3.0))
    steered, next_state = plan_fleet(replace(ctx, observed=(3600.0, 360.0, 3600.0)), FleetState(lam=3.0))
    assert set(kept.gpu) < set(steered.gpu) and next_state.lam < 3.0
