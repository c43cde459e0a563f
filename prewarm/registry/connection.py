"""Redis clients built from settings: redis://, rediss:// (TLS) and passwords.

Sync clients serve the workers and the registry; the gateway uses the asyncio client.
Both come from one place so that TLS and password handling cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

from prewarm.core.errors import SettingsError
from prewarm.core.settings import RedisSettings


def _kwargs(cfg: RedisSettings) -> dict[str, Any]:
    if cfg.url is None:
        raise SettingsError("PREWARM_REDIS_URL is not set (and no embedded Redis was started)")
    kw: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 10,
    }
    if cfg.password is not None:
        kw["password"] = cfg.password.get_secret_value()
    if cfg.url.startswith("rediss://"):
        if cfg.tls_ca_file:
            kw["ssl_ca_certs"] = cfg.tls_ca_file
        if not cfg.tls_verify:
            kw["ssl_cert_reqs"] = "none"
    return kw


def sync_client(cfg: RedisSettings) -> "redis.Redis[str]":
    return redis.Redis.from_url(cfg.url or "", **_kwargs(cfg))


def async_client(cfg: RedisSettings) -> "aioredis.Redis[str]":
    return aioredis.Redis.from_url(cfg.url or "", **_kwargs(cfg))


def broker_url(cfg: RedisSettings) -> str:
    """The Celery broker URL: the registry's Redis, on `broker_db` when set, password included."""
    if cfg.url is None:
        raise SettingsError("PREWARM_REDIS_URL is not set (and no embedded Redis was started)")
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(cfg.url)
    netloc = parts.netloc
    if cfg.password is not None and "@" not in netloc:
        # escaped: a password holding '/', '#', '@' or '%' must not end the netloc (kombu unquotes it)
        netloc = f":{quote(cfg.password.get_secret_value(), safe='')}@{netloc}"
    path = f"/{cfg.broker_db}" if cfg.broker_db is not None else parts.path
    query = parts.query
    if parts.scheme == "rediss" and "ssl_cert_reqs" not in query:
        extra = "ssl_cert_reqs=" + ("required" if cfg.tls_verify else "none")
        if cfg.tls_ca_file:
            extra += f"&ssl_ca_certs={cfg.tls_ca_file}"
        query = f"{query}&{extra}" if query else extra
    return urlunsplit((parts.scheme, netloc, path, query, parts.fragment))
