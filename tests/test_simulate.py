"""The trace replay on tiny hand-made traces whose right answer is known."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecasting.budget import replicas_needed
from forecasting.planner import PlannerParams, StepInputs
from forecasting.sim.interface import Observation, Policy, PolicyEnv
from forecasting.sim.policies import POLICIES, Prewarm, make_policy
from forecasting.curves import weighted_quantile
from forecasting.sim.scoring import run_backtest
from forecasting.sim.simulate import SimParams, build_workload, replay
from forecasting.data.traces import RateTrace, RequestTrace
from prewarm.cli import main

#: the ideal replica model these hand-made answers are worked out for: every cold start takes exactly
#: cold_start_s and every decision acts at once (the charges have their own tests, tests/test_sim_charges.py)
P = SimParams(cold_start_cv=0.0, actuation_delay_s=0.0, load_share=0.0)


def request_trace(times: list[float], context: float = 1000.0, generated: float = 10.0) -> RequestTrace:
    t = np.asarray(times, dtype=np.float64)
    return RequestTrace(t=t, context_tokens=np.full(t.size, context), generated_tokens=np.full(t.size, generated),
                        source="hand-made")


class Scripted(Policy):
    """A test policy: the live count is a step function of time, ready from the start."""

    name = "scripted"
    period_s = 1.0

    def __init__(self, steps: list[tuple[float, int]]) -> None:
        self.steps = steps

    def start(self, env: PolicyEnv) -> int:
        return self.steps[0][1]

    def decide(self, obs: Observation) -> int:
        return [n for t, n in self.steps if t <= obs.now][-1]


def test_single_burst_reactive_pays_one_cold_start_oracle_none() -> None:
    # 10 requests of 30 s (1200 generated tokens at 40/s) at t=100, on an idle service with 1 replica
    times = [0.0] + [100.0] * 10 + [300.0]
    gen = [1.0] + [1200.0] * 10 + [1.0]
    trace = RequestTrace(t=np.asarray(times), context_tokens=np.zeros(12), generated_tokens=np.asarray(gen),
                         source="burst")
    work = build_workload(trace, P)
    reactive = replay(work, make_policy("reactive"), P)
    # 8 slots take 8; 2 wait. The HPA sync at 120 sees 10 busy -> 2 replicas; ready at 128.7
    assert reactive.starts == 1
    hits = np.sort(reactive.wait[reactive.wait > P.wait_threshold_s])
    assert hits.size == 2
    assert hits == pytest.approx([28.7, 28.7])
    oracle = replay(work, make_policy("oracle"), P)
    assert (oracle.wait <= P.wait_threshold_s).all()
    assert oracle.wait.max() == 0.0


def test_steady_load_within_one_replica_no_cold_starts() -> None:
    # one request a second, 0.3 s each: far within one replica, for 15 minutes
    trace = request_trace([float(i) for i in range(900)], context=1000.0, generated=10.0)
    work = build_workload(trace, P)
    for name in ("reactive", "fixed_pool", "keepalive", "oracle"):
        run = replay(work, make_policy(name), P)
        assert run.wait.max() == 0.0, name
        assert run.starts == 0, name


def test_every_policy_starts_at_its_own_sizing_of_the_first_minutes_load() -> None:
    """"As if it had been running": each policy's replicas at time 0 are what it would size the first minute's
    load to. The planner sized it with its starting margin (a + 6 sqrt(a)); the replay gave it ceil(a / slots),
    fewer than any baseline started with, and counted the waits of that start as its misses (Mooncake at 60 s:
    all 31 of its waits in the first three minutes, 2.6x the budget over the hour)."""
    secs = np.arange(0, 1800, 60.0)
    work = build_workload(RateTrace(window_start_s=secs, rate=np.full(secs.size, 100.0), window_s=60.0,
                                    source="steady 100 req/s"), P)
    env = PolicyEnv(work=work, params=P)
    a, p = env.initial_load(), PlannerParams()
    prewarm, sized = make_policy("prewarm").start(env), make_policy("reactive_sized").start(env)
    assert prewarm == replicas_needed(a + p.margin_initial * math.sqrt(a), P.slots)
    assert sized == replicas_needed(a + p.queue_beta * math.sqrt(a), P.slots)
    assert prewarm > sized > math.ceil(a / P.slots)
    assert make_policy("prewarm_fixed_margin", margin=0.0).start(env) == math.ceil(round(a / P.slots, 9))


def test_gpu_hours_arithmetic() -> None:
    trace = request_trace([0.0, 3599.5], context=0.0, generated=2.0)
    work = build_workload(trace, P)
    assert work.duration_s == 3600.0
    run = replay(work, Scripted([(0.0, 2)]), P)
    assert run.gpu_s == pytest.approx(2 * 3600.0)
    # one more replica from t=1800: it loads (8.7 s) and is paid from its load start
    run = replay(work, Scripted([(0.0, 1), (1800.0, 2)]), P)
    assert run.gpu_s == pytest.approx(3600.0 + 1800.0)
    assert run.starts == 1
    assert int(run.live[1000]) == 1 and int(run.live[2000]) == 2


def test_draining_replica_finishes_its_requests() -> None:
    # two 40 s requests at t=0 land on two replicas; at t=10 the policy wants one
    trace = RequestTrace(t=np.asarray([0.0, 0.0, 599.0]), context_tokens=np.zeros(3),
                         generated_tokens=np.asarray([1598.0, 1598.0, 1.0]), source="drain")
    work = build_workload(trace, P)
    run = replay(work, Scripted([(0.0, 2), (10.0, 1)]), P)
    assert run.wait.max() == 0.0  # both were served without interruption
    assert run.gpu_s == pytest.approx(600.0 + 40.0)  # the drained one retired when its request ended
    assert int(run.live[20]) == 2 and int(run.live[45]) == 1


class _SpyPrewarm(Prewarm):
    """The shipped policy, recording what each step was shown."""

    seen: list[tuple[float, float, float]] = []  # (decision time, end of the fine buckets, end of the coarse ones)
    now_loads: list[tuple[float, float | None]] = []  # (seconds of the bucket in progress, the load so far shown)

    def inputs(self, now: float, ready: int, loading: int) -> StepInputs:
        inp = super().inputs(now, ready, loading)
        hist = inp.profile_history
        coarse_end = hist[0] + hist[1] * hist[2].size if hist is not None else -1.0
        self.seen.append((inp.now, inp.observed.end, coarse_end))
        self.now_loads.append((inp.now - inp.observed.end, inp.observed.now_load))
        return inp


def test_prewarm_never_sees_the_future() -> None:
    rng = np.random.default_rng(3)
    trace = RateTrace(window_start_s=np.arange(0, 3600.0, 60.0), rate=rng.uniform(0.5, 4.0, 60), window_s=60.0,
                      source="spy")
    params = replace(P, seed=1)
    work = build_workload(trace, params)
    policy = _SpyPrewarm()
    _SpyPrewarm.seen, _SpyPrewarm.now_loads = [], []
    run = replay(work, policy, params)
    assert run.ttft.size == work.arrivals.size  # type: ignore[union-attr]
    assert len(_SpyPrewarm.seen) == 720  # one step every interval_s (5 s), as the live beat
    for now, fine_end, coarse_end in _SpyPrewarm.seen:
        # every bucket shown ended at or before the decision time
        assert fine_end <= now + 1e-9 and coarse_end <= now + 1e-9, (now, fine_end, coarse_end)
    assert any(c != -1.0 for _, _, c in _SpyPrewarm.seen)  # the profile is learned from the coarse history
    # halfway through a bucket the step sees the load so far in it (the replay's own, as a gateway's flushes credit
    # it); at a bucket's end there is none yet
    assert {round(e) for e, _ in _SpyPrewarm.now_loads} == {0, 5}
    assert all((load is None) == (round(e) == 0) for e, load in _SpyPrewarm.now_loads)
    assert max(load or 0.0 for _, load in _SpyPrewarm.now_loads) > 0.0
    env = PolicyEnv(work=work, params=params)
    view = env.past_counts(1234.5)
    assert view.size == 1234
    with pytest.raises(ValueError):
        view[0] = 99.0


def test_determinism_under_seed() -> None:
    trace = RateTrace(window_start_s=np.arange(0, 1800.0, 300.0), rate=np.asarray([1.0, 3.0, 8.0, 2.0, 1.0, 5.0]),
                      window_s=300.0, source="seeded")
    a = run_backtest(trace, SimParams(seed=7), ("reactive", "keepalive", "oracle"))["result"]
    b = run_backtest(trace, SimParams(seed=7), ("reactive", "keepalive", "oracle"))["result"]
    c = run_backtest(trace, SimParams(seed=8), ("reactive", "keepalive", "oracle"))["result"]
    strip = lambda r: {k: {m: v for m, v in s.items() if m != "replay_s"} for k, s in r["policies"].items()}  # noqa: E731
    assert strip(a) == strip(b)
    assert a["params"]["requests"] != c["params"]["requests"]


def test_fluid_engine_capacity_and_waits() -> None:
    # 200 req/s for 10 minutes, 0.5 s each (10 ms of prefill + 19.6 tokens of decode)
    trace = RateTrace(window_start_s=np.asarray([0.0]), rate=np.asarray([200.0]), window_s=600.0, source="flat")
    params = replace(P, mean_context_tokens=0.0, prefill_base_s=0.01, mean_generated_tokens=19.6)
    work = build_workload(trace, params)
    assert work.aggregated and any("aggregated per second" in n for n in work.notes)
    # 100 busy slots needed: 16 replicas (128 slots) serve it without waiting
    ample = replay(work, Scripted([(0.0, 16)]), params)
    assert ample.wait.max() == pytest.approx(0.0, abs=1e-6)
    assert ample.gpu_s == pytest.approx(16 * 600.0)
    # 10 replicas serve 160 req/s: the backlog grows 40 req/s, and the last arrivals wait ~ 600*40/160
    short = replay(work, Scripted([(0.0, 10)]), params)
    assert short.wait.max() == pytest.approx(600 * 40 / 160, rel=0.1)
    assert short.weight is not None
    share = float(short.weight[short.wait > 0.5].sum() / short.weight.sum())
    assert share > 0.95


class Counting(Scripted):
    """A scripted policy that adds up the requests the replay reports as having waited (what the gateway counts)."""

    def __init__(self, steps: list[tuple[float, int]]) -> None:
        super().__init__(steps)
        self.waited = 0.0

    def decide(self, obs: Observation) -> int:
        self.waited += obs.waited
        return super().decide(obs)


def test_the_fluid_engines_waited_counter_is_what_the_score_counts_as_waited() -> None:
    """The counter the budget's feedback reads (`Observation.waited`) counts a request that waits longer than the
    threshold, the wait accrued within its arrival second included: 10 replicas serve 160 of 200 req/s until 6 more,
    asked for at 10 s, have loaded and drain the queue. Counting only the queue left at each second's end beyond
    capacity x threshold gave 4,771 of the 5,433 requests that waited."""
    trace = RateTrace(window_start_s=np.asarray([0.0]), rate=np.asarray([200.0]), window_s=120.0, source="flat")
    params = replace(P, mean_context_tokens=0.0, prefill_base_s=0.01, mean_generated_tokens=19.6)
    work = build_workload(trace, params)
    assert work.aggregated
    counting = Counting([(0.0, 10), (10.0, 16)])
    run = replay(work, counting, params)
    assert run.weight is not None  # the fluid engine weighs its cohorts
    scored = float(run.weight[run.wait > params.wait_threshold_s].sum())
    assert scored > 1000
    assert counting.waited == pytest.approx(scored, rel=0.03)


def test_weighted_quantile() -> None:
    v = np.asarray([1.0, 2.0, 3.0])
    assert weighted_quantile(v, np.asarray([1.0, 1.0, 98.0]), 0.5) == 3.0
    assert weighted_quantile(v, np.asarray([98.0, 1.0, 1.0]), 0.5) == 1.0


def test_cli_json_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 900, 1500))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for x in t:
        stamp = pd.Timestamp("2023-11-16 18:00:00") + pd.Timedelta(seconds=float(x))
        lines.append(f"{stamp.strftime('%Y-%m-%d %H:%M:%S.%f')}0,{rng.integers(100, 4000)},{rng.integers(5, 60)}")
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n")
    plot = tmp_path / "out.png"
    rc = main(["backtest", str(path), "--json", "--plot", str(plot), "--rate-scale", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"trace", "params", "policies", "rows"}
    assert {r["policy"] for r in last["rows"]} == set(POLICIES)
    assert set(last["policies"]) == set(POLICIES)
    for s in last["policies"].values():
        for key in ("ttft_p50_s", "ttft_p99_s", "ttft_p999_s", "cold_start_share", "gpu_hours",
                    "gpu_hours_vs_reactive", "gpu_hours_vs_oracle", "warm_cost_ratio"):
            assert key in s
    assert last["params"]["rate_scale"] == 2.0
    assert "rate scaled x2" in out  # the scaling is stated in the readable output too
    assert plot.stat().st_size > 10_000
    assert main(["backtest", str(path), "--policies", "nope"]) == 2


def test_score_after_excludes_a_warm_up_for_every_policy() -> None:
    from forecasting.sim.scoring import score

    trace = request_trace([0.0, 10.0, 1900.0, 3599.5], context=0.0, generated=2.0)
    work = build_workload(trace, P)
    run = replay(work, Scripted([(0.0, 2)]), P)
    full, late = score(run, work, P), score(run, work, P, after_s=1800.0)
    assert full["gpu_hours"] == pytest.approx(2.0)
    assert late["gpu_hours"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beyond the trace"):
        score(run, work, P, after_s=7200.0)


def test_prewarm_keeps_capacity_between_recurring_bursts() -> None:
    # a burst of 40 requests of 10 s (5 replicas' worth) every 200 s, idle between: bursts cannot be
    # forecast, so the quality gate keeps scale-downs reactive, and the capacity the first burst
    # needed is still there for the next ones (they recur within the stabilization window)
    times, gen = [0.0], [1.0]
    for b in range(8):
        times += [60.0 + 200.0 * b + i * 0.01 for i in range(40)]
        gen += [396.0] * 40
    times.append(1700.0)
    gen.append(1.0)
    trace = RequestTrace(t=np.asarray(times), context_tokens=np.zeros(len(times)), generated_tokens=np.asarray(gen),
                         source="bursts")
    work = build_workload(trace, P)
    later = work.arrivals >= 200.0  # type: ignore[operator]
    policy = Prewarm(record=True)
    prewarm = replay(work, policy, P)
    assert (prewarm.wait[~later] > P.wait_threshold_s).sum() > 0  # the first burst is unforeseeable
    assert prewarm.wait[later].max() <= P.wait_threshold_s
    assert set(policy.modes) == {"reactive"}


def test_a_planner_that_starts_after_its_history_sees_only_its_own_replicas() -> None:
    """`plan_from_s` (`prewarm up --history`): until the planner's first step the replay keeps its starting
    replicas; from that step on the planner sees only its own, as the live one, which starts on an empty stack.
    The replicas held before serve until its own are ready (nothing waits), then go."""
    trace = request_trace([float(i) for i in range(900)], context=1000.0, generated=10.0)
    work = build_workload(trace, P)
    policy = Prewarm(record=True, plan_from_s=300.0)
    run = replay(work, policy, P)
    held = Prewarm(plan_from_s=300.0).start(PolicyEnv(work=work, params=P))
    assert held >= 1 and (run.live[:300] == held).all()
    first = policy.decisions[0]
    assert first[0] >= 300.0 and first[1].live == 0  # none of the held replicas is the planner's
    want = first[2].target + first[2].pool_target
    assert want >= 1 and run.live[int(first[0]) + 1] == held + want  # the held serve while its own load
    assert run.wait.max() <= P.wait_threshold_s
    last = policy.decisions[-1]
    assert last[1].live == run.live[-1] == last[2].target + last[2].pool_target  # then only its own are live
