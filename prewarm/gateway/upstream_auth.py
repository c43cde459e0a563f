"""Each upstream's own API key: what the gateway sends to a replica, and what a refusal of it means.

A vLLM pod started with its own `--api-key` answers 401 to any other key. The gateway used to
send the runtimes' key (`runtime.api_key`) to every replica, so every user request to such a
pod was refused, and since a 4xx answer is not demand the planner saw no traffic and scaled
the model down. Now a replica names its key with `Replica.auth_ref`, `<secret>/<key>`, which
the pod warmer registers (`kubernetes.pod_api_key_ref`):

- the registry holds the reference only, never the key in clear: Redis is read by every
  prewarm process and often by operators, while a Kubernetes Secret has RBAC, encryption at
  rest and rotation; the chart mounts each model's key Secret into the gateway at
  `gateway.upstream_keys_dir`, one file per reference (`<dir>/<secret>/<key>`);
- a replica without a reference (prewarm's own runtimes) gets the runtimes' key, as before;
- files are read again after `gateway.upstream_keys_refresh_s`, so a rotated Secret (which
  the kubelet rewrites in place) is picked up without a restart.

A key the gateway does not hold, or an upstream that answers 401/403 to the key it was
sent, is the deployment's fault, not the client's (a client's own Authorization never
passes): the replica is skipped for this request and, when no replica takes it, the client
gets 502 `upstream_auth` naming the reference. A 502 is demand, so the planner keeps
counting the traffic while the operator fixes the key.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from aiohttp import web

from prewarm.core.domain import Replica

log = logging.getLogger(__name__)


class UpstreamKeys:
    """The Authorization header for each replica, from its `auth_ref`."""

    def __init__(self, default_key: str | None, keys_dir: str | None, refresh_s: float = 30.0) -> None:
        self.default = {"Authorization": f"Bearer {default_key}"} if default_key else {}
        self.dir = Path(keys_dir) if keys_dir else None
        self.refresh_s = refresh_s
        self._cache: dict[str, tuple[float, str | None]] = {}  # ref -> (read at, monotonic; key or None)
        self._logged: dict[str, float] = {}  # replica id -> when its refusal was last logged (one line per refresh)

    def _key(self, ref: str) -> str | None:
        now = time.monotonic()
        hit = self._cache.get(ref)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        key: str | None = None
        if self.dir is not None:  # `ref` was validated (`check_key_ref`): one level under the directory
            try:
                key = (self.dir / ref).read_text().strip() or None
            except OSError as exc:
                log.error("no API key %r for upstreams under %s: %s", ref, self.dir, exc)
        self._cache[ref] = (now, key)
        return key

    def headers(self, replica: Replica) -> dict[str, str] | None:
        """The header to send `replica`; None when its key is not held here."""
        if not replica.auth_ref:
            return self.default
        key = self._key(replica.auth_ref)
        return {"Authorization": f"Bearer {key}"} if key else None

    def missing(self, replica: Replica) -> web.Response:
        where = f"under {self.dir}" if self.dir else "(gateway.upstream_keys_dir is not set)"
        return _bad_gateway(f"the gateway holds no API key {replica.auth_ref!r} for replica {replica.id} {where}")

    def refused(self, rid: str, ref: str, status: int) -> web.Response:
        now = time.monotonic()
        if now - self._logged.get(rid, -self.refresh_s) >= self.refresh_s:  # every request would be one line
            self._logged[rid] = now
            log.error("replica %s answered %d to the gateway's API key %r: its key and the gateway's differ", rid,
                      status, ref or "runtime.api_key")
        return _bad_gateway(f"replica {rid} refused the gateway's API key {ref or 'runtime.api_key'!r} ({status})")


def _bad_gateway(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_auth"}}
    return web.json_response(body, status=502)
