"""The per-replica work lock on a real Redis: refreshed while its owner works, handed to nobody by accident."""

from __future__ import annotations

import time

import redis

from prewarm.core import keys
from tests.celery_helpers import wait_for
from workers.node.lock import ReplicaLock

RID = "tiny@r1/n1/0"


def test_a_lock_that_expired_while_nobody_took_it_is_taken_back_not_lost(redis_client: "redis.Redis[str]") -> None:
    """A starved refresh (the node loaded) let the TTL pass: stepping aside left the replica pending with no
    task on it (seen in CI, a vLLM replica under load). Nobody held it, so its owner takes it back."""
    lock = ReplicaLock(redis_client, RID, "task-a", ttl_s=0.3)
    assert lock.acquire(deadline=time.monotonic() + 1)
    with lock:
        redis_client.delete(keys.replica_lock(RID))  # as if the TTL had passed before the refresh ran
        wait_for(lambda: redis_client.get(keys.replica_lock(RID)) == "task-a", 5, "the lock taken back", poll=0.02)
        time.sleep(0.4)  # more than a TTL: it is refreshed again, and never reported lost
        assert not lock.lost.is_set() and redis_client.get(keys.replica_lock(RID)) == "task-a"
    assert redis_client.get(keys.replica_lock(RID)) is None  # released


def test_a_lock_another_task_took_is_lost_and_left_to_it(redis_client: "redis.Redis[str]") -> None:
    lock = ReplicaLock(redis_client, RID, "task-a", ttl_s=0.3)
    assert lock.acquire(deadline=time.monotonic() + 1)
    with lock:
        redis_client.set(keys.replica_lock(RID), "task-b", px=5000)  # expired, and a redelivered task took it
        wait_for(lock.lost.is_set, 5, "the lock reported lost", poll=0.02)
    assert redis_client.get(keys.replica_lock(RID)) == "task-b"  # the release does not delete its successor's lock
