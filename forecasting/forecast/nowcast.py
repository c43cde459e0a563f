"""The planner's forecaster: demand over the next lead, from the last minutes, shaped by the day.

What makes a predictive scale-down pay is accuracy over the planner's own horizon (the
lead: a cold start p95 plus a margin, tens of seconds to a few minutes), not an hour
ahead. Over that horizon the best information is the last minutes' level; the learned
seasonal profile (the day's shape of the request rate, learned from the coarse history)
only bends it along the daily ramps. So the forecast of the demand peak over the next
``h`` fine buckets, at origin ``i``, is one of three point forecasts:

- ``persistence``: the last bucket's demand;
- ``seasonal_naive``: the same buckets one day earlier (when a day of fine history exists);
- ``nowcast``: the mean of the last ``level_buckets`` buckets, times the profile's ratio
  between the target time and the level window once a profile has been learned (each of the
  two read no lower than the profile can tell from zero, `Profile.floor`: near a time of day
  that saw no traffic the ratio of two near-zeros multiplied five requests in flight into
  677,377 on ServeGen chunk-73, and the planner asked for 88,188 replicas);

each scored over the last ``window`` origins at exactly this horizon (their targets are
already observed, so this is the forecaster scoring its own recent forecasts), and the
one with the lowest MAE is used. Its quantiles are split-conformal: the empirical
quantiles of ``sqrt(actual) - sqrt(point)`` over the same window are added to the point
forecast on the square-root scale (the variance-stabilising scale of counts), so the planning quantile covers its nominal share of recent
outcomes whatever the traffic (calm, bursty, ramping), and adapts within the window when
the traffic changes. The forecast-quality figure the planner's gate reads is the chosen
method's typical error: the mean absolute error of its median over the scored origins, the
largest ``1 - quantile`` of them left out (the share the planning quantile does not cover),
relative to the mean target. A step no forecast showed is a handful of large errors; counted
in the mean, it held the fallback's stabilization window for up to twenty minutes after each
large step of a dense trace, which the cold-start budget's margin is there to pay for. A
forecaster that misses often (bursty traffic) misses beyond that share and still trips it.

Nothing here is keyed to a clock: the season (``season_s``, a day by default, a week or a
batch job's cron period where the operator declares one) and the profile's resolution
(``bin_s``) come from the planner's settings, and the profile interpolates between bin
centres, so a rate that steps anywhere within a bin is not assumed to step on its edge.
What the forecaster misses on steps the profile did not foresee is left to the planner's
cold-start budget, which calibrates its margin on the misses it observes.

Pure numpy: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

DAY_S = 86400.0
ZERO_COUNT_UPPER = -math.log(0.05)  # a Poisson count of 0: its mean is below this at 95% (about 3)


@dataclass(frozen=True)
class Profile:
    """The day's shape of the request rate: ``values[k]`` is the mean rate of time-of-day bin k
    relative to the day's mean (mean 1), learned from ``days`` days of coarse history."""

    bin_s: float
    values: tuple[float, ...]
    days: float  # seasons of history it was learned from
    season_s: float = DAY_S  # the period the shape repeats over (declared by the operator; a day by default)
    level: float = 0.0  # the mean rate (req/s) the shape is relative to, over the history it was learned from (0: unknown)

    def to_dict(self) -> dict[str, object]:
        return {"bin_s": self.bin_s, "values": list(self.values), "days": self.days, "season_s": self.season_s,
                "level": self.level}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
        """The inverse of `to_dict` (a state saved before `season_s` or `level` existed: a day, level unknown)."""
        return cls(float(d["bin_s"]), tuple(float(v) for v in d["values"]), float(d["days"]),
                   float(d.get("season_s", DAY_S)), float(d.get("level", 0.0)))

    @property
    def floor(self) -> float:
        """The lowest value the profile can tell from zero: a bin that saw no request over its `days` is below
        3 requests' worth (the 95% upper bound of a Poisson count of 0, -ln 0.05) at 95%, relative to the level.
        0 where the level is unknown (a state saved before it was kept)."""
        scale = self.level * self.bin_s * self.days
        return ZERO_COUNT_UPPER / scale if scale > 0 else 0.0

    def ratio(self, to: np.ndarray, since: np.ndarray) -> np.ndarray:
        """The profile at `to` over the profile at `since` (epoch seconds), each read no lower than `floor`: how
        the rate bends between them, never a division by a near-zero the profile cannot tell from zero."""
        floor = max(self.floor, 1e-9)
        return np.maximum(self.at(to), floor) / np.maximum(self.at(since), floor)

    def at(self, ts: np.ndarray) -> np.ndarray:
        """The profile at epoch seconds ``ts``, linearly interpolated between bin centres (circular)."""
        v = np.asarray(self.values, dtype=np.float64)
        pos = np.mod(np.asarray(ts, dtype=np.float64), self.season_s) / self.bin_s - 0.5
        lo = np.floor(pos).astype(np.int64)
        frac = pos - lo
        n = v.size
        return v[np.mod(lo, n)] * (1 - frac) + v[np.mod(lo + 1, n)] * frac


def fit_profile(rates: np.ndarray, start: float, bucket_s: float, *, bin_s: float, season_s: float = DAY_S,
                min_days: float = 2.0) -> Profile | None:
    """Learn the daily profile from a regular rate series (req/s per bucket from epoch ``start``).

    None when the series spans less than ``min_days`` days or has no traffic: a shape seen
    once is not a season. Bins are averaged over days (a bin missing on some day is averaged
    over the days that have it), smoothed over their two neighbours, and normalised to mean 1.
    """
    y = np.asarray(rates, dtype=np.float64)
    if not (bin_s > 0 and season_s >= bin_s):
        raise ValueError(f"profile bin_s must be > 0 and at most season_s, got bin_s={bin_s}, season_s={season_s}")
    if y.size * bucket_s < min_days * season_s or not np.any(y > 0):
        return None
    nbins = max(1, int(round(season_s / bin_s)))
    bin_s = season_s / nbins  # whole bins per season
    ts = start + np.arange(y.size) * bucket_s
    idx = (np.mod(ts, season_s) // bin_s).astype(np.int64) % nbins
    sums = np.bincount(idx, weights=y, minlength=nbins)
    counts = np.bincount(idx, minlength=nbins)
    mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    if np.all(np.isnan(mean)):
        return None
    mean = np.where(np.isnan(mean), np.nanmean(mean), mean)
    smooth = (np.roll(mean, 1) + mean + np.roll(mean, -1)) / 3.0
    level = float(smooth.mean())
    if not level > 0:
        return None
    return Profile(bin_s=bin_s, values=tuple(float(v) for v in smooth / level), days=y.size * bucket_s / season_s,
                   season_s=season_s, level=level)


@dataclass(frozen=True)
class Forecast:
    """Demand (peak in-flight requests) over the next ``horizon`` fine buckets, and how good it was."""

    method: str  # "persistence", "seasonal_naive", "nowcast", or "none" (no history)
    median: float  # of the peak over the horizon
    upper: float  # the planning quantile of the peak over the horizon
    next_upper: float  # the planning quantile of the next bucket alone (a dip before a rise is held)
    error: float | None  # typical relative error of the median over the scored window (None: too few scored)
    coverage: float | None  # share of the scored window at or under the planning quantile
    scored: int  # origins scored
    errors: tuple[tuple[str, float], ...] = ()  # MAE of every candidate, for the benchmark


def _points(y: np.ndarray, origins: np.ndarray, h: int, start: float, bucket_s: float, level_buckets: int,
            profile: Profile | None, season: int) -> dict[str, np.ndarray]:
    """Each candidate's point forecast of the peak over the ``h`` buckets after each origin."""
    out = {"persistence": y[origins]}
    first_o, last_o = int(origins[0]), int(origins[-1])  # origins ascend
    lo = max(0, first_o - level_buckets + 1)
    cs = np.empty(last_o + 2 - lo)
    cs[0] = 0.0
    np.cumsum(y[lo: last_o + 1], out=cs[1:])
    first = origins - (level_buckets - 1)
    np.maximum(first, lo, out=first)
    level = (cs[origins + 1 - lo] - cs[first - lo]) / (origins + 1 - first)
    if profile is not None:
        t_level = start + (origins - (level_buckets - 1) / 2.0 + 0.5) * bucket_s
        t_target = start + (origins + 1 + h / 2.0) * bucket_s
        level = level * profile.ratio(t_target, t_level)
    out["nowcast"] = level
    if season > 0 and first_o - season + 1 >= 0:
        out["seasonal_naive"] = _window_max(y, first_o - season + 1, origins.size, h)
    return out


def _window_max(y: np.ndarray, first: int, k: int, h: int) -> np.ndarray:
    """The peak of ``y`` over the ``h`` buckets from ``first + i``, for i in 0..k-1."""
    out = y[first: first + k].copy()
    for j in range(1, h):
        np.maximum(out, y[first + j: first + j + k], out=out)
    return out


def _q(x: np.ndarray, q: float) -> float:
    """The q-quantile (lower order statistic; cheaper than np.quantile, called at every step)."""
    k = min(x.size - 1, max(0, int(math.ceil(q * x.size)) - 1))
    return float(np.partition(x, k)[k])


def forecast_peak(y: np.ndarray, start: float, bucket_s: float, *, horizon: int, quantile: float,
                  window: int = 360, level_buckets: int = 6, profile: Profile | None = None,
                  min_scored: int = 12, season_s: float = DAY_S) -> Forecast:
    """Forecast the peak of ``y`` (per fine bucket, from epoch ``start``) over the next ``horizon`` buckets.

    ``y`` holds complete buckets only, oldest first; the forecast is made at the end of its
    last bucket. See the module docstring for the method.
    """
    y = np.asarray(y, dtype=np.float64)
    h = max(1, int(horizon))
    n = y.size
    if n == 0:
        return Forecast("none", 0.0, 0.0, 0.0, None, None, 0)
    season = int(round(season_s / bucket_s))
    usable = n - h  # origins whose target is fully observed
    k = min(window, max(0, usable))
    if k < min_scored:
        # too little scored history: the recent peak, flat; quantiles unknown (upper = median)
        point = float(y[-level_buckets:].max())
        return Forecast("persistence", point, point, point, None, None, k)
    origins = np.arange(usable - k, usable, dtype=np.int64)
    target = _window_max(y, usable - k + 1, k, h)
    now = np.array([n - 1], dtype=np.int64)
    pts = _points(y, origins, h, start, bucket_s, level_buckets, profile, season)
    maes = {name: float(np.abs(target - p).mean()) for name, p in pts.items()}
    best = min(maes, key=lambda m: (maes[m], m != "persistence"))
    fp = _fwd(pts[best])
    z = _fwd(target) - fp
    z_med = _median_shift(target, fp, z, maes[best])
    # the gate's figure: the typical error of the forecaster that scored best over the whole window, its
    # errors beyond the planning quantile left out (the misses the cold-start budget's margin pays for)
    scale = float(target.mean())
    abs_err = np.abs(target - _inv(fp + z_med))
    error = float(abs_err[abs_err <= _q(abs_err, quantile)].mean() / scale) if scale > 0 else 0.0
    z_up = _q(z, quantile)
    base = math.sqrt(max(float(_points(y, now, h, start, bucket_s, level_buckets, profile, season)[best][0]), 0.0))
    median = _sq(base + z_med)
    upper = _sq(base + z_up)
    # the next bucket alone: the same point, the residuals of a one-bucket horizon
    z1 = _fwd(y[usable - k + 1: usable + 1]) - fp
    next_upper = min(upper, _sq(base + _q(z1, quantile)))
    coverage = float((target <= _inv(fp + z_up) + 1e-9).mean())
    r = lambda v: round(max(0.0, v), 9)  # noqa: E731  (square-root round trips leave float noise)
    return Forecast(best, r(median), r(upper), r(next_upper), r(error), coverage, k,
                    tuple(sorted((m, r(v)) for m, v in maes.items())))


def _sq(z: float) -> float:
    """`_inv` of one value."""
    m = max(z, 0.0)
    return m * m


def _median_shift(target: np.ndarray, fp: np.ndarray, z: np.ndarray, mae: float) -> float:
    """The median residual, or 0 where shifting by it did not pay on the scored window."""
    z_med = _q(z, 0.5)
    return 0.0 if np.abs(target - _inv(fp + z_med)).mean() > mae else z_med


def _fwd(x: np.ndarray | float) -> np.ndarray:
    """Residuals live on the square-root scale: counts' noise grows as their square root, so one
    set of residual quantiles serves a quiet bucket and a busy one (log would multiply a burst)."""
    return np.sqrt(np.maximum(np.asarray(x, dtype=np.float64), 0.0))


def _inv(z: np.ndarray | float) -> np.ndarray:
    return np.square(np.maximum(np.asarray(z, dtype=np.float64), 0.0))


def lead_buckets(lead_s: float, bucket_s: float) -> int:
    """Fine buckets the lead spans (at least one)."""
    return max(1, int(math.ceil(round(lead_s / bucket_s, 9))))
