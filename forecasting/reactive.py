"""The planner's reactive fallback: what it keeps and what it starts while its forecasts are poor.

Pure (no clock, no I/O). While the forecaster's recent forecasts are poor (`forecasting.planner`'s
mode gate), the planner behaves as the HPA does around its forecast:
- a fall keeps what the calibrated sizing gives the largest peak in flight observed within the
  stabilization window (`observed_need`; the HPA's stabilization over its own recommendations), and
  the peaks of the last lead, unsized, keep the replicas they filled in either mode;
- a rise is made only where it is shown (`rise_shown`): the forecast's peak in flight, or the load so
  far in the bucket in progress, fills more replicas than are live, unsized; the rise is then to the
  sized count. Sized, a poor forecast's noise started replicas no peak filled: Mooncake at 8.7 s, at
  the safe start's margin, stepped 11 -> 13 -> 11 replicas every minute or two while its peaks filled
  5-7 (47 starts in the hour to the HPA's 12, 2.44x its starts per GPU-hour).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from forecasting.budget import replicas_needed


def observed_need(peak: np.ndarray, bucket_s: float, window_s: float, margin: Callable[[float], float],
                  slots: float, headroom: float) -> int | None:
    """The replicas `margin` sizes for the largest peak in flight (`peak`, per fine bucket of `bucket_s`) of
    the last `window_s` (None: less history than that; 0 for no window: nothing observed holds capacity).
    The reactive floor over the stabilization window sizes the peak as the target is (unsized, it sat below
    the target, which then followed each burst's forecast down within seconds and started it again at the
    next); the lead's floor passes the peak unsized: the replicas it filled."""
    k = int(math.ceil(window_s / bucket_s))
    if k == 0:
        return 0
    if peak.size < k:
        return None
    return replicas_needed(margin(float(peak[-k:].max())), slots, headroom)


def rise_shown(upper: float, next_upper: float, now_load: float | None, live: int, slots: float,
               headroom: float) -> bool:
    """Whether a reactive step may add replicas: the forecast's peak in flight over the lead (`upper`) or the
    next bucket (`next_upper`), or the load so far in the bucket in progress, fills more than the `live`
    replicas unsized."""
    shown = max(upper, next_upper, now_load or 0.0)
    return replicas_needed(shown, slots, headroom) > live
