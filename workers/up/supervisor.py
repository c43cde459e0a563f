"""Child processes of `prewarm up`: started in their own process groups, logged to files,
and all stopped — with whatever runtimes the agents spawned — when the run ends.

Nothing may be left running after Ctrl-C or the end of a replay, so stopping is layered:
SIGTERM to each group (agents stop their runtimes on the way out), a grace period,
SIGKILL to what remains, then any runtime still named in an agent's pid files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from workers.node.supervision import recorded_pid


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]


@dataclass
class Supervisor:
    log_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)
    pid_dirs: list[Path] = field(default_factory=list)  # agent state dirs holding runtime pid files

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `prewarm ARGS` (or a full argv when args[0] is absolute) in a new process group."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop_all
        argv = args if os.path.isabs(args[0]) else [str(Path(sys.executable).with_name("prewarm")), *args]
        proc = subprocess.Popen(
            argv, env={**os.environ, **self.env, **(env or {})}, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        child = Child(name, proc, log_path, log)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def tail(self, child: Child, lines: int = 20) -> str:
        try:
            return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop_all(self, grace_s: float = 15.0) -> None:
        for child in reversed(self.children):
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            if child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
            child.log.close()
        for pid in self._runtime_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _runtime_pids(self) -> list[int]:
        pids = []
        for d in self.pid_dirs:
            for f in d.rglob("slot-*.json"):
                try:
                    pid = recorded_pid(json.loads(f.read_text()))
                    if pid is None:
                        continue
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if b"serve-model" in cmdline:
                    pids.append(pid)
        return pids


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
