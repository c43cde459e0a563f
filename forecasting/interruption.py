"""An interruption: a fall of the traffic that its learned season or its own recent level contradicts
is held, not released.

The planner follows a fall as soon as its forecast over the lead stays below what is left. That is
right for a fall the season explains (the evening), and wrong for a fall to (nearly) nothing at an hour
the season has always seen busy: an upstream outage, a load balancer that lost its targets, a client
that stopped for a deploy, a gap in the counters. Such traffic comes back at full rate, and every
replica released meanwhile is a cold start paid by the requests that return (on ServeGen m-small's
14 days, 91% of the planner's waits came in the 300 s after 12 windows of zero requests).

Bursty traffic has no season to contradict: a tenant that sends for an hour, stops for twenty
minutes and comes back at the same rate, at no repeating time of day (ServeGen m-large's clients:
chunk-73 comes back from zero 34 times in 14 days, at up to 174 req/s). What contradicts its fall is
its own recent level: a drop to nothing from the rate it ran at over the last `interruption_hold_s`
is as unlike chance as one at a busy hour of the season (73% of the planner's waits on chunk-73 came
in the half hour after a return). So the expectation is the larger of the two: the profile's, and
the mean rate of the `interruption_hold_s` before the judged buckets (its silent buckets included,
so a short burst in a quiet hour expects little and is let go). A fall that a declared batch job
explains (one of the model's ran within that span) is judged against the profile alone.

So when the requests the gateway counted over the recent fine buckets are below
`interruption_share` of that expectation (for the profile: its shape times the rate it was learned at)
and the expectation is large enough for the shortfall not to be noise (at least
`interruption_min_requests`: a Poisson count expecting 20 is under 2 with probability 4e-8), the planner
holds replicas for at most `interruption_hold_s` from the start of the fall; after that the fall is
believed. A fall is always found on that hour's level; once it has stayed silent past the hour, the
planner may re-read it with a longer span where the model's own pauses ask for one and the cold-start
budget cannot afford to miss their returns (`forecasting.pauses`, `pause_memory` 64 by default): the level is then read
over that span and the fall held until it ends. The window is the shortest run of recent buckets that expects that many requests (a busy
model decides within one bucket, a quiet one over more), at most `window_max_s`. Without a profile
(under two seasons of history) only the recent level is read.

What is held is what the expectation that leads asks for (`Fall.peak`). Where the season leads (the profile
expects at least the recent level: the hour is as busy as the traffic was), every live replica. Where
the recent level leads, the replicas its expected requests need at the peak in flight a request
brought over the level's span, sized as the planner sizes a peak (the margin the cold-start budget
calibrated included), at most the live ones: a tenant that sent for twenty minutes of the hour expects
a third of its rate, and is held at what a third needs. A bursty tenant's profile, smeared over the
hours it sends at random, lies far below its bursts, so its pauses are led by the level. The level's
span slides into the silence step by step, so what a long pause holds shrinks as it lasts, down to what the
model's returns bring, read at the budget (`forecasting.pauses.return_peak`, with pauses remembered).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import numpy as np

from forecasting.forecast.nowcast import Profile


class InterruptionParams(Protocol):
    """The planner parameters read here (`forecasting.planner.PlannerParams`)."""

    @property
    def interruption_share(self) -> float: ...
    @property
    def interruption_min_requests(self) -> float: ...
    @property
    def interruption_hold_s(self) -> float: ...


def expected_requests(profile: Profile | None, start: float, bucket_s: float, n: int) -> np.ndarray | None:
    """What the profile expects in each of `n` buckets from epoch `start` (None: no profile, or one without
    the rate it was learned at)."""
    if profile is None or not profile.level > 0 or n <= 0:
        return None
    mids = start + (np.arange(n, dtype=np.float64) + 0.5) * bucket_s
    return profile.level * profile.at(mids) * bucket_s


def recent_level(requests: np.ndarray, end: int, bucket_s: float, span_s: float) -> float:
    """The mean requests per bucket over the `span_s` before bucket index `end` (the buckets there are; 0: none)."""
    before = requests[max(0, end - int(span_s // bucket_s)):max(0, end)]
    return float(before.mean()) if before.size else 0.0


class Fall(NamedTuple):
    """An interruption: the expectation the fall is judged against, and which one leads it."""

    expected: float  # requests per bucket the judged buckets were expected to bring (the larger of the two)
    by_season: bool  # the profile's expectation is at least the recent level's: the hour is as busy as the traffic was
    # where the level leads: the peak in flight the expected requests bring, at the peak per request of the level's
    # span (None: the season leads, or no peaks were given)
    peak: float | None = None


def _window(n: int, bucket_s: float, window_max_s: float) -> int:
    """The index of the first bucket an interruption is judged on (the level is read before it)."""
    return n - min(n, max(1, int(window_max_s // bucket_s)))


def _short(requests: np.ndarray, exp: np.ndarray, p: InterruptionParams) -> bool:
    """Whether the last buckets fall below `interruption_share` of `exp` (the expectation of the last len(exp)),
    over the shortest recent run expecting at least `interruption_min_requests` (False: none expects enough)."""
    expected = np.cumsum(exp[::-1])  # over the last 1, 2, ... buckets
    enough = np.flatnonzero(expected >= p.interruption_min_requests)
    if enough.size == 0:
        return False  # too quiet an hour to tell a fall from chance
    k = int(enough[0]) + 1
    return float(np.sum(requests[-k:])) < p.interruption_share * float(expected[k - 1])


def interrupted(profile: Profile | None, requests: np.ndarray, start: float, bucket_s: float, window_max_s: float,
                p: InterruptionParams, recent: bool = True, peak: np.ndarray | None = None) -> Fall | None:
    """Whether the last buckets of `requests` (per bucket from epoch `start`) fall short as an interruption does
    (None: not): below `interruption_share` of the larger of the profile's expectation and the recent level's
    (`recent_level` over the `interruption_hold_s` before them; `recent` False: the profile's alone, as when a
    declared batch job ran within that span and its end explains the fall), over the shortest recent run of
    buckets expecting at least `interruption_min_requests` (within `window_max_s`). With `peak` (the peak in
    flight per bucket), a fall the level leads carries the peak its expected requests bring (`Fall.peak`)."""
    if not 0 < p.interruption_share < 1 or requests.size == 0:
        return None
    first = _window(requests.size, bucket_s, window_max_s)
    level = recent_level(requests, first, bucket_s, p.interruption_hold_s) if recent else 0.0
    exp = expected_requests(profile, start + first * bucket_s, bucket_s, requests.size - first)
    by_season = exp is not None and float(exp.mean()) >= level
    exp = np.full(requests.size - first, level) if exp is None else np.maximum(exp, level)
    if not _short(requests, exp, p):
        return None
    expected = float(exp.mean())
    back = None if by_season or peak is None or level <= 0 else \
        expected * recent_level(peak, first, bucket_s, p.interruption_hold_s) / level
    return Fall(expected, by_season, back)


def hold(quiet_since: float | None, now: float, is_interrupted: bool, hold_s: float) -> tuple[float | None, bool]:
    """The start of the current interruption (None: none) and whether its replicas are still held."""
    if not is_interrupted:
        return None, False
    since = now if quiet_since is None else quiet_since
    return since, now - since <= hold_s


def held_target(fall: Fall | None, held: bool, quiet_since: float | None, span_s: float, alpha: float | None,
                hold_s: float, live: int, need: Callable[[float, float], int]) -> tuple[int, str] | None:
    """The replicas a fall still held keeps and why (None: no fall held): every live one where the season leads,
    else `need(expected requests, peak)` of the level's peak (within the live ones; the planner's is at least what
    the peak fills, as it keeps the replicas the peaks of a lead filled while traffic runs). `span_s` over
    `hold_s`: a silent fall held for the span its pauses ask for, at the share `alpha` the budget lets outlast it."""
    if fall is None or not held:
        return None
    keep = live if fall.peak is None else min(live, need(fall.expected, fall.peak))
    return keep, (f"interruption: requests far below the {'profile' if fall.by_season else 'recent level'}'s "
                  f"expectation since {quiet_since:.0f}: {keep} held (at most {span_s:.0f} s"
                  + (f", as the budget lets {alpha:.1%} of its pauses outlast)" if span_s > hold_s else ")"))
