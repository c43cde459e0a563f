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
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis

from prewarm.core import keys
from prewarm.registry.connection import sync_client
from prewarm.core.settings import Settings
from workers import app as app_mod

log = logging.getLogger("prewarm.beat")

DEMAND_SCAN_S = 10.0
FRAGMENTATION_SWEEP_S = 300.0
EVENT_DISPATCH_S = 2.0


def schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The beat schedule: every entry runs on the planner queue."""
    return {
        "reap-expired-replicas": {"task": app_mod.REAP,
                                  "schedule": timedelta(seconds=settings.registry.reaper_interval_s)},
        "scan-unmet-demand": {"task": app_mod.SCAN_DEMAND, "schedule": timedelta(seconds=DEMAND_SCAN_S)},
        "sweep-fragmentation": {"task": app_mod.SWEEP_FRAGMENTATION,
                                "schedule": timedelta(seconds=FRAGMENTATION_SWEEP_S)},
        "dispatch-due-scale-events": {"task": app_mod.DISPATCH_EVENTS,
                                      "schedule": timedelta(seconds=EVENT_DISPATCH_S)},
        "forecast-and-plan": {"task": app_mod.FORECAST, "schedule": timedelta(seconds=settings.planner.interval_s)},
    }


class BeatLock:
    """The single-beat lock: acquire (waiting as a standby), refresh, and exit the process if it is lost."""

    def __init__(self, client: "redis.Redis[str]", owner: str, ttl_s: int = keys.BEAT_LOCK_TTL_S) -> None:
        self.client = client
        self.owner = owner
        self.ttl_s = ttl_s
        self._stop = threading.Event()

    def wait_acquire(self, *, poll_s: float = 1.0, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        warned = False
        while not self.client.set(keys.BEAT_LOCK, self.owner, nx=True, ex=self.ttl_s):
            if not warned:
                log.warning("another beat (%s) is active; waiting as a standby", self.client.get(keys.BEAT_LOCK))
                warned = True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        threading.Thread(target=self._refresh, name="beat-lock", daemon=True).start()
        return True

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.client.get(keys.BEAT_LOCK) != self.owner:
                    log.error("beat lock lost to %s: exiting so that only one beat runs",
                              self.client.get(keys.BEAT_LOCK))
                    os._exit(3)
                self.client.expire(keys.BEAT_LOCK, self.ttl_s)
            except redis.RedisError as exc:
                log.warning("could not refresh the beat lock: %s", exc)

    def release(self) -> None:
        self._stop.set()
        try:
            if self.client.get(keys.BEAT_LOCK) == self.owner:
                self.client.delete(keys.BEAT_LOCK)
        except redis.RedisError:
            pass


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
