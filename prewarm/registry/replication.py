"""Writes that a failover cannot lose: the writes and a Redis WAIT on one connection.

Redis replicates asynchronously: a primary acknowledges a write before any replica has it,
and a primary killed in that instant takes the write with it (the promoted replica never saw
it). `WAIT numreplicas timeout` blocks the connection that wrote until that many replicas
acknowledged everything it wrote so far, so the writes and the WAIT go down one connection,
in one non-transactional pipeline (a WAIT inside MULTI would not block).

How many replicas to ask for is `prewarm.policy.outbox.replicas_to_wait`: the configured
count (`redis.wait_replicas`), or, while the group is known to be short of replicas (its old
primary dead after a failover), the count it has, so that a degraded group costs one WAIT
timeout per recheck and not one per write. A shortfall is logged once per episode; the write
stands (the primary has it), and the caller learns how many replicas it reached.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import redis

from prewarm.policy.outbox import ReplicaShortfall, replicas_to_wait

log = logging.getLogger("prewarm.registry.replication")

#: After a WAIT that fell short, how long the smaller count is used before the full one is asked again.
RECHECK_S = 5.0


class ReplicatedWrites:
    """Run queued writes, then WAIT for the replicas (see the module docstring). Thread-safe."""

    def __init__(self, required: int, timeout_ms: int, *, recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if required < 0 or timeout_ms <= 0:
            raise ValueError(f"replicas must be >= 0 and the WAIT timeout > 0 ms (got {required}, {timeout_ms})")
        self.required = required
        self.timeout_ms = timeout_ms
        self.recheck_s = recheck_s
        self._clock = clock
        self._shortfall: ReplicaShortfall | None = None
        self._lock = threading.Lock()

    def execute(self, pipe: "redis.client.Pipeline[str]") -> tuple[list[Any], int | None]:
        """Execute `pipe` (its writes queued, transaction=False) with a WAIT after them.

        Returns the writes' results and the replicas that acknowledged them (None when no WAIT
        was asked: nothing required, or the group is known to have no replica now)."""
        with self._lock:
            target = replicas_to_wait(self.required, self._shortfall, now=self._clock(), recheck_s=self.recheck_s)
        if target == 0:
            return list(pipe.execute()), None
        pipe.execute_command("WAIT", target, self.timeout_ms)
        results = list(pipe.execute())
        acked = int(results[-1])
        self._observe(acked)
        return results[:-1], acked

    def _observe(self, acked: int) -> None:
        with self._lock:
            if acked >= self.required:
                if self._shortfall is not None:
                    log.info("writes reach %d replica(s) again", acked)
                self._shortfall = None
                return
            if self._shortfall is None or self._shortfall.acked != acked:
                log.warning("only %d of %d replica(s) acknowledged within %d ms: a failover now could lose the "
                            "latest writes (redis.wait_replicas)", acked, self.required, self.timeout_ms)
            self._shortfall = ReplicaShortfall(acked, self._clock())
