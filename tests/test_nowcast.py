"""The nowcast's seasonal bend: the level of the last buckets times the profile's ratio between then and the target."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting.forecast.nowcast import Profile, _points, fit_profile
from forecasting.park import need_within

BUCKET = 10.0


def _profile(values: list[float], level: float = 1.0, days: float = 3.0) -> Profile:
    return Profile(bin_s=86400.0 / len(values), values=tuple(values), days=days, level=level)


def test_the_profile_cannot_tell_a_rate_below_three_requests_over_its_history_from_zero() -> None:
    prof = _profile([1.0] * 144, level=2.0, days=3.0)  # 600 s bins: 3,600 s of each bin seen at 2 req/s
    assert prof.floor == pytest.approx(-np.log(0.05) / (2.0 * 600.0 * 3.0))
    assert _profile([1.0] * 144, level=0.0).floor == 0.0  # a state saved before the level was kept


def test_a_level_is_not_multiplied_by_the_ratio_of_two_near_zeros() -> None:
    """ServeGen chunk-73: five requests in flight at a time of day the profile had seen empty, its ratio to the
    next bins (a near-zero over a near-zero) made the nowcast 677,377 and the planner asked for 88,188 replicas."""
    values = [1.0] * 144
    values[50] = 0.0  # 08:20-08:30 saw no request on any of the days
    prof = _profile(values)
    now = 50 * 600.0 + 300.0 + 30.0  # the level window (the last minute) centred on the empty bin's centre
    y = np.full(200, 5.0)
    start = now - y.size * BUCKET
    origin = np.array([y.size - 1])
    h = 6
    point = float(_points(y, origin, h, start, BUCKET, 6, prof, season=0)["nowcast"][0])
    t_target = start + (y.size + h / 2.0) * BUCKET
    assert prof.at(np.array([t_target]))[0] > 0.05  # the target is on the way back up
    # the ratio of the target's value to the floor at most: the profile's resolution, not a division by ~0
    assert point <= 5.0 * prof.at(np.array([t_target]))[0] / prof.floor + 1e-9
    assert point < 1_000.0


def test_where_the_profile_saw_traffic_the_bend_is_its_plain_ratio() -> None:
    rng = np.random.default_rng(0)
    day = np.arange(0, 3 * 86400, 60.0)
    rates = 100.0 * (1.5 + np.sin(2 * np.pi * day / 86400.0)) + rng.normal(0, 1, day.size)
    prof = fit_profile(rates, 0.0, 60.0, bin_s=1800.0)
    assert prof is not None and min(prof.values) > 100 * prof.floor
    y = np.full(60, 40.0)
    start = 3 * 86400.0 + 6 * 3600.0  # on the morning's ramp
    origin = np.array([y.size - 1])
    point = float(_points(y, origin, 6, start, BUCKET, 6, prof, season=0)["nowcast"][0])
    t_level = start + (origin[0] - 2.5 + 0.5) * BUCKET
    t_target = start + (origin[0] + 1 + 3.0) * BUCKET
    ratio = prof.at(np.array([t_target]))[0] / prof.at(np.array([t_level]))[0]
    assert point == pytest.approx(40.0 * ratio, rel=1e-12)


def test_parking_reads_the_same_bounded_ratio() -> None:
    """`forecasting.park.need_within` scales the level by the profile's highest point ahead over now: next to an
    empty time of day, now's value is a near-zero too."""
    values = [1.0] * 144
    values[50] = 0.0
    prof = _profile(values)
    now = 50 * 600.0 + 300.0 + 1e-3  # a hair past the empty bin's centre: the profile reads ~2e-6 there
    assert 0 < prof.at(np.array([now]))[0] < prof.floor
    need = need_within(prof, 5.0, now, 20.0, 3600.0)
    assert need == pytest.approx(5.0 * 1.0 / prof.floor)  # the peak ahead (1.0) over the floor, not over ~2e-6
    assert need_within(_profile([0.0] + [1.0] * 143), 5.0, 300.0, 20.0, 3600.0) is None  # empty now: no claim
