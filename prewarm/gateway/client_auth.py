"""Who may call the gateway: clients' API keys, from a mounted Secret, and the name each one is fair-shared by.

Issue 20's fair shares are per client, and a client was its `Authorization` bearer token,
whatever it was: a client that invented a new token per request got a new share each time,
so the fairness a greedy client was meant to meet was its to opt out of. With
`gateway.client_keys_dir` set (the chart mounts a Secret there: one file per client, the
file's name the client's name, its content the key), the gateway authenticates:

- a user request without a key, or with one that is not in the directory, is answered 401
  `invalid_api_key` (OpenAI's answer) before anything else is done for it: not demand, no
  queue, no share;
- a known key's client is its file's name: its fair share, whatever address it comes from;
- keys are held as SHA-256 digests only, and the directory is read again after
  `gateway.client_keys_refresh_s`, so a rotated or added key (the kubelet rewrites a mounted
  Secret in place) is honoured without a restart; a key removed stops working at the next read.

Signed warmup requests carry their own proof and are not asked for a key. Without the
setting nothing changes (a key, when present, still names the client, unauthenticated).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from prewarm.policy.clients import bearer

log = logging.getLogger(__name__)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ClientKeys:
    """The clients' keys (digests) by name, read from `keys_dir` and re-read after `refresh_s`."""

    def __init__(self, keys_dir: str | None, refresh_s: float = 30.0) -> None:
        self.dir = Path(keys_dir) if keys_dir else None
        self.refresh_s = refresh_s
        self._names: dict[str, str] = {}  # digest -> client name
        self._read_at: float | None = None

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _load(self) -> dict[str, str]:
        now = time.monotonic()
        if self.dir is None or (self._read_at is not None and now - self._read_at < self.refresh_s):
            return self._names
        names: dict[str, str] = {}
        try:
            # a mounted Secret also holds `..data` and timestamped `..2026_…` entries: dot names are not clients
            for f in sorted(p for p in self.dir.iterdir() if not p.name.startswith(".") and p.is_file()):
                key = f.read_text().strip()
                if key:
                    names[_digest(key)] = f.name
        except OSError as exc:  # keep the last keys read: an unreadable mount must not open or close the gateway
            log.error("client keys under %s could not be read (%s); keeping the %d read before", self.dir, exc,
                      len(self._names))
            self._read_at = now
            return self._names
        if not names:
            log.error("no client key under %s: every user request is refused 401", self.dir)
        self._names, self._read_at = names, now
        return names

    def client(self, authorization: str | None) -> str | None:
        """The client's name for a request's `Authorization` header; None when it names no known key."""
        token = bearer(authorization)
        return None if token is None else self._load().get(_digest(token))
