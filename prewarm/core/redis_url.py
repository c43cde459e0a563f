"""What a `PREWARM_REDIS_URL` names, parsed once: a single Redis or a Sentinel-watched group.

Pure (no redis import): the settings validate the URL with it when they are read, so a bad
database index or a Sentinel list without ports fails at start naming the variable, and
`prewarm.registry.connection` builds the clients and the Celery broker URL from the same
parse, so the two cannot disagree on what the URL means.

Forms:
- `redis://[:password@]host:port[/db]`, `rediss://…` (TLS), `unix:///path[?db=N]`: one server.
- `sentinel://[:password@]host:port[,host:port…][/db]`: the Sentinels of a primary/replica
  group whose name is `redis.sentinel_master`. The password, if any, is the data nodes'
  (as in kombu's `sentinel://`); the Sentinels' own is `redis.sentinel_password`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
#: Redis's own ceiling is `databases - 1` on the server (16 by default); a URL can only be
#: checked against the integer range here, the server answers the rest (a clean 503, see connection).
MAX_DB = 2**31 - 1


@dataclass(frozen=True)
class RedisAddress:
    scheme: str  # redis | rediss | unix | sentinel
    db: int
    password: str | None
    sentinels: tuple[tuple[str, int], ...] = ()  # sentinel scheme only

    @property
    def is_sentinel(self) -> bool:
        return self.scheme == "sentinel"


def _db(text: str, url: str) -> int:
    if text == "":
        return 0
    if not text.isdigit() or not text.isascii():
        raise ValueError(f"database index must be a non-negative integer, got {text!r} in {url!r}")
    value = int(text)
    if value > MAX_DB:
        raise ValueError(f"database index {value} is out of range in {url!r}")
    return value


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"each Sentinel must be host:port (port 1-65535), got {item!r} in {url!r}")
    return host.strip("[]"), int(port)


def parse(url: str) -> RedisAddress:
    """Parse and check a Redis URL; ValueError says what is wrong (the URL's password never printed)."""
    shown = _redact(url)
    if not url.startswith(SCHEMES):
        raise ValueError("must start with redis://, rediss:// (TLS), unix:// or sentinel:// (Sentinel)")
    scheme, _, rest = url.partition("://")
    if scheme == "sentinel":
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        password = unquote(userinfo.partition(":")[2]) if at and userinfo else None
        items = [h for h in hosts.split(",") if h.strip()]
        if not items:
            raise ValueError(f"a sentinel:// URL lists one or more Sentinels as host:port, got {shown!r}")
        sentinels = tuple(_host_port(h.strip(), shown) for h in items)
        return RedisAddress(scheme, _db(path.split("?", 1)[0].strip("/"), shown), password or None, sentinels)
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"{exc} in {shown!r}") from None
    if scheme != "unix" and not parts.hostname:
        raise ValueError(f"no host in {shown!r}")
    del port
    if scheme == "unix":
        db_text = (parse_qs(parts.query).get("db") or [""])[0]
    else:
        db_text = parts.path.strip("/")
    return RedisAddress(scheme, _db(db_text, shown), unquote(parts.password) if parts.password else None)


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    return f"{scheme}{sep}{netloc}{slash}{tail}"
