"""The parts of `prewarm up`'s fidelity check (`workers.up.fidelity`, `workers.up.seed`), each on its real input:
the gateway's own Prometheus exposition, the registry's audit stream and the executor's event records in a
real Redis, and the gateway's counting code writing a history into it. The whole check runs end to end in
tests/test_up.py and tests/test_planner_equivalence.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.metrics import Metrics
from prewarm.core.settings import RegistrySettings
from prewarm.registry.replicas import ReplicaRegistry
from workers.up.fidelity import (actuation_delays, counted_since, demand_delays, gateway_waits_over, judge, registrations,
                                 replica_seconds, service_s)
from workers.up.seed import seed_history
from workers.up.workload import UpOptions, from_trace


def test_judge_applies_the_bar() -> None:
    ok = judge(100.0, 108.0, 10, 12)
    assert ok["replica_seconds_ratio"] == pytest.approx(1.08)
    assert ok["replica_seconds_within"] and ok["waited_within"]
    assert not judge(100.0, 111.0, 10, 12)["replica_seconds_within"]
    assert judge(100.0, 100.0, 0, 3)["waited_within"]  # max(3, 20%): a short run may differ by three
    assert not judge(100.0, 100.0, 0, 4)["waited_within"]
    assert not judge(100.0, 100.0, 50, 61)["waited_within"]  # 20% of 50 is 10
    fleet = judge(200.0, 150.0, 2, 4.6, quantity="gpu_mb_seconds")  # the fleet's: same bar, its own names
    assert fleet["gpu_mb_seconds_ratio"] == pytest.approx(0.75) and not fleet["gpu_mb_seconds_within"]
    assert fleet["waited_simulated"] == 5 and fleet["waited_within"] and "replica_seconds_ratio" not in fleet


def test_replica_seconds_integrates_the_window_only() -> None:
    t, live = [0.0, 10.0, 20.0, 30.0], [1, 3, 2, 0]
    assert replica_seconds(t, live, 0.0, 40.0) == pytest.approx(10 + 30 + 20)
    assert replica_seconds(t, live, 15.0, 25.0) == pytest.approx(5 * 3 + 5 * 2)
    assert service_s([0.1, 0.2, 3.0], 0.5) == pytest.approx(0.15)
    assert service_s([3.0], 0.5) is None


def test_waits_for_a_start_come_from_the_gateways_hold_histogram() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    for s in (0.01, 0.2, 0.7, 3.0, 12.0):
        m.cold_start_wait.labels("demo").observe(s)
    m.cold_start_wait.labels("other").observe(9.0)
    text = generate_latest(registry).decode()
    assert gateway_waits_over(text, "demo", 0.5) == 3
    assert gateway_waits_over(text, "absent", 0.5) == 0
    with pytest.raises(ValueError, match="no bucket at 0.7"):
        gateway_waits_over(text, "demo", 0.7)


def test_actuation_delay_is_event_due_time_to_registration(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, RegistrySettings())
    r = Replica("demo", "r1", "n1", 0)
    reg.register(r, now=1000.0 + 2.5)
    reg.transition(r.id, ReplicaState.LOADING, now=1004.0)
    event = {"event_id": "e1", "kind": "scale_up", "model": "demo", "revision": "r1", "at": 1000.0, "replicas": 1,
             "pool": "serving", "nodes": [], "reason": "test"}
    redis_client.hset(keys.planned_event("e1"), mapping={"event": json.dumps(event), "replicas": json.dumps([r.id])})
    down = dict(event, event_id="e2", kind="scale_down")
    redis_client.hset(keys.planned_event("e2"), mapping={"event": json.dumps(down), "replicas": json.dumps([r.id])})
    seen = registrations(reg.events())
    assert seen == {r.id: pytest.approx(1002.5)}
    assert actuation_delays(redis_client, seen) == (pytest.approx(2.5),)


def test_history_is_counted_by_the_gateways_code(redis_url: str, redis_client: "redis.Redis[str]") -> None:
    times = np.array([1000.5, 1001.0, 1009.95, 1075.0])
    assert asyncio.run(seed_history(redis_url, "demo", times, 0.1)) == 4
    assert redis_client.get(keys.requests("demo", 10, 1000)) == "3"
    assert redis_client.get(keys.requests("demo", 60, 960)) == "3"
    assert redis_client.get(keys.requests("demo", 60, 1020)) == "1"
    assert redis_client.get(keys.inflight_peak("demo", 10, 1000)) == "1"  # never two in flight at once
    # the request at 1009.95 is in flight 0.05 s in its bucket and 0.05 s in the next
    assert float(redis_client.get(keys.busy("demo", 10, 1010)) or 0) == pytest.approx(0.05)
    assert float(redis_client.hget(keys.REQUESTS_FIRST, "demo") or 0) == 960.0
    assert counted_since(redis_client, "demo", 1000.0, 1080.0, times[:2]) == 2


def test_history_workload_splits_the_trace_uncompressed(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": int(s * 1000), "input_length": 4, "output_length": 4,
                                        "hash_ids": []}) + "\n" for s in (0.0, 10.0, 99.0, 100.0, 150.0, 400.0)))
    wl = from_trace(UpOptions(out_dir=tmp_path, trace=str(path), history_s=100.0, duration_s=100.0, max_rps=100.0))
    assert wl.history.tolist() == [-100.0, -90.0, -1.0]
    assert wl.arrivals.tolist() == [0.0, 50.0]
    with pytest.raises(ValueError, match="nothing after --history"):
        from_trace(UpOptions(out_dir=tmp_path, trace=str(path), history_s=500.0))


def test_simulated_planner_runs_the_batch_job_of_the_model_it_plans() -> None:
    """The report's replay plans the run's model by name: a batch job naming it starts replicas there too
    (it used to plan a model called 'trace', to which the run's batch job never applied)."""
    from forecasting.data.traces import RequestTrace, TraceFormat
    from forecasting.sim.scoring import run_backtest
    from forecasting.sim.simulate import SimParams
    from prewarm.core.settings import PlannerSettings

    t = np.arange(0.0, 600.0, 1.0)
    trace = RequestTrace(t=t, context_tokens=np.zeros(t.size), generated_tokens=np.full(t.size, 100.0), source="flat",
                         start_epoch=1_800_000_000.0, format=TraceFormat.REQUEST_CSV)
    planner = PlannerSettings(interval_s=5, batch_jobs=[{"cron": "*/5 * * * *", "model": "demo", "replicas": 2,
                                                         "duration_s": 60, "name": "batch"}])
    params = SimParams(cold_start_s=5.0, cold_start_cv=0.0, prefill_base_s=0.0, decode_tokens_per_s=1000.0)
    starts = {name: run_backtest(trace, params, policies=("prewarm",), policy_kwargs={
        "prewarm": {"planner_settings": planner, "model_name": name}})["result"]["policies"]["prewarm"]["cold_starts"]
        for name in ("demo", "other")}
    assert starts["demo"] > starts["other"], starts


def test_a_load_the_live_executor_cannot_cancel_is_charged_to_ready() -> None:
    """The live scale-down retires ready replicas only; with `cancel_loads=False` the simulator does the same:
    two loads the policy no longer wants run their whole cold start, and the scale-down takes the one ready
    replica instead (as the live executor's `partial` scale-down does); one of the two goes at the next decision."""
    from forecasting.data.traces import RequestTrace, TraceFormat
    from forecasting.sim.interface import Observation, Policy, PolicyEnv
    from forecasting.sim.simulate import SimParams, build_workload, replay

    class Drop(Policy):
        name = "drop"
        period_s = 5.0

        def start(self, env: PolicyEnv) -> int:
            return 1

        def decide(self, obs: Observation) -> int:
            return 3 if obs.now < 5 else 1

    t = np.arange(0.0, 60.0, 1.0)
    trace = RequestTrace(t=t, context_tokens=np.zeros(t.size), generated_tokens=np.full(t.size, 10.0), source="s",
                         start_epoch=0.0, format=TraceFormat.REQUEST_CSV)
    gpu = {}
    for cancel in (True, False):
        params = SimParams(cold_start_s=20.0, cold_start_cv=0.0, actuation_delay_s=0.0, load_share=0.0, prefill_base_s=0.0,
                           decode_tokens_per_s=1000.0, cancel_loads=cancel)
        gpu[cancel] = replay(build_workload(trace, params), Drop(), params).gpu_s
    assert gpu[True] == pytest.approx(60.0 + 2 * 5.0)  # cancelled at 5 s
    assert gpu[False] == pytest.approx(5.0 + 20.0 + 60.0, abs=0.05)  # the ready one drained at 5 s; one of the
    # loads retired by the decision at 20 s, when it is ready; the other kept to the end


def test_each_replayed_request_keeps_its_own_measured_latency() -> None:
    from workers.up.fidelity import request_services

    got = request_services(np.array([0.5, 1.25, 2.0]), [2.0, 0.5], [0.9, 0.1], 0.2)
    assert got.tolist() == [0.1, 0.2, 0.9]


def test_demand_delays_match_each_on_demand_load_to_the_arrival_that_found_its_model_cold() -> None:
    def ev(ts: float, rid: str, to: str) -> tuple[str, dict[str, str]]:
        return ("0-0", {"ts": str(ts), "replica": rid, "to": to})

    events = [
        ev(100.5, "m@r/n/0", "pending"), ev(102.0, "m@r/n/0", "ready"),  # loaded on demand of the 100.0 arrival
        ev(150.0, "m@r/n/0", "retired"),
        ev(160.0, "m@r/n/1", "pending"), ev(163.0, "m@r/n/1", "ready"),  # no arrival found it cold: ahead of demand
        ev(190.0, "m@r/n/1", "retired"),
        ev(203.0, "m@r/n/0", "pending"),  # the 195 s arrival waited 8 s for the scan to start this load
        ev(210.0, "m@r/n/2", "pending"),  # a second load while the first starts: no arrival left to match
        ev(120.0, "other@r/n/0", "pending"),  # another model's registration is not this model's
    ]
    arrivals = [100.0, 101.0, 140.0, 161.0, 195.0, 196.0, 400.0]
    assert demand_delays(arrivals, events, "m", window_s=30.0) == pytest.approx((0.5, 8.0))
    assert demand_delays(arrivals, events, "m", window_s=5.0) == pytest.approx((0.5,))  # 195 is 8 s before 203
    assert demand_delays([], events, "m", window_s=30.0) == ()
