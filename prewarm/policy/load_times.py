"""The one reading of recorded load times: their p95, what a planner leads a rise by.

The registry keeps a model's last `LOADTIMES_KEEP` loads (and each tier's wakes and loads) and
reads them here; the replays (`forecasting.sim`, `forecasting.fleet`) read the loads they
charged the same way, so a replayed planner knows what a live one would.

Pure.
"""

from __future__ import annotations

import math
from typing import Iterable

#: The quantile of recorded load times a planner leads by: a rise planned one p95 ahead is ready in time for 19
#: of 20 loads; a higher quantile of the last 200 would be set by one or two outliers (an image pull, a slow node).
LOAD_TIME_QUANTILE = 0.95


def load_time_p95(seconds: Iterable[float]) -> float | None:
    """The `LOAD_TIME_QUANTILE` of `seconds` by nearest rank; None where nothing was recorded."""
    values = sorted(seconds)
    if not values:
        return None
    return float(values[min(len(values) - 1, max(0, math.ceil(LOAD_TIME_QUANTILE * len(values)) - 1))])
