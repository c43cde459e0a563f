"""The cold-start budget: the margin's feedback (pure), the gateway's observation of it (real Redis, real
HTTP), and the planner steering to it in the replay on traffic whose steps fall on no grid."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import pytest

from forecasting.calibration import (SCORE_BIN, calibrate, calibrate_margin, needed_margins, quantile_margin,
                                     record_sizing)
from forecasting.data.history import load_fine_counters
from forecasting.data.traces import RateTrace
from forecasting.forecast.nowcast import fit_profile
from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from forecasting.sim.scoring import run_backtest
from forecasting.sim.workload import SimParams
from prewarm.core import keys
from prewarm.core.domain import LoadPhase, ModelSpec, ReplicaState
from tests.httpservers import Upstream
from tests.test_gateway import Harness, served_by

P = PlannerParams(cold_start_budget=0.001, budget_gain=0.1, margin_initial=2.0, margin_max=10.0,
                  budget_calibration_s=3600.0)


def _counts(n: int, per_bucket: float = 100.0) -> np.ndarray:
    return np.full(n, per_bucket)


def test_the_first_count_only_marks_where_counting_starts() -> None:
    beta, end, rate, weight = calibrate_margin(_counts(6), np.full(6, 50.0), 1000.0, 10.0, None, None, None, None, P)
    assert (beta, end, rate, weight) == (2.0, 1060.0, None, None)  # misses before the planner acted are not its own


def test_misses_over_the_budget_raise_the_margin_in_proportion_to_the_window_budget_spent() -> None:
    req, waited = _counts(360), np.zeros(360)
    waited[-1] = 36.0  # one hour at 100 per bucket: the window's budget is 36 waits; this spends it once more
    beta, end, rate, weight = calibrate_margin(req, waited, 0.0, 10.0, 2.0, 3590.0, None, None, P)
    assert (end, rate, weight) == (3600.0, 10.0, 10.0)  # no rate carried yet: the bucket counted is its estimate
    assert beta == pytest.approx(2.0 + 0.1 * (36.0 - 0.001 * 100.0) / 36.0)


def test_a_calm_window_lowers_the_margin_by_the_gain_and_the_bounds_hold() -> None:
    req, waited = _counts(360), np.zeros(360)
    beta = calibrate_margin(req, waited, 0.0, 10.0, 2.0, 0.0, 10.0, 3600.0, P)[0]
    assert beta == pytest.approx(2.0 - 0.1)
    assert calibrate_margin(req, waited, 0.0, 10.0, 0.01, 0.0, 10.0, 3600.0, P)[0] == 0.0
    waited[-10:] = 1000.0
    assert calibrate_margin(req, waited, 0.0, 10.0, 9.0, 0.0, 10.0, 3600.0, P)[0] == 10.0  # no wind-up past the ceiling


def test_buckets_already_counted_are_not_counted_twice_and_no_counter_leaves_the_margin() -> None:
    req, waited = _counts(10), np.full(10, 5.0)
    assert calibrate_margin(req, waited, 0.0, 10.0, 3.0, 100.0, 10.0, 60.0, P) == (3.0, 100.0, 10.0, 60.0)
    assert calibrate_margin(req, None, 0.0, 10.0, 3.0, 50.0, 10.0, 60.0, P) == (3.0, 100.0, 10.0, 60.0)
    beta, _, rate, _ = calibrate_margin(req, waited, 0.0, 10.0, 3.0, 90.0, 10.0, 60.0, P)  # only the last bucket is new
    per_window = 100.0 * 360
    assert rate == pytest.approx(10.0)
    assert beta == pytest.approx(3.0 + 0.1 * (5.0 - 0.1) / (0.001 * per_window))


def test_the_overspend_is_weighed_by_the_horizon_rate_so_the_budget_is_a_share_of_requests() -> None:
    """A miss at a busy hour weighs as much as one at a quiet hour: the overspend is normalised by the rate
    carried over the budget's horizon, not by the last hour's, so the integrator's fixed point is the share
    of all requests (normalised by its own hour, a busy hour's misses counted for less)."""
    busy, quiet = _counts(360, 1000.0), _counts(360, 10.0)
    one_miss = np.zeros(360)
    one_miss[-1] = 72.0
    horizon_rate = 50.5  # requests/s over the day: the busy and the quiet hour alike
    at_busy = calibrate_margin(busy, one_miss, 0.0, 10.0, 2.0, 3590.0, horizon_rate, 86400.0, P)[0]
    at_quiet = calibrate_margin(quiet, one_miss, 0.0, 10.0, 2.0, 3590.0, horizon_rate, 86400.0, P)[0]
    assert at_busy - 2.0 == pytest.approx(0.1 * (72.0 - 1.0) / (0.001 * horizon_rate * 3600.0))
    assert at_quiet - 2.0 == pytest.approx(0.1 * (72.0 - 0.01) / (0.001 * horizon_rate * 3600.0))
    # the carried rate follows the traffic over the horizon (an exponential average of what was counted)
    _, _, r, w = calibrate_margin(busy, np.zeros(360), 0.0, 10.0, 2.0, 0.0, 1.0, 7200.0, P)
    keep = math.exp(-3600.0 / P.budget_horizon_s)
    assert r is not None and w is not None
    assert w == pytest.approx(keep * 7200.0 + 3600.0)
    assert r == pytest.approx((keep * 7200.0 * 1.0 + 360 * 1000.0) / w)
    # before anything was counted the rate is what is counted first, whatever zeros the history held before
    idle_then_busy = np.r_[np.zeros(354), np.full(6, 100.0)]
    _, _, r0, w0 = calibrate_margin(idle_then_busy, np.zeros(360), 0.0, 10.0, 2.0, 3540.0, None, None, P)
    assert (r0, w0) == (10.0, 60.0)


def test_planner_state_carries_the_margin_through_json() -> None:
    s = PlannerState(margin=4.25, counted_end=1234.0, counted_rate=12.5, counted_weight_s=600.0)
    assert PlannerState.from_json(s.to_json()) == s


def test_until_its_first_overspend_the_margin_is_never_above_the_largest_a_counted_bucket_needed() -> None:
    """A calm start: the integrator comes down from its safe start by the gain an hour, but once the counted
    buckets hold one budget's worth of requests and are one budget's worth of buckets its margin is no higher
    than the largest any of them needed (with slots for 16 and 9 sized, peaks of 20 and 12 needed
    (20 - 16) / 4 = 1 and (12 - 9) / 3 = 1: one bin, 1.0). The largest of n buckets claims that at most 1/n of
    them need more, so an hour of 10 s buckets (360) does not show a 0.1% tail, however many requests they hold.
    The first step whose waits are over the budget ends the cap: a wait the needed margins do not show (a load
    that came late) must not be argued away by them, so from there the integrator alone moves the margin."""
    p = replace(P, margin_initial=6.0)
    n = 1080  # three hours of 10 s buckets of 100 requests
    req, waited, peak = _counts(n), np.zeros(n), np.r_[np.full(n // 2, 20.0), np.full(n // 2, 12.0)]
    sized = ((-60.0, 20.0, 16.0, 0.0), (n * 5.0 - 10.0, 20.0, 9.0, 0.0))
    calm = calibrate(req, waited, peak, 0.0, 10.0, PlannerState(counted_end=0.0, sized=sized), p)
    assert calm.margin == pytest.approx(1.0) and not calm.overspent  # capped: the integrator alone gives 6 - 0.3
    assert calm.scored_buckets == n
    assert calibrate_margin(req, waited, 0.0, 10.0, 6.0, 0.0, None, None, p)[0] == pytest.approx(5.7)
    hour = calibrate(req[:360], waited[:360], peak[:360], 0.0, 10.0, PlannerState(counted_end=0.0, sized=sized), p)
    assert hour.margin == pytest.approx(5.9)  # 36,000 requests, but 360 buckets: fewer than one budget's (1,000)
    req, waited, peak = req[:360], waited[:360], peak[n // 2 - 180: n // 2 + 180]
    missed = waited.copy()
    missed[-1] = 72.0  # the window's budget (36) spent twice
    carried = PlannerState(margin=calm.margin, counted_end=3600.0, counted_rate=10.0, counted_weight_s=3600.0,
                           shortfalls=calm.shortfalls, scored_buckets=calm.scored_buckets,
                           sized=((3500.0, 20.0, 9.0, 0.0),))
    after = calibrate(req, missed, peak, 3600.0, 10.0, carried, p)
    assert after.overspent and after.margin == pytest.approx(1.0 + 0.1 * (72.0 - 36.0) / 36.0)
    high = replace(carried, margin=5.0, counted_end=7200.0, overspent=True)
    later = calibrate(req, waited, peak, 7200.0, 10.0, high, p)  # calm again: down by the gain, no cap
    assert later.overspent and later.margin == pytest.approx(4.9)
    assert PlannerState.from_json(replace(high, overspent=True).to_json()).overspent
    assert PlannerState.from_json(carried.to_json()).scored_buckets == n


# -- the quantile rule: the margin read from the margins past buckets needed -------------------------------------

Q = PlannerParams(cold_start_budget=0.01, budget_gain=0.1, margin_initial=2.0, margin_max=10.0, margin_rule="quantile",
                  shortfall_horizon_s=3600.0)


def test_a_step_that_saw_no_bucket_sized_no_load_to_score_buckets_against() -> None:
    """The planner's first step has no counter to read: its forecast is 0, and the replicas it keeps are those it
    was handed. Recorded as a sizing of 0, every later bucket needed its whole peak as margin ((peak - 0) / 1),
    the cap read 40 (its ceiling) for the seven days the scores are kept, and the calm start never came down on
    any trace that starts with more than one replica's load (Mooncake's hour: 1.6x `reactive`'s GPU-hours)."""
    p, model, t0 = PlannerParams(cold_start_budget=0.001), ModelSpec(name="m", revision="r", slots=8), 1_700_000_000.0
    blind = observed_from_counts(t0, 10.0, [], [], [], [])
    _, state = step(StepInputs(model, t0, blind, ReplicaCounts(7, 0, 0), p), PlannerState())
    assert state.sized == ()
    seen = observed_from_counts(t0, 10.0, [400.0], [50.0], [500.0], [0.0])
    decision, state = step(StepInputs(model, t0 + 10.0, seen, ReplicaCounts(7, 0, 0), p), state)
    assert len(state.sized) == 1 and state.sized[0][2] == decision.forecast.upper > 0


def test_in_whole_replicas_a_bucket_needs_a_margin_only_for_the_replicas_its_peak_fills() -> None:
    """Eight slots a replica: a peak of 5 is served by the one a load of 2 is sized for (it needs no margin), a peak
    of 12 needs two replicas, so a load just over 8: (8 - 4) / 2 = 2 against a sized 4, where the slots alone
    ask (12 - 4) / 2 = 4."""
    sized = ((0.0, 10.0, 4.0, 0.0),)
    req, peak = np.array([1.0, 1.0, 1.0]), np.array([5.0, 12.0, 16.0])
    assert needed_margins(req, peak, 0.0, 10.0, 0, sized, 41)[[int(0.5 / SCORE_BIN), int(4 / SCORE_BIN), 24]].tolist() \
        == [1.0, 1.0, 1.0]
    whole = needed_margins(req, peak, 0.0, 10.0, 0, sized, 41, slots=8.0)
    assert whole[0] == 1.0 and whole[int(2 / SCORE_BIN) + 1] == 2.0  # 5: none; 12 and 16: just over 2 (two replicas)


def test_each_bucket_is_scored_against_the_sizing_whose_capacity_was_there_in_time() -> None:
    """A bucket's needed margin is (peak - a) / sqrt(a) against the load `a` the latest step sized whose lead had run
    out by the bucket's end, plus that step's offset (a peak's staffing beta); a bucket no step sized is left out."""
    sized = ((0.0, 20.0, 16.0, 0.0), (10.0, 20.0, 25.0, 1.5), (20.0, 20.0, 100.0, 0.0))
    req, peak = np.array([7.0, 5.0, 3.0, 2.0]), np.array([30.0, 24.0, 45.0, 35.0])
    hist = needed_margins(req, peak, 0.0, 10.0, 0, sized, 41)
    # bucket 0 ends at 10 s: no lead had run out; bucket 1 (ends 20 s): the step at 0 s, (24 - 16) / 4 = 2;
    # bucket 2 (30 s): the step at 10 s, (45 - 25) / 5 + 1.5 = 5.5; bucket 3 (40 s): the step at 20 s, below its load
    assert hist.sum() == 10.0 and hist[0] == 2.0
    assert hist[int(2 / SCORE_BIN)] == 5.0 and hist[int(5.5 / SCORE_BIN)] == 3.0
    assert needed_margins(req, peak, 0.0, 10.0, 2, sized, 41).sum() == 5.0  # only the buckets from `first`


def test_the_quantile_margin_leaves_at_most_alpha_of_the_requests_short() -> None:
    hist = np.zeros(41)
    hist[4], hist[12], hist[40] = 980.0, 15.0, 5.0  # margins 1, 3 and 10 needed
    assert quantile_margin(hist, 0.02, 100.0) == 1.0  # 20 requests' buckets needed more: 2%
    assert quantile_margin(hist, 0.01, 100.0) == 3.0
    assert quantile_margin(hist, 0.0, 100.0) == 10.0  # none may be short: the most any bucket needed
    assert quantile_margin(hist, 0.0005, 100.0) == 10.0
    assert quantile_margin(np.zeros(41), 0.01, 100.0) is None
    assert quantile_margin(hist, 0.01, 1001.0) is None  # too few requests to read a share from


def test_the_quantile_rule_moves_its_level_by_the_overspend_and_forgets_over_its_horizon() -> None:
    req, peak, waited = _counts(360), np.full(360, 50.0), np.zeros(360)
    sized = ((-60.0, 20.0, 49.0, 0.0),)  # every bucket needed (50 - 49) / 7: one bin
    first = calibrate(req, waited, peak, 0.0, 10.0, PlannerState(), Q)
    assert (first.margin, first.counted_end, first.alpha, sum(first.shortfalls)) == (2.0, 3600.0, 0.01, 0.0)
    calm = calibrate(req, waited, peak, 0.0, 10.0, PlannerState(counted_end=0.0, sized=sized), Q)
    assert calm.alpha == pytest.approx(0.01 + 0.1 * 0.01)  # a calm window: the level rises by gain x budget
    assert sum(calm.shortfalls) == pytest.approx(36000.0) and calm.margin == pytest.approx(SCORE_BIN)
    waited[-1] = 720.0  # the window's budget (360) spent twice
    missed = calibrate(req, waited, peak, 0.0, 10.0, PlannerState(counted_end=0.0, sized=sized), Q)
    assert missed.alpha == pytest.approx(0.01 - 0.1 * 360.0 / 36000.0)
    later = calibrate(req, np.zeros(360), peak, 3600.0, 10.0,
                      PlannerState(counted_end=3600.0, shortfalls=calm.shortfalls, alpha=calm.alpha), Q)
    assert sum(later.shortfalls) == pytest.approx(36000.0 * math.exp(-1.0))  # one horizon: e^-1 (no sizing: no new)
    off = replace(Q, cold_start_budget=1.0)  # no budget: the margin stays at its start (the fixed-margin ablation)
    assert calibrate(req, waited, peak, 0.0, 10.0, PlannerState(counted_end=0.0, sized=sized), off).margin == 2.0


def test_the_sizings_kept_are_only_those_the_coming_buckets_will_be_scored_against() -> None:
    assert record_sizing((), 100.0, 20.0, 5.0, 0.0, PlannerParams()) == ((100.0, 20.0, 5.0, 0.0),)
    kept = ((10.0, 20.0, 1.0, 0.0), (40.0, 20.0, 2.0, 0.0), (60.0, 20.0, 3.0, 0.0), (90.0, 20.0, 4.0, 0.0))
    # at 100 s the buckets not yet counted end after 70 s: the sizing of 60 s is due at 80 s, the one of 40 s the
    # last before them (it sized the bucket ending at 70 s), the one of 10 s is not needed again
    out = record_sizing(kept, 100.0, 20.0, 5.0, 1.5, Q)
    assert out == kept[1:] + ((100.0, 20.0, 5.0, 1.5),)


def test_the_quantile_rule_is_a_setting_and_its_state_goes_through_json(clean_env: pytest.MonkeyPatch) -> None:
    from prewarm.core.errors import SettingsError
    from prewarm.core.settings import Settings

    s = PlannerState(margin=3.25, counted_end=100.0, shortfalls=(1.0, 2.5), alpha=0.002, sized=((1.0, 2.0, 3.0, 0.0),))
    assert PlannerState.from_json(s.to_json()) == s
    clean_env.setenv("PREWARM_PLANNER_MARGIN_RULE", "quantile")
    clean_env.setenv("PREWARM_PLANNER_SHORTFALL_HORIZON_S", "86400")
    p = PlannerParams.from_settings(Settings.load().planner)
    assert (p.margin_rule, p.shortfall_horizon_s) == ("quantile", 86400.0)
    clean_env.setenv("PREWARM_PLANNER_MARGIN_RULE", "pid")
    with pytest.raises(SettingsError, match="PREWARM_PLANNER_MARGIN_RULE"):
        Settings.load()
    with pytest.raises(ValueError, match="margin_rule 'pid'"):
        PlannerParams(margin_rule="pid")


def test_under_the_quantile_rule_the_budget_moves_the_gpu_on_off_grid_traffic() -> None:
    """The operator's knob under the quantile rule: a tighter budget spends more GPU for no more hits. (On these ten
    hours it has none at either budget: its level starts at the budget and rises by gain x budget a calm hour, so
    on a short trace it sizes on the tail of the margins needed; docs/operating.md, "the quantile rule".)"""
    tr = _off_grid_trace(10.0, seed=3)
    shares, gpu = [], []
    for budget in (0.01, 0.0003):
        kw = {"cold_start_budget": budget, "margin_initial": 1.5, "margin_rule": "quantile"}
        row = run_backtest(tr, SimParams(), ["prewarm"], policy_kwargs={"prewarm": kw})["result"]["rows"][0]
        shares.append(row["cold_start_share"])
        gpu.append(row["gpu_hours"])
    assert shares[1] <= shares[0] and gpu[1] > gpu[0]


def test_the_profile_resolution_and_season_are_declared_not_fixed() -> None:
    day = np.r_[np.full(431, 1.0), np.full(1009, 3.0)]  # a step at 07:11 (minute 431): on no 10-minute grid
    rates = np.tile(day, 3)
    prof = fit_profile(rates, 0.0, 60.0, bin_s=900.0)
    assert prof is not None and prof.bin_s == 900.0 and len(prof.values) == 96
    assert prof.at(np.array([3 * 3600.0]))[0] < 0.5 < 1.0 < prof.at(np.array([12 * 3600.0]))[0]
    week = fit_profile(np.tile(day, 15), 0.0, 60.0, bin_s=3600.0, season_s=7 * 86400.0)
    assert week is not None and len(week.values) == 168 and week.season_s == 7 * 86400.0
    assert fit_profile(rates, 0.0, 60.0, bin_s=900.0, season_s=7 * 86400.0) is None  # three days are no week
    with pytest.raises(ValueError, match="bin_s"):
        fit_profile(rates, 0.0, 60.0, bin_s=2 * 86400.0)


def test_settings_name_a_profile_bin_longer_than_its_season(clean_env: pytest.MonkeyPatch) -> None:
    from prewarm.core.errors import SettingsError
    from prewarm.core.settings import Settings

    clean_env.setenv("PREWARM_PLANNER_SEASON_S", "3600")
    clean_env.setenv("PREWARM_PLANNER_PROFILE_BIN_S", "7200")
    with pytest.raises(SettingsError, match="PREWARM_PLANNER_PROFILE_BIN_S"):
        Settings.load()
    clean_env.setenv("PREWARM_PLANNER_COLD_START_BUDGET", "0.002")
    clean_env.setenv("PREWARM_PLANNER_PROFILE_BIN_S", "600")
    p = PlannerParams.from_settings(Settings.load().planner)
    assert (p.cold_start_budget, p.season_s, p.profile_bin_s) == (0.002, 3600.0, 600.0)


def _off_grid_trace(hours: float, seed: int) -> RateTrace:
    """A daily-ish rate whose steps fall at random seconds (no window grid), with a slow wave under them."""
    rng = np.random.default_rng(seed)
    t, starts, rates = 0.0, [], []
    while t < hours * 3600:
        starts.append(t)
        wave = 1.0 + 0.5 * math.sin(2 * math.pi * t / 86400.0)
        rates.append(120.0 * wave * rng.uniform(0.75, 1.3))
        t += float(rng.uniform(200.0, 1100.0))
    secs = np.arange(0, int(hours * 3600), 60.0)
    idx = np.searchsorted(np.asarray(starts), secs, side="right") - 1
    # written per minute (the trace format is regular): steps inside a minute land on its start, never on a 600 s grid
    return RateTrace(window_start_s=secs, rate=np.asarray(rates)[idx], window_s=60.0, source=f"off-grid seed {seed}")


def test_the_budget_moves_the_hits_on_off_grid_traffic() -> None:
    """The operator's knob buys cold starts back: a tighter budget gives fewer hits for more GPU."""
    tr = _off_grid_trace(10.0, seed=3)
    shares, gpu = [], []
    for budget in (0.01, 0.0003):
        out = run_backtest(tr, SimParams(), ["prewarm"],
                           policy_kwargs={"prewarm": {"cold_start_budget": budget, "margin_initial": 1.5}})["result"]
        row = out["rows"][0]
        assert row["cold_start_budget"] == budget
        shares.append(row["cold_start_share"])
        gpu.append(row["gpu_hours"])
    assert shares[1] < shares[0] and gpu[1] > gpu[0]


_NOT_HELD = pytest.mark.xfail(strict=True, reason=(
    "issue 17's target is not met on every seed: the budget's integrator learns from misses, and on this traffic "
    "they come as one or two large events a day (a step beyond the margin, then every request of a cold start "
    "waits; on seed 5 none big enough comes, and the safe start is spent for nothing). Measured with the "
    "day-horizon normaliser, budget 0.1%, gain 0.2, seeds 3/5/7: 0.92x / 0.35x / 0.89x the budget (0.01% and "
    "gain 0.1 before: 4.2x / 0x / 6.1x); with recommendations held for their lead and the fluid replay's waited "
    "counter as the gateway counts: 0.93x / 0.33x / 0.94x; before the planner read the load so far in the bucket in "
    "progress (every 10 s, on complete buckets): 0.83x / 0.27x / 0.68x; since (every 5 s): 0.57x / 0.26x / 0.49x, "
    "seed 7 at 503.6 GPU-hours against 513.7 before: fewer waits for less GPU, and the integrator's descent "
    "(`budget_gain` per calm window) does not spend what the faster reaction saved within one day; since the warm "
    "budget keeps the live replicas it once cut and restored at alternate steps: 0.55x / 0.16x / 0.56x (seed 7 "
    "held, at 509.9 GPU-hours); re-read at 45147f6: 0.65x / 0.16x / 0.56x (the quantile rule 0.11x / 0x / 0.26x, "
    "docs/operating.md). Remove this mark when the planner meets it; strict, so a pass is reported"))


@pytest.mark.parametrize("seed", [3, pytest.param(5, marks=_NOT_HELD), 7])
def test_the_budget_holds_over_a_day_on_off_grid_traffic(seed: int) -> None:
    """The operator's goal, held: over one day of traffic whose steps fall on no grid (a daily wave, a new rate
    every 200-1100 s), with default settings, the realised cold-start share is within 0.5x-1.25x the budget."""
    out = run_backtest(_off_grid_trace(24.0, seed=seed), SimParams(), ["prewarm"])["result"]
    row = out["rows"][0]
    assert row["cold_start_budget"] == PlannerParams().cold_start_budget
    assert 0.5 <= row["cold_start_share"] / row["cold_start_budget"] <= 1.25, row


# -- the live observation: what the gateway counts is what the planner reads --------------------------------------

def _totals(h: Harness, since: float) -> tuple[float, float]:
    """(requests, waited) the gateway has flushed for model m since `since`: what the planner reads."""
    end = math.floor(time.time() / keys.FINE_RESOLUTION_S) * keys.FINE_RESOLUTION_S + keys.FINE_RESOLUTION_S
    _, requests, _, _, waited = load_fine_counters(h.reg.client, "m", start=since, end=end,
                                                   bucket_s=keys.FINE_RESOLUTION_S)
    return float(requests.sum()), float(waited.sum())


def _waited_total(h: Harness, since: float) -> float:
    return _totals(h, since)[1]


def _until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)


def test_the_gateway_counts_requests_that_waited_for_capacity(redis_url: str) -> None:
    h = Harness(redis_url, hold_timeout_s=5.0, wait_threshold_s=0.2)
    since = time.time() - keys.FINE_RESOLUTION_S
    try:
        r = h.add(0, Upstream("late"), state=ReplicaState.LOADING, progress=0.2, phase=LoadPhase.FIRST_LAYERS)
        ready = threading.Event()

        def finish() -> None:
            ready.wait(5.0)
            h.reg.transition(r.id, ReplicaState.WARMING, now=time.time())
            h.reg.transition(r.id, ReplicaState.READY, now=time.time())

        threading.Thread(target=finish).start()
        threading.Timer(0.5, ready.set).start()
        assert served_by(h.complete()) == "late"  # held until the load finished: one request waited
        _until(lambda: _waited_total(h, since) == 1.0, "the held request counted as waited")
        assert served_by(h.complete()) == "late"  # a ready replica: no wait
        _until(lambda: _totals(h, since)[0] == 2.0, "the second request flushed")
        assert _totals(h, since) == (2.0, 1.0)
    finally:
        h.close()


def test_a_request_refused_for_want_of_a_replica_counts_as_waited(redis_url: str) -> None:
    h = Harness(redis_url)  # hold_timeout_s 0: 503 at once
    since = time.time() - keys.FINE_RESOLUTION_S
    try:
        h.add(0, Upstream("x"), state=ReplicaState.LOADING, progress=0.1, phase=LoadPhase.EMBEDDINGS)
        status, headers, _ = h.complete()
        assert status == 503 and int(headers["retry-after"]) >= 1
        _until(lambda: _waited_total(h, since) == 1.0, "the refused request counted as waited")
    finally:
        h.close()


def test_idle_traffic_one_replica_serves_is_not_held_at_two_for_the_safe_start() -> None:
    """A steady 0.7 req/s (NASA's mean) for a day: one replica serves it and nothing waits. From its safe start
    of 6 the integrator alone comes down by the gain an hour (to 4.8 after six), and the peaks in flight sized
    with it keep a second replica for most of the day. Capped at the margins the counted buckets needed, read as
    (peak - a) / sqrt(a), it still did (their largest, 3.4: 2.0x `reactive`'s GPU-hours over six hours); read in
    whole replicas (one holds 8 slots, and no peak here fills two), the planner holds one from the cap's first
    reading, once a budget's worth of buckets (1,000 of 10 s, 2.8 hours) is counted."""
    secs = np.arange(0, 24 * 3600, 60.0)
    tr = RateTrace(window_start_s=secs, rate=np.full(secs.size, 0.7), window_s=60.0, source="steady 0.7 req/s")
    out = run_backtest(tr, SimParams(), ["reactive", "prewarm"])["result"]["policies"]
    assert out["prewarm"]["cold_start_share"] == 0.0 == out["reactive"]["cold_start_share"]
    assert out["prewarm"]["gpu_hours_vs_reactive"] < 1.2
