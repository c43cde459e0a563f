"""How long a fall is held, and the least it keeps: learned from the model's own pauses, as the cold-start budget affords.

A tenant that stops sending and comes back at the same rate pays a whole cold start of waits at its
returning rate for every return that finds its replicas released: a margin on the square root of a zero
load is zero, and no forecast sees an onset that does not recur (ServeGen's chunk-116 comes back from zero
85 times in 14 days, after pauses of 10 minutes to 18 hours). The interruption hold
(`forecasting.interruption`) keeps what the traffic's recent level expects; held for a fixed span
(`interruption_hold_s`, an hour) it is the wrong length for every tenant but one: too short where the pauses
run for hours, and one length for a tenant whose misses the budget can afford and one whose it cannot.

So the span is read from the pauses the model has had, as the serverless keep-alive of a histogram of
idle times is (Shahrad et al., 2020), at the quantile the cold-start budget affords. A return the hold
misses makes the requests of its first lead back wait; over a pause cycle (the mean time between returns)
the budget lets `cold_start_budget` of the cycle's requests wait. Their ratio is the share of
pauses that may outlast the hold:

    alpha = cold_start_budget x requests per cycle / median requests of a lead back

and the hold is the (1 - alpha) quantile of the remembered pause lengths, never below
`interruption_hold_s` (alpha of 1 or more: a miss is cheap against the traffic between pauses, and the
hour stays) and never above the season (`season_s`: a pause longer than a day is the daily profile's to
judge, and the gateway keeps its fine counters two days). Read from few pauses the quantile is their
longest, on the safe side, as the margin starts on the safe side of the budget.

The learned span does not change how a fall is found: that is judged on the hour's level, as before (read
over a day, the level of a bursty tenant's busiest burst made every quiet hour after it a fall, and the
holds cost more GPU for more waits: chunk-73 at 60 s, 0.58% of its requests waited with a fixed 24 h span,
0.32% with the hour). It changes how long a fall that stays silent is held: past the hour, while no
request came since it began (`silent_through`), its level is read over the learned span (so what is held
fades as the pause takes up more of it) and it is held until the span ends. What it holds is never below
what the returns bring in their first lead, read at the budget (`return_size`: the least whose mean excess over
the remembered returns, what they would make wait, is the budget's share of a pause cycle; the median of them
until the last round, which left a larger return than the median to wait), at most the live replicas.

A pause is a run of fine buckets without a request at least `stabilization_s` long (a shorter one is
covered by the scale-down window: nothing was released); what a miss of it costs is the requests of its
first lead back. The last `pause_memory` pauses are remembered (64 by default; 0: none, and the hour holds).
Dense traffic has no pause, or pauses (a counter gap, an outage) so rare against its traffic that alpha is
above 1: nothing changes there (ServeGen m-small's 14 days at 60 s, identical to the digit).

On by default since the planner stopped releasing the live replicas its target still wants
(`forecasting.budget.trim`); before that it was a split on the two bursty clients (docs/operating.md, "Built,
off by default", and "Built since: the learned span of a silent fall is the default"). With the return's
floor (then the median), 14 days, seed 0, against the hour alone: chunk-116 waits 5.4x less at a 60 s cold
start for 6% less GPU, and 52% less at 8.7 s for 14% more; chunk-73 waits 29% less at 60 s for 5% less GPU,
and 26% more at 8.7 s for 13% more (1.27x the budget, from 1.01x).
The floor read at the budget, against the median: chunk-116 waits 2.2x less at 60 s for 0.6% more GPU and 13%
less at 8.7 s for 2.2% more; chunk-73 3-4% less for 12% / 6.7% more GPU (a poor trade: its largest returns come
back above what was live when the pause began, and a hold never loads).

Pure: no I/O, no clock (bucket times come with the counts).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

import numpy as np

Pause = tuple[float, float, float]  # (ended at, length s, the requests of the lead back)


class Pauses(NamedTuple):
    """What is carried between steps (`forecasting.planner.PlannerState`)."""

    pauses: tuple[Pause, ...] = ()
    silent_since: float | None = None  # the end of the last bucket with a request (None: none seen yet)
    since: float | None = None  # when the pauses began to be counted (the span their frequency is read over)
    requests: float = 0.0  # the requests counted since `since` (the traffic the budget's share is of)
    counted_to: float | None = None  # the end of the last bucket counted in `requests`


def from_dict(d: dict[str, Any]) -> Pauses:
    """`Pauses._asdict()` read back (from JSON: lists for tuples)."""
    s, since = d.get("silent_since"), d.get("since")
    to = d.get("counted_to")
    return Pauses(tuple((float(e), float(n), float(r)) for e, n, r in d.get("pauses", ())),
                  None if s is None else float(s), None if since is None else float(since),
                  float(d.get("requests", 0.0)), None if to is None else float(to))


def observe(carried: Pauses, requests: np.ndarray, start: float, bucket_s: float, min_s: float,
            memory: int, lead_s: float) -> Pauses:
    """Take in the fine buckets (requests per bucket from epoch `start`): a return after at least `min_s`
    without a request is remembered as a pause (the last `memory`), with the requests of its first `lead_s`
    back (what a return that finds nothing makes wait)."""
    if requests.size == 0:
        return carried
    since = start if carried.since is None else carried.since
    end = start + requests.size * bucket_s
    new = requests[max(0, int((carried.counted_to - start) // bucket_s)):] if carried.counted_to is not None else requests
    carried = carried._replace(since=since, requests=carried.requests + float(new.sum()),
                               counted_to=max(end, carried.counted_to or end))
    busy = np.flatnonzero(requests > 0)
    if busy.size == 0:
        return carried
    pauses, silent = carried.pauses, carried.silent_since
    if silent is not None:
        back = busy[start + busy * bucket_s >= silent]
        if back.size and start + float(back[0]) * bucket_s - silent >= min_s:
            ended = start + float(back[0]) * bucket_s
            pauses = (pauses + ((ended, ended - silent, 0.0),))[-memory:]
    if pauses and pauses[-1][0] >= start:  # the requests of the lead back, as its buckets come in
        ended, length, got = pauses[-1]
        first = int((ended - start) // bucket_s)
        lead = float(requests[first:first + max(1, int(math.ceil(lead_s / bucket_s)))].sum())
        pauses = pauses[:-1] + ((ended, length, max(got, lead)),)
    last = start + (float(busy[-1]) + 1.0) * bucket_s
    return carried._replace(pauses=pauses, silent_since=max(last, silent or last), since=since)


class ReturnParams(Protocol):
    """The planner parameters `return_peak` reads (`forecasting.planner.PlannerParams`)."""

    @property
    def cold_start_budget(self) -> float: ...
    @property
    def pause_memory(self) -> int: ...


def _median_back(ps: tuple[Pause, ...]) -> float:
    """The median requests of the remembered pauses' first lead back: what a return brings before capacity can."""
    return float(np.median([p[2] for p in ps]))


def _cycle(carried: Pauses, memory: int) -> float | None:
    """The requests of a pause cycle: those counted over the span the remembered pauses came in, per pause (None: no
    pause remembered or no request counted)."""
    ps, since, to = carried.pauses, carried.since, carried.counted_to
    if not ps or not carried.requests > 0 or since is None or to is None or not to > since:
        return None
    first = since if len(ps) < memory else max(since, ps[0][0] - ps[0][1])
    return carried.requests * (to - first) / (to - since) / len(ps)


def hold_s(carried: Pauses, budget: float, memory: int, floor_s: float, ceiling_s: float) -> tuple[float, float | None]:
    """The learned hold, within [`floor_s`, `ceiling_s`], and the share of pauses the budget lets outlast it (None:
    no pause remembered, no request counted, or no budget)."""
    cycle = _cycle(carried, memory)
    if cycle is None or not 0 < budget < 1:
        return floor_s, None
    lengths = np.array([p[1] for p in carried.pauses])
    miss = _median_back(carried.pauses)  # the waits of a return that finds nothing
    alpha = budget * cycle / miss if miss > 0 else 1.0
    if alpha >= 1.0:
        return floor_s, alpha
    return min(ceiling_s, max(floor_s, float(np.quantile(lengths, 1.0 - alpha)))), alpha


def return_size(carried: Pauses, budget: float, memory: int) -> float:
    """The fewest requests of a lead back a held fall must serve so that the remembered returns' mean excess over
    them (what a return beyond the hold makes wait) is within the budget's share of a pause cycle: the whole
    distribution of the returns read at the budget, not its median (0: no pause remembered)."""
    if not carried.pauses:
        return 0.0
    cycle = _cycle(carried, memory)
    if cycle is None or not 0 < budget < 1:
        return _median_back(carried.pauses)
    back = np.sort(np.array([p[2] for p in carried.pauses]))
    # mean((back - s)+) is piecewise linear and falls as s rises: on [back[i-1], back[i]] it is
    # (sum(back[i:]) - (n - i) s) / n, so solve each segment and take the first whose root lies within it
    n = back.size
    roots = (np.cumsum(back[::-1])[::-1] - n * (budget * cycle)) / (n - np.arange(n))
    i = int(np.argmax(roots <= back))  # the last segment always holds its root
    return max(float(roots[i]), float(back[i - 1]) if i else 0.0)


def return_peak(carried: Pauses, expected: float, peak: float, lead_s: float, bucket_s: float, p: ReturnParams) -> float:
    """The peak in flight the returns bring in their first lead, sized at the budget (`return_size`), at the peak
    per request of a fall held by its recent level (`expected` requests per bucket bringing `peak`; 0: no pause
    remembered): the least a held fall keeps. The level's span slides into the silence, so read alone what a hold
    keeps shrinks as a pause lasts, while the returns come back at the rate they left (ServeGen's chunk-116 at 60
    s: 30-67 req/s met by 1-3 replicas). Read at the median of the returns (the last round), a return larger than
    the median still waited: chunk-116 at 60 s 0.2969% of its requests, 0.1376% read at the budget. It is not
    margined: it is read from what returns brought, not a forecast whose misses the margin answers for, and a
    margin wound up by the returns it could not see multiplied it (the median sized with the margin: chunk-116 at
    8.7 s spent 29% more GPU-hours for 18% fewer waits)."""
    if not carried.pauses or not expected > 0:
        return 0.0
    back = return_size(carried, p.cold_start_budget, p.pause_memory) / max(1, math.ceil(lead_s / bucket_s))
    return back * peak / expected


def silent_through(carried: Pauses, quiet_since: float | None, now: float, span_s: float) -> bool:
    """Whether an interruption that began at `quiet_since` has had no request since, and is within `span_s`."""
    s = carried.silent_since
    return quiet_since is not None and s is not None and s <= quiet_since and now - quiet_since <= span_s
