"""The cold-start budget's calibration: the planner's margin calibrated online on the misses the gateway observes.

The operator's goal is a share of requests that may wait for capacity (a load or a wake),
`cold_start_budget`. No forecast knob maps to that share on every trace (a planning quantile
barely moves it: the misses come from changes the recent residuals never showed), so the
planner steers to it by feedback, as adaptive conformal inference (Gibbs & Candes, 2021)
steers its quantile from its own misses: every step the staffing margin beta (slots for a
load a are a + beta sqrt(a)) moves by

    beta += gain x (waited - budget x requests) / (budget x requests per calibration window)

over the fine buckets counted since the last step. Requests that waited push it up in
proportion to how much of a window's budget they spent; calm buckets bring it down by `gain`
per window. It is an integrator of the overspend, so over a long run the realised share is
the budget whatever the trace, as long as the margin stays within its bounds (the clip at
[0, margin_max] keeps it from winding up while the budget cannot be met, or is met for free).

"Requests per calibration window" is the mean request rate over the budget's horizon
(`budget_horizon_s`, a day by default: the span the operator's share is meant over), carried
between steps, not the last hour's: normalised by the last hour, a miss at the daily peak
weighed less than one at night, so the margin held an hourly average of shares and the share
of requests (misses come with rises, at busy hours) ran over the budget. The average is of
the buckets counted since the planner acted, corrected for its start: seeded with the fine
history read, it took in the zero buckets a live gateway reports for the time before a run
(the replay has none), and the live margin fell far faster than the replayed one.

`sizing` applies the margin: to a mean load in flight whole, to a peak in flight (the
planner's reactive mode) only beyond the staffing beta a peak already holds.

`waited` is what the gateway counts per fine bucket (requests held for capacity longer than
the wait threshold), the same counter the simulator fills from its replay; `None` (a
history without the counter) leaves the margin where it is.

Pure: no I/O, no clock (bucket times come with the counts).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import numpy as np


class BudgetParams(Protocol):
    """The planner parameters the calibration reads (`forecasting.planner.PlannerParams`)."""

    @property
    def margin_initial(self) -> float: ...
    @property
    def cold_start_budget(self) -> float: ...
    @property
    def budget_gain(self) -> float: ...
    @property
    def budget_calibration_s(self) -> float: ...
    @property
    def margin_max(self) -> float: ...
    @property
    def budget_horizon_s(self) -> float: ...


def calibrate_margin(requests: np.ndarray, waited: np.ndarray | None, start: float, bucket_s: float,
                     margin: float | None, counted_end: float | None, rate: float | None, weight_s: float | None,
                     p: BudgetParams) -> tuple[float, float | None, float | None, float | None]:
    """The margin after counting the buckets of `requests`/`waited` (from epoch `start`) that end after
    `counted_end`; the new `counted_end`; and the request rate (per second) over the budget's horizon that
    normalises the overspend, with the seconds of counting it rests on (`rate`, `weight_s`: carried from the
    last step; None: nothing counted yet). The rate is an exponential average over `budget_horizon_s` of the
    buckets counted, corrected for its start (the sum of decayed requests over the sum of decayed seconds), so
    the zero buckets before a model had traffic, or before the planner acted, do not weigh in. The first call
    counts nothing (it only marks where counting starts): misses before the planner acted are not its own."""
    beta = p.margin_initial if margin is None else float(margin)
    n = int(requests.size)
    end = start + n * bucket_s
    if waited is None or n == 0 or not 0 < p.cold_start_budget < 1:
        return beta, end if n else counted_end, rate, weight_s
    if counted_end is None:
        return beta, end, rate, weight_s
    first = max(0, int(math.ceil(round((counted_end - start) / bucket_s, 9))))
    if first >= n:
        return beta, counted_end, rate, weight_s
    req = float(np.sum(requests[first:]))
    miss = float(np.sum(waited[first:]))
    span = (n - first) * bucket_s
    # weighed by the rate carried so far (before these buckets join it); with none yet, by these buckets' own
    norm = rate if rate is not None and weight_s else req / span
    keep = math.exp(-span / p.budget_horizon_s)
    w = keep * (weight_s or 0.0)
    weight_s = w + span
    rate = (w * (rate or 0.0) + req) / weight_s
    per_window = norm * p.budget_calibration_s
    if not per_window > 0:
        return beta, end, rate, weight_s
    beta += p.budget_gain * (miss - p.cold_start_budget * req) / (p.cold_start_budget * per_window)
    return min(p.margin_max, max(0.0, beta)), end, rate, weight_s


def sizing(peak: bool, margin: float, queue_beta: float) -> Callable[[float], float]:
    """Slots for a forecast load `a` with the calibrated margin: a + margin x sqrt(a) for a mean load in flight
    (square-root staffing covers its fluctuation within a bucket); for a peak in flight (the planner's reactive
    mode) only the margin beyond `queue_beta`, a + max(0, margin - queue_beta) x sqrt(a): a peak already holds
    the fluctuation the staffing part stands for, and sized again it kept a second replica for a load one serves."""
    extra = max(0.0, margin - queue_beta) if peak else margin
    return lambda a: a + extra * math.sqrt(max(a, 0.0))
