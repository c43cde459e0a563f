"""How many replicas of a warm model serve its traffic in the pool replay, and who waits for them.

The pool replay (`forecasting.fleet.simulate`) runs several replicas of a busy model, so a
model's throughput is charged as well as its warmth. Two pure pieces:

- `HpaCounts`: the replicas a Kubernetes HPA gives a warm model from its observed request
  rate (desired = ceil(rate / (capacity x target utilisation)), scale-down stabilised over
  a window: the maximum desired count over it, as the HPA's default 300 s window does).
  Every policy's warm models are sized this way, except those a policy sizes itself (the
  fleet planner's dense models, which the count planner sizes);
- `capacity_waits`: a per-step fluid queue per model. Arrivals come evenly at ``lam``
  requests/s, the ready replicas serve ``mu`` requests/s, and ``backlog`` requests wait at
  the step's start, so the queue is ``max(0, backlog + (lam - mu) s)`` at ``s`` seconds in
  and an arrival then waits ``queue / mu``. An arrival waits for capacity when that is over
  the wait threshold (the gateway's `waited` counter).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class HpaCounts:
    """The replicas an HPA gives each model from the rates of the steps already replayed."""

    def __init__(self, capacity_rps: np.ndarray, step_s: float, *, target: float = 0.7,
                 scale_down_s: float = 300.0) -> None:
        if not 0 < target <= 1:
            raise ValueError(f"the HPA's target utilisation must be within (0, 1], got {target}")
        self.per_replica = np.asarray(capacity_rps, dtype=np.float64) * target
        self.step_s = step_s
        self.recent: deque[np.ndarray] = deque(maxlen=max(1, int(math.ceil(scale_down_s / step_s))))

    def observe(self, counts: np.ndarray) -> None:
        """A step's requests per model (the HPA's metric: the rate it saw)."""
        self.recent.append(np.ceil(np.asarray(counts, dtype=np.float64) / self.step_s / self.per_replica - 1e-9))

    def desired(self) -> np.ndarray:
        """Replicas per model for the next step (at least 1: a warm model has one)."""
        if not self.recent:
            return np.ones(self.per_replica.size, dtype=np.int64)
        return np.maximum(1, np.max(np.stack(self.recent), axis=0)).astype(np.int64)


def capacity_waits(backlog: np.ndarray, lam: np.ndarray, mu: np.ndarray, dt: float,
                   threshold_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per model over one step of ``dt`` s: (requests that wait longer than ``threshold_s`` for a ready
    replica's slot, their mean wait in s, the backlog left at the step's end)."""
    slope = lam - mu
    thr = threshold_s * mu
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = np.where(slope != 0, (thr - backlog) / slope, np.inf)
    # the span of the step during which the queue stands above the threshold
    rising = np.where(slope > 0, dt - np.clip(cross, 0.0, dt), 0.0)
    falling = np.where(slope < 0, np.clip(cross, 0.0, dt), 0.0)
    flat = np.where((slope == 0) & (backlog > thr), dt, 0.0)
    span = np.where(mu > 0, rising + falling + flat, dt)
    waited = np.minimum(lam * span, lam * dt)
    end = np.maximum(0.0, backlog + slope * dt)
    # the queue over the span is linear: its mean is the mean of its two ends there
    q_from = np.where(slope > 0, np.maximum(thr, backlog), backlog)
    q_to = np.where(slope > 0, end, np.maximum(thr, backlog + slope * span))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_wait = np.where((span > 0) & (mu > 0), (q_from + q_to) / 2.0 / mu, 0.0)
    return waited, mean_wait, end


def throughput_gb(mem_gb: np.ndarray, capacity_rps: np.ndarray, counts: np.ndarray, step_s: float, *,
                  target: float, q: float) -> float:
    """The GPU memory of the replicas beyond each model's first that its busy steps need (the ``q`` quantile of
    its rate over the HPA's per-replica rate): what a pool sized for its tiers adds for throughput."""
    if counts.size == 0:
        return 0.0
    rate = np.quantile(np.asarray(counts, dtype=np.float64), q, axis=0) / step_s
    need = np.ceil(rate / (np.asarray(capacity_rps) * target) - 1e-9)
    return float((np.asarray(mem_gb) * np.maximum(0.0, need - 1.0)).sum())
