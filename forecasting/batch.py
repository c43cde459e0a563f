"""Scheduled batch jobs: rises the planner knows of in advance, from their cron expression.

A job needs `replicas` more replicas for `duration_s` from each cron time; the planner
(`forecasting.planner.step`) adds them a lead ahead, on top of the load before the run
(never on top of a forecast that already holds it), and puts the known rises into the
target schedule it records for KEDA and the HPA. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from croniter import croniter

from prewarm.core.domain import ModelSpec
from prewarm.core.errors import InvalidPayload


@dataclass(frozen=True)
class BatchJob:
    """A scheduled batch job: at each cron time it needs `replicas` more for `duration_s`."""

    cron: str
    model: str  # a model name or a model key (name@revision)
    replicas: int
    duration_s: float
    name: str = ""

    def __post_init__(self) -> None:
        if not croniter.is_valid(self.cron):
            raise InvalidPayload(f"batch job {self.name or self.model!r}: invalid cron expression {self.cron!r}")
        if self.replicas <= 0:
            raise InvalidPayload(f"batch job {self.name or self.model!r}: replicas must be > 0, got {self.replicas}")
        if self.duration_s <= 0:
            raise InvalidPayload(f"batch job {self.name or self.model!r}: duration_s must be > 0, got {self.duration_s}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "BatchJob":
        try:
            return cls(cron=str(data["cron"]), model=str(data["model"]), replicas=int(data["replicas"]),
                       duration_s=float(data["duration_s"]), name=str(data.get("name", "")))
        except KeyError as exc:
            raise InvalidPayload(f"batch job is missing field {exc.args[0]!r}") from exc

    def applies_to(self, model: ModelSpec) -> bool:
        return self.model in (model.name, model.key)


def batch_replicas(jobs: Sequence[BatchJob], model: ModelSpec, lo: float, hi: float) -> tuple[int, float]:
    """The most replicas batch jobs of `model` need at once within [lo, hi), and when the earliest
    of those runs started (or starts)."""
    spans: list[tuple[float, float, int]] = []
    for job in jobs:
        if not job.applies_to(model):
            continue
        it = croniter(job.cron, datetime.fromtimestamp(lo - job.duration_s, tz=timezone.utc))
        while True:
            fire = float(it.get_next(float))
            if fire >= hi:
                break
            if fire + job.duration_s > lo:
                spans.append((fire, fire + job.duration_s, job.replicas))
    best = 0
    for s, _, _ in spans:
        t = max(s, lo)
        best = max(best, sum(r for a, b, r in spans if a <= t < b))
    return best, min((s for s, _, _ in spans), default=hi)


def batch_schedule(jobs: Sequence[BatchJob], model: ModelSpec, now: float, lead: float, horizon_s: float,
                   forecast_need: int, base: int, pool: int) -> tuple[tuple[float, int], ...]:
    """Later targets the planner already knows of (due epoch s, replicas): each run of a job within `horizon_s`
    is due one lead ahead of its start and ends with it: `forecast_need` (the forecast part, held as now; the
    next step re-plans) or `base` (the load before the run) plus the run's replicas, whichever is more, plus
    the warm `pool`."""
    times: set[float] = set()
    for job in jobs:
        if not job.applies_to(model):
            continue
        it = croniter(job.cron, datetime.fromtimestamp(now + lead, tz=timezone.utc))
        while True:
            fire = float(it.get_next(float))
            if fire > now + lead + horizon_s:
                break
            times.update((fire - lead, fire + job.duration_s))
    out = []
    for t in sorted(times):
        batch, _ = batch_replicas(jobs, model, t, t + lead + 1.0)
        out.append((t, max(forecast_need, base + batch) + pool))
    return tuple(out)
