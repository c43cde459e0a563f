"""Rolling-origin backtests: window placement, no look-ahead, refit modes, scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest
from sklearn.base import BaseEstimator

from forecasting.forecast.backtest import cross_validation, cutoff_positions, scores
from forecasting.data.history import load_file, rate_series
from forecasting.forecast.models import QuantileForecaster, SeasonalNaiveForecaster


class Recording(BaseEstimator):
    """Wraps a forecaster and records the last index of every series it fits or predicts on."""

    log: ClassVar[list[tuple[str, float]]] = []

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def fit(self, y: pd.Series) -> "Recording":
        Recording.log.append(("fit", float(y.index.max())))
        self.inner_ = (self.inner or SeasonalNaiveForecaster(bucket_s=60.0)).fit(y)
        return self

    def predict(self, y_hist: pd.Series, horizon: int) -> pd.DataFrame:
        Recording.log.append(("predict", float(y_hist.index.max())))
        return self.inner_.predict(y_hist, horizon)


def ramp(n: int) -> pd.Series:
    return pd.Series(np.arange(n, dtype=float), index=pd.Index(np.arange(n) * 60.0, name="ts"))


def test_cutoffs_end_with_the_series() -> None:
    assert cutoff_positions(100, h=10, n_windows=3, step_size=5) == [79, 84, 89]
    assert cutoff_positions(11, h=10, n_windows=1, step_size=1) == [0]
    with pytest.raises(ValueError, match="too short"):
        cutoff_positions(20, h=10, n_windows=3, step_size=5)
    with pytest.raises(ValueError, match=">= 1"):
        cutoff_positions(100, h=0, n_windows=3, step_size=5)


@pytest.mark.parametrize("refit, fits", [(True, 4), (False, 1), (2, 2)])
def test_windows_never_see_the_future(refit: bool | int, fits: int) -> None:
    y = ramp(200)
    Recording.log.clear()
    cv = cross_validation(Recording(), y, h=12, n_windows=4, step_size=7, refit=refit)
    assert list(cv.columns[:3]) == ["cutoff", "ts", "y"] and "q0.9" in cv.columns
    assert len(cv) == 48 and cv["ts"].iloc[-1] == y.index[-1]  # the last window ends at the end
    cutoffs = sorted(set(cv["cutoff"]))
    assert cutoffs == [y.index[p] for p in (166, 173, 180, 187)]
    for cutoff, window in cv.groupby("cutoff"):
        assert window["ts"].min() == cutoff + 60 and len(window) == 12
        assert window["y"].tolist() == (window["ts"] / 60).tolist()
    assert [kind for kind, _ in Recording.log].count("fit") == fits
    predicted = [t for kind, t in Recording.log if kind == "predict"]
    assert predicted == cutoffs  # each window predicts from exactly its cutoff
    # Every fit happened on data up to a cutoff no later than the windows it served.
    fitted = [t for kind, t in Recording.log if kind == "fit"]
    assert set(fitted) <= set(cutoffs) and max(fitted) <= max(cutoffs)


def test_scores_by_hand() -> None:
    cv = pd.DataFrame({
        "cutoff": 0.0, "ts": [1.0, 2.0, 3.0, 4.0],
        "y": [10.0, 20.0, 30.0, 40.0],
        "q0.5": [12.0, 18.0, 30.0, 30.0],
        "q0.9": [15.0, 25.0, 29.0, 45.0],
    })
    s = scores(cv)
    assert s["mae"] == pytest.approx((2 + 2 + 0 + 10) / 4)
    assert s["under_provision_rate"] == pytest.approx(0.25) and s["coverage"] == pytest.approx(0.75)
    assert s["pinball"] == pytest.approx((0.1 * 5 + 0.1 * 5 + 0.9 * 1 + 0.1 * 5) / 4)
    assert s["over_provision"] == pytest.approx((5 + 5 + 0 + 5) / 4)
    assert scores(cv, "q0.5")["under_provision_rate"] == pytest.approx(0.5)  # 20 > 18, 40 > 30
    with pytest.raises(ValueError, match="no column 'q0.99'"):
        scores(cv, "q0.99")


def test_quantile_forecaster_beats_seasonal_naive_on_servegen(traces_dir: Path) -> None:
    """Hourly horizon on the real 14-day ServeGen series, one fit per 8 windows."""
    y = rate_series(load_file(traces_dir / "servegen_m_large_rate.csv", bucket_s=600))
    kw = dict(h=6, n_windows=16, step_size=25, refit=8)
    q = scores(cross_validation(QuantileForecaster(bucket_s=600, max_horizon=6), y, **kw))
    naive = scores(cross_validation(SeasonalNaiveForecaster(bucket_s=600), y, **kw))
    assert q["mae"] < 0.7 * naive["mae"]
    assert q["pinball"] < naive["pinball"]
    assert q["under_provision_rate"] <= 0.25
