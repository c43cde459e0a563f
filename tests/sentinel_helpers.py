"""A real Redis Sentinel group for the failover tests: a primary, a replica and three Sentinels.

Every process is the Debian `redis-server` / `redis-sentinel` binary (`make system-deps`
installs both) on a free loopback port, with its files in a temporary directory. The
Sentinels watch the primary under one name with quorum 2, call it down after
`down_after_ms` without an answer, and promote the replica. `kill_primary` is SIGKILL: the
primary gets no chance to hand anything over.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest
import redis

from prewarm.registry.embedded import free_port, redis_binary, stop_process, wait_for_port

MASTER = "prewarm"


def sentinel_binary() -> str:
    found = shutil.which("redis-sentinel")
    if not found:
        pytest.fail("redis-sentinel is not on PATH: `make system-deps` installs the Debian package redis-sentinel")
    return found


class SentinelGroup:
    def __init__(self, *, sentinels: int = 3, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="prewarm-sentinel-")
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.data_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: dict[int, "subprocess.Popen[bytes]"] = {}

    @property
    def url(self) -> str:
        return "sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + "/0"

    def _redis(self, port: int, *extra: str) -> None:
        d = Path(self.dir.name) / str(port)
        d.mkdir()
        self.procs[port] = subprocess.Popen(
            [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--logfile", str(d / "redis.log"), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", port, 10.0, f"redis {port}")

    def _sentinel(self, port: int, primary: int) -> None:
        d = Path(self.dir.name) / f"sentinel-{port}"
        d.mkdir()
        conf = d / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {MASTER} 1\n")
        self.procs[port] = subprocess.Popen([sentinel_binary(), str(conf)], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", port, 10.0, f"sentinel {port}")

    def start(self) -> "SentinelGroup":
        primary, replica = self.data_ports
        self._redis(primary)
        self._redis(replica, "--replicaof", "127.0.0.1", str(primary))
        for port in self.sentinel_ports:
            self._sentinel(port, primary)
        self.wait_settled(primary)
        return self

    def primary_port(self) -> int:
        with redis.Redis(port=self.sentinel_ports[0], decode_responses=True, socket_timeout=2) as s:
            _, port = s.sentinel_get_master_addr_by_name(MASTER)
            return int(port)

    def wait_settled(self, primary: int, timeout_s: float = 60.0) -> None:
        """Until the replica is in sync and every Sentinel knows the replica and the other Sentinels
        (a failover needs a quorum of Sentinels that found each other)."""
        deadline = time.monotonic() + timeout_s
        others = len(self.sentinel_ports) - 1
        while time.monotonic() < deadline:
            try:
                ready = True
                for port in self.sentinel_ports:
                    with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as s:
                        _, master = s.sentinel_get_master_addr_by_name(MASTER)
                        replicas = s.sentinel_slaves(MASTER)
                        ready &= int(master) == primary and len(s.sentinel_sentinels(MASTER)) >= others and any(
                            r.get("master-link-status") == "ok" and "s_down" not in r.get("flags", "")
                            for r in replicas)
                if ready:
                    return
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"the Sentinel group did not settle on primary {primary} within {timeout_s}s")

    def kill_primary(self) -> int:
        port = self.primary_port()
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)
        return port

    def wait_promoted(self, old: int, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old:
                    with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as r:
                        if r.info("replication")["role"] == "master":
                            return port
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"no replica was promoted within {timeout_s}s after {old} was killed")

    def close(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()
        self.dir.cleanup()

    def __enter__(self) -> "SentinelGroup":
        return self.start()

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.close()
