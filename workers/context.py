"""What a task needs from the process it runs in: settings, Redis, registry, metrics, hosted runtimes.

One `WorkerContext` per worker process, built once (by `prewarm agent` / `prewarm planner`
before the worker starts, or lazily on the first task when a worker was started with
`celery -A workers.app worker`). Tasks only interpret payloads and call into it; the
context holds no policy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import redis
from prometheus_client import CollectorRegistry

from prewarm.core.metrics import Metrics
from prewarm.registry.connection import replicated_writes, sync_client
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import Settings
from workers.node.supervision import RuntimeSupervisor


@dataclass
class WorkerContext:
    settings: Settings
    client: "redis.Redis[str]"
    registry: ReplicaRegistry
    metrics: Metrics
    clock: Callable[[], float] = time.time
    _runtimes: RuntimeSupervisor | None = field(default=None, repr=False)

    @property
    def node(self) -> str:
        return self.settings.agent.node

    @property
    def runtimes(self) -> RuntimeSupervisor:
        """The runtime slot table; created on first use so planner workers never make one."""
        if self._runtimes is None:
            self._runtimes = RuntimeSupervisor(self.settings)
        return self._runtimes

    @classmethod
    def build(cls, settings: Settings, *, registry: CollectorRegistry | None = None) -> "WorkerContext":
        client = sync_client(settings.redis)
        return cls(
            settings=settings,
            client=client,
            registry=ReplicaRegistry(client, settings.registry, writes=replicated_writes(settings.redis)),
            metrics=Metrics(registry or CollectorRegistry()),
        )


_lock = threading.Lock()
_current: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    global _current
    with _lock:
        _current = ctx


def current(settings: Settings) -> WorkerContext:
    """The process's context; built from `settings` (the app's) if nobody installed one."""
    global _current
    with _lock:
        if _current is None:
            _current = WorkerContext.build(settings)
        return _current


def uninstall() -> None:
    global _current
    with _lock:
        _current = None
