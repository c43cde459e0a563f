"""When the gateway may route from its last view of ready replicas while Redis is away.

Issue 20 (major 7): during a 10 s Redis restart 41 of 218 requests got 503 although every
replica was alive. The replicas did not change; only the gateway's way of seeing them did.
So the gateway keeps its last good view per model and, while the registry cannot be read,
routes from it. Pure: the gateway's adapter (`prewarm/gateway/registry_view.py`) passes the
clock in and carries out what these functions say.

The rule, written down:

1. Registry reachable: the view is read as always, and only replicas whose heartbeat is
   fresh are in it.
2. Registry away (a read failed): the last good view is served while its age is at most
   `gateway.stale_view_max_s`. Past that the gateway answers 503 with Retry-After, as before:
   a view older than that may hold replicas that were drained, failed or died meanwhile, and
   nothing the gateway sees says otherwise. While away, at most one read is tried per
   `gateway.refresh_interval_s`, so requests do not queue behind connection attempts.
3. Heartbeats are measured in time the registry was reachable. While Redis is away no agent
   can heartbeat, so when it returns every heartbeat looks expired until the agents' next
   beat (up to `registry.heartbeat_interval_s`). For one heartbeat TTL after the registry
   returns, the gateway reads heartbeats against a clock set back by the outage (capped at
   `stale_view_max_s`): a replica that was fresh when Redis went away stays fresh for the
   rest of its TTL, and no longer. The reaper applies the same idea (it reaps nothing
   until a TTL has passed after a silence), so the gateway and the reaper agree.
4. Nothing here overrides what the gateway itself sees: a replica whose connections fail is
   excluded as always (`gateway.failure_threshold`), stale view or not.

So a replica whose heartbeat would have expired is never routed for more than
`stale_view_max_s + heartbeat_ttl_s` past its last heartbeat, and a replica that was drained
or failed is never routed once the registry can be read (transitions leave the indexes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StalenessRule:
    max_stale_s: float  # gateway.stale_view_max_s
    heartbeat_ttl_s: float  # registry.heartbeat_ttl_s
    retry_interval_s: float  # gateway.refresh_interval_s: reads tried while away, at most one per this


@dataclass(frozen=True)
class RegistryHealth:
    """What the gateway knows of its registry's reachability (wall-clock seconds)."""

    last_ok_at: float | None = None  # last successful read
    away_since: float | None = None  # first failed read of the current outage; None while reachable
    last_attempt_at: float | None = None  # last read tried while away
    back_at: float | None = None  # when the registry returned from the last outage
    outage_s: float = 0.0  # how long that outage lasted, as the gateway saw it (capped)


def read_ok(health: RegistryHealth, now: float, rule: StalenessRule) -> RegistryHealth:
    """A read succeeded: the outage, if there was one, ends now."""
    if health.away_since is None:
        return replace(health, last_ok_at=now)
    start = health.last_ok_at if health.last_ok_at is not None else health.away_since
    outage = min(max(0.0, now - start), rule.max_stale_s)
    return RegistryHealth(last_ok_at=now, away_since=None, last_attempt_at=None, back_at=now, outage_s=outage)


def read_failed(health: RegistryHealth, now: float) -> RegistryHealth:
    return replace(health, away_since=health.away_since if health.away_since is not None else now,
                   last_attempt_at=now)


def should_read(health: RegistryHealth, now: float, rule: StalenessRule) -> bool:
    """While away, one read per retry interval; otherwise whenever the cache asks."""
    if health.away_since is None or health.last_attempt_at is None:
        return True
    return now - health.last_attempt_at >= rule.retry_interval_s


def may_serve_stale(read_at: float | None, now: float, rule: StalenessRule) -> bool:
    """Whether a view read at `read_at` may still be routed from while the registry is away."""
    return read_at is not None and now - read_at <= rule.max_stale_s


def heartbeat_clock(health: RegistryHealth, now: float, rule: StalenessRule) -> float:
    """The `now` to judge heartbeats against: set back by the outage for one TTL after it ended."""
    if health.back_at is not None and now - health.back_at < rule.heartbeat_ttl_s:
        return now - health.outage_s
    return now


def view_age(health: RegistryHealth, now: float) -> float:
    """Seconds since the last successful read while the registry is away; 0 while it is reachable."""
    if health.away_since is None or health.last_ok_at is None:
        return 0.0
    return max(0.0, now - health.last_ok_at)
