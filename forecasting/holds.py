"""The reactive mode holds its own recommendations for their lead.

Pure (no clock, no I/O). In reactive mode (the forecaster's recent forecasts were poor) the
planner still scales up on its forecast of the peak in flight, "N replicas within the
lead", but releases capacity only reactively. Its floor was the largest peak observed
within `stabilization_s`, sized; a forecast above what was observed (a burst's upper
quantile) was then dropped at the next step, before the lead it was made for had passed:
the replicas it had started were cancelled while loading, and the next burst started them
again (on Azure code, 136 starts in an hour to the HPA's 31). A recommendation is a claim
about the next lead, so it stands until that lead has passed: the floor is also the
largest target recommended by a step whose lead has not yet run out (the HPA keeps the
highest of its own recommendations over its window; this window is the forecast's own).

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
