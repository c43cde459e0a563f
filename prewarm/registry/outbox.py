"""The task outbox in Redis: sent tasks recorded before they are published, settled once.

- `record`: the producer writes the record (`keys.OUTBOX`) and its check time
  (`keys.OUTBOX_DUE`), then WAITs for the replicas (`prewarm/registry/replication.py`),
  before the message is published: a failover after that finds the record on the promoted
  replica even when the message itself is lost.
- `begin`: a delivery starts one attempt of a task; one Lua call says whether it runs, was
  settled already (a redelivered copy) or is running in another delivery (a copy delivered
  meanwhile). Running takes a lease (`keys.task_running`) that the delivery refreshes while it
  runs (`refresh`, one call for all of a process's leases) and releases at its end.
- `settle`: the delivery that finished the task sets its done mark (`keys.task_done`, SET NX)
  and removes the record, in one transaction.
- `due` / `postpone` / `forget`: what the sweep reads and writes (the rule is
  `prewarm.policy.outbox.sweep_action`; the sweep is `workers/delivery.py`).

Keys live in the registry's database; what the broker holds is the broker's (kombu's lists
and its `unacked` hash), read by the sweep.
"""

from __future__ import annotations

import logging
from enum import Enum

import redis

from prewarm.core import keys
from prewarm.core.errors import InvalidPayload
from prewarm.policy.outbox import OutboxRecord
from prewarm.registry.replication import ReplicatedWrites

log = logging.getLogger("prewarm.registry.outbox")

#: 'settled' if the task's done mark exists; else take the attempt's lease ('run') or say it is held ('running').
_BEGIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'settled' end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'run' end
return 'running'
"""

#: Release an attempt's lease only if this delivery holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


#: Extend every lease this process still holds (KEYS[i] held with ARGV[i + 1]) to ARGV[1] ms; the count extended.
_REFRESH = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    n = n + 1
  end
end
return n
"""


class Begin(str, Enum):
    RUN = "run"  # this delivery runs the task (and holds the attempt's lease)
    SETTLED = "settled"  # the task was settled before: a redelivered copy, does nothing
    RUNNING = "running"  # another delivery runs this attempt now: a copy, does nothing


class Outbox:
    def __init__(self, client: "redis.Redis[str]", writes: ReplicatedWrites) -> None:
        self.client = client
        self.writes = writes
        self._begin = client.register_script(_BEGIN)
        self._release = client.register_script(_RELEASE)
        self._refresh = client.register_script(_REFRESH)

    # --- producer ---------------------------------------------------------------------
    def record(self, rec: OutboxRecord, *, resend_after_s: float) -> int | None:
        """Record a task about to be published; returns the replicas that have the record (None: none asked)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.OUTBOX, rec.task_id, rec.to_json())
        pipe.zadd(keys.OUTBOX_DUE, {rec.task_id: rec.check_at(resend_after_s)})
        _, acked = self.writes.execute(pipe)
        return acked

    # --- worker -----------------------------------------------------------------------
    def begin(self, task_id: str, retries: int, *, token: str, lease_s: float) -> Begin:
        verdict = self._begin(keys=[keys.task_done(task_id), keys.task_running(task_id, retries)],
                              args=[token, max(1, int(lease_s * 1000))])
        return Begin(verdict)

    def release(self, task_id: str, retries: int, *, token: str) -> None:
        self._release(keys=[keys.task_running(task_id, retries)], args=[token])

    def refresh(self, leases: list[tuple[str, int, str]], *, lease_s: float) -> int:
        """Extend the leases (task id, attempt, token) still held by their tokens; returns how many were."""
        if not leases:
            return 0
        return int(self._refresh(keys=[keys.task_running(t, r) for t, r, _ in leases],
                                 args=[max(1, int(lease_s * 1000)), *(tok for _, _, tok in leases)]))

    def settle(self, task_id: str, outcome: str) -> bool:
        """Mark the task done (first settle wins) and drop its record. True if this call set the mark."""
        pipe = self.client.pipeline(transaction=True)
        pipe.set(keys.task_done(task_id), outcome[:200], nx=True, ex=keys.TASK_DELIVERIES_TTL_S)
        pipe.hdel(keys.OUTBOX, task_id)
        pipe.zrem(keys.OUTBOX_DUE, task_id)
        return bool(pipe.execute()[0])

    def settled(self, task_id: str) -> str | None:
        return self.client.get(keys.task_done(task_id))

    # --- sweep ------------------------------------------------------------------------
    def due(self, now: float, limit: int) -> list[OutboxRecord]:
        """Records whose check time has come (oldest first). An unreadable record is dropped, logged."""
        ids = self.client.zrangebyscore(keys.OUTBOX_DUE, "-inf", now, start=0, num=limit)
        if not ids:
            return []
        raws = self.client.hmget(keys.OUTBOX, ids)
        out = []
        for task_id, raw in zip(ids, raws):
            if raw is None:  # settled between the two reads, or a record whose write broke off
                self.client.zrem(keys.OUTBOX_DUE, task_id)
                continue
            try:
                out.append(OutboxRecord.from_json(raw))
            except InvalidPayload as exc:
                log.error("outbox record %s is unreadable and dropped: %s", task_id, exc)
                self.forget(task_id)
        return out

    def facts(self, recs: list[OutboxRecord]) -> list[tuple[bool, bool]]:
        """(settled, running) for each record, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for rec in recs:
            pipe.exists(keys.task_done(rec.task_id))
            pipe.exists(keys.task_running(rec.task_id, rec.retries))
        flat = pipe.execute()
        return [(bool(flat[2 * i]), bool(flat[2 * i + 1])) for i in range(len(recs))]

    def postpone(self, task_id: str, at: float) -> None:
        self.client.zadd(keys.OUTBOX_DUE, {task_id: at}, xx=True)

    def forget(self, task_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(keys.OUTBOX, task_id)
        pipe.zrem(keys.OUTBOX_DUE, task_id)
        pipe.execute()

    def size(self) -> int:
        return int(self.client.hlen(keys.OUTBOX))
