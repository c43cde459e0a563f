"""The planner's replica target per model, as recorded in Redis: written by the planner, read by
whatever carries it to Kubernetes (the KEDA external scaler, the HPA's external metric).

The planner (`workers.planning.forecast.plan_model`) records, in its per-model record
(`keys.last_forecast(model)`), a step schedule of replica counts: the count it wants serving
now (warm pool included; 0 is a real value: nothing wanted, KEDA may deactivate the
Deployment) and each later count with the time it is due. Scale-ups are due one lead
(measured cold start plus margin) ahead of the forecast need, so the schedule already holds
"the rise a lead ahead". The planner runs every `planner.interval_s`, while KEDA and the HPA
ask every few seconds; reading the schedule at the reader's `now` hands over a rise that
falls due between two planning rounds on time. Reading a step function is a lookup, not a
decision: the numbers are the planner's.

This module is the one place that knows the record's target fields: a change of their shape
is one edit here. A record older than `max_age_s` (the planner stopped) is refused with
`TargetStale` rather than served, so KEDA applies its `fallback` and the HPA keeps its
last count instead of following a plan nobody renews.

A record is checked before a number of it is served (issue 20): its time must be finite and
not ahead of the reader's clock by more than `max_age_s` (the planner's and the scaler's
clocks may disagree a little; a record from further in the future is a broken clock or a
broken record, and would otherwise never turn stale), and every count must be a whole number
from 0 to `MAX_REPLICAS`. A record that fails is refused as unreadable (`TargetUnknown`,
UNAVAILABLE to KEDA, so its `fallback` applies), never half-served: NaN, 1.5 or 1e300 used to
escape as an unhandled error (gRPC UNKNOWN), and 1e300 made `IsActive` say true while
`GetMetrics` failed.

A rollout across two Deployments of one model (stable and canary, issue 19) needs one target
each: the planner also records a target per revision (`keys.revision_target(model, revision)`,
the same fields, checked the same way): each revision's share while a rollout runs, and the
model's whole target for the revision it plans otherwise. `read_target(..., revision=R)` serves
it; a revision the planner never recorded is `TargetUnknown`, as an unknown model is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import redis

from prewarm.core import keys
from prewarm.core.errors import RegistryUnavailable, TemporaryError

#: Fields of the planner record (`keys.last_forecast(model)`) this module owns.
TARGET_FIELD = "target"  # the count wanted at planning time
SCHEDULE_FIELD = "target_schedule"  # JSON [[due epoch s, replicas], ...], ascending
PLANNED_AT_FIELD = "target_at"  # when the planner wrote the schedule (epoch s); its own field, because a
# failed planning round rewrites the record's "at" and status but leaves the last schedule
AWAKE_FIELD = "target_awake"  # of the pods wanted now, how many awake (the rest parked asleep by the pod warmer)

#: The largest count served: a Deployment's replicas are an int32 in Kubernetes.
MAX_REPLICAS = 2**31 - 1

#: Every Redis error that means "cannot reach Redis now".
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


class TargetUnknown(TemporaryError):
    """No planner record with a target exists (yet) for the model."""


class TargetStale(TemporaryError):
    """The planner's record is older than the reader accepts: the planner stopped renewing it."""


@dataclass(frozen=True)
class ReplicaTarget:
    model: str
    replicas: int  # what the planner wants running now (0: none)
    planned_at: float  # when the planner wrote the schedule
    age_s: float  # now - planned_at
    next_at: float | None  # when the count changes next (None: not within the planned horizon)
    next_replicas: int | None
    awake: int = 0  # of `replicas`, how many the planner wants awake now (the others asleep)
    revision: str | None = None  # the revision whose record this is (None: the model's own record)

    @property
    def active(self) -> bool:
        """KEDA's activation: the Deployment is wanted at all."""
        return self.replicas > 0


def schedule_fields(schedule: Sequence[tuple[float, int]], *, planned_at: float,
                    awake: int | None = None) -> dict[str, str]:
    """The record fields for a schedule (first step: now) and how many of the pods wanted now are awake
    (None: all). The writer side of `read_target`."""
    if not schedule:
        raise ValueError("a target schedule needs at least the step for now")
    steps = [[float(t), max(0, int(n))] for t, n in sorted(schedule)]
    now_awake = steps[0][1] if awake is None else min(steps[0][1], max(0, int(awake)))
    return {TARGET_FIELD: str(steps[0][1]), SCHEDULE_FIELD: json.dumps(steps), PLANNED_AT_FIELD: repr(planned_at),
            AWAKE_FIELD: str(now_awake)}


def _count(value: Any) -> int:
    """A replica count from the record: a whole number in 0..MAX_REPLICAS, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"count {value!r} is not a number")
    number = value
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        raise ValueError(f"count {value!r} is not a whole number")
    if not 0 <= number <= MAX_REPLICAS:
        raise ValueError(f"count {value!r} is outside 0..{MAX_REPLICAS}")
    return int(number)


def parse_steps(schedule: str | None, target: str | None, planned_at: float) -> list[tuple[float, int]]:
    """The schedule's steps, each checked (finite due time, whole count in range); ValueError naming the fault."""
    raw: Any = json.loads(schedule) if schedule else [[planned_at, float(str(target))]]
    if not isinstance(raw, list) or not raw:
        raise ValueError("empty or malformed schedule")
    steps = []
    for step in raw:
        if not isinstance(step, list) or len(step) != 2:
            raise ValueError(f"schedule step {step!r} is not [due, count]")
        due = float(step[0])
        if not math.isfinite(due):
            raise ValueError(f"schedule step {step!r} has no finite due time")
        steps.append((due, _count(step[1])))
    return steps


def step_at(steps: Sequence[Sequence[float]], now: float) -> tuple[int, float | None, int | None]:
    """The count of the last step due at or before `now` (the first step when none is), and the next change."""
    current = int(steps[0][1])
    for i, (t, n) in enumerate(steps):
        if t > now:
            nxt = next(((float(tt), int(nn)) for tt, nn in steps[i:] if int(nn) != current), None)
            return current, nxt[0] if nxt else None, nxt[1] if nxt else None
        current = int(n)
    return current, None, None


def read_target(client: "redis.Redis[str]", model: str, *, now: float, max_age_s: float,
                revision: str | None = None) -> ReplicaTarget:
    """The planner's target for `model` (or for one `revision` of it) at `now`; TargetUnknown, TargetStale or
    RegistryUnavailable otherwise."""
    key = keys.last_forecast(model) if revision is None else keys.revision_target(model, revision)
    what = f"model {model!r}" if revision is None else f"revision {revision!r} of model {model!r}"
    try:
        raw: list[str | None] = client.hmget(key, [SCHEDULE_FIELD, TARGET_FIELD, PLANNED_AT_FIELD, AWAKE_FIELD])
    except _REDIS_DOWN as exc:
        raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc
    schedule, target, at, awake = raw
    if at is None or (schedule is None and target is None):
        if revision is None:
            raise TargetUnknown(f"no planner target recorded for {what} (is the planner running and "
                                f"planning it? PREWARM_PLANNER_MODELS)", retry_after=5.0)
        raise TargetUnknown(f"no planner target recorded for {what} (the planner records one for the revision "
                            f"it plans, PREWARM_PLANNER_MODELS, and for both revisions of a running rollout)",
                            retry_after=5.0)
    try:
        planned_at = float(at)
        if not math.isfinite(planned_at):
            raise ValueError(f"{PLANNED_AT_FIELD} {at!r} is not a finite time")
        steps = parse_steps(schedule, target, planned_at)
    except (ValueError, TypeError) as exc:
        raise TargetUnknown(f"the planner record of {what} holds no readable target: {exc}") from exc
    age = now - planned_at
    if age < -max_age_s:
        raise TargetUnknown(f"the planner record of {what} was written {-age:.0f}s in the future (more than "
                            f"{max_age_s:.0f}s ahead of this clock): a broken clock or record", retry_after=5.0)
    if age > max_age_s:
        raise TargetStale(f"the planner's target for {what} is {age:.0f}s old (more than {max_age_s:.0f}s): "
                          f"the planner is not renewing it", retry_after=5.0)
    replicas, next_at, next_replicas = step_at(steps, now)
    # the recorded split is the planning step's; a later step of the schedule (a batch rise) is wanted awake
    first_step = len(steps) == 1 or float(steps[1][0]) > now
    now_awake = min(replicas, int(awake)) if first_step and awake is not None and awake.isdigit() else replicas
    # a record a little ahead (clocks within max_age_s of each other) is fresh: age 0, never negative
    return ReplicaTarget(model, replicas, planned_at, max(0.0, age), next_at, next_replicas, now_awake, revision)


def write_revision_target(client: "redis.Redis[str]", model: str, revision: str, fields: dict[str, str]) -> None:
    """Record one revision's target (`schedule_fields`), renewing the record's expiry."""
    key = keys.revision_target(model, revision)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)  # a record is the writer's whole answer: no field of an older one survives
    pipe.hset(key, mapping=fields)
    pipe.expire(key, keys.REVISION_TARGET_TTL_S)
    pipe.execute()


def recorded_models(client: "redis.Redis[str]") -> list[str]:
    """Models that have a planner record (whether or not it holds a target)."""
    prefix = keys.last_forecast("")
    try:
        return sorted(k[len(prefix):] for k in client.scan_iter(match=prefix + "*", count=200))
    except _REDIS_DOWN as exc:
        raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc


def recorded_revisions(client: "redis.Redis[str]") -> list[tuple[str, str]]:
    """(model, revision) of every revision target record."""
    prefix = keys.revision_target("", "")[:-1]  # "...:revtarget:"
    try:
        found = [k[len(prefix):] for k in client.scan_iter(match=prefix + "*", count=200)]
    except _REDIS_DOWN as exc:
        raise RegistryUnavailable(f"registry unavailable: {exc}", retry_after=1.0) from exc
    return sorted((m, r) for m, _, r in (k.rpartition("@") for k in found) if m and r)
