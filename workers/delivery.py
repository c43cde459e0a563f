"""Exactly-once effects over an at-least-once broker: the task outbox, settling, and its sweep.

Issue 20: across a Redis Sentinel failover a task could be lost. Replication is asynchronous,
so (a) a message a worker BRPOPed just before the primary died, whose unacked record had not
reached the replica, and (b) a producer's LPUSH the old primary acknowledged but had not yet
replicated, are both gone from the promoted replica. Three parts close that:

1. Producer (`PrewarmCelery.send_task`, every send of every process, retries included): before
   the message is published, the task (id, name, args, queue, attempt, sent and due times) is
   recorded in Redis and the write is WAITed onto a replica (`prewarm/registry/outbox.py`,
   `redis.wait_replicas`). A send that raises may still have been recorded, and then runs once.
2. Worker (`SettledTask.__call__`, around every task body): a delivery first asks whether the
   task was settled (a copy redelivered after it finished: skipped) or is running in another
   delivery (a copy delivered meanwhile: skipped), both counted in
   `prewarm_task_duplicates_total`; else it runs under a lease (refreshed while it runs, gone
   `agent.lock_ttl_s` after its holder stopped) and, once the body returned or failed for good,
   settles it: the done mark (SET NX) and the record's removal in one transaction. A retry
   (`Retry`), a requeue (`Reject(requeue=True)`) or a failure because Redis went away (a lost
   connection, seen in the chaos test as the primary died under a task) is not settled.
3. Sweep (`sweep`, the beat's `sweep_outbox` on the planner queue every
   `agent.outbox_sweep_interval_s`): records `agent.outbox_resend_after_s` past their due time
   whose task is neither settled, running, nor in the broker (its queue, or kombu's `unacked`
   hash) are published again with the same id and attempt, so the done mark still
   deduplicates. One ZRANGEBYSCORE when nothing is overdue; the broker is read only for
   overdue records. The rule is `prewarm.policy.outbox.sweep_action`.

The beat's periodic tasks (`names.PERIODIC`) skip all of this: their next tick re-sends them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import redis
from celery import Celery, Task
from celery.exceptions import Reject, Retry
from kombu import Queue
from kombu.exceptions import OperationalError

from prewarm.core.errors import failure_reason
from prewarm.core.metrics import Metrics
from prewarm.core.settings import Settings
from prewarm.policy.outbox import OutboxRecord, SweepAction, sweep_action
from prewarm.registry.connection import broker_client, replicated_writes, sync_client
from prewarm.registry.outbox import Begin, Outbox
from workers import context, names

log = logging.getLogger("prewarm.delivery")

#: kombu's Redis transport keeps the messages workers hold, unacked, in this hash (its `unacked_key`).
UNACKED_KEY = "unacked"
#: Overdue records one sweep looks at; the rest wait for the next one (the sweep stays cheap).
SWEEP_LIMIT = 200


class Delivery:
    """One app's outbox, its view of the broker and the leases its deliveries hold, built on first use
    (after a worker's fork). The leases are refreshed by one thread per process, every third of
    `agent.lock_ttl_s`, so a lease outlives a holder that died, or whose release Redis could not take
    (a failover), by at most `lock_ttl_s`: a copy of its task is then run again (by the sweep)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._outbox: Outbox | None = None
        self._broker: "redis.Redis[str] | None" = None
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[str, int]] = {}  # token -> (task id, attempt)
        self._keeper: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def lease_s(self) -> float:
        return self.settings.agent.lock_ttl_s

    def hold(self, task_id: str, retries: int, token: str) -> None:
        with self._lock:
            self._leases[token] = (task_id, retries)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="task-leases", daemon=True)
                self._keeper.start()

    def drop(self, token: str) -> None:
        with self._lock:
            self._leases.pop(token, None)

    def _keep(self) -> None:
        while not self._closed.wait(self.lease_s / 3):
            with self._lock:
                held = [(t, r, tok) for tok, (t, r) in self._leases.items()]
            try:
                self.outbox.refresh(held, lease_s=self.lease_s)
            except redis.RedisError as exc:  # Redis away: the leases run out, and their copies are run again
                log.warning("could not refresh %d task lease(s): %s", len(held), exc)

    @property
    def outbox(self) -> Outbox:
        with self._lock:
            if self._outbox is None:
                self._outbox = Outbox(sync_client(self.settings.redis), replicated_writes(self.settings.redis))
            return self._outbox

    @property
    def broker(self) -> "redis.Redis[str]":
        with self._lock:
            if self._broker is None:
                self._broker = broker_client(self.settings.redis)
            return self._broker

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._outbox is not None:
                self._outbox.client.close()
            if self._broker is not None:
                self._broker.close()
            self._outbox = self._broker = None


def _queue_name(queue: Any) -> str | None:
    if isinstance(queue, Queue):
        return str(queue.name)
    return str(queue) if queue else None


def _due_at(now: float, countdown: float | None, eta: datetime | str | None) -> float:
    if eta is not None:
        return (datetime.fromisoformat(eta) if isinstance(eta, str) else eta).timestamp()
    return now + float(countdown or 0.0)


class PrewarmCelery(Celery):
    """Celery whose `send_task` records a task in the outbox before it publishes it."""

    delivery: Delivery

    def send_task(self, name: str, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                  countdown: float | None = None, eta: datetime | None = None, task_id: str | None = None,
                  retries: int = 0, **options: Any) -> Any:
        task_id = task_id or str(uuid.uuid4())
        if name not in names.PERIODIC:
            now = time.time()
            queue = _queue_name(options.get("queue")) or names.route_task(name, args or (), kwargs or {}, options)["queue"]
            rec = OutboxRecord(task_id, name, queue, list(args or ()), dict(kwargs or {}), int(retries or 0),
                               sent_at=now, due_at=_due_at(now, countdown, eta))
            self.delivery.outbox.record(rec, resend_after_s=self.delivery.settings.agent.outbox_resend_after_s)
        return super().send_task(name, args, kwargs, countdown=countdown, eta=eta, task_id=task_id, retries=retries,
                                 **options)

    def close(self) -> None:
        self.delivery.close()
        super().close()


def lost_connection(exc: BaseException) -> bool:
    """Redis (or the broker) went away under the task: a failover, not a verdict on the task. Such a task is
    left unsettled (the sweep sends it again once Redis is back), whatever its own policy made of it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (redis.ConnectionError, redis.TimeoutError, OperationalError)):
            return True
        seen = seen.__cause__
    return False


def _outcome(result: Any) -> str:
    return str(result.get("outcome", "done")) if isinstance(result, dict) else "done"


class SettledTask(Task):
    """Every prewarm task's base: skip copies, run under a lease, settle once (module docstring, 2)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if self.name in names.PERIODIC or req.called_directly or req.is_eager or not req.id:
            return super().__call__(*args, **kwargs)
        app: PrewarmCelery = self.app
        outbox = app.delivery.outbox
        task_id, retries = str(req.id), int(req.retries or 0)
        token = f"{req.hostname}:{uuid.uuid4().hex}"
        verdict = outbox.begin(task_id, retries, token=token, lease_s=app.delivery.lease_s)
        if verdict is not Begin.RUN:
            context.current(app.delivery.settings).metrics.task_duplicates.labels(self.name).inc()
            if verdict is Begin.SETTLED:
                outbox.forget(task_id)  # a resend that crossed its settle must not leave a record behind
            log.info("%s[%s] is a duplicate (%s): this copy does nothing", self.name, task_id, verdict.value)
            return {"task_id": task_id, "outcome": "duplicate", "because": verdict.value}
        app.delivery.hold(task_id, retries, token)
        settle_as: str | None = None
        try:
            result = super().__call__(*args, **kwargs)
            settle_as = _outcome(result)
            return result
        except Retry:
            raise  # sent again (recorded again, the next attempt): not settled
        except Reject as rejected:
            if not rejected.requeue:
                settle_as = f"rejected: {rejected.reason}"
            raise
        except Exception as exc:
            if not lost_connection(exc):  # failed for good: acked as failed, the broker will not deliver it again
                settle_as = f"failed: {failure_reason(exc)}"
            raise
        finally:
            app.delivery.drop(token)
            self._end(outbox, task_id, retries, token, settle_as)

    def _end(self, outbox: Outbox, task_id: str, retries: int, token: str, settle_as: str | None) -> None:
        try:
            if settle_as is not None:
                outbox.settle(task_id, settle_as)
            outbox.release(task_id, retries, token=token)
        except redis.RedisError as exc:  # the record stays: the sweep sends it again, and its effect is idempotent
            log.warning("%s[%s]: could not %s (%s); its lease runs out within %.0fs and the outbox sweep sends it "
                        "again", self.name, task_id, "settle" if settle_as else "release its lease", exc,
                        self.app.delivery.lease_s)


def _holds(raw: str, ids: set[str]) -> str | None:
    """The task id a kombu message (JSON, possibly wrapped in [message, exchange, key]) carries, if in `ids`."""
    try:
        msg = json.loads(raw)
    except ValueError:
        return None
    if isinstance(msg, list) and msg:
        msg = msg[0]
    headers = msg.get("headers") if isinstance(msg, dict) else None
    found = headers.get("id") if isinstance(headers, dict) else None
    return found if found in ids else None


def in_broker(broker: "redis.Redis[str]", recs: Iterable[OutboxRecord]) -> set[str]:
    """The ids of these tasks that the broker still holds: queued in their queue, or unacked by a worker."""
    by_queue: dict[str, set[str]] = {}
    for rec in recs:
        by_queue.setdefault(rec.queue, set()).add(rec.task_id)
    wanted = set().union(*by_queue.values()) if by_queue else set()
    found: set[str] = set()
    for queue, ids in by_queue.items():
        for raw in broker.lrange(queue, 0, -1):
            hit = _holds(raw, ids)
            if hit:
                found.add(hit)
    if wanted - found:
        for _, raw in broker.hscan_iter(UNACKED_KEY, count=500):
            hit = _holds(raw, wanted - found)
            if hit:
                found.add(hit)
    return found


def sweep(app: PrewarmCelery, metrics: Metrics, *, now: float) -> dict[str, Any]:
    """One sweep of the outbox (module docstring, 3). Returns what it did, by task id."""
    delivery = app.delivery
    outbox = delivery.outbox
    resend_after = delivery.settings.agent.outbox_resend_after_s
    recs = outbox.due(now, SWEEP_LIMIT)
    report: dict[str, Any] = {"resent": [], "later": [], "forgotten": []}
    if not recs:
        return report
    facts = outbox.facts(recs)
    open_recs = [rec for rec, (settled, running) in zip(recs, facts) if not settled and not running]
    present = in_broker(delivery.broker, open_recs) if open_recs else set()
    for rec, (settled, running) in zip(recs, facts):
        action = sweep_action(settled=settled, running=running, in_broker=rec.task_id in present)
        if action is SweepAction.FORGET:
            outbox.forget(rec.task_id)
            report["forgotten"].append(rec.task_id)
        elif action is SweepAction.LATER:
            outbox.postpone(rec.task_id, now + resend_after)
            report["later"].append(rec.task_id)
        else:
            log.warning("%s[%s] (attempt %d, sent %.0fs ago) is neither settled, running nor in the broker: "
                        "lost in a failover, sent again", rec.name, rec.task_id, rec.retries, now - rec.sent_at)
            app.send_task(rec.name, args=list(rec.args), kwargs=dict(rec.kwargs), task_id=rec.task_id,
                          retries=rec.retries, queue=rec.queue)
            metrics.outbox_resent.labels(rec.name).inc()
            report["resent"].append(rec.task_id)
    return report
