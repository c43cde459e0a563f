"""The runtime processes one node agent hosts: spawn, adopt after a crash, stop.

Each replica runs in its own `prewarm serve-model` child process on port
`agent.port_base + slot`, under a `workers.node.guard` that stops it if no agent has vouched
for it (a lease file touched on every heartbeat) for `agent.orphan_grace_s`. The child initialises torch and CUDA itself, so the agent (a
Celery worker) never touches the accelerator and a crash of the agent does not take the
GPU context with it. A pid file per slot (under `agent.state_dir`) records what runs
where, written before the spawn (without a pid: `recorded_pid` finds the runtime by its port)
and again after it, so an agent killed at any point leaves a record: an agent that starts after
a crash adopts the runtimes whose replica is still live in the registry and stops the others,
so no orphan keeps GPU memory. Runtimes are started
in their own session and write to a log file, so they survive the agent's death cleanly.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prewarm.adapters.vllm import is_vllm_command
from prewarm.core import http
from prewarm.core.domain import Replica
from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.core.settings import Settings
from workers.node import engines
from workers.node.memory import MemoryLedger

log = logging.getLogger("prewarm.agent.host")


class SlotBusy(TemporaryError):
    """The slot still hosts another replica's runtime: a retire or an eviction of it is in progress.

    The planner reuses a slot once its replica leaves the registry's live states, which can be
    before the agent has stopped the runtime (the retire runs beside the prewarm): the prewarm
    waits for the slot instead of failing the new replica (`prewarm up --models 3` lost a
    replica and its requests' warm start that way)."""

    reason = "slot_busy"


class RuntimeExited(TemporaryError):
    reason = "runtime_exited"
    """The runtime process of a replica ended; the message carries the tail of its log."""


@dataclass
class HostedRuntime:
    """One runtime process and the replica it serves."""

    replica: Replica  # the latest record the agent knows (heartbeats re-create it from this)
    port: int
    pid: int
    model_dir: str
    started_at: float
    endpoint: str
    adopted: bool = False
    proc: "subprocess.Popen[bytes] | None" = field(default=None, repr=False)
    engine: str = engines.BUILTIN  # which server runs here (workers/node/engines.py)
    # the server's log and where this server's output starts in it (None: adopted, its start not seen)
    log: tuple[str, int] | None = None

    @property
    def health_path(self) -> str:
        return engines.health_path(self.engine)

    @property
    def ready_path(self) -> str:
        return engines.ready_path(self.engine)

    @property
    def slot(self) -> int:
        return self.replica.slot

    def exit_code(self) -> int | None:
        """None while the process runs; its exit status (or -1 when not our child) once it ended."""
        if self.proc is not None:
            return self.proc.poll()
        return None if _pid_alive(self.pid) else -1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _is_our_runtime(pid: int, port: int) -> bool:
    """The process is a `serve-model` on that port (guards against a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\x00")
    except OSError:
        return _pid_alive(pid) and not Path("/proc").is_dir()
    return (b"serve-model" in cmdline or is_vllm_command(cmdline)) and str(port).encode() in cmdline


def _runtime_pids_on(port: int) -> list[int]:
    """Live `serve-model` processes started for `port` (Linux /proc; empty elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found = []
    for entry in proc.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and _pid_alive(int(entry.name)) \
                and _is_our_runtime(int(entry.name), port):
            found.append(int(entry.name))
    return found


def recorded_pid(record: dict[str, Any]) -> int | None:
    """The runtime a pid file names: its pid, or for a record written before the spawn (no pid: its agent died
    before it learned the pid), the guard found on the record's port (the leader of its own session, the
    runtime below it); None: nothing runs for it."""
    pid, port = record.get("pid"), int(record["port"])
    if pid is not None:
        return int(pid)
    for found in _runtime_pids_on(port):
        try:
            if os.getsid(found) == found:
                return found
        except OSError:
            continue
    return None


def _healthz(endpoint: str, timeout: float = 1.0, path: str = "/healthz") -> bool:
    try:
        return 200 <= http.fetch("GET", f"{endpoint}{path}", timeout=timeout).status < 300
    except (OSError, ValueError):
        return False


def readiness(endpoint: str, timeout: float = 2.0, path: str = "/readyz") -> tuple[bool, str]:
    """The runtime's own verdict (`GET /readyz`, a vLLM's `/health`): (ready, why). A refused connection or
    a timeout is "not ready" too: the process is up (the caller checked) but does not answer."""
    try:
        resp = http.fetch("GET", f"{endpoint}{path}", timeout=timeout)
    except (OSError, ValueError) as exc:
        return False, f"no answer: {exc}"
    if 200 <= resp.status < 300:
        return True, "ready"
    try:
        body = json.loads(resp.body)
        reason = str(body.get("reason", resp.status)) if isinstance(body, dict) else f"status {resp.status}"
    except ValueError:
        reason = f"status {resp.status}"
    return False, reason


class RuntimeSupervisor:
    """The slot table of one agent: which runtime process serves which replica."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state_dir = Path(settings.agent.state_dir) / settings.agent.node
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._slots: dict[int, HostedRuntime] = {}
        self.ledger = MemoryLedger.from_settings(settings)  # GPU / host memory each hosted replica holds

    # --- table ------------------------------------------------------------------------
    def port_of(self, slot: int) -> int:
        return self.settings.agent.port_base + slot

    def endpoint_of(self, slot: int) -> str:
        return f"http://{self.settings.agent.advertise_host}:{self.port_of(slot)}"

    def get(self, rid: str) -> HostedRuntime | None:
        with self._lock:
            for hosted in self._slots.values():
                if hosted.replica.id == rid:
                    return hosted
        return None

    def all(self) -> list[HostedRuntime]:
        with self._lock:
            return list(self._slots.values())

    def hosted_ids(self) -> set[str]:
        with self._lock:
            return {h.replica.id for h in self._slots.values()}

    def update(self, replica: Replica) -> None:
        """Remember the latest record of a hosted replica (what heartbeats re-create from)."""
        with self._lock:
            hosted = self._slots.get(replica.slot)
            if hosted is not None and hosted.replica.id == replica.id:
                hosted.replica = replica

    def _pidfile(self, slot: int) -> Path:
        return self.state_dir / f"slot-{slot}.json"

    def lease(self, slot: int) -> Path:
        return self.state_dir / f"slot-{slot}.lease"

    def touch_leases(self) -> None:
        """Vouch for every hosted runtime: its guard stops it once nobody has for `agent.orphan_grace_s`."""
        for hosted in self.all():
            try:
                self.lease(hosted.slot).touch()
            except OSError as exc:
                log.warning("could not touch the lease of %s: %s", hosted.replica.id, exc)

    def logfile(self, slot: int) -> Path:
        return self.state_dir / f"slot-{slot}.log"

    def log_tail(self, slot: int, lines: int = 15) -> str:
        try:
            text = self.logfile(slot).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    # --- spawn / reuse ----------------------------------------------------------------
    def ensure(self, replica: Replica, model_dir: str, *, now: float) -> HostedRuntime:
        """The runtime of `replica`: the running (or adopted) one, else a freshly spawned one."""
        if replica.slot >= self.settings.agent.replica_slots:
            raise PermanentError(
                f"slot {replica.slot} is outside this node's {self.settings.agent.replica_slots} replica slots"
            )
        with self._lock:
            hosted = self._slots.get(replica.slot)
            if hosted is not None:
                if hosted.replica.id != replica.id:
                    raise SlotBusy(f"slot {replica.slot} on node {replica.node} still hosts {hosted.replica.id}",
                                   retry_after=2.0)
                if hosted.exit_code() is None:
                    hosted.replica = replica
                    return hosted
                log.warning("runtime of %s (pid %d) ended; starting a new one", replica.id, hosted.pid)
                self._forget(replica.slot)
            hosted = self._spawn(replica, model_dir, now=now)
            self._slots[replica.slot] = hosted
            return hosted

    def _spawn(self, replica: Replica, model_dir: str, *, now: float) -> HostedRuntime:
        port = self.port_of(replica.slot)
        endpoint = self.endpoint_of(replica.slot)
        for pid in _runtime_pids_on(port):  # a runtime nobody recorded (its agent died before the pid file)
            log.warning("stopping an unrecorded runtime (pid %d) on port %d of slot %d", pid, port, replica.slot)
            _terminate(pid, None, 5.0)
        if any(_healthz(f"http://127.0.0.1:{port}", timeout=0.5, path=p) for p in ("/healthz", "/health")):
            raise TemporaryError(f"port {port} of slot {replica.slot} is taken by a process this agent does not know",
                                 retry_after=5.0)
        lease = self.lease(replica.slot)
        lease.touch()
        guard = [sys.executable, "-m", "workers.node.guard", "--lease", str(lease),
                 "--grace-s", repr(self.settings.agent.orphan_grace_s), "--"]
        server = engines.server_spec(self.settings, replica, model_dir, port)
        engine = server.engine if server is not None else engines.BUILTIN
        self._write_record(replica, port, None, model_dir, now, engine)  # before the spawn: a kill after it leaves one
        cmd = guard + (server.argv if server is not None else [
            sys.executable, "-m", "prewarm.cli", "serve-model",
            "--model-dir", model_dir,
            "--host", self.settings.runtime.host,
            "--port", str(port),
            "--model-name", replica.model,
            "--revision", replica.revision,
            "--node", replica.node,
            "--no-autoload",
        ])
        with open(self.logfile(replica.slot), "ab") as logfh:
            logfh.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {replica.id}\n".encode())
            logfh.flush()
            started_at_byte = logfh.tell()
            try:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, **server.env} if server is not None else None,
                )
            except BaseException:
                self._pidfile(replica.slot).unlink(missing_ok=True)
                raise
        hosted = HostedRuntime(replica=replica, port=port, pid=proc.pid, model_dir=model_dir, started_at=now,
                               endpoint=endpoint, proc=proc, engine=engine,
                               log=(str(self.logfile(replica.slot)), started_at_byte))
        self._write_record(replica, port, proc.pid, model_dir, now, engine)
        log.info("started runtime for %s: pid %d on port %d", replica.id, proc.pid, port)
        return hosted

    def _write_record(self, replica: Replica, port: int, pid: int | None, model_dir: str, started_at: float,
                      engine: str) -> None:
        """The slot's pid file (`pid` None: written before the spawn), replaced atomically."""
        data = {"replica_id": replica.id, "replica": replica.to_fields(), "pid": pid, "port": port,
                "model_dir": model_dir, "started_at": started_at, "engine": engine}
        tmp = self._pidfile(replica.slot).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self._pidfile(replica.slot))

    def wait_healthy(self, hosted: HostedRuntime, *, deadline: float, check: Callable[[], None] | None = None) -> None:
        """Wait until the runtime answers /healthz; RuntimeExited if it dies first; `check()` may abort."""
        while True:
            if check is not None:
                check()
            code = hosted.exit_code()
            if code is not None:
                raise RuntimeExited(f"runtime of {hosted.replica.id} exited with status {code}: "
                                    f"{self.log_tail(hosted.slot)}")
            if _healthz(hosted.endpoint, path=hosted.health_path):
                return
            if time.monotonic() > deadline:
                raise TemporaryError(f"runtime of {hosted.replica.id} did not answer {hosted.health_path} in time", 5.0)
            time.sleep(0.1)

    # --- stop -------------------------------------------------------------------------
    def stop(self, rid: str, *, grace_s: float = 10.0) -> bool:
        """Stop the runtime of `rid` (SIGTERM, then SIGKILL after `grace_s`) and free its memory; False if not hosted."""
        with self._lock:
            hosted = self.get(rid)
            self.ledger.release(rid)  # also a booking whose runtime never started
            if hosted is None:
                return False
            self._forget(hosted.slot)
        _terminate(hosted.pid, hosted.proc, grace_s)
        log.info("stopped runtime of %s (pid %d)", rid, hosted.pid)
        return True

    def stop_all(self, *, grace_s: float = 10.0) -> None:
        for hosted in self.all():
            self.stop(hosted.replica.id, grace_s=grace_s)

    def _forget(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._pidfile(slot).unlink(missing_ok=True)
        self.lease(slot).unlink(missing_ok=True)

    # --- after a crash ----------------------------------------------------------------
    def adopt_orphans(self, keep: Callable[[Replica], Replica | None]) -> list[HostedRuntime]:
        """Look at the pid files a previous agent left: adopt what `keep` accepts, stop the rest.

        `keep(replica)` returns the current record when the replica should go on being hosted
        (it is still live in the registry), else None.
        """
        adopted = []
        for path in sorted(self.state_dir.glob("slot-*.json")):
            try:
                data = json.loads(path.read_text())
                replica = Replica.from_fields(data["replica"])
                pid, port = recorded_pid(data), int(data["port"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable pid file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if pid is None:  # recorded before a spawn that never ran, or whose runtime has ended
                path.unlink(missing_ok=True)
                continue
            alive = _pid_alive(pid) and _is_our_runtime(pid, port)
            current = keep(replica) if alive else None
            engine = str(data.get("engine", engines.BUILTIN))
            if alive and current is not None and self._await_healthz(pid, replica.slot, engines.health_path(engine)):
                hosted = HostedRuntime(replica=current, port=port, pid=pid, model_dir=str(data.get("model_dir", "")),
                                       started_at=float(data.get("started_at", 0.0)),
                                       endpoint=self.endpoint_of(replica.slot), adopted=True, engine=engine)
                with self._lock:
                    self._slots[replica.slot] = hosted
                if data.get("pid") is None:  # found by its port: recorded with its pid from now on
                    self._write_record(current, port, pid, hosted.model_dir, hosted.started_at, engine)
                self.lease(replica.slot).touch()
                adopted.append(hosted)
                log.info("adopted runtime of %s (pid %d) left by a previous agent", replica.id, pid)
                continue
            if alive:
                log.info("stopping orphaned runtime of %s (pid %d): its replica is no longer live", replica.id, pid)
                _terminate(pid, None, 5.0)
            path.unlink(missing_ok=True)
        return adopted

    def _await_healthz(self, pid: int, slot: int, path: str = "/healthz") -> bool:
        """An orphan may still be starting (importing torch): give it the runtime start timeout."""
        deadline = time.monotonic() + self.settings.agent.runtime_start_timeout_s
        while _pid_alive(pid):
            if _healthz(self.endpoint_of(slot), timeout=1.0, path=path):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return False


def _terminate(pid: int, proc: "subprocess.Popen[bytes] | None", grace_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not _pid_alive(pid):
            return
        time.sleep(0.05)
    try:  # the guard leads its own process group: this takes the runtime under it along
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    if proc is not None:
        proc.wait(timeout=5)


__all__ = ["HostedRuntime", "RuntimeExited", "RuntimeSupervisor"]
