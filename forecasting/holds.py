"""A planner's recommendation holds until its lead has passed, in either mode.

Pure (no clock, no I/O). Every step says "N replicas within the lead". Dropped at the next
step, before that lead has passed, the replicas a recommendation started were cancelled
while loading or retired just ready, and the next step's forecast started them again:
- in reactive mode (the forecaster's recent forecasts were poor) the planner scales up on
  its forecast of the peak in flight, but its floor was the peaks it had observed, so a
  forecast above them was dropped at once (Azure code at 8.7 s: a target of 17, then 8
  twenty seconds later, then 10 and 12; 136 starts in an hour to the HPA's 31);
- in predictive mode a fall was released as soon as one step's forecast over the next lead
  was below what was left, so the forecast's step-to-step noise moved the target by one
  up and down (ServeGen m-large over 14 days: 19,400 starts to the HPA's 9,300, 2.2x its
  starts per GPU-hour).
A recommendation is a claim about the next lead, so it stands as a floor until that lead
has passed: the target is never below the largest recommendation whose lead is still
running (the HPA keeps the highest of its own recommendations over a 300 s window; this
window is the forecast's own lead). A fall is then released at most one lead later.

`holds` is a tuple of (until, replicas), kept as a monotone queue: later entries have
later `until` and fewer replicas, so its first live entry is the largest.
"""

from __future__ import annotations

Holds = tuple[tuple[float, int], ...]


def held(holds: Holds, now: float) -> int:
    """The largest recommendation whose lead has not run out at `now` (0: none)."""
    return max((n for until, n in holds if until > now), default=0)


def record(holds: Holds, now: float, lead_s: float, replicas: int) -> Holds:
    """`holds` after a step at `now` recommended `replicas` within `lead_s`: expired entries and those the
    new one outlasts with at least as many replicas are dropped."""
    kept = tuple((u, n) for u, n in holds if u > now and n > replicas)
    return kept + ((now + lead_s, int(replicas)),)
