"""The beat: the periodic planner tasks, and the guarantee that exactly one beat runs.

Two beats would enqueue every periodic task twice, so `run_beat` first takes a Redis lock
(`keys.BEAT_LOCK`, refreshed while it runs). A second beat waits as a standby and takes
over when the first one's lock expires; a beat that loses its lock exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import redis
from redis.exceptions import LockError, LockNotOwnedError

from prewarm.core import keys
from prewarm.registry.connection import sync_client
from prewarm.core.settings import Settings
from workers import app as app_mod
from workers.schedule import schedule

log = logging.getLogger("prewarm.beat")

class BeatLock:
    """The single-beat lock (redis-py's `Lock`: owner token checked atomically by Lua on every
    extend and release, so a beat never deletes or extends its successor's lock).

    Acquire (waiting as a standby), refresh from a thread, and exit the process if it is lost.
    """

    def __init__(self, client: "redis.Redis[str]", owner: str, ttl_s: int = keys.BEAT_LOCK_TTL_S) -> None:
        self.client = client
        self.owner = owner
        self.ttl_s = ttl_s
        self._lock = client.lock(keys.BEAT_LOCK, timeout=ttl_s, thread_local=False)
        self._stop = threading.Event()

    def wait_acquire(self, *, poll_s: float = 1.0, timeout_s: float | None = None) -> bool:
        holder = self.client.get(keys.BEAT_LOCK)
        if holder is not None and holder != self.owner:
            log.warning("another beat (%s) is active; waiting as a standby", holder)
        if not self._lock.acquire(blocking=True, sleep=poll_s, blocking_timeout=timeout_s, token=self.owner):
            return False
        threading.Thread(target=self._refresh, name="beat-lock", daemon=True).start()
        return True

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._lock.reacquire()
            except LockNotOwnedError:
                log.error("beat lock lost to %s: exiting so that only one beat runs", self.client.get(keys.BEAT_LOCK))
                os._exit(3)
            except redis.RedisError as exc:
                log.warning("could not refresh the beat lock: %s", exc)

    def release(self) -> None:
        self._stop.set()
        try:
            self._lock.release()
        except (LockError, redis.RedisError):
            pass  # expired or taken over: the successor's lock is not ours to delete


def run_beat(settings: Settings, *, schedule_file: str | None = None, loglevel: str = "INFO") -> int:
    """Run the one beat of the deployment (blocks)."""
    client = sync_client(settings.redis)
    lock = BeatLock(client, f"{os.uname().nodename}:{os.getpid()}")
    # SIGTERM before Celery installs its own handler must still release the lock (finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        lock.wait_acquire()
        log.info("beat lock acquired; scheduling %s", ", ".join(schedule(settings)))
        app = app_mod.make_app(settings)
        path = Path(schedule_file or Path(settings.agent.state_dir) / "beat-schedule")
        path.parent.mkdir(parents=True, exist_ok=True)
        app.Beat(loglevel=loglevel, schedule=str(path), max_interval=5).run()
    finally:
        lock.release()
    return 0
