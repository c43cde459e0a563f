"""Helpers that start and stop REAL prewarm worker processes for the integration tests.

`WorkerProcess` runs `prewarm agent` / `prewarm planner` / `prewarm beat` as a child process
with an environment pointing at the test Redis, waits until Celery reports the worker
ready, and stops it with SIGTERM (or SIGKILL when a test wants a crash). Its log is a file,
so a test can read what the worker said and a failure shows it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import pytest

from prewarm.core import keys
from prewarm.registry.embedded import claim_port_block, stop_process
from prewarm.core.settings import Settings

if TYPE_CHECKING:
    import redis

ROOT = Path(__file__).resolve().parents[1]
PREWARM = [sys.executable, "-m", "prewarm.cli"]

T = TypeVar("T")


def steady_counters(client: "redis.Redis[str]", model: str, *, ahead: int = 3) -> None:
    """An hour of steady load as the gateway counts it, per 10 s bucket: 100 requests, 20 in flight on average
    (busy 200 request-seconds), 24 at the peak; and `ahead` buckets after the one in progress, for a step that runs
    after the next boundary. A step reads the bucket in progress at any second of it, so there (and ahead) the
    peak is the mean: the load so far, never above its peak, reads the steady 20 whatever the second."""
    fine = int(time.time() // 10) * 10
    for i in range(-ahead, 361):
        start = fine - 10 * i
        client.set(keys.requests(model, 10, start), 100)
        client.set(keys.inflight_peak(model, 10, start), 24 if i > 0 else 20)
        client.set(keys.busy(model, 10, start), 200.0)
    client.hset(keys.REQUESTS_FIRST, model, fine - 3600)
    client.sadd(keys.REQUEST_MODELS, model)


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str | Callable[[], str], poll: float = 0.1) -> T:
    """Poll until `predicate()` is truthy and return it (never None, then); fail naming `what` after `timeout` seconds.

    `what` may be a callable, called only on failure: logs read then show what happened meanwhile.
    """
    deadline = time.monotonic() + timeout
    last = predicate()
    while not last:
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {said} (last value: {last!r})")
        time.sleep(poll)
        last = predicate()
    assert last is not None  # truthy
    return last


def worker_env(redis_url: str, state_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a test worker: the test Redis, short timeouts, a private state directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env.update({
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_WARMUP_SECRET": "test-warmup-secret",
        "PREWARM_REDIS_SOCKET_TIMEOUT_S": "10",  # the shared test machine stalls; a slow reply is not an outage
        "PREWARM_WARMUP_REQUESTS": "3",
        # The machine is shared and noisy: the performance check gets a wide margin here, and the
        # test of a failing performance check sets an impossible baseline instead.
        "PREWARM_WARMUP_LATENCY_FACTOR": "50",
        "PREWARM_AGENT_STATE_DIR": str(state_dir / "agent"),
        "PREWARM_AGENT_REPLICA_SLOTS": "4",
        "PREWARM_AGENT_PORT_BASE": str(_port_block()),
        # Short, so that a SIGKILLed task comes back within seconds; long enough for a runtime to start
        # on a busy 2-core machine (a task past its limit is retried and resumes, so it is not fatal).
        "PREWARM_AGENT_TASK_TIME_LIMIT_S": "20",
        "PREWARM_AGENT_VISIBILITY_TIMEOUT_S": "21",  # > the time limit, as in production
        "PREWARM_AGENT_RESTORE_INTERVAL_S": "1",
        "PREWARM_AGENT_LOCK_TTL_S": "8",  # outlives Redis stalls on a loaded machine; expires before redelivery
        "PREWARM_AGENT_RETRY_BACKOFF_S": "0.5",
        "PREWARM_AGENT_RUNTIME_START_TIMEOUT_S": "60",
        "PREWARM_AGENT_DRAIN_TIMEOUT_S": "2",
        "PREWARM_AGENT_ORPHAN_GRACE_S": "30",
        "PREWARM_RUNTIME_MODELS_DIR": str(state_dir / "models"),
        "PREWARM_RUNTIME_SNAPSHOT_DIR": str(state_dir / "snapshots"),
        "PREWARM_RUNTIME_DEVICE": "cpu",
        "PREWARM_REGISTRY_HEARTBEAT_INTERVAL_S": "0.5",
        "PREWARM_REGISTRY_HEARTBEAT_TTL_S": "3",
        "PREWARM_WARMUP_KEEPALIVE_INTERVAL_S": "0.5",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(overrides)
    return env


def settings_from_env(env: Mapping[str, str]) -> Settings:
    """The `Settings` a worker started with `env` loads: its PREWARM_* variables and nothing else."""
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("PREWARM_")]:
            mp.delenv(k)
        for k, v in env.items():
            if k.startswith("PREWARM_"):
                mp.setenv(k, v)
        return Settings.load()


def queued_tasks(client: "redis.Redis[str]", queue: str) -> list[dict[str, Any]]:
    """The task messages waiting in a Redis-transport queue: (task name, args)."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        msg = json.loads(raw)
        body = json.loads(base64.b64decode(msg["body"])) if msg["properties"].get("body_encoding") == "base64" \
            else json.loads(msg["body"])
        out.append({"task": msg["headers"]["task"], "args": body[0], "id": msg["headers"].get("id")})
    return out


def publish_node(client: "redis.Redis[str]", node: str, slots: int) -> None:
    """Write a node's view the way its agent publishes it (`keys.node_info`, with its TTL)."""
    client.hset(keys.node_info(node), mapping={"name": node, "replica_slots": str(slots), "ready": "1"})
    client.expire(keys.node_info(node), keys.NODE_INFO_TTL_S)


# Runtime port blocks live below the kernel's ephemeral range (32768+ on Linux), where nothing
# else gets a port by accident: `free_port()` (bind to port 0) and every outgoing connection
# draw theirs from the ephemeral range, so a block chosen there could be handed to another
# test's server between the check and the runtime's bind. `prewarm up` claims its blocks in 20000-29999.
# A block is claimed with an exclusive lock on a file named after it, held until this test
# process exits, so neither another xdist worker nor another test session on this machine
# (a second checkout, a developer's run beside CI) can take it; the walk starts at a random
# block so that two sessions do not queue on the same first blocks.
_BLOCKS_FROM, _BLOCKS_TO = 30000, 32760


def _port_block(size: int = 8) -> int:
    """A base port with `size` free ports after it (runtime ports are port_base + slot), claimed for this process."""
    return claim_port_block(size, _BLOCKS_FROM, _BLOCKS_TO)


class WorkerProcess:
    """One `prewarm <command>` child process and its log."""

    def __init__(self, args: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.args = args
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._offset = 0

    def start(self, *, ready_marker: str | None = " ready.", timeout: float = 60.0) -> "WorkerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen(PREWARM + self.args, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=fh, stderr=subprocess.STDOUT)
        if ready_marker:
            self.wait_ready(ready_marker, timeout)
        return self

    def wait_ready(self, marker: str = " ready.", timeout: float = 60.0) -> None:
        """Wait for `marker` in the log since start; fail with the log if the process exits first."""
        proc = self.proc
        assert proc is not None, "start() the process first"
        wait_for(lambda: marker in self.log() or proc.poll() is not None, timeout,
                 f"`prewarm {' '.join(self.args)}` to become ready")
        if proc.poll() is not None:
            raise AssertionError(f"`prewarm {' '.join(self.args)}` exited with {proc.returncode}:\n"
                                 f"{self.log()[-4000:]}")

    def log(self, *, since_start: bool = True) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[self._offset if since_start else 0:].decode("utf-8", "replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the worker gets no chance to ack, requeue or clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Celery's warm shutdown), then SIGKILL if it does not end in time."""
        if self.proc is None:
            return None
        return stop_process(self.proc, timeout)


def runtime_pids(port: int, *, guards: bool = False) -> list[int]:
    """Pids of live `serve-model` processes for `port` (from /proc; zombies excluded), or of their guards."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\x00")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if b"serve-model" in cmd and str(port).encode() in cmd and (b"workers.node.guard" in cmd) == guards \
                and state != "Z":
            out.append(int(entry.name))
    return out
