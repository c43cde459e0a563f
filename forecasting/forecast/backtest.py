"""Rolling-origin backtests of forecasters, in statsforecast's ``cross_validation`` shape.

A forecaster is judged the way the planner uses it: at a cutoff, fitted on the history up
to that cutoff only, it predicts the next ``h`` buckets; then the cutoff moves by
``step_size`` buckets. ``n_windows`` cutoffs are placed so the last window ends exactly at
the end of the series. The two figures that matter for prewarming are the MAE of the
median (how good the forecast is) and the under-provision rate: the share of buckets
whose true rate exceeded the quantile used for planning (how often the plan comes up short).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import pandas as pd
from sklearn.base import clone


class Forecaster(Protocol):
    """What a backtest needs: the estimator API of `forecasting.forecast.models`."""

    def fit(self, y: pd.Series) -> Any: ...
    def predict(self, y_hist: pd.Series, horizon: int) -> pd.DataFrame: ...
    def get_params(self, deep: bool = True) -> dict[str, Any]: ...


def cutoff_positions(n: int, *, h: int, n_windows: int, step_size: int) -> list[int]:
    """Positions (0-based, into a series of ``n`` buckets) of each window's last training bucket."""
    if h < 1 or n_windows < 1 or step_size < 1:
        raise ValueError(f"h, n_windows and step_size must be >= 1 (got {h}, {n_windows}, {step_size})")
    last = n - h - 1
    first = last - (n_windows - 1) * step_size
    if first < 0:
        raise ValueError(
            f"a series of {n} buckets is too short for {n_windows} windows of h={h} every "
            f"{step_size} buckets (needs at least {h + 1 + (n_windows - 1) * step_size})"
        )
    return [first + i * step_size for i in range(n_windows)]


def cross_validation(
    estimator: Forecaster, y: pd.Series, *, h: int, n_windows: int, step_size: int,
    refit: bool | int = True,
) -> pd.DataFrame:
    """Forecasts from rolling origins: columns ``cutoff``, ``ts``, ``y`` and the quantile columns.

    ``cutoff`` is the index (bucket start) of the last bucket the window's model saw.
    ``refit=True`` fits a fresh clone at every cutoff; ``False`` fits once, at the first
    cutoff, and later windows only predict from their longer history; an int ``k`` refits
    every ``k`` windows. In every case the model is fitted and predicts only on data up to
    its window's cutoff.
    """
    if not isinstance(y, pd.Series):
        raise TypeError(f"y must be a pandas Series, got {type(y).__name__}")
    if isinstance(refit, bool):
        every = 1 if refit else 0
    elif isinstance(refit, int) and refit >= 0:
        every = refit
    else:
        raise ValueError(f"refit must be a bool or a non-negative int, got {refit!r}")
    positions = cutoff_positions(len(y), h=h, n_windows=n_windows, step_size=step_size)
    parts: list[pd.DataFrame] = []
    model: Any = None
    for i, pos in enumerate(positions):
        history = y.iloc[: pos + 1]
        if model is None or (every and i % every == 0):
            model = clone(estimator).fit(history)
        pred = model.predict(history, h)
        truth = y.iloc[pos + 1: pos + 1 + h]
        frame = pred.reset_index(drop=True)
        frame.insert(0, "y", truth.to_numpy(dtype=np.float64))
        frame.insert(0, "ts", truth.index.to_numpy(dtype=np.float64))
        frame.insert(0, "cutoff", float(y.index[pos]))
        parts.append(frame)
    return pd.concat(parts, ignore_index=True)


def scores(cv: pd.DataFrame, quantile_col: str = "q0.9") -> dict[str, float]:
    """Accuracy of a backtest: ``mae`` of q0.5, ``under_provision_rate`` of ``quantile_col``.

    Also ``coverage`` (1 - under-provision rate), ``pinball`` (the quantile loss of
    ``quantile_col``, the proper score of a quantile), ``over_provision`` (mean of
    ``quantile_col - y`` where it is above y: capacity paid for and not used, in req/s)
    and ``n`` (buckets scored).
    """
    for col in ("y", "q0.5", quantile_col):
        if col not in cv.columns:
            raise ValueError(f"the backtest frame has no column {col!r} (columns: {list(cv.columns)})")
    tau = float(quantile_col[1:])
    y = cv["y"].to_numpy(dtype=np.float64)
    med = cv["q0.5"].to_numpy(dtype=np.float64)
    upper = cv[quantile_col].to_numpy(dtype=np.float64)
    if y.size == 0:
        raise ValueError("the backtest frame is empty")
    diff = y - upper
    under = float(np.mean(diff > 0))
    return {
        "mae": float(np.mean(np.abs(y - med))),
        "under_provision_rate": under,
        "coverage": 1.0 - under,
        "pinball": float(np.mean(np.maximum(tau * diff, (tau - 1) * diff))),
        "over_provision": float(np.mean(np.clip(-diff, 0, None))),
        "n": float(y.size),
    }
