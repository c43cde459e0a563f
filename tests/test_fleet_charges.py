"""What the fleet replay charges for tiers (docs/fleet.md): only a model on GPU sleeps, sleeping models
fit in host memory, a sleep's copy holds GPU memory, idle times are measured on arrivals, rate
traces become Poisson counts, and the baselines get the planner's sleep tier."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting.fleet.backtest import FleetSetup, resample, run_fleet_backtest
from forecasting.fleet.catalog import Catalog, ModelCard, Tier
from forecasting.fleet.policies import FleetEnv, FleetPolicy, KeepAlive, SleepTier, make_fleet_policy
from forecasting.fleet.simulate import simulate
from forecasting.fleet.traces import FleetTrace


class _Scripted(FleetPolicy):
    """GPU and asleep masks given per step (a test policy)."""

    name = "scripted"

    def __init__(self, plan: dict[int, tuple[list[int], list[int]]]) -> None:
        self.plan = plan

    def decide(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        gpu, asleep = self._none(), self._none()
        on, sleep = self.plan.get(t, ([], []))
        gpu[on] = True
        asleep[sleep] = True
        return gpu, asleep


def _fleet(counts: list[list[float]], mem: tuple[float, ...] = (8.0, 30.0), host_gb: float = 100.0,
           sleep_share: float = 1.0) -> tuple[FleetTrace, FleetEnv]:
    names = tuple(f"m{i}" for i in range(len(mem)))
    tr = FleetTrace(names, np.asarray(counts, dtype=np.float64), 60.0, "hand-made", "test")
    cat = Catalog(tuple(ModelCard(n, m) for n, m in zip(names, mem)))
    env = FleetEnv(catalog=cat, step_s=60.0, n_nodes=1, node_gpu_gb=1000.0, node_host_gb=host_gb,
                   sleep_share=sleep_share)
    return tr, env


def test_only_a_model_on_gpu_can_sleep() -> None:
    tr, env = _fleet([[0, 0], [0, 0], [1, 0]])
    never_loaded = simulate(tr, _Scripted({0: ([], [0]), 1: ([], [0]), 2: ([], [0])}), env)
    assert never_loaded.sleeps == 0 and never_loaded.wakes == 0 and never_loaded.loads == 1  # a full load
    loaded_first = simulate(tr, _Scripted({0: ([0], []), 1: ([], [0]), 2: ([], [0])}), env)
    assert loaded_first.sleeps == 1 and loaded_first.wakes == 1
    assert loaded_first.full_load_share == 0.0 and never_loaded.full_load_share == 1.0


def test_sleeping_models_fit_in_host_memory_least_recently_used_out() -> None:
    # both were on GPU; 8 + 30 GB asleep do not fit in 32 GB of host memory: the one used last stays asleep
    tr, env = _fleet([[1, 0], [0, 1], [0, 0], [1, 1]], host_gb=32.0)
    run = simulate(tr, _Scripted({0: ([0, 1], []), 1: ([0, 1], []), 2: ([], [0, 1]), 3: ([], [0, 1])}), env)
    # both loaded at step 0; m1 (used at step 1) slept and woke; m0 (used at step 0) did not fit: loaded again
    assert run.sleeps == 1 and run.wakes == 1 and run.loads == 2 + 1


def test_an_actuation_delay_keeps_a_load_later_and_more_requests_cold() -> None:
    from dataclasses import replace

    tr, env = _fleet([[6, 0], [6, 0]], mem=(8.0,) * 2)
    ready_s = env.catalog.cards[0].time_to_ready(Tier.DISK)
    keep = _Scripted({1: ([0], [])})  # loaded on demand at step 0 (ready one load time after its first request)
    plain = simulate(tr, keep, env)
    late = simulate(tr, keep, replace(env, actuation_s=60.0 - ready_s))  # ... and now ready after step 0 ends
    assert plain.loads == late.loads == 1
    assert 0 < plain.cold_requests < 6 < late.cold_requests < 12  # all of step 0 waited, and the first of step 1


def test_a_model_brought_back_comes_from_where_its_weights_were() -> None:
    """A model the policy puts back on GPU before its request is a wake if it slept the step before and a page
    cache load if it was cached: not a load from disk whatever it was (the planner's pre-warmed wakes were all
    charged as full loads)."""
    tr, env = _fleet([[1, 0], [0, 0], [0, 0], [1, 0]], mem=(30.0, 8.0))
    woken = simulate(tr, _Scripted({0: ([0], []), 1: ([], [0]), 2: ([0], []), 3: ([0], [])}), env)
    assert (woken.loads, woken.sleeps, woken.wakes) == (1, 1, 1)
    cached = simulate(tr, _Scripted({0: ([0], []), 1: ([], []), 2: ([0], []), 3: ([0], [])}), env)
    assert (cached.loads, cached.wakes) == (2, 0)  # reloaded (from the page cache): a load, not a wake
    assert woken.cold_requests == cached.cold_requests == 1.0  # only step 0's request, before anything was loaded
    card = env.catalog.cards[0]
    assert card.time_to_ready(Tier.ASLEEP) < card.time_to_ready(Tier.CACHED) < card.time_to_ready(Tier.DISK)


def test_a_sleep_holds_its_gpu_memory_during_the_copy() -> None:
    tr, env = _fleet([[1, 0], [0, 0], [0, 0]], mem=(30.0, 8.0))
    slept = simulate(tr, _Scripted({0: ([0], []), 1: ([], [0]), 2: ([], [0])}), env)
    evicted = simulate(tr, _Scripted({0: ([0], []), 1: ([], []), 2: ([], [])}), env)
    copy_s = float(env.sleep_s(30.0))
    assert copy_s == pytest.approx(0.1 + 30.0 / 1.75)
    assert slept.warm_gb_h - evicted.warm_gb_h == pytest.approx(30.0 * copy_s / 3600.0)


def test_keepalive_counts_idle_time_from_the_last_arrival() -> None:
    # one request in step 0 (served at 30 s, the middle of its step): a 600 s keep-alive ends at 630 s,
    # so the model is still warm in step 10 (600-660 s) and gone in step 11
    counts = [[1.0, 0.0]] + [[0.0, 0.0]] * 14
    tr, env = _fleet(counts)
    policy = KeepAlive(600.0)
    policy.reset(env)
    warm = []
    for t in range(tr.n_steps):
        gpu, _ = policy.decide(t)
        warm.append(bool(gpu[0]))
        policy.observe(t, tr.counts[t], gpu)
    assert warm[1:11] == [True] * 10 and not any(warm[11:])


def test_rate_traces_become_poisson_counts() -> None:
    rates = FleetTrace(("a", "b"), np.asarray([[600.0, 6.0]] * 48), 600.0, "rates", "client_rates")
    setup = FleetSetup(n_nodes=1, node_gpu_gb=1000.0, score_after_s=0.0)
    even = resample(rates, 60.0).counts
    assert np.allclose(even[:, 1], 0.6)  # a window's mean spread evenly: never an idle minute
    out = run_fleet_backtest(rates, setup=setup, policies=("keepalive",), curve=False)
    off = run_fleet_backtest(rates, setup=FleetSetup(n_nodes=1, node_gpu_gb=1000.0, score_after_s=0.0, poisson=False),
                             policies=("keepalive",), curve=False)
    assert out["poisson_counts"] is True and off["poisson_counts"] is False
    assert out["rows"][0]["requests"] != off["rows"][0]["requests"]  # drawn, not spread
    assert out["rows"][0]["requests"] == pytest.approx(off["rows"][0]["requests"], rel=0.05)


def test_the_sleep_baselines_sleep_what_they_release_and_wake_it_on_demand() -> None:
    # a request every 20 minutes: a 10-minute keep-alive releases the model between them
    counts = [[1.0 if t % 20 == 0 else 0.0, 0.0] for t in range(120)]
    tr, env = _fleet(counts)
    plain = simulate(tr, make_fleet_policy("keepalive"), env)
    sleep = simulate(tr, make_fleet_policy("keepalive_sleep"), env)
    assert isinstance(make_fleet_policy("hybrid_histogram_sleep"), SleepTier)
    assert plain.wakes == 0 and plain.loads == 6
    assert sleep.loads == 1 and sleep.wakes == 5 and sleep.sleeps == 6  # the last release sleeps too
    assert sleep.ttft_p50_s < plain.ttft_p50_s  # a wake is a fraction of a load
    assert sleep.full_load_share == pytest.approx(1 / 6) and plain.full_load_share == 1.0
    assert sleep.cold_share == plain.cold_share  # the same requests still wait, for less
    assert env.catalog.cards[0].time_to_ready(Tier.ASLEEP) < env.catalog.cards[0].time_to_ready(Tier.DISK)
    none_fit = simulate(tr, make_fleet_policy("keepalive_sleep"), _fleet(counts, host_gb=4.0)[1])
    assert none_fit.wakes == 0 and none_fit.loads == 6  # no host memory for it: it falls to cache/disk


def test_fleet_cli_rows_carry_starts_and_the_charges_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    from prewarm.cli import main

    fix = Path(__file__).parent / "fixtures" / "fleet" / "client_rates.csv"
    out = {}
    for flags in ([], ["--even-counts", "--sleep-gbps", "3", "--sleep-share", "0.5"]):
        rc = main(["backtest", str(fix), "--no-curve", "--json", "--policies", "keepalive,keepalive_sleep", *flags])
        assert rc == 0
        out[bool(flags)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out[False]["poisson_counts"] is True and out[True]["poisson_counts"] is False
    for result in out.values():
        assert {r["policy"] for r in result["rows"]} == {"keepalive", "keepalive_sleep"}
        assert all("starts" in r and "sleeps" in r for r in result["rows"])
    with pytest.raises(ValueError, match="sleep_share"):
        FleetSetup(sleep_share=1.5)


def test_the_pool_replay_takes_the_single_model_replays_charge_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`--actuation-delay`, `--cold-start-cv` and `--load-share` change the pool replay's charges as they change the
    single model's; by default both charge `forecasting.charges`'s values, and the JSON says which were in force."""
    import json
    from pathlib import Path

    from forecasting.charges import ACTUATION_S, COLD_START_CV, LOAD_SHARE
    from prewarm.cli import main

    fix = Path(__file__).parent / "fixtures" / "fleet" / "client_rates.csv"
    out = {}
    for flags in ((), ("--actuation-delay", "0", "--cold-start-cv", "0", "--load-share", "0.25"), ("--ideal",)):
        assert main(["backtest", str(fix), "--no-curve", "--json", "--policies", "keepalive", *flags]) == 0
        out[flags[:1]] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out[()]["charges"] == {"actuation_s": ACTUATION_S, "cold_start_cv": COLD_START_CV, "load_share": LOAD_SHARE}
    assert out[("--actuation-delay",)]["charges"] == {"actuation_s": 0.0, "cold_start_cv": 0.0, "load_share": 0.25}
    assert out[("--ideal",)]["charges"] == {"actuation_s": 0.0, "cold_start_cv": 0.0, "load_share": 0.0}
    # every load of the keep-alive's on-demand loads starts 2.5 s later by default: more of its requests wait
    assert out[("--actuation-delay",)]["rows"][0]["cold_share"] < out[()]["rows"][0]["cold_share"]
    with pytest.raises(ValueError, match="load_share"):
        FleetSetup(load_share=1.5)
