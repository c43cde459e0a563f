"""One pooled HTTP client for the process: warmup and validation requests, the runtime client,
health checks and the Prometheus history loader all go through it.

Why: `urllib.request.urlopen` opens (and closes) a TCP connection per call, so every warmup
request, every health check and every history query paid a connect; with keep-alive pools
(urllib3's `PoolManager`, thread-safe, one pool per host) the agent's many small calls to
its runtimes reuse their connections. The gateway's proxy path has its own aiohttp session
(it is asyncio); this one serves the threaded side.

`fetch` never raises on an HTTP status: it returns it. A request that gets no answer at all
(refused, reset, timed out) raises `Unreachable`, an `OSError`, so callers that caught
urllib's errors keep working.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping

import urllib3

_POOL: urllib3.PoolManager | None = None
_LOCK = threading.Lock()


class Unreachable(OSError):
    """No HTTP answer: the connection was refused, reset or timed out."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> object:
        import json

        return json.loads(self.body)


def pool() -> urllib3.PoolManager:
    """The process-wide pool (created on first use; a forked child gets its own after fork)."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            # no retries: a request is never re-sent (a POST never doubled), and the callers have their own
            # retry policies; a pooled connection the server dropped is noticed and replaced before use
            _POOL = urllib3.PoolManager(num_pools=64, maxsize=16, block=False, retries=False)
        return _POOL


def fetch(method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None, *,
          timeout: float = 30.0) -> Response:
    """One request on a pooled connection; the status is returned, whatever it is."""
    try:
        resp = pool().request(method, url, body=body, headers=dict(headers or {}),
                              timeout=urllib3.Timeout(connect=min(timeout, 5.0), read=timeout),
                              preload_content=True, redirect=False)
    except urllib3.exceptions.HTTPError as exc:  # urllib3's base: connect, read, protocol, timeout errors
        raise Unreachable(f"{method} {url}: {exc}") from exc
    return Response(resp.status, bytes(resp.data), {k: v for k, v in resp.headers.items()})


def _reset_after_fork() -> None:
    global _POOL, _LOCK
    _POOL = None
    _LOCK = threading.Lock()


try:  # connections must not be shared across a fork (Celery prefork, subprocess helpers)
    import os

    os.register_at_fork(after_in_child=_reset_after_fork)
except AttributeError:  # pragma: no cover - not POSIX
    pass
