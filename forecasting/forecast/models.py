"""Forecasters of request rate quantiles, with the scikit-learn estimator contract.

The planner provisions for an upper quantile of demand (p90 by default), not the mean:
under-provisioning costs a cold start, over-provisioning only GPU time. So the models
here predict several quantiles per future bucket.

- `QuantileForecaster`: one HistGradientBoostingRegressor with quantile loss per
  quantile, on the features of `forecasting.forecast.features` (lags, rolling means, calendar,
  same time yesterday / last week). Direct multi-horizon strategy with the horizon as a
  feature: one model answers every horizon up to ``max_horizon`` buckets, trained on a
  seeded sample of (origin, horizon) pairs so fitting stays in the seconds. The target is
  ``log1p(rate)`` minus the recent level: quantiles survive that monotone shift exactly,
  and one model copes with 2 req/s and 2,000 req/s alike.
- `SeasonalNaiveForecaster`: "same time one season ago" plus the empirical quantiles of
  that rule's residuals: the baseline every forecaster must beat.

Both take ``y``: a req/s `pandas.Series` indexed by bucket start (epoch seconds, regular
spacing, see `forecasting.data.history.rate_series`), and ``predict(y_hist, horizon)`` uses
nothing after ``y_hist``'s last index. Output columns are ``f"q{q:g}"`` (``q0.5``,
``q0.9``, ``q0.99``), non-negative and non-decreasing across quantiles.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.utils.validation import check_is_fitted
from threadpoolctl import threadpool_limits

from forecasting.forecast.features import FeatureSpec, build, choose_spec, season_buckets

#: Default horizon of QuantileForecaster when ``max_horizon`` is None: six hours of buckets.
DEFAULT_HORIZON_S = 6 * 3600.0
#: Fewer (origin, horizon) training rows than this and the model falls back to flat quantiles.
MIN_TRAIN_ROWS = 30
#: Fewer held-out rows than this and the quantiles are left uncalibrated.
MIN_CALIBRATION_ROWS = 50


def quantile_columns(quantiles: Sequence[float]) -> list[str]:
    """Column names for quantiles: 0.5 -> "q0.5", 0.99 -> "q0.99"."""
    return [f"q{q:g}" for q in quantiles]


def _check_quantiles(quantiles: Sequence[float]) -> np.ndarray:
    qs = np.asarray(list(quantiles), dtype=np.float64)
    if qs.size == 0 or np.any((qs <= 0) | (qs >= 1)):
        raise ValueError(f"quantiles must be a non-empty list of values in (0, 1), got {quantiles!r}")
    if np.any(np.diff(qs) <= 0):
        raise ValueError(f"quantiles must be strictly increasing, got {quantiles!r}")
    return qs


def check_series(y: pd.Series, bucket_s: float | None, *, what: str = "y") -> tuple[np.ndarray, np.ndarray, float]:
    """Values, index (float epoch s) and bucket size of a rate series, validated.

    The index must be strictly increasing with one regular spacing (``bucket_s`` when
    given); values finite and >= 0. Errors name what is wrong.
    """
    if not isinstance(y, pd.Series):
        raise TypeError(f"{what} must be a pandas Series indexed by bucket start, got {type(y).__name__}")
    values = y.to_numpy(dtype=np.float64)
    if isinstance(y.index, pd.DatetimeIndex):
        epoch = pd.Timestamp(0, tz=y.index.tz) if y.index.tz is not None else pd.Timestamp(0)
        index = np.asarray((y.index - epoch).total_seconds(), dtype=np.float64)
    else:
        index = np.asarray(y.index, dtype=np.float64)
    if values.size == 0:
        raise ValueError(f"{what} is empty")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"{what} must hold finite, non-negative rates")
    if values.size >= 2:
        diffs = np.diff(index)
        step = float(diffs[0])
        if step <= 0 or np.any(np.abs(diffs - step) > 1e-6 * max(step, 1.0)):
            raise ValueError(f"{what} must have a regular, increasing index (fill gaps with 0 first)")
        if bucket_s is not None and abs(step - bucket_s) > 1e-6 * max(bucket_s, 1.0):
            raise ValueError(f"{what} has {step:g} s buckets but the forecaster expects {bucket_s:g} s")
    else:
        if bucket_s is None:
            raise ValueError(f"{what} has one bucket: pass bucket_s to know its size")
        step = float(bucket_s)
    return values, index, step


def _finish(raw: np.ndarray, index: np.ndarray, quantiles: Sequence[float]) -> pd.DataFrame:
    """Non-negative, monotone-across-quantiles frame from raw (rows x quantiles) predictions."""
    out = np.maximum.accumulate(np.clip(raw, 0.0, None), axis=1)
    return pd.DataFrame(out, index=pd.Index(index, name="ts"), columns=quantile_columns(quantiles))


class QuantileForecaster(BaseEstimator):
    """Gradient-boosted quantile forecaster of the request rate, direct multi-horizon.

    Parameters:
        quantiles: the quantiles to predict, increasing, in (0, 1).
        bucket_s: the series' bucket size in seconds; None takes it from ``y`` at fit.
        max_horizon: the longest horizon trained (buckets); None means six hours of buckets.
            Longer horizons at predict reuse the model with ``h`` clipped to it.
        n_horizons: how many distinct horizons (1, ..., max_horizon, geometrically spaced)
            training rows are built for; trees interpolate between them.
        max_train_rows: training rows are a seeded uniform sample of at most this many
            (origin, horizon) pairs, which bounds the fit time.
        level_window: buckets averaged into the "recent level" everything is relative to.
        max_iter, learning_rate, max_leaf_nodes, min_samples_leaf, l2_regularization:
            passed to each HistGradientBoostingRegressor.
        random_state: seed of the row sample and of the boosting.
        n_threads: OpenMP threads for boosting (1 keeps fits steady on shared machines).
        calibration_fraction: the latest share of the series held out of fitting to
            calibrate the quantiles (split conformal); 0 turns calibration off.
    """

    def __init__(
        self,
        quantiles: Sequence[float] = (0.5, 0.9, 0.99),
        bucket_s: float | None = None,
        max_horizon: int | None = None,
        n_horizons: int = 12,
        max_train_rows: int = 6000,
        level_window: int = 3,
        max_iter: int = 80,
        learning_rate: float = 0.1,
        max_leaf_nodes: int = 15,
        min_samples_leaf: int = 50,
        l2_regularization: float = 0.0,
        random_state: int = 0,
        n_threads: int = 1,
        calibration_fraction: float = 0.15,
    ) -> None:
        self.quantiles = quantiles
        self.bucket_s = bucket_s
        self.max_horizon = max_horizon
        self.n_horizons = n_horizons
        self.max_train_rows = max_train_rows
        self.level_window = level_window
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.min_samples_leaf = min_samples_leaf
        self.l2_regularization = l2_regularization
        self.random_state = random_state
        self.n_threads = n_threads
        self.calibration_fraction = calibration_fraction

    def fit(self, y: pd.Series, X: None = None) -> "QuantileForecaster":
        """Learn from the whole of ``y`` (req/s by bucket start). ``X`` is unused (sklearn's signature)."""
        qs = _check_quantiles(self.quantiles)
        values, _index, step = check_series(y, self.bucket_s)
        if self.n_horizons < 1 or self.max_train_rows < 1:
            raise ValueError("n_horizons and max_train_rows must be >= 1")
        n = values.size
        wanted = self.max_horizon if self.max_horizon is not None else max(1, math.ceil(DEFAULT_HORIZON_S / step))
        if wanted < 1:
            raise ValueError(f"max_horizon must be >= 1, got {self.max_horizon}")
        self.bucket_s_ = step
        self.max_horizon_ = int(wanted)
        # Horizons that have at least a few targets inside the series.
        reachable = min(self.max_horizon_, n - 2)
        origins, horizons = self._training_pairs(n, reachable)
        fit_rows, calib_rows = self._split(n, origins, horizons)
        # The feature set is chosen on the stretch the trees are fitted on, so that seasonal
        # lags are only used when fitted rows have them.
        fitted_span = int((origins + horizons)[fit_rows].max()) + 1 if fit_rows.any() else n
        self.spec_: FeatureSpec = choose_spec(fitted_span, step, self.max_horizon_, level_window=self.level_window)
        self.feature_names_ = self.spec_.names
        self.n_train_rows_ = int(fit_rows.sum())
        if origins.size < MIN_TRAIN_ROWS:
            # Too little history to learn a shape: flat empirical quantiles of what there is.
            self.models_: dict[float, HistGradientBoostingRegressor] | None = None
            self.fallback_: np.ndarray | None = np.quantile(values, qs)
            self.calibration_: dict[float, float] = {}
            self.n_calibration_rows_ = 0
            return self
        self.fallback_ = None
        target_ts = _index[origins + horizons]
        X_rows, level = build(self.spec_, values, origins, horizons, target_ts)
        z = np.log1p(values[origins + horizons]) - level
        self.n_calibration_rows_ = int(calib_rows.sum())
        self.models_ = {}
        # One OpenMP thread: on a shared 2-core machine, HGB's spinning worker threads make
        # a fit 5-10x slower under load; one thread is steady and nearly as fast idle.
        with threadpool_limits(limits=self.n_threads, user_api="openmp"):
            self._fit_models(qs, X_rows[fit_rows], z[fit_rows])
            self.calibration_ = self._calibrate(qs, X_rows[calib_rows], z[calib_rows])
        return self

    def _split(self, n: int, origins: np.ndarray, horizons: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows to fit on and rows to calibrate on: the latest stretch of the series, held out.

        Fit rows have their target before the cut; calibration rows their origin at or after
        it, so the calibration targets are never seen in fitting. Rows that straddle the cut
        are dropped. Too few rows on either side: fit on everything, no calibration.
        """
        everything = np.ones(origins.size, dtype=bool)
        if not 0 < self.calibration_fraction < 1:
            return everything, ~everything
        cut = n - int(round(self.calibration_fraction * n))
        fit_rows = origins + horizons < cut
        calib_rows = origins >= cut - 1
        if fit_rows.sum() < MIN_TRAIN_ROWS or calib_rows.sum() < MIN_CALIBRATION_ROWS:
            return everything, ~everything
        return fit_rows, calib_rows

    def _calibrate(self, qs: np.ndarray, X_cal: np.ndarray, z_cal: np.ndarray) -> dict[float, float]:
        """Per-quantile shifts (log space) that make held-out coverage match each quantile.

        Split-conformal for quantile regression: the q-quantile of ``z - ẑ_q`` on held-out
        rows, added to ẑ_q, covers a new row with probability ~q even when the trees
        overfit. Without held-out rows every shift is 0.
        """
        assert self.models_ is not None
        out: dict[float, float] = {}
        for q in qs:
            if z_cal.size == 0:
                out[float(q)] = 0.0
                continue
            scores = z_cal - self.models_[float(q)].predict(X_cal)
            level = min(1.0, float(q) * (1 + 1 / z_cal.size))
            out[float(q)] = float(np.quantile(scores, level))
        return out

    def _fit_models(self, qs: np.ndarray, X_rows: np.ndarray, z: np.ndarray) -> None:
        assert self.models_ is not None
        # A feature with no value in any fitted row (a seasonal lag the sample missed) cannot
        # be binned; as a constant it is never split on, and predict may pass real values.
        empty = np.all(np.isnan(X_rows), axis=0)
        if empty.any():
            X_rows = X_rows.copy()
            X_rows[:, empty] = 0.0
        for q in qs:
            model = HistGradientBoostingRegressor(
                loss="quantile", quantile=float(q), max_iter=self.max_iter,
                learning_rate=self.learning_rate, max_leaf_nodes=self.max_leaf_nodes,
                min_samples_leaf=self.min_samples_leaf, l2_regularization=self.l2_regularization,
                early_stopping=False, random_state=self.random_state,
            )
            self.models_[float(q)] = model.fit(X_rows, z)

    def _training_pairs(self, n: int, reachable: int) -> tuple[np.ndarray, np.ndarray]:
        if reachable < 1:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        ks = np.unique(np.round(np.geomspace(1, reachable, num=min(self.n_horizons, reachable))).astype(np.int64))
        first = min(self.level_window - 1, n - 1)
        origins_list = [np.arange(first, n - k, dtype=np.int64) for k in ks]
        horizons_list = [np.full(o.size, k, dtype=np.int64) for o, k in zip(origins_list, ks)]
        origins = np.concatenate(origins_list) if origins_list else np.empty(0, dtype=np.int64)
        horizons = np.concatenate(horizons_list) if horizons_list else np.empty(0, dtype=np.int64)
        if origins.size > self.max_train_rows:
            rng = np.random.default_rng(self.random_state)
            pick = np.sort(rng.choice(origins.size, size=self.max_train_rows, replace=False))
            origins, horizons = origins[pick], horizons[pick]
        return origins, horizons

    def predict(self, y_hist: pd.Series, horizon: int) -> pd.DataFrame:
        """Quantiles (req/s) of the ``horizon`` buckets after ``y_hist``'s last bucket."""
        check_is_fitted(self)
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        values, index, _ = check_series(y_hist, self.bucket_s_, what="y_hist")
        ks = np.arange(1, horizon + 1, dtype=np.int64)
        target_ts = index[-1] + ks * self.bucket_s_
        qs = list(self.quantiles)
        if self.models_ is None:
            assert self.fallback_ is not None
            return _finish(np.tile(self.fallback_, (horizon, 1)), target_ts, qs)
        origins = np.full(horizon, values.size - 1, dtype=np.int64)
        X_rows, level = build(self.spec_, values, origins, ks, target_ts, horizon_cap=self.max_horizon_)
        with threadpool_limits(limits=self.n_threads, user_api="openmp"):
            raw = np.column_stack([
                np.expm1(level + self.models_[float(q)].predict(X_rows) + self.calibration_[float(q)])
                for q in qs
            ])
        return _finish(raw, target_ts, qs)


class SeasonalNaiveForecaster(BaseEstimator):
    """The rate one season ago, plus the empirical quantiles of that rule's errors.

    At fit, the residuals ``y[t] - y[t - season]`` give one additive offset per quantile
    (with less than a season of data, the naive rule ``y[t] - y[t - 1]`` stands in). At
    predict, a target bucket gets the latest same-phase bucket not after the origin, or
    the last observed bucket when the history is shorter than a season.
    """

    def __init__(
        self, season_s: float = 86400.0, quantiles: Sequence[float] = (0.5, 0.9, 0.99),
        bucket_s: float | None = None,
    ) -> None:
        self.season_s = season_s
        self.quantiles = quantiles
        self.bucket_s = bucket_s

    def fit(self, y: pd.Series, X: None = None) -> "SeasonalNaiveForecaster":
        qs = _check_quantiles(self.quantiles)
        values, _index, step = check_series(y, self.bucket_s)
        if not self.season_s > 0:
            raise ValueError(f"season_s must be positive, got {self.season_s}")
        self.bucket_s_ = step
        self.season_ = season_buckets(self.season_s, step)
        lag = self.season_ if values.size > self.season_ else 1
        self.residual_lag_ = lag
        residuals = values[lag:] - values[:-lag] if values.size > lag else np.empty(0)
        self.offsets_ = np.quantile(residuals, qs) if residuals.size else np.zeros(qs.size)
        return self

    def predict(self, y_hist: pd.Series, horizon: int) -> pd.DataFrame:
        check_is_fitted(self)
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        values, index, _ = check_series(y_hist, self.bucket_s_, what="y_hist")
        n = values.size
        ks = np.arange(1, horizon + 1, dtype=np.int64)
        back = n - 1 + ks - np.ceil(ks / self.season_).astype(np.int64) * self.season_
        base = np.where(back >= 0, values[np.clip(back, 0, None)], values[-1])
        raw = base[:, None] + self.offsets_[None, :]
        return _finish(raw, index[-1] + ks * self.bucket_s_, list(self.quantiles))
