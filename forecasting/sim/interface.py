"""The interface between the replay and a scaling policy: what a policy knows, sees and answers.

Policies (`forecasting.sim.policies`) and the engine (`forecasting.sim.simulate`) both import
this module and not each other.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from forecasting.sim.workload import SimParams, Workload


@dataclass(frozen=True)
class Observation:
    """What a policy sees at a decision: only the past and present."""

    now: float
    ready: int
    loading: int
    load_mean: float  # mean busy slots + queued requests since the policy's last decision
    arrivals: float  # requests that arrived since the last decision
    period_s: float
    cold_start_p95_s: float | None = None  # p95 of the cold starts completed so far (None: none yet), as measured live
    waited: float = 0.0  # requests that waited for capacity longer than the wait threshold since the last decision


@dataclass(frozen=True, eq=False)
class PolicyEnv:
    """What a policy knows before the replay: the replica model, and the past on request."""

    work: Workload
    params: SimParams

    def past_counts(self, now: float) -> np.ndarray:
        """Arrivals per second strictly before `now` (read-only): all a policy may look at."""
        view = self.work.counts[: max(0, int(math.floor(now)))]
        view.flags.writeable = False
        return view

    def initial_load(self) -> float:
        """Busy slots in the first minute: every policy starts as if it had been running."""
        head = self.work.counts[:60]
        return float(head.mean() * self.work.mean_service_s) if head.size else 0.0


class Policy(ABC):
    name: str = "policy"
    period_s: float = 15.0

    @abstractmethod
    def start(self, env: PolicyEnv) -> int:
        """Replicas ready at time 0."""

    @abstractmethod
    def decide(self, obs: Observation) -> int:
        """Live replicas wanted now."""
