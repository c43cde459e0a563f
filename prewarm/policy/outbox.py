"""The task outbox's rules: what an outbox record is, when a sent task is sent again, how many
replicas a write waits for.

Issue 20: across a Redis Sentinel failover a Celery task could vanish. Replication is
asynchronous, so a producer's LPUSH the old primary acknowledged, or a worker's BRPOP whose
unacked record had not reached the replica, is gone from the promoted one. The outbox
(`prewarm/registry/outbox.py`, wired in `workers/delivery.py`) records every task before it is
published, on a replica too (Redis WAIT); the worker that settles the task removes the record;
a sweep sends again, with the same task id, what is recorded but neither settled, running nor
in the broker. These functions decide; the adapters only read facts and carry out the verdict.
Pure: no I/O, `now` passed in.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping, Sequence

from prewarm.core.errors import InvalidPayload


@dataclass(frozen=True)
class OutboxRecord:
    """A sent task as the outbox keeps it: enough to publish it again, with the same id."""

    task_id: str
    name: str
    queue: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    retries: int = 0  # the attempt the message carries (a retry is sent again as the same attempt)
    sent_at: float = 0.0  # epoch seconds
    due_at: float = 0.0  # when it may run (sent_at, or its countdown/ETA)

    def __post_init__(self) -> None:
        for name in ("task_id", "name", "queue"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidPayload(f"outbox record: {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise InvalidPayload(f"outbox record {self.task_id}: retries must be an integer >= 0, got {self.retries!r}")
        for name in ("sent_at", "due_at"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidPayload(f"outbox record {self.task_id}: {name} must be a finite number, got {value!r}")

    def to_json(self) -> str:
        data = asdict(self)
        data["args"] = list(self.args)
        data["kwargs"] = dict(self.kwargs)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> "OutboxRecord":
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(f"outbox record is not JSON: {raw!r:.200}") from exc
        if not isinstance(data, dict):
            raise InvalidPayload(f"outbox record must be a JSON object, got {raw!r:.200}")
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InvalidPayload(f"outbox record has unknown fields {sorted(unknown)}")
        if not isinstance(data.get("args", []), list) or not isinstance(data.get("kwargs", {}), dict):
            raise InvalidPayload(f"outbox record {data.get('task_id')!r}: args must be a list and kwargs an object")
        try:
            return cls(**data)
        except TypeError as exc:  # a field missing
            raise InvalidPayload(f"outbox record {data.get('task_id')!r}: {exc}") from exc

    def check_at(self, resend_after_s: float) -> float:
        """When the sweep first looks at it: `resend_after_s` past the time it was due."""
        return max(self.sent_at, self.due_at) + resend_after_s


class SweepAction(str, Enum):
    FORGET = "forget"  # settled (its settle lost the race with the record, or the record outlived it): drop it
    LATER = "later"  # running, or still in the broker (queued, or held unacked by a worker): look again later
    RESEND = "resend"  # neither settled, running nor in the broker: the failover lost it; publish it again


def sweep_action(*, settled: bool, running: bool, in_broker: bool) -> SweepAction:
    """What the sweep does with a record past its check time, from what Redis says of its task."""
    if settled:
        return SweepAction.FORGET
    if running or in_broker:
        return SweepAction.LATER
    return SweepAction.RESEND


@dataclass(frozen=True)
class ReplicaShortfall:
    """A WAIT that got fewer replicas than asked: how many answered, and when."""

    acked: int
    at: float  # monotonic seconds


def replicas_to_wait(required: int, shortfall: ReplicaShortfall | None, *, now: float, recheck_s: float) -> int:
    """How many replicas the next WAIT asks for.

    `required` normally. After a WAIT that got only `acked` (a Sentinel group whose old primary
    is dead has no replica until it returns), ask for `acked` until `recheck_s` has passed, then
    for `required` again: a group short of replicas costs one WAIT timeout per `recheck_s`, not
    one per write, and a replica that comes back is waited for again within `recheck_s`."""
    if required < 0:
        raise ValueError(f"required replicas must be >= 0, got {required}")
    if shortfall is None or now - shortfall.at >= recheck_s:
        return required
    return min(required, shortfall.acked)
