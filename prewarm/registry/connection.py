"""Redis clients built from settings: redis://, rediss:// (TLS), passwords and Sentinel groups.

Sync clients serve the workers and the registry; the gateway uses the asyncio client.
Both come from one place so that TLS, password and Sentinel handling cannot drift apart.

With a `sentinel://` URL (`prewarm/core/redis_url.py`) every client is a Sentinel-managed
one (redis-py `Sentinel.master_for`): it asks the Sentinels where the primary is on each new
connection, so after a failover the registry, the counters, the beat lock and the gateway
reconnect to the promoted replica by themselves. The Celery broker gets kombu's own
`sentinel://` transport with its `master_name` transport option (`broker_transport_options`).

A server that accepts the connection and then refuses its set-up (a database index beyond
the server's `databases`, for instance) is unusable, not a bug in the request: the handshake
turns that refusal into a `ConnectionError`, which every caller already answers as "Redis
unavailable" (a 503 with Retry-After at the gateway), instead of a `ResponseError` that
escaped as a 500 on every request.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from prewarm.core.errors import SettingsError
from prewarm.core.redis_url import RedisAddress
from prewarm.core.settings import RedisSettings
from prewarm.registry.replication import ReplicatedWrites


def _unusable(exc: redis.ResponseError) -> redis.ConnectionError:
    return redis.ConnectionError(f"Redis refused the connection set-up ({exc}); check PREWARM_REDIS_URL "
                                 "(its database index) and the password")


def _handshake(conn: Any) -> None:
    try:
        conn.on_connect()
    except redis.ResponseError as exc:
        raise _unusable(exc) from exc


async def _ahandshake(conn: Any) -> None:
    try:
        await conn.on_connect()
    except redis.ResponseError as exc:
        raise _unusable(exc) from exc


def _address(cfg: RedisSettings) -> RedisAddress:
    address = cfg.address
    if address is None or cfg.url is None:
        raise SettingsError("PREWARM_REDIS_URL is not set (and no embedded Redis was started)")
    return address


def _kwargs(cfg: RedisSettings) -> dict[str, Any]:
    address = _address(cfg)
    kw: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 10,
    }
    if cfg.password is not None and address.password is None:
        kw["password"] = cfg.password.get_secret_value()
    if address.scheme == "rediss":
        if cfg.tls_ca_file:
            kw["ssl_ca_certs"] = cfg.tls_ca_file
        if not cfg.tls_verify:
            kw["ssl_cert_reqs"] = "none"
    return kw


def _sentinel_kwargs(cfg: RedisSettings) -> dict[str, Any]:
    """How to talk to the Sentinels themselves: the same timeouts, their own password."""
    kw: dict[str, Any] = {"socket_timeout": cfg.socket_timeout_s, "socket_connect_timeout": cfg.connect_timeout_s}
    if cfg.sentinel_password is not None:
        kw["password"] = cfg.sentinel_password.get_secret_value()
    return kw


def _master_kwargs(cfg: RedisSettings, address: RedisAddress) -> dict[str, Any]:
    kw = _kwargs(cfg)
    kw["db"] = address.db
    if address.password is not None:
        kw["password"] = address.password
    return kw


def sync_client(cfg: RedisSettings) -> "redis.Redis[str]":
    address = _address(cfg)
    if address.is_sentinel:
        sentinel = redis.sentinel.Sentinel(list(address.sentinels), sentinel_kwargs=_sentinel_kwargs(cfg))
        client: "redis.Redis[str]" = sentinel.master_for(str(cfg.sentinel_master), redis_connect_func=_handshake,
                                                          **_master_kwargs(cfg, address))
        return client
    return redis.Redis.from_url(cfg.url or "", redis_connect_func=_handshake, **_kwargs(cfg))


def broker_client(cfg: RedisSettings) -> "redis.Redis[str]":
    """A client of the broker's database (`broker_db`, else the registry's): to read what kombu holds."""
    address = _address(cfg)
    if cfg.broker_db is None or cfg.broker_db == address.db:
        return sync_client(cfg)
    if address.is_sentinel:
        sentinel = redis.sentinel.Sentinel(list(address.sentinels), sentinel_kwargs=_sentinel_kwargs(cfg))
        kw = _master_kwargs(cfg, address)
        kw["db"] = cfg.broker_db
        client: "redis.Redis[str]" = sentinel.master_for(str(cfg.sentinel_master), redis_connect_func=_handshake, **kw)
        return client
    return redis.Redis.from_url(broker_url(cfg), redis_connect_func=_handshake, **_kwargs(cfg))


def replicated_writes(cfg: RedisSettings) -> ReplicatedWrites:
    """How writes that must survive a failover wait for replicas (`redis.wait_replicas`, `wait_timeout_ms`)."""
    return ReplicatedWrites(cfg.effective_wait_replicas, cfg.wait_timeout_ms)


def async_client(cfg: RedisSettings) -> "aioredis.Redis[str]":
    address = _address(cfg)
    if address.is_sentinel:
        sentinel = aiosentinel.Sentinel(list(address.sentinels), sentinel_kwargs=_sentinel_kwargs(cfg))
        client: "aioredis.Redis[str]" = sentinel.master_for(str(cfg.sentinel_master), redis_connect_func=_ahandshake,
                                                             **_master_kwargs(cfg, address))
        return client
    return aioredis.Redis.from_url(cfg.url or "", redis_connect_func=_ahandshake, **_kwargs(cfg))


def broker_url(cfg: RedisSettings) -> str:
    """The Celery broker URL: the registry's Redis, on `broker_db` when set, password included.
    For a Sentinel group, kombu's form: one `sentinel://` URL per Sentinel, joined by ';'."""
    address = _address(cfg)
    url = cfg.url or ""
    password = address.password or (cfg.password.get_secret_value() if cfg.password is not None else None)
    # escaped: a password holding '/', '#', '@' or '%' must not end the netloc (kombu unquotes it)
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    if address.is_sentinel:
        db = cfg.broker_db if cfg.broker_db is not None else address.db
        return ";".join(f"sentinel://{auth}{host}:{port}/{db}" for host, port in address.sentinels)
    parts = urlsplit(url)
    netloc = parts.netloc
    if cfg.password is not None and "@" not in netloc:
        netloc = f"{auth}{netloc}"
    path = f"/{cfg.broker_db}" if cfg.broker_db is not None else parts.path
    query = parts.query
    if parts.scheme == "rediss" and "ssl_cert_reqs" not in query:
        extra = "ssl_cert_reqs=" + ("required" if cfg.tls_verify else "none")
        if cfg.tls_ca_file:
            extra += f"&ssl_ca_certs={cfg.tls_ca_file}"
        query = f"{query}&{extra}" if query else extra
    return urlunsplit((parts.scheme, netloc, path, query, parts.fragment))


def broker_transport_options(cfg: RedisSettings) -> dict[str, Any]:
    """What kombu's `sentinel://` transport needs besides the URL: the group's name and how to
    reach the Sentinels. Empty for a single Redis."""
    address = _address(cfg)
    if not address.is_sentinel:
        return {}
    return {"master_name": cfg.sentinel_master, "sentinel_kwargs": _sentinel_kwargs(cfg)}
