"""Forecasters: the scikit-learn estimator contract, the output shape, and that they learn.

Synthetic series with a known daily cycle and seeded noise stand in for traffic where the
right answer must be known; the real traces are scored in test_backtest and benchmarks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from forecasting.forecast.backtest import cross_validation, scores
from forecasting.forecast.features import FeatureSpec, build, choose_spec
from forecasting.forecast.models import QuantileForecaster, SeasonalNaiveForecaster, quantile_columns

BUCKET = 600.0
PER_DAY = 144


def daily_series(days: int, *, seed: int = 0, start: float = 1_700_006_400.0, noise: float = 0.1) -> pd.Series:
    """req/s in 10-minute buckets: 100 + 80 sin(time of day), multiplicative noise."""
    rng = np.random.default_rng(seed)
    n = days * PER_DAY
    ts = start + np.arange(n) * BUCKET
    phase = 2 * np.pi * np.mod(ts, 86400) / 86400
    clean = 100 + 80 * np.sin(phase)
    return pd.Series(clean * rng.lognormal(0, noise, n), index=pd.Index(ts, name="ts"))


@pytest.fixture(scope="module")
def seasonal() -> pd.Series:
    return daily_series(10)


ESTIMATORS = [
    QuantileForecaster(bucket_s=BUCKET, max_horizon=12),
    SeasonalNaiveForecaster(bucket_s=BUCKET),
]


@pytest.mark.parametrize("est", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_estimator_contract(est, seasonal: pd.Series) -> None:
    est = clone(est)
    with pytest.raises(NotFittedError):
        est.predict(seasonal, 3)
    before = set(vars(est))
    assert not [k for k in before if k.endswith("_")]
    assert est.fit(seasonal) is est
    learned = set(vars(est)) - before
    assert learned and all(k.endswith("_") for k in learned)
    params = est.get_params()
    assert params["quantiles"] == (0.5, 0.9, 0.99)
    copy = clone(est)
    assert copy.get_params() == params and not [k for k in vars(copy) if k.endswith("_")]
    copy.set_params(quantiles=(0.1, 0.5, 0.9))
    assert copy.get_params()["quantiles"] == (0.1, 0.5, 0.9)
    # __init__ stores parameters untouched, even invalid ones; fit is where they are checked.
    bad = type(est)(quantiles=(0.9, 0.5))
    with pytest.raises(ValueError, match="strictly increasing"):
        bad.fit(seasonal)


@pytest.mark.parametrize("est", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_prediction_shape(est, seasonal: pd.Series) -> None:
    est = clone(est).fit(seasonal.iloc[:-20])
    out = est.predict(seasonal.iloc[:-20], 20)
    assert list(out.columns) == ["q0.5", "q0.9", "q0.99"] == quantile_columns((0.5, 0.9, 0.99))
    assert out.index.tolist() == seasonal.index[-20:].tolist()  # the next bucket starts
    values = out.to_numpy()
    assert np.all(np.isfinite(values)) and np.all(values >= 0)
    assert np.all(np.diff(values, axis=1) >= 0)  # monotone across quantiles
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        est.predict(seasonal, 0)
    with pytest.raises(ValueError, match="600 s"):
        est.predict(pd.Series([1.0, 2.0], index=[0.0, 60.0]), 2)
    with pytest.raises(ValueError, match="regular"):
        est.predict(pd.Series([1.0, 2.0, 3.0], index=[0.0, 600.0, 1800.0]), 2)


def test_quantile_forecaster_learns_the_daily_cycle() -> None:
    """Fitted once on 7 days, predicting 2 h ahead from 84 origins over the next 7 days."""
    y = daily_series(14)
    est = QuantileForecaster(bucket_s=BUCKET, max_horizon=12)
    kw = dict(h=12, n_windows=84, step_size=12, refit=False)
    cv = cross_validation(est, y, **kw)
    s = scores(cv)
    flat = float(np.mean(np.abs(cv["y"] - y.iloc[: 7 * PER_DAY].mean())))
    assert s["mae"] < 0.35 * flat
    # p90 covers ~90% of buckets (seeds 0-3 give 0.85-0.92: 1,008 correlated buckets).
    assert 0.8 <= s["coverage"] <= 0.97
    assert scores(cv, "q0.99")["coverage"] >= 0.95
    naive = scores(cross_validation(SeasonalNaiveForecaster(bucket_s=BUCKET), y, **kw))
    assert s["pinball"] < naive["pinball"]


def test_seasonal_naive_is_exact_on_a_periodic_series() -> None:
    y = daily_series(3, noise=0.0)
    est = SeasonalNaiveForecaster(bucket_s=BUCKET).fit(y)
    assert est.season_ == PER_DAY and est.residual_lag_ == PER_DAY
    assert est.offsets_ == pytest.approx(np.zeros(3), abs=1e-9)
    out = est.predict(y.iloc[:-30], 30)
    for col in out.columns:
        assert out[col].to_numpy() == pytest.approx(y.iloc[-30:].to_numpy())
    # Less than a season of history: the last observed value stands in.
    short = SeasonalNaiveForecaster(bucket_s=BUCKET).fit(y.iloc[:10])
    assert short.residual_lag_ == 1
    assert short.predict(y.iloc[:10], 3)["q0.5"].iloc[0] == pytest.approx(y.iloc[9] + short.offsets_[0])


def test_short_histories_and_zero_traffic() -> None:
    y = daily_series(1)
    tiny = QuantileForecaster(bucket_s=BUCKET).fit(y.iloc[:8])
    assert tiny.models_ is None and tiny.fallback_ is not None  # too little to learn a shape
    out = tiny.predict(y.iloc[:1], 4)
    assert np.all(np.diff(out.to_numpy(), axis=1) >= 0) and len(out) == 4
    # Half a day of 10-minute buckets: no calendar or seasonal features, still a model.
    half = QuantileForecaster(bucket_s=BUCKET, max_horizon=6).fit(y.iloc[:72])
    assert half.models_ is not None
    assert not (half.spec_.time_of_day or half.spec_.daily or half.spec_.weekly)
    assert np.all(np.isfinite(half.predict(y.iloc[:2], 6).to_numpy()))
    # A stretch of zeros (an outage) inside the history, and a history that ends in it.
    holed = daily_series(4, seed=3)
    holed.iloc[200:300] = 0.0
    est = QuantileForecaster(bucket_s=BUCKET, max_horizon=6).fit(holed)
    during = est.predict(holed.iloc[:290], 6).to_numpy()
    assert np.all(np.isfinite(during)) and np.all(during >= 0)
    assert during[:, 0].max() < 50  # no instant return to normal traffic mid-outage
    zeros = pd.Series(np.zeros(400), index=np.arange(400) * BUCKET)
    flat = QuantileForecaster(bucket_s=BUCKET, max_horizon=6).fit(zeros).predict(zeros, 6)
    assert flat.to_numpy() == pytest.approx(np.zeros((6, 3)), abs=1e-6)


def test_horizons_beyond_the_trained_range_are_answered(seasonal: pd.Series) -> None:
    est = QuantileForecaster(bucket_s=BUCKET, max_horizon=6).fit(seasonal)
    out = est.predict(seasonal, 30)
    assert len(out) == 30 and np.all(np.isfinite(out.to_numpy()))


def test_features_read_nothing_after_the_origin() -> None:
    """Changing every value after an origin leaves that origin's feature rows unchanged."""
    y = daily_series(16).to_numpy()
    spec = choose_spec(y.size, BUCKET, 12)
    assert spec.time_of_day and spec.day_of_week and spec.daily and spec.weekly
    origins = np.array([5, 150, 1100, 2000, 2200])
    horizons = np.array([1, 12, 7, 144, 3])
    ts = 1_700_006_400.0 + (origins + horizons) * BUCKET
    X, level = build(spec, y, origins, horizons, ts)
    for i, o in enumerate(origins):
        changed = y.copy()
        changed[o + 1:] = 1e6
        Xc, lc = build(spec, changed, origins[i:i + 1], horizons[i:i + 1], ts[i:i + 1])
        np.testing.assert_array_equal(np.nan_to_num(Xc[0], nan=-7.0), np.nan_to_num(X[i], nan=-7.0))
        assert lc[0] == level[i]
    with pytest.raises(ValueError, match="horizons must be >= 1"):
        build(spec, y, origins, np.zeros(5, dtype=int), ts)
    with pytest.raises(ValueError, match="bucket_s must be positive"):
        FeatureSpec(bucket_s=0)


def test_seasonal_features_follow_the_fitted_stretch() -> None:
    """7.6 days: a week of lags exists in the series but not before the calibration cut."""
    y = daily_series(8).iloc[: int(7.6 * PER_DAY)]
    est = QuantileForecaster(bucket_s=BUCKET, max_horizon=6).fit(y)
    assert est.n_calibration_rows_ > 0
    assert est.spec_.daily and not est.spec_.weekly
    assert np.all(np.isfinite(est.predict(y, 6).to_numpy()))
