"""The per-replica work lock: one task works on a replica at a time, and a dead owner's work is taken over.

A redelivered task (its worker died, or the broker's visibility timeout passed) may meet
the original still working. The lock (`keys.replica_lock`, SET NX with a TTL) is
refreshed by a thread every third of its TTL while its owner works, so it lives exactly as
long as a live owner does: after a SIGKILL it expires within `agent.lock_ttl_s` and the
redelivered task takes the work over from the registry's state. Release and refresh
compare the owner token, so an expired owner cannot delete its successor's lock. A lock that
expired while its live owner's refresh was late (a starved thread on a loaded node) and that
nobody took meanwhile is taken back by the refresh, atomically: stepping aside for an owner
that does not exist left the replica pending with no task working on it.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Callable

import redis

from prewarm.core import keys

log = logging.getLogger("prewarm.agent.lock")

_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""  # 1: refreshed; 2: it had expired and nobody held it: taken back; 0: another task owns it

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class ReplicaLock:
    """`with ReplicaLock(...) as lock:` after `acquire()`; `lock.lost` is set if the lock slipped away."""

    def __init__(self, client: "redis.Redis[str]", rid: str, owner: str, ttl_s: float) -> None:
        self.client = client
        self.key = keys.replica_lock(rid)
        self.owner = owner
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refresh = client.register_script(_REFRESH)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        return bool(self.client.set(self.key, self.owner, nx=True, px=self.ttl_ms))

    def holder(self) -> str | None:
        return self.client.get(self.key)

    def acquire(self, *, deadline: float, poll_s: float = 0.25, stop_waiting: Callable[[], bool] | None = None) -> bool:
        """Wait for the lock until `deadline` (monotonic); False if `stop_waiting()` says the work is done."""
        while True:
            if self.try_acquire():
                self._start_refresh()
                return True
            if stop_waiting is not None and stop_waiting():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica lock {self.key} is still held by {self.holder()!r}")
            time.sleep(poll_s)

    def _start_refresh(self) -> None:
        self._stop.clear()
        self.lost.clear()
        self._thread = threading.Thread(target=self._run, name=f"lock-{self.key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self.ttl_ms / 3000.0
        while not self._stop.wait(interval):
            try:
                done = self._refresh(keys=[self.key], args=[self.owner, self.ttl_ms])
                if not done:
                    log.warning("lost replica lock %s (another task owns it now)", self.key)
                    self.lost.set()
                    return
                if done == 2:
                    log.warning("replica lock %s had expired before its refresh (nobody took it): taken back",
                                self.key)
            except redis.RedisError as exc:  # keep trying: the TTL leaves room for a blip
                log.warning("could not refresh replica lock %s: %s", self.key, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        try:
            self._release(keys=[self.key], args=[self.owner])
        except redis.RedisError as exc:
            log.warning("could not release replica lock %s (it expires by itself): %s", self.key, exc)

    def __enter__(self) -> "ReplicaLock":
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.release()
