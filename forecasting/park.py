"""Parking: a replica the forecast needs again soon is put to sleep instead of retired.

Pure (no clock, no I/O). A scale-down releases replicas the forecast does not need over
the next lead. Retired, a replica needed again later pays a full cold start; parked asleep
(engine level-1 sleep: weights to host memory, GPU freed) it comes back in its wake time,
a fraction of a load. `planner.park_horizon_s` says how far ahead "again soon" reaches: a
replica needed within it is parked, one that is not is retired (its host memory is better
spent on other models). Off (0) by default.

How much is needed within the horizon comes from the learned daily profile: the level of
the last minute scaled by the profile's highest point in (now + lead, now + horizon]
relative to now (`Profile.ratio`: each read no lower than the profile can tell from zero).
No profile learned (less than its days of history), or one that saw no traffic now: nothing
is parked, as the planner cannot say the need comes back.
"""

from __future__ import annotations

import numpy as np

from forecasting.forecast.nowcast import Profile

__all__ = ["need_within", "park_count"]


def need_within(profile: Profile | None, level: float, now: float, lead_s: float, horizon_s: float) -> float | None:
    """The mean load in flight the profile expects at its highest in (now + lead, now + horizon], from the
    level now (None: no profile, or a horizon within the lead)."""
    if profile is None or horizon_s <= lead_s or not level >= 0:
        return None
    if not float(profile.at(np.array([now]))[0]) > 0:
        return None
    ts = np.arange(now + lead_s, now + horizon_s + profile.bin_s, profile.bin_s)
    return level * float(profile.ratio(ts, np.array([now])).max())


def park_count(scale_down: int, loading: int, target: int, asleep: int, need_horizon: int) -> int:
    """How many of a scale-down's replicas to park asleep: ready ones only (loading ones are cancelled),
    as many as the horizon needs back beyond the target and the replicas already asleep."""
    ready_released = max(0, scale_down - loading)
    return max(0, min(ready_released, need_horizon - target - asleep))
