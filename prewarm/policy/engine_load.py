"""Requests in flight per replica, from the gateway's count and the engine's own.

A gateway counts only what it sent itself; an engine that exposes its queue (vLLM's
`num_requests_running` + `num_requests_waiting`) counts every gateway's requests, the
warmup and keep-alive traffic, and what is still queued inside it. Routing and the
planner's in-flight peak take the larger of the two per replica: the engine's figure is a
heartbeat old, the gateway's is live but partial, and neither undercounts the other's
part. A replica whose engine says nothing keeps the gateway's count.

No I/O, no clock.
"""

from __future__ import annotations

from typing import Mapping


def merged_inflight(gateway: Mapping[str, int], engine: Mapping[str, int]) -> dict[str, int]:
    """Per replica, the larger of the gateway's in-flight count and the engine's running + waiting."""
    if not engine:
        return dict(gateway)
    out = dict(gateway)
    for rid, n in engine.items():
        if n > out.get(rid, 0):
            out[rid] = n
    return out


def model_level(engine: Mapping[str, int]) -> int:
    """The model's requests in flight as its engines count them (the sum over its replicas)."""
    return sum(max(0, n) for n in engine.values())
