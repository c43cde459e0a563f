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
Until its first overspend (`overspent`) it is never above the largest margin a counted bucket
needed (the quantile rule's scores, below), once the scored buckets hold one budget's worth of
requests and are one budget's worth of buckets (1 / budget: 1,000 buckets, 2.8 hours of 10 s
buckets, at 0.1%): a calm start comes down to what the traffic needed, not by the gain per window
(NASA, which one replica serves: 1.34x `reactive`'s GPU-hours for a day of safe start). The largest
of n buckets stands for the share 1/n of them that may need more; read from fewer buckets it
claimed a tail they cannot show (on dense traffic a few seconds of buckets hold 1,000 requests,
the cap pulled the margin to what a calm hour needed, and the next rise overspent the day's
budget: 1.5x it on a day of off-grid steps). The cap reads the scores in whole replicas
(`needed_margins`' `slots`): a peak the replicas sized already serve needs no margin. A step that
saw no bucket sized no load, and no bucket is scored against it. After the first overspend, the
integrator alone: a wait the scores do not show (a load later than its lead) must not be argued
away by them.

"Requests per calibration window" is the mean request rate over the budget's horizon
(`budget_horizon_s`, a day by default: the span the operator's share is meant over), carried
between steps, not the last hour's: normalised by the last hour, a miss at the daily peak
weighed less than one at night, so the margin held an hourly average of shares and the share
of requests (misses come with rises, at busy hours) ran over the budget. The average is of
the buckets counted since the planner acted, corrected for its start: seeded with the fine
history read, it took in the zero buckets a live gateway reports for the time before a run
(the replay has none), and the live margin fell far faster than the replayed one.

The quantile rule (`margin_rule="quantile"`, not the default; figures in docs/operating.md) sets the
margin from what past buckets needed instead, as split conformal prediction sets its interval from
past scores: each step records the load it sized (`record_sizing`), and once that step's lead has
run out each fine bucket is scored by the margin it needed, (peak in flight - a) / sqrt(a) (plus
the staffing beta a peak already holds, in reactive mode). The margin is the quantile of those
scores, weighed by the bucket's requests and decayed over `shortfall_horizon_s`, that leaves at
most `alpha` of the requests short; the feedback moves only the level `alpha` (starting at the
budget), by the integrator's step in units of the level (gain x budget per calm window). The
integrator's margin after an event is set by how many requests waited, and its level when the
next one comes by how long it was calm (a sawtooth, paid for all along); the quantile's is set by
how much margin the events needed, so it stays where they put it.

`sizing` applies the margin: to a mean load in flight whole, to a peak in flight (the
planner's reactive mode) counted from the staffing beta a peak already holds.

`waited` is what the gateway counts per fine bucket (requests held for capacity longer than
the wait threshold), the same counter the simulator fills from its replay; `None` (a
history without the counter) leaves the margin where it is.

Pure: no I/O, no clock (bucket times come with the counts).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Protocol

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
    @property
    def margin_rule(self) -> str: ...
    @property
    def headroom(self) -> float: ...
    @property
    def shortfall_horizon_s(self) -> float: ...
    @property
    def fine_bucket_s(self) -> float: ...
    @property
    def interval_s(self) -> float: ...


Sizing = tuple[float, float, float, float]  # a step's sizing, scored later: (made at, lead s, load a, offset)
RULES = ("integrator", "quantile")
SCORE_BIN = 0.25  # the resolution of the needed margins' histogram, in units of the margin


class Carried(Protocol):
    """What the calibration carries between steps (`forecasting.planner.PlannerState`)."""

    @property
    def margin(self) -> float | None: ...
    @property
    def counted_end(self) -> float | None: ...
    @property
    def counted_rate(self) -> float | None: ...
    @property
    def counted_weight_s(self) -> float | None: ...
    @property
    def shortfalls(self) -> tuple[float, ...]: ...
    @property
    def alpha(self) -> float | None: ...
    @property
    def sized(self) -> tuple[Sizing, ...]: ...
    @property
    def overspent(self) -> bool: ...
    @property
    def scored_buckets(self) -> float: ...


class Calibrated(NamedTuple):
    """The calibration's fields of the planner's state after a step."""

    margin: float
    counted_end: float | None
    counted_rate: float | None
    counted_weight_s: float | None
    shortfalls: tuple[float, ...]
    alpha: float | None
    overspent: bool
    scored_buckets: float


def _new_buckets(n: int, waited: np.ndarray | None, start: float, bucket_s: float, counted_end: float | None,
                 p: BudgetParams) -> tuple[int | None, float | None]:
    """The first bucket not counted yet (None: nothing to count) and the new `counted_end`. The first call
    counts nothing (it only marks where counting starts): misses before the planner acted are not its own."""
    end = start + n * bucket_s
    if waited is None or n == 0 or not 0 < p.cold_start_budget < 1:
        return None, end if n else counted_end
    if counted_end is None:
        return None, end
    first = max(0, int(math.ceil(round((counted_end - start) / bucket_s, 9))))
    return (None, counted_end) if first >= n else (first, end)


def _carry_rate(req: float, span: float, rate: float | None, weight_s: float | None,
               horizon_s: float) -> tuple[float, float, float]:
    """(the rate that normalises these buckets' overspend, the new carried rate, its weight in seconds): the
    rate carried so far (before these buckets join it), or with none yet these buckets' own; the carried rate is
    an exponential average over `horizon_s` (the budget's horizon), corrected for its start."""
    norm = rate if rate is not None and weight_s else req / span
    w = math.exp(-span / horizon_s) * (weight_s or 0.0)
    return norm, (w * (rate or 0.0) + req) / (w + span), w + span


def _overspend_windows(miss: float, req: float, norm_rate: float, budget: float, calibration_s: float) -> float | None:
    """The budget overspent by `miss` waits among `req` requests, in calibration windows' budgets (a window's
    requests at `norm_rate` per second): what the integrator moves by `gain` per unit (negative: underspent;
    None: no requests to measure it against)."""
    per_window = norm_rate * calibration_s
    if not per_window > 0:
        return None
    return (miss - budget * req) / (budget * per_window)


def budget_overspend(requests: float, waited: float, span_s: float, rate: float | None, weight_s: float | None, *,
                     budget: float, calibration_s: float, horizon_s: float) -> tuple[float | None, float, float]:
    """The budget overspent by `waited` of `requests` counted over `span_s` seconds, in calibration windows'
    budgets (None: no requests to measure it against), and the carried request rate over `horizon_s` with its
    weight in seconds: the one measure every integrator of the cold-start budget moves by (the count planner's
    margin here, the fleet planner's memory price in `forecasting.fleet.planner`)."""
    norm, rate, weight_s = _carry_rate(requests, span_s, rate, weight_s, horizon_s)
    return _overspend_windows(waited, requests, norm, budget, calibration_s), rate, weight_s


def calibrate_margin(requests: np.ndarray, waited: np.ndarray | None, start: float, bucket_s: float,
                     margin: float | None, counted_end: float | None, rate: float | None, weight_s: float | None,
                     p: BudgetParams) -> tuple[float, float | None, float | None, float | None]:
    """The integrator's margin after counting the buckets of `requests`/`waited` (from epoch `start`) that end
    after `counted_end`; the new `counted_end`; and the request rate (per second) over the budget's horizon that
    normalises the overspend, with the seconds of counting it rests on (`rate`, `weight_s`: carried from the
    last step; None: nothing counted yet). The rate is an exponential average over `budget_horizon_s` of the
    buckets counted, corrected for its start (the sum of decayed requests over the sum of decayed seconds), so
    the zero buckets before a model had traffic, or before the planner acted, do not weigh in."""
    beta = p.margin_initial if margin is None else float(margin)
    first, end = _new_buckets(int(requests.size), waited, start, bucket_s, counted_end, p)
    if first is None or waited is None:
        return beta, end, rate, weight_s
    req, miss = float(np.sum(requests[first:])), float(np.sum(waited[first:]))
    over, rate, weight_s = budget_overspend(req, miss, (requests.size - first) * bucket_s, rate, weight_s,
                                            budget=p.cold_start_budget, calibration_s=p.budget_calibration_s,
                                            horizon_s=p.budget_horizon_s)
    if over is None:
        return beta, end, rate, weight_s
    beta += p.budget_gain * over
    return min(p.margin_max, max(0.0, beta)), end, rate, weight_s


def _bins(p: BudgetParams) -> int:
    return int(math.ceil(p.margin_max / SCORE_BIN)) + 1


def needed_margins(requests: np.ndarray, peak: np.ndarray, start: float, bucket_s: float, first: int,
                   sized: tuple[Sizing, ...], nbins: int, slots: float | None = None,
                   headroom: float = 0.0) -> np.ndarray:
    """Requests per bin of the margin each bucket from `first` needed: (peak in flight - a) / sqrt(a), plus the
    sizing's offset, against the load `a` sized by the latest step whose lead had run out by the bucket's end
    (its capacity was there in time). Buckets no recorded step sized are left out. With `slots` (a replica's) a
    margin is needed only for the replicas: enough when the sizing asks for as many replicas as the peak fills,
    so the load it needs is just above what one replica fewer is sized for, (ceil(peak / slots) - 1) x slots /
    (1 + headroom) (`forecasting.budget.replicas_needed`)."""
    return _scores(requests, peak, start, bucket_s, first, sized, nbins, slots, headroom)[0]


def _scores(requests: np.ndarray, peak: np.ndarray, start: float, bucket_s: float, first: int,
            sized: tuple[Sizing, ...], nbins: int, slots: float | None, headroom: float) -> tuple[np.ndarray, int]:
    """`needed_margins`, and how many buckets it scored."""
    out, scored = np.zeros(nbins), 0
    for k in range(first, requests.size):
        end = start + (k + 1) * bucket_s
        due = [r for r in sized if r[0] + r[1] <= end + 1e-9]
        if not due:
            continue
        _, _, a, offset = max(due)
        load = float(peak[k])
        if slots is not None:
            load = (math.ceil(round(load / slots, 9)) - 1) * slots / (1.0 + headroom) + 1e-6
        need = (load - a) / math.sqrt(max(a, 1.0)) + offset
        out[min(nbins - 1, max(0, int(math.ceil(need / SCORE_BIN - 1e-9))))] += float(requests[k])
        scored += 1
    return out, scored


def quantile_margin(hist: np.ndarray, alpha: float, min_requests: float) -> float | None:
    """The smallest margin beyond which at most `alpha` of the requests' buckets needed more (None: the
    histogram holds fewer than `min_requests`, too few to read a share of them from)."""
    total = float(hist.sum())
    if total <= 0 or total < min_requests:
        return None
    above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0.0]])  # requests in the bins above each
    return float(np.argmax(above <= alpha * total)) * SCORE_BIN


def _needed_hist(requests: np.ndarray, peak: np.ndarray, start: float, bucket_s: float, first: int | None,
                 c: Carried, p: BudgetParams, slots: float | None = None) -> tuple[np.ndarray, float]:
    """The carried histogram of needed margins (`needed_margins`) and the buckets it holds, both decayed over
    `shortfall_horizon_s`, with the buckets from `first` added (None: none new)."""
    nbins = _bins(p)
    fresh = len(c.shortfalls) != nbins
    hist = np.zeros(nbins) if fresh else np.asarray(c.shortfalls, dtype=np.float64)
    held = 0.0 if fresh else float(c.scored_buckets)
    if first is None:
        return hist, held
    decay = math.exp(-(requests.size - first) * bucket_s / p.shortfall_horizon_s)
    new, scored = _scores(requests, peak, start, bucket_s, first, c.sized, nbins, slots, p.headroom)
    return hist * decay + new, held * decay + scored


def _calibrate_quantile(requests: np.ndarray, waited: np.ndarray | None, peak: np.ndarray, start: float,
                        bucket_s: float, c: Carried, p: BudgetParams) -> Calibrated:
    alpha = p.cold_start_budget if c.alpha is None else float(c.alpha)
    rate, weight_s = c.counted_rate, c.counted_weight_s
    first, end = _new_buckets(int(requests.size), waited, start, bucket_s, c.counted_end, p)
    hist, held = _needed_hist(requests, peak, start, bucket_s, first, c, p)
    if first is not None and waited is not None:
        req, miss = float(np.sum(requests[first:])), float(np.sum(waited[first:]))
        over, rate, weight_s = budget_overspend(req, miss, (requests.size - first) * bucket_s, rate, weight_s,
                                                budget=p.cold_start_budget, calibration_s=p.budget_calibration_s,
                                                horizon_s=p.budget_horizon_s)
        if over is not None:  # the integrator's move, in units of the level: gain x budget per calm window
            alpha = min(1.0, max(0.0, alpha - p.budget_gain * p.cold_start_budget * over))
    # read once it holds one budget's worth of requests (one of them may wait)
    m = quantile_margin(hist, alpha, 1.0 / p.cold_start_budget) if 0 < p.cold_start_budget < 1 else None
    return Calibrated(p.margin_initial if m is None else min(m, p.margin_max), end, rate, weight_s,
                      tuple(float(x) for x in hist), alpha, c.overspent, held)


def calibrate(requests: np.ndarray, waited: np.ndarray | None, peak: np.ndarray, start: float, bucket_s: float,
              c: Carried, p: BudgetParams, slots: float | None = None) -> Calibrated:
    """The margin after this step's new buckets, by the rule `p.margin_rule` (see the module docstring);
    `slots`: a replica's, so that the integrator's cap scores the buckets in whole replicas."""
    if p.margin_rule == "quantile":
        return _calibrate_quantile(requests, waited, peak, start, bucket_s, c, p)
    first, _ = _new_buckets(int(requests.size), waited, start, bucket_s, c.counted_end, p)
    beta, end, rate, weight_s = calibrate_margin(requests, waited, start, bucket_s, c.margin, c.counted_end,
                                                 c.counted_rate, c.counted_weight_s, p)
    # `first` is None where nothing is counted (no waits read among them)
    if c.overspent or (first is not None and waited is not None
                       and float(np.sum(waited[first:])) > p.cold_start_budget * float(np.sum(requests[first:]))):
        return Calibrated(beta, end, rate, weight_s, (), c.alpha, True, 0.0)
    # until the first overspend, never above the largest margin a counted bucket needed, read once the buckets
    # hold one budget's worth of requests and are one budget's worth of buckets: the largest of n buckets
    # stands for the share 1/n of them beyond it, so under 1/budget of them it claims a tail they cannot show
    hist, held = _needed_hist(requests, peak, start, bucket_s, first, c, p, slots)
    enough = 0 < p.cold_start_budget < 1 and held >= 1.0 / p.cold_start_budget - 1e-9
    cap = quantile_margin(hist, 0.0, 1.0 / p.cold_start_budget) if enough else None
    return Calibrated(min(beta, cap) if cap is not None else beta, end, rate, weight_s,
                      tuple(float(x) for x in hist), c.alpha, False, held)


def record_sizing(sized: tuple[Sizing, ...], now: float, lead_s: float, load: float, offset: float,
                  p: BudgetParams) -> tuple[Sizing, ...]:
    """The sizings the quantile rule will score the coming buckets against, with this step's: (now, lead, the
    load sized, the margin's offset: the staffing beta a peak in flight already holds). Kept: those whose lead
    ends within the buckets not yet counted, and the last one before them."""
    horizon = now - 2 * p.fine_bucket_s - p.interval_s
    recent = [r for r in sized if r[0] + r[1] >= horizon]
    older = [r for r in sized if r[0] + r[1] < horizon]
    return tuple(([max(older)] if older else []) + recent) + ((now, lead_s, float(load), float(offset)),)


def sizing(peak: bool, margin: float, queue_beta: float) -> Callable[[float], float]:
    """Slots for a forecast load `a` with the calibrated margin: a + margin x sqrt(a) for a mean load in flight
    (square-root staffing covers its fluctuation within a bucket); for a peak in flight (the planner's reactive
    mode) the margin counted from the `queue_beta` a peak already holds, a + (margin - queue_beta) x sqrt(a), so
    that one margin sizes both modes alike: under beta it sizes below the peak, as it sizes a mean load within
    its fluctuation. Clipped at no margin beyond the peak, a margin the budget had brought under beta still sized
    every peak whole: a tenant one replica serves started a second for each brief peak over its slots and
    released it after the stabilization window (chunk-72 of the m-large clients at 60 s: 31 starts in 7 days
    against `reactive`'s 6, for waits 0.02x the budget). A peak with a request in flight keeps one replica
    (at least min(a, 1) slots), whatever the margin."""
    extra = margin - queue_beta if peak else margin
    return lambda a: max(a + extra * math.sqrt(max(a, 0.0)), min(a, 1.0))
