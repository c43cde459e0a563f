"""The planner's exported ratios: warm cost and forecast error (pure parts)."""

from __future__ import annotations

import pandas as pd
import pytest

from workers.planning.forecast import forecast_error, warm_cost_ratio


@pytest.mark.parametrize(("live", "need", "ratio"), [(0, 0, 0.0), (4, 4, 0.0), (5, 4, 0.2), (3, 5, 0.0), (10, 7, 0.3)])
def test_warm_cost_ratio(live: int, need: int, ratio: float) -> None:
    assert warm_cost_ratio(live, need) == pytest.approx(ratio)


def test_forecast_error_joins_on_buckets() -> None:
    predicted = pd.Series({0.0: 2.0, 60.0: 4.0, 120.0: 9.0})  # the last bucket is not observed yet
    actual = pd.Series({0.0: 1.0, 60.0: 5.0})
    assert forecast_error(predicted, actual) == pytest.approx(2.0 / 6.0)  # |2-1| + |4-5| over max(6, 6)
    assert forecast_error(pd.Series(dtype=float), actual) is None
    assert forecast_error(pd.Series({0.0: 1.0}), pd.Series({0.0: 0.0})) == 1.0  # a forecast for a silent stretch
    assert forecast_error(pd.Series({0.0: 0.0}), pd.Series({0.0: 0.0})) == 0.0
