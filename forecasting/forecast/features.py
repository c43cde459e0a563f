"""Forecast features: what is known at a forecast origin about a target bucket ahead.

The quantile forecaster predicts the rate of bucket ``o + k`` from the series up to and
including bucket ``o`` (the origin), for horizons ``k >= 1``. Every feature here is built
from ``y[:o + 1]`` only, so a model trained on these rows cannot peek at the future; the
tests check that property directly.

Features (all in log1p space and relative to the recent level, so one model serves a
service at 2 req/s and one at 2,000 req/s, and zero-traffic stretches are ordinary values):

- ``h``: the horizon in buckets;
- ``level``: log1p of the mean rate over the last ``level_window`` buckets;
- ``lag{j}``: the rate ``j`` buckets before the origin, relative to the level;
- ``roll{w}``: trailing means over ``w`` buckets, relative to the level;
- calendar of the target bucket: time of day (fraction, sin, cos) and day of week
  (index, sin, cos), used only when the training span makes them meaningful;
- ``day_lag`` / ``week_lag``: the rate at the same time yesterday / last week (the most
  recent such bucket at or before the origin), relative to the level; and
  ``day_ratio`` / ``week_ratio``: how the rate moved from the origin's time to the target's
  time one day / week earlier (the daily shape, independent of today's level).

Missing values (a lag before the series start) are NaN; gradient-boosted trees route them
natively, which is how short histories fall back to the features they do have.

Pure: numpy only, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
#: 1970-01-01 (epoch 0) was a Thursday; with this offset Monday is day 0.
_EPOCH_WEEKDAY = 3


@dataclass(frozen=True)
class FeatureSpec:
    """Which features a fitted model uses; fixed at fit time so predict builds the same columns."""

    bucket_s: float
    level_window: int = 3
    lags: tuple[int, ...] = (0, 1, 2, 3, 5, 8)
    rolling: tuple[int, ...] = (6, 24, 96)
    time_of_day: bool = False
    day_of_week: bool = False
    daily: bool = False
    weekly: bool = False

    def __post_init__(self) -> None:
        if not self.bucket_s > 0:
            raise ValueError(f"bucket_s must be positive, got {self.bucket_s}")
        if self.level_window < 1:
            raise ValueError(f"level_window must be >= 1, got {self.level_window}")
        if any(j < 0 for j in self.lags) or any(w < 1 for w in self.rolling):
            raise ValueError(f"lags must be >= 0 and rolling windows >= 1: {self.lags} {self.rolling}")

    @property
    def day_buckets(self) -> int:
        return season_buckets(DAY_S, self.bucket_s)

    @property
    def week_buckets(self) -> int:
        return season_buckets(WEEK_S, self.bucket_s)

    @property
    def names(self) -> list[str]:
        out = ["h", "level"] + [f"lag{j}" for j in self.lags] + [f"roll{w}" for w in self.rolling]
        if self.time_of_day:
            out += ["tod", "tod_sin", "tod_cos"]
        if self.day_of_week:
            out += ["dow", "dow_sin", "dow_cos"]
        if self.daily:
            out += ["day_lag", "day_ratio"]
        if self.weekly:
            out += ["week_lag", "week_ratio"]
        return out


def season_buckets(season_s: float, bucket_s: float) -> int:
    """How many buckets make one season (at least 1)."""
    return max(1, int(round(season_s / bucket_s)))


def choose_spec(n: int, bucket_s: float, max_horizon: int, *, level_window: int = 3) -> FeatureSpec:
    """The feature set a series of ``n`` buckets supports.

    Calendar features need at least two days of data (one day of time-of-day values teaches
    a tree nothing it can reuse), day of week two weeks; seasonal lags need one season plus
    the horizon so that some training rows have them.
    """
    span_s = n * bucket_s
    day = season_buckets(DAY_S, bucket_s)
    week = season_buckets(WEEK_S, bucket_s)
    return FeatureSpec(
        bucket_s=bucket_s,
        level_window=level_window,
        time_of_day=span_s >= 2 * DAY_S,
        day_of_week=span_s >= 2 * WEEK_S,
        daily=bucket_s < DAY_S and n > day + max_horizon,
        weekly=bucket_s < WEEK_S and n > week + max_horizon,
    )


def trailing_mean(cs: np.ndarray, end: np.ndarray, window: int) -> np.ndarray:
    """Mean of ``y[end - window + 1 .. end]`` from ``cs`` (cumsum with a leading 0).

    Partial windows at the series start use what exists; ``end < 0`` gives NaN.
    """
    end = np.asarray(end, dtype=np.int64)
    lo = np.clip(end - window + 1, 0, None)
    valid = end >= 0
    e = np.where(valid, end, 0)
    out = (cs[e + 1] - cs[lo]) / np.maximum(e - lo + 1, 1)
    return np.where(valid, out, np.nan)


def _at(logy: np.ndarray, idx: np.ndarray) -> np.ndarray:
    ok = idx >= 0
    return np.where(ok, logy[np.where(ok, idx, 0)], np.nan)


def build(
    spec: FeatureSpec, y: np.ndarray, origins: np.ndarray, horizons: np.ndarray,
    target_ts: np.ndarray, *, horizon_cap: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows for (origin, horizon) pairs, and each row's level (log1p space).

    ``y`` is the rate series (req/s, non-negative); ``origins`` index into it; every
    value read is at an index <= its row's origin. ``target_ts`` is the epoch second of
    each row's target bucket (for the calendar features). ``horizon_cap`` clips the ``h``
    feature to the range a model was trained on.
    """
    y = np.asarray(y, dtype=np.float64)
    origins = np.asarray(origins, dtype=np.int64)
    horizons = np.asarray(horizons, dtype=np.int64)
    if origins.shape != horizons.shape or origins.shape != np.shape(target_ts):
        raise ValueError("origins, horizons and target_ts must have the same shape")
    if origins.size and (origins.min() < 0 or origins.max() >= y.size):
        raise ValueError(f"origins must index into the series of {y.size} buckets")
    if np.any(horizons < 1):
        raise ValueError("horizons must be >= 1")
    logy = np.log1p(y)
    cs = np.concatenate([[0.0], np.cumsum(y)])
    level = np.log1p(trailing_mean(cs, origins, spec.level_window))
    cols: list[np.ndarray] = [
        np.minimum(horizons, horizon_cap) if horizon_cap else horizons.astype(np.float64),
        level,
    ]
    for j in spec.lags:
        cols.append(_at(logy, origins - j) - level)
    for w in spec.rolling:
        cols.append(np.log1p(trailing_mean(cs, origins, w)) - level)
    ts = np.asarray(target_ts, dtype=np.float64)
    if spec.time_of_day:
        tod = np.mod(ts, DAY_S) / DAY_S
        cols += [tod, np.sin(2 * np.pi * tod), np.cos(2 * np.pi * tod)]
    if spec.day_of_week:
        dow = np.mod(np.floor(ts / DAY_S) + _EPOCH_WEEKDAY, 7)
        cols += [dow, np.sin(2 * np.pi * dow / 7), np.cos(2 * np.pi * dow / 7)]
    for flag, season in ((spec.daily, spec.day_buckets), (spec.weekly, spec.week_buckets)):
        if not flag:
            continue
        # The latest same-phase bucket that is not after the origin: m seasons back.
        m = np.ceil(horizons / season).astype(np.int64)
        back = origins + horizons - m * season
        then_level = np.log1p(trailing_mean(cs, origins - m * season, spec.level_window))
        seasonal = _at(logy, back)
        cols += [seasonal - level, seasonal - then_level]
    return np.column_stack([np.asarray(c, dtype=np.float64) for c in cols]), level
