"""A fall the learned season or the model's own recent level contradicts is held, not released
(forecasting/interruption.py)."""

from __future__ import annotations

import numpy as np

from forecasting.batch import BatchJob
from forecasting.forecast.nowcast import Profile, fit_profile
from forecasting.interruption import Fall, hold, interrupted
from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec

DAY = 86400.0
P = PlannerParams()
# busy by day (10 req/s from 06:00 to 18:00), nearly idle by night (0.01 req/s)
FLAT_DAY = Profile(bin_s=3600.0, values=tuple(1.0 if 6 <= h < 18 else 0.001 for h in range(24)), days=3.0,
                   level=10.0)


def _busy(n: int, rate: float = 10.0) -> np.ndarray:
    return np.full(n, rate * 10.0)  # requests per 10 s bucket


def test_silence_at_a_busy_hour_is_an_interruption_and_at_a_quiet_one_is_not() -> None:
    noon, night = 12 * 3600.0, 2 * 3600.0
    requests = np.concatenate([_busy(29), [0.0]])  # the last bucket empty, 100 expected
    assert interrupted(FLAT_DAY, requests, noon - 300, 10.0, 300.0, P)
    assert not interrupted(FLAT_DAY, _busy(30), noon - 300, 10.0, 300.0, P)
    assert not interrupted(FLAT_DAY, np.concatenate([_busy(29), [50.0]]), noon - 300, 10.0, 300.0, P)  # half: a dip
    # at night 300 s expect 3 requests: too few to tell silence from chance
    assert not interrupted(FLAT_DAY, np.zeros(30), night - 300, 10.0, 300.0, P)
    # no profile (under two seasons of history), or one without its rate, and nothing before: nothing held
    assert not interrupted(None, np.zeros(30), noon - 300, 10.0, 300.0, P)
    assert not interrupted(Profile(3600.0, FLAT_DAY.values, 3.0), np.zeros(30), noon - 300, 10.0, 300.0, P)


def test_silence_after_a_busy_hour_is_an_interruption_without_a_profile() -> None:
    """Bursty traffic has no season: its own recent level is what the silence contradicts."""
    night = 2 * 3600.0
    busy_then_silent = np.concatenate([_busy(360), np.zeros(30)])  # an hour at 10 req/s, then 5 min of nothing
    assert interrupted(None, busy_then_silent, night - 3900, 10.0, 300.0, P)
    assert interrupted(FLAT_DAY, busy_then_silent, night - 3900, 10.0, 300.0, P)  # a quiet hour of the season too
    assert not interrupted(None, np.concatenate([_busy(360), _busy(30, 1.0)]), night - 3900, 10.0, 300.0, P)  # a fall
    # a short burst in a quiet hour: its mean over the hour expects 4 requests in 5 minutes, too few to tell
    burst = np.concatenate([np.zeros(359), [50.0], np.zeros(30)])
    assert not interrupted(None, burst, night - 3900, 10.0, 300.0, P)


def test_the_fall_names_the_expectation_that_leads_it() -> None:
    """The season where the profile expects at least the recent level (the hour is as busy as the traffic was),
    the recent level where it expects more than the profile does (a bursty tenant's pause at a quiet hour)."""
    noon, night = 12 * 3600.0, 2 * 3600.0
    busy_then_silent = np.concatenate([_busy(360), np.zeros(30)])
    assert interrupted(FLAT_DAY, busy_then_silent, noon - 3900, 10.0, 300.0, P) == Fall(100.0, True)
    at_night = interrupted(FLAT_DAY, busy_then_silent, night - 3900, 10.0, 300.0, P)
    assert at_night is not None and not at_night.by_season and at_night.expected == 100.0
    assert interrupted(None, busy_then_silent, night - 3900, 10.0, 300.0, P) == Fall(100.0, False)
    assert interrupted(None, busy_then_silent, night - 3900, 10.0, 300.0, P, recent=False) is None  # a batch job's end


def test_a_quiet_model_is_judged_over_more_buckets() -> None:
    quiet = Profile(FLAT_DAY.bin_s, FLAT_DAY.values, 3.0, level=0.5)  # 5 requests per bucket by day
    noon = 12 * 3600.0
    one_empty = np.concatenate([np.full(29, 5.0), [0.0]])
    assert not interrupted(quiet, one_empty, noon - 300, 10.0, 300.0, P)  # 5 expected in one bucket: chance
    four_empty = np.concatenate([np.full(26, 5.0), np.zeros(4)])
    assert interrupted(quiet, four_empty, noon - 300, 10.0, 300.0, P)  # 20 expected over four: not chance


def test_the_hold_lasts_from_the_start_of_the_fall_at_most_hold_s() -> None:
    assert hold(None, 100.0, True, 3600.0) == (100.0, True)
    assert hold(100.0, 3700.0, True, 3600.0) == (100.0, True)
    assert hold(100.0, 3701.0, True, 3600.0) == (100.0, False)  # believed after the hold
    assert hold(100.0, 200.0, False, 3600.0) == (None, False)  # traffic back: the next fall starts afresh


def test_fit_profile_keeps_the_rate_it_was_learned_at() -> None:
    t = np.arange(0, 3 * DAY, 60.0)
    rates = np.where((t % DAY) < DAY / 2, 30.0, 10.0)
    prof = fit_profile(rates, 0.0, 60.0, bin_s=1800.0)
    assert prof is not None and abs(prof.level - 20.0) < 1e-9
    assert PlannerState.from_json(PlannerState(profile=prof, quiet_since=5.0).to_json()).profile == prof


def _step(requests: np.ndarray, now: float, state: PlannerState, live: int,
          params: PlannerParams = P, service_s: float = 0.05) -> tuple[int, PlannerState, str]:
    """One step over 10 s buckets of `requests`, each request in flight for `service_s`."""
    busy = requests * service_s
    obs = observed_from_counts(now - requests.size * 10.0, 10.0, requests, np.ceil(busy / 10.0), busy)
    inp = StepInputs(ModelSpec("m", "r1", slots=4), now, obs, ReplicaCounts(ready=live), params)
    decision, state = step(inp, state)
    return decision.target, state, " ".join(e.reason for e in decision.events)


def test_the_planner_keeps_its_replicas_through_an_interruption_and_then_lets_them_go() -> None:
    noon = 12 * 3600.0
    state = PlannerState(profile=FLAT_DAY, profile_at=noon - 60, margin=0.0)
    busy_then_silent = np.concatenate([_busy(420), np.zeros(60)])  # 70 min busy, then 10 min of nothing
    target, state, _ = _step(busy_then_silent, noon, state, live=6)
    assert target == 6 and state.quiet_since == noon  # held: the profile expects 10 req/s at noon
    # the same silence after a quiet hour (a burst of 10 s in it, and no profile) is followed down
    burst_then_silent = np.concatenate([np.zeros(389), [50.0], np.zeros(90)])
    down, _, _ = _step(burst_then_silent, noon, PlannerState(margin=0.0), live=6)
    assert down < 6
    # past the hold the fall is believed
    later, state2, _ = _step(busy_then_silent, noon + P.interruption_hold_s + 10, state, live=6)
    assert later < 6 and state2.quiet_since == noon


def test_bursty_traffic_is_held_through_a_short_silence_at_what_its_level_needs_then_let_go() -> None:
    """No profile: a model that ran at 10 req/s for an hour and went silent keeps the replicas its recent level
    needs (it comes back at the rate it left), not more than it has, at most `interruption_hold_s` from the fall;
    then the fall is believed. A fall the season contradicts keeps every live replica (the test above)."""
    night = 2 * 3600.0
    busy_then_silent = np.concatenate([_busy(400), np.zeros(30)])  # 20 in flight (2 s each), then nothing
    need, _, _ = _step(_busy(430), night, PlannerState(margin=0.0), live=1, service_s=2.0)  # what the load needs (a
    # rise to it: a fall from more live would leave the release band's spare)
    assert 5 <= need < 12
    target, state, why = _step(busy_then_silent, night, PlannerState(margin=0.0), live=12, service_s=2.0)
    assert target == need and state.quiet_since == night and "recent level" in why  # not the 12 live: the level's need
    few, _, _ = _step(busy_then_silent, night, PlannerState(margin=0.0), live=need - 2, service_s=2.0)
    assert few == need - 2  # held, never grown by a silence
    half_hour = np.concatenate([_busy(400), np.zeros(210)])
    held, state, _ = _step(half_hour, night + 1800, state, live=need, service_s=2.0)
    assert 0 < held <= need and state.quiet_since == night
    hour = np.concatenate([_busy(400), np.zeros(390)])
    later, _, _ = _step(hour, night + P.interruption_hold_s + 10, state, live=need, service_s=2.0)
    assert later < held


def test_the_end_of_a_declared_batch_job_is_followed_not_held() -> None:
    """A model whose only traffic is a declared nightly job (01:00 for 30 minutes): its end is no interruption,
    though its fall contradicts the recent level; the same fall without the job declared is held."""
    job = BatchJob(cron="0 1 * * *", model="m", replicas=4, duration_s=1800.0)
    now = 3600.0 + 2100.0  # 01:35, five minutes after the run
    requests = np.concatenate([np.zeros(360), _busy(180), np.zeros(30)])
    with_job = PlannerParams(batch_jobs=(job,))
    down, state, _ = _step(requests, now, PlannerState(margin=0.0), live=6, params=with_job, service_s=2.0)
    assert down < 6 and state.quiet_since is None
    held, state, _ = _step(requests, now, PlannerState(margin=0.0), live=6, service_s=2.0)
    assert held > down and state.quiet_since == now  # what the hour's mean of 10 in flight needs
