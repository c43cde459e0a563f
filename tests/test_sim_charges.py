"""What the replay charges (docs/simulator.md): shared load bandwidth, actuation delay, measured and
spread cold starts, the planner's running p95, the forecast-free ablation and the output contract."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecasting.charges import ACTUATION_S, LOAD_SHARE, WAIT_THRESHOLD_S, copies_ready_s
from forecasting.data.traces import RateTrace, RequestTrace
from forecasting.fleet.catalog import Catalog, ModelCard
from forecasting.fleet.policies import FleetEnv
from forecasting.budget import replicas_needed
from forecasting.planner import PlannerParams
from forecasting.sim.interface import Observation, Policy, PolicyEnv
from forecasting.sim.loads import LoadBank, cold_start_p95
from forecasting.sim.policies import POLICIES, Prewarm, ReactiveSized, make_policy, oracle_want
from forecasting.curves import foresight
from forecasting.sim.scoring import at_equal_share, run_backtest, run_sweep, sweep_summary
from forecasting.sim.simulate import SimParams, Workload, build_workload, replay
from prewarm.cli import main

IDEAL = SimParams(cold_start_cv=0.0, actuation_delay_s=0.0, load_share=0.0)
ROW_KEYS = {"policy", "knob", "value", "default", "gpu_hours", "gpu_hours_vs_reactive", "cold_start_share",
            "ttft_p99_s", "starts"}


def _drain(bank: LoadBank, until: float = 1e9) -> dict[int, float]:
    """Step the bank through every event up to `until`: replica -> ready time."""
    ready: dict[int, float] = {}
    while bank.next_time() <= until:
        for rid, at in bank.pop_ready(bank.next_time()):
            ready[rid] = at
    return ready


SHARED = replace(IDEAL, node_loads="shared")


@pytest.mark.parametrize(("node_loads", "gpus_per_node", "share", "expected"), [
    ("shared", 1, 1.0, {0: 10.0, 1: 10.0}),  # a node each: no sharing
    ("shared", 2, 1.0, {0: 20.0, 1: 20.0}),  # one node: two transfers at half speed
    ("shared", 2, 0.5, {0: 15.0, 1: 15.0}),  # half of each start is transfer (shared), half is not
    ("shared", 2, 0.0, {0: 10.0, 1: 10.0}),  # nothing shared
    # the default (prewarm's runtime fills the node snapshot once): the first replica is ready after one
    # load, where sharing made both wait for two; the last is no later
    ("ordered", 1, 1.0, {0: 10.0, 1: 10.0}),  # a node each: nothing to wait for
    ("ordered", 2, 1.0, {0: 10.0, 1: 20.0}),  # one node: the second transfers after the first
    ("ordered", 2, 0.5, {0: 10.0, 1: 15.0}),  # the second's transfer waits for the first's (5 s), not its rest
    ("ordered", 2, 0.0, {0: 10.0, 1: 10.0}),  # no transfer: nothing waits
])
def test_concurrent_loads_on_one_node_share_its_bandwidth_or_take_turns(
        node_loads: str, gpus_per_node: int, share: float, expected: dict[int, float]) -> None:
    bank = LoadBank(replace(IDEAL, node_loads=node_loads, cold_start_s=10.0, gpus_per_node=gpus_per_node,
                            load_share=share), np.random.default_rng(0))
    bank.begin(0, 0.0)
    bank.begin(1, 0.0)
    assert _drain(bank) == pytest.approx(expected)
    assert bank.starts == 2 and bank.loading == 0


def test_a_cancelled_load_held_bandwidth_until_cancelled() -> None:
    bank = LoadBank(replace(SHARED, cold_start_s=10.0, gpus_per_node=2, load_share=1.0), np.random.default_rng(0))
    bank.begin(0, 0.0)
    bank.begin(1, 0.0)
    assert _drain(bank, until=4.0) == {}
    bank.release(1, 4.0)  # cancelled: 0 has moved 2 s of its 10 at half speed, the other 8 at full
    assert _drain(bank) == pytest.approx({0: 12.0})
    assert bank.starts == 2  # the cancelled start was paid for


@pytest.mark.parametrize(("cancel", "expected"), [(0, {1: 14.0, 2: 24.0}), (1, {0: 10.0, 2: 20.0})])
def test_ordered_a_cancelled_transfer_hands_the_node_on_and_a_cancelled_waiter_leaves_the_queue(
        cancel: int, expected: dict[int, float]) -> None:
    bank = LoadBank(replace(IDEAL, cold_start_s=10.0, gpus_per_node=4, load_share=1.0), np.random.default_rng(0))
    for rid in range(3):
        bank.begin(rid, 0.0)
    assert _drain(bank, until=4.0) == {}
    bank.release(cancel, 4.0)  # 0 transfers (the next starts at 4 s), or 1 waits (gone; 2 follows 0)
    assert _drain(bank) == pytest.approx(expected)
    assert bank.starts == 3 and bank.loading == 0


def test_a_later_load_joins_the_sharing_and_slows_the_first() -> None:
    bank = LoadBank(replace(SHARED, cold_start_s=10.0, gpus_per_node=8, load_share=1.0), np.random.default_rng(0))
    bank.begin(0, 0.0)
    bank.begin(1, 6.0)  # 0 has 4 s left, now at half speed: done at 14; 1 then has 6 s left alone: 20
    assert _drain(bank) == pytest.approx({0: 14.0, 1: 20.0})
    ordered = LoadBank(replace(IDEAL, cold_start_s=10.0, gpus_per_node=8, load_share=1.0), np.random.default_rng(0))
    ordered.begin(0, 0.0)
    ordered.begin(1, 6.0)  # ordered: 0 is not slowed; 1 transfers after it
    assert _drain(ordered) == pytest.approx({0: 10.0, 1: 20.0})


def test_a_credited_snapshot_lets_the_fill_s_waiters_and_later_loads_copy_from_it_at_once() -> None:
    credited = replace(IDEAL, cold_start_s=10.0, gpus_per_node=4, load_share=1.0, snapshot_ratio=0.3)
    bank = LoadBank(credited, np.random.default_rng(0))
    for rid in range(3):
        bank.begin(rid, 0.0)
    # 0 fills the snapshot (10 s); 1 and 2 waited for it, then copy from it together: 3 s each, not 10 after 10
    assert _drain(bank) == pytest.approx({0: 10.0, 1: 13.0, 2: 13.0})
    bank.begin(3, 20.0)  # the node has its snapshot: a later load copies from it at once
    assert _drain(bank) == pytest.approx({3: 23.0})
    bank.begin(4, 30.0)  # node 0 is full: node 1 has no snapshot yet, 4 fills it, 5 copies from it after
    bank.begin(5, 30.0)
    assert _drain(bank) == pytest.approx({4: 40.0, 5: 43.0})
    uncredited = LoadBank(replace(credited, snapshot_ratio=None), np.random.default_rng(0))
    for rid in range(3):
        uncredited.begin(rid, 0.0)
    assert _drain(uncredited) == pytest.approx({0: 10.0, 1: 20.0, 2: 30.0})  # the published rows' charge


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_both_replays_charge_one_snapshot_rule(share: float) -> None:
    """The single-model replay's credited node (`LoadBank`) and the pool replay's copies (`copies_ready_s`, which
    `forecasting.fleet.simulate` charges a model's replicas beyond its first with) give the same ready times: the
    first fills the node's snapshot, the others copy once it is filled, a filled node's copy starts at once."""
    cold, ratio = 10.0, 0.3
    credited = replace(IDEAL, cold_start_s=cold, gpus_per_node=4, load_share=share, snapshot_ratio=ratio)
    bank = LoadBank(credited, np.random.default_rng(0))
    for rid in range(3):
        bank.begin(rid, 1.0)
    copy_s = ratio * share * cold + (1.0 - share) * cold  # a load from the snapshot: its copy and its own rest
    burst = copies_ready_s(1.0, cold, copy_s, False, share)
    assert _drain(bank) == pytest.approx({0: 1.0 + cold, 1: float(burst), 2: float(burst)})
    bank.begin(3, 20.0)
    assert _drain(bank) == pytest.approx({3: float(copies_ready_s(20.0, cold, copy_s, True, share))})


def test_both_replays_take_their_charges_from_one_place() -> None:
    env = FleetEnv(catalog=Catalog((ModelCard("m", 8.0),)), step_s=60.0, n_nodes=1, node_gpu_gb=80.0,
                   node_host_gb=100.0)
    params = SimParams()
    assert (env.actuation_s, env.wait_threshold_s, env.load_share) == (
        params.actuation_delay_s, params.wait_threshold_s, params.load_share) == (
        ACTUATION_S, WAIT_THRESHOLD_S, LOAD_SHARE)


def test_a_cancelled_fill_leaves_no_snapshot_and_the_next_in_line_reads_the_original() -> None:
    bank = LoadBank(replace(IDEAL, cold_start_s=10.0, gpus_per_node=4, load_share=1.0, snapshot_ratio=0.3),
                    np.random.default_rng(0))
    bank.begin(0, 0.0)
    bank.begin(1, 0.0)
    assert _drain(bank, until=4.0) == {}
    bank.release(0, 4.0)  # the fill is cancelled: 1 transfers from the original from 4 s, filling it
    assert _drain(bank) == pytest.approx({1: 14.0})
    bank.begin(2, 15.0)
    assert _drain(bank) == pytest.approx({2: 18.0})


def test_replicas_pack_onto_the_lowest_node_and_free_gpus_are_reused() -> None:
    bank = LoadBank(replace(IDEAL, gpus_per_node=2), np.random.default_rng(0))
    assert [bank.place(r) for r in range(5)] == [0, 0, 1, 1, 2]
    bank.release(1, 0.0)
    assert bank.place(5) == 0


def test_planner_knows_only_the_starts_it_has_seen() -> None:
    bank = LoadBank(replace(IDEAL, cold_starts_s=(5.0, 30.0)), np.random.default_rng(4))
    assert bank.observed_p95() is None  # nothing measured yet: the planner uses its default
    seen = []
    for rid in range(40):
        bank.begin(rid, 100.0 * rid)
        got = _drain(bank, until=100.0 * rid + 99.0)
        seen += [at - 100.0 * rid for at in got.values()]
    assert set(seen) == {5.0, 30.0}  # measured cold starts are drawn from, with replacement
    values = sorted(seen)
    assert bank.observed_p95() == values[int(np.ceil(0.95 * len(values))) - 1]  # as registry.load_time_p95
    assert cold_start_p95(replace(IDEAL, cold_starts_s=(5.0, 30.0))) == 30.0
    # a lognormal of CV 0.3 around 8.7 s: its p95 is above the mean
    assert cold_start_p95(SimParams()) == pytest.approx(8.7 * np.exp(1.645 * 0.2936 - 0.2936**2 / 2), rel=1e-3)


class _StepUp(Policy):
    """One replica, `to` wanted from t = 10 s (decisions every second)."""

    name = "step_up"
    period_s = 1.0

    def __init__(self, to: int = 2) -> None:
        self.to = to

    def start(self, env: PolicyEnv) -> int:
        return 1

    def decide(self, obs: Observation) -> int:
        return self.to if obs.now >= 10.0 else 1


def _two_requests(aggregated: bool) -> tuple[Workload, SimParams]:
    """Two requests a minute apart, constant 5 s starts, on the exact or the fluid engine."""
    trace = RequestTrace(t=np.asarray([0.0, 60.0]), context_tokens=np.zeros(2), generated_tokens=np.ones(2),
                         source="two")
    params = replace(IDEAL, cold_start_s=5.0, aggregate_above_rps=0.0 if aggregated else 50.0)
    return build_workload(trace, params), params


@pytest.mark.parametrize("aggregated", [False, True])
def test_a_decision_acts_after_the_actuation_delay(aggregated: bool) -> None:
    work, params = _two_requests(aggregated)
    assert work.aggregated is aggregated
    at_once = replay(work, _StepUp(), params)
    delayed = replay(work, _StepUp(), replace(params, actuation_delay_s=3.0))
    assert at_once.live[11] == 2 and delayed.live[11] == 1 and delayed.live[14] == 2
    assert delayed.gpu_s == pytest.approx(at_once.gpu_s - 3.0, abs=1.0)  # the second replica starts 3 s later


@pytest.mark.parametrize("aggregated", [False, True])
def test_a_pool_of_n_replicas_places_no_more(aggregated: bool) -> None:
    """The live placement drops a scale-up no node has a slot for; `max_replicas` charges the same."""
    work, params = _two_requests(aggregated)
    assert replay(work, _StepUp(5), params).live.max() == 5
    capped = replay(work, _StepUp(5), replace(params, max_replicas=2))
    assert capped.live.max() == 2 and capped.starts == 1
    with pytest.raises(ValueError, match="max_replicas"):
        replace(params, max_replicas=0)


def test_prewarm_plans_with_the_running_p95_not_the_exact_one() -> None:
    # a burst every 5 minutes makes the planner start replicas; every start takes 40 s
    times = sorted([60.0 + 300.0 * b + i * 0.02 for b in range(6) for i in range(60)] + [0.0, 1799.0])
    trace = RequestTrace(t=np.asarray(times), context_tokens=np.zeros(len(times)),
                         generated_tokens=np.full(len(times), 200.0), source="bursts")
    params = replace(IDEAL, cold_starts_s=(40.0,))
    work = build_workload(trace, params)
    running = Prewarm(record=True)
    replay(work, running, params)
    leads = [d.lead_s for _, _, d in running.decisions]
    margin = PlannerParams().lead_margin_s
    assert leads[0] == pytest.approx(PlannerParams().default_cold_start_s + margin)  # nothing seen yet
    assert leads[-1] == pytest.approx(40.0 + margin)  # learned from the starts it saw
    exact = Prewarm(record=True)
    replay(work, exact, replace(params, planner_cold_start="exact"))
    assert [d.lead_s for _, _, d in exact.decisions] == pytest.approx([40.0 + margin] * len(exact.decisions))


def test_reactive_sized_is_the_planners_sizing_on_the_last_observation() -> None:
    policy = ReactiveSized(window_s=60.0)
    trace = RateTrace(window_start_s=np.asarray([0.0]), rate=np.asarray([1.0]), window_s=60.0, source="x")
    policy.start(PolicyEnv(work=build_workload(trace, IDEAL), params=IDEAL))
    beta = PlannerParams().queue_beta
    need = replicas_needed(40.0 + beta * np.sqrt(40.0), IDEAL.slots)
    assert policy.decide(Observation(0.0, 1, 0, 40.0, 400.0, 10.0)) == need  # up at once
    assert policy.decide(Observation(10.0, need, 0, 2.0, 20.0, 10.0)) == need  # down waits for the window
    assert policy.decide(Observation(50.0, need, 0, 2.0, 20.0, 10.0)) == need
    low = replicas_needed(2.0 + beta * np.sqrt(2.0), IDEAL.slots)
    assert policy.decide(Observation(71.0, need, 0, 2.0, 20.0, 10.0)) == low  # 60 s after the last high need
    assert ReactiveSized(queue_beta=3.0).params.queue_beta == 3.0
    with pytest.raises(ValueError, match="window_s"):
        ReactiveSized(window_s=-1.0)


@pytest.mark.parametrize(("share", "expected"), [
    (0.01, 0.8),  # on a point
    (0.015, 0.75),  # between two
    (0.001, None),  # below the curve's range
    (0.5, None),  # above it
    (0.035, 0.6),  # the non-monotone tail read through its lower envelope (0.03 reached at 0.6)
])
def test_at_equal_share_interpolates_on_the_curve(share: float, expected: float | None) -> None:
    curve = [{"cold_start_share": x, "gpu_hours_vs_reactive": y} for x, y in
             [(0.02, 0.7), (0.01, 0.8), (0.005, 0.9), (0.03, 0.6), (0.04, 0.65)]]
    got = at_equal_share(curve, share)
    assert got == (None if expected is None else pytest.approx(expected))


def test_sweep_summary_reads_every_curve_at_prewarms_default_share() -> None:
    pts = [
        {"policy": "prewarm", "default": True, "cold_start_share": 0.01, "gpu_hours_vs_reactive": 0.7},
        {"policy": "prewarm", "default": False, "cold_start_share": 0.02, "gpu_hours_vs_reactive": 0.6},
        {"policy": "reactive", "default": True, "cold_start_share": 0.005, "gpu_hours_vs_reactive": 1.0},
        {"policy": "reactive", "default": False, "cold_start_share": 0.02, "gpu_hours_vs_reactive": 0.8},
        {"policy": "oracle", "default": True, "cold_start_share": 0.03, "gpu_hours_vs_reactive": 0.5},
    ]
    out = sweep_summary(pts)
    assert out["cold_start_share"] == 0.01
    assert out["policies"] == {"prewarm": 0.7, "reactive": pytest.approx(1.0 - 0.2 / 3), "oracle": None}


def test_foresight_reads_the_oracle_against_the_ablation_at_prewarms_share() -> None:
    pts = [
        {"policy": "prewarm", "default": True, "cold_start_share": 0.01, "gpu_hours_vs_reactive": 0.85},
        {"policy": "reactive_sized", "default": True, "cold_start_share": 0.02, "gpu_hours_vs_reactive": 0.8},
        {"policy": "reactive_sized", "default": False, "cold_start_share": 0.005, "gpu_hours_vs_reactive": 1.0},
        {"policy": "oracle", "default": True, "cold_start_share": 0.0, "gpu_hours_vs_reactive": 0.6},
    ]
    fs = foresight(pts, sweep_summary(pts))
    assert fs is not None
    base = 1.0 - 0.2 * (0.01 - 0.005) / 0.015  # reactive_sized's curve at prewarm's share
    assert fs["oracle_vs_reactive_sized"] == pytest.approx(0.6 / base)
    assert fs["prewarm_vs_reactive_sized"] == pytest.approx(0.85 / base)
    assert fs["captured"] == pytest.approx((base - 0.85) / (base - 0.6)) and fs["oracle_cold_start_share"] == 0.0
    # the ablation's curve short of prewarm's share, or no oracle: nothing to read
    assert foresight(pts[:1] + pts[2:], sweep_summary(pts[:1] + pts[2:])) is None
    assert foresight(pts[:3], sweep_summary(pts[:3])) is None
    # an oracle no cheaper than the ablation there: nothing for a forecast to get
    worse = pts[:3] + [dict(pts[3], gpu_hours_vs_reactive=1.2)]
    assert foresight(worse, sweep_summary(worse))["captured"] is None  # type: ignore[index]


def _small_rate_trace() -> RateTrace:
    rng = np.random.default_rng(5)
    return RateTrace(window_start_s=np.arange(0, 7200.0, 300.0), rate=rng.uniform(2.0, 12.0, 24), window_s=300.0,
                     source="small")


def test_rows_follow_the_output_contract() -> None:
    out = run_backtest(_small_rate_trace(), SimParams(), POLICIES)["result"]
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == set(POLICIES) >= {"reactive", "reactive_sized", "prewarm", "oracle"}
    for r in rows.values():
        assert set(r) == ROW_KEYS | ({"cold_start_budget"} if r["policy"] == "prewarm" else set()) and r["default"] is True
        assert r["starts"] == out["policies"][r["policy"]]["cold_starts"]
    assert rows["reactive"]["gpu_hours_vs_reactive"] == 1.0
    assert (rows["prewarm"]["knob"], rows["prewarm"]["value"]) == ("cold_start_budget", 0.001)
    assert rows["prewarm"]["cold_start_budget"] == 0.001
    assert (rows["reactive_sized"]["knob"], rows["reactive_sized"]["value"]) == ("queue_beta", 1.5)


def test_sweep_gives_rows_points_and_the_equal_share_summary() -> None:
    knobs = {"reactive": ("target", (0.5, 0.7, 0.9), 0.7), "reactive_sized": ("queue_beta", (0.5, 1.5, 3.0), 1.5),
             "prewarm": ("cold_start_budget", (0.01, 0.001), 0.001)}
    out = run_sweep(_small_rate_trace(), SimParams(), ("reactive", "reactive_sized", "prewarm", "oracle"), knobs=knobs)
    assert len(out["points"]) == 3 + 3 + 2 + 1
    assert all(set(p) == ROW_KEYS | ({"cold_start_budget"} if p["policy"] == "prewarm" else set())
               for p in out["points"])
    assert [p["cold_start_budget"] for p in out["points"] if p["policy"] == "prewarm"] == [0.01, 0.001]
    assert {r["policy"] for r in out["rows"]} == {"reactive", "reactive_sized", "prewarm", "oracle"}
    eq = out["at_equal_cold_start_share"]
    prewarm = next(r for r in out["rows"] if r["policy"] == "prewarm")
    assert eq["cold_start_share"] == prewarm["cold_start_share"]
    assert eq["policies"]["prewarm"] == prewarm["gpu_hours_vs_reactive"]
    assert set(eq["policies"]) == {"reactive", "reactive_sized", "prewarm", "oracle"}
    fs = out["foresight"]
    assert (fs is None) == (eq["policies"]["reactive_sized"] is None)  # read only where its curve reaches the share
    if fs is not None:
        assert fs["prewarm_vs_reactive_sized"] == pytest.approx(eq["policies"]["prewarm"] / eq["policies"]["reactive_sized"])


def test_cli_sweep_json_and_the_charges_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              clean_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rate.csv"
    tr = _small_rate_trace()
    path.write_text("window_start_s,rate_req_per_s\n" + "".join(f"{s:g},{r:.3f}\n" for s, r in zip(tr.window_start_s,
                                                                                                   tr.rate)))
    rc = main(["backtest", str(path), "--policies", "reactive,reactive_sized,prewarm", "--sweep",
               str(tmp_path / "s.png"), "--json", "--cold-start", "60", "--actuation-delay", "4",
               "--gpus-per-node", "4", "--node-loads", "shared"])
    out = capsys.readouterr().out
    assert rc == 0, out
    last = json.loads(out.strip().splitlines()[-1])
    assert {"rows", "points", "at_equal_cold_start_share"} <= set(last)
    assert last["params"]["cold_start_s"] == 60.0 and last["params"]["actuation_delay_s"] == 4.0
    assert last["params"]["gpus_per_node"] == 4 and last["params"]["cold_start_cv"] == 0.3
    assert last["params"]["node_loads"] == "shared"
    assert (tmp_path / "s.png").stat().st_size > 10_000
    rc = main(["backtest", str(path), "--policies", "reactive", "--json", "--ideal", "--snapshot-ratio", "0.34"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and last["params"]["cold_start_cv"] == 0.0 and last["params"]["actuation_delay_s"] == 0.0
    assert last["params"]["snapshot_ratio"] == 0.34
    with pytest.raises(SystemExit):
        main(["backtest", str(path), "--cold-starts", "5,x"])
    assert "not a comma-separated list of seconds" in capsys.readouterr().err


def test_bad_charges_are_named() -> None:
    for kw, name in [({"cold_start_cv": -1.0}, "cold_start_cv"), ({"actuation_delay_s": -1.0}, "actuation_delay_s"),
                     ({"cold_starts_s": (5.0, 0.0)}, "cold_starts_s"), ({"gpus_per_node": 0}, "gpus_per_node"),
                     ({"load_share": 1.5}, "load_share"), ({"planner_cold_start": "psychic"}, "planner_cold_start"),
                     ({"node_loads": "psychic"}, "node_loads"), ({"snapshot_ratio": 0.0}, "snapshot_ratio"),
                     ({"snapshot_ratio": 1.5}, "snapshot_ratio"),
                     ({"snapshot_ratio": 0.3, "node_loads": "shared"}, "'shared' reads keep no snapshot")]:
        with pytest.raises(ValueError, match=name):
            SimParams(**kw)  # type: ignore[arg-type]


def test_the_feedback_ablation_keeps_its_margin_where_prewarm_moves_it() -> None:
    """`prewarm_fixed_margin` is prewarm with its budget's feedback off: replayed only when named, its margin
    stays where it is set while prewarm's calibration moves its own on the same arrivals."""
    assert "prewarm_fixed_margin" not in POLICIES
    out = run_backtest(_small_rate_trace(), SimParams(cold_start_s=60.0), ("reactive", "prewarm", "prewarm_fixed_margin"))["result"]
    pw, fixed = out["policies"]["prewarm"], out["policies"]["prewarm_fixed_margin"]
    start = PlannerParams().margin_initial  # both start there
    assert fixed["margin_final"] == start and fixed["cold_start_budget"] == 1.0
    assert pw["margin_final"] != start  # the feedback moved prewarm's margin
    row = next(r for r in out["rows"] if r["policy"] == "prewarm_fixed_margin")
    assert (row["knob"], row["value"]) == ("margin", start)
    with pytest.raises(ValueError, match="prewarm_fixed_margin"):
        run_backtest(_small_rate_trace(), SimParams(), ("no_such_policy",))


def test_the_ablation_runs_with_the_planner_settings_prewarm_runs_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's planner settings (here from the environment) reach `prewarm backtest`'s prewarm and its
    feedback-off ablation alike: the ablation differs from prewarm in its feedback only."""
    from prewarm.cli.backtest import _planner_kwargs
    from prewarm.core.settings import Settings

    monkeypatch.setenv("PREWARM_PLANNER_STABILIZATION_S", "120")
    kw = _planner_kwargs(Settings.load())
    for name in ("prewarm", "prewarm_fixed_margin"):
        policy = make_policy(name, **kw[name])
        assert isinstance(policy, Prewarm) and policy.params.stabilization_s == 120.0, name


@pytest.mark.parametrize("node_loads,snapshot", [("ordered", None), ("shared", None), ("ordered", 0.34)])
@pytest.mark.parametrize("aggregated", [False, True])
def test_the_oracle_leads_a_nodes_worth_of_loads_by_their_turns(node_loads: str, snapshot: float | None,
                                                                aggregated: bool) -> None:
    """A step that needs two nodes' worth of replicas at once: the replicas behind others on their node load later
    than one cold start, so the oracle starts them earlier and no request waits (one cold start's lead waited)."""
    trace = RateTrace(window_start_s=np.array([0.0, 1800.0]), rate=np.array([0.5, 160.0]), window_s=1800.0,
                      source="step")
    params = SimParams(cold_start_s=60.0, node_loads=node_loads, snapshot_ratio=snapshot,
                       aggregate_above_rps=0.0 if aggregated else 1e9)
    out = run_backtest(trace, params, ("oracle",))
    work = out["work"]
    assert work.aggregated is aggregated and work.need.max() > 2 * params.gpus_per_node
    assert out["result"]["policies"]["oracle"]["cold_start_share"] == 0.0
    want = oracle_want(work.need, params)
    level = 2 * params.gpus_per_node  # the last replica on the second node: 7 behind the others in its node's line
    behind = params.gpus_per_node - 1
    cold = 60.0 * (1 + 3 * params.cold_start_cv)  # the slowest draw the oracle plans for
    lead = cold + behind * cold * params.load_share * (snapshot or 1.0) + params.actuation_delay_s
    needed_at = int(np.argmax(work.need >= level))
    assert work.need[1800:1860].max() >= level and (want >= work.need).all()
    assert int(np.argmax(want >= level)) <= needed_at - lead
