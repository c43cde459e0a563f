"""The runtime guard: a replica's runtime ends when no agent vouches for it any more.

Runtimes outlive their agent on purpose (an agent that restarts adopts them and no load is
lost), but an agent that never comes back must not leave a model holding GPU memory. The
agent starts each runtime under this small guard (no torch, a few MB) and touches the
slot's lease file on every heartbeat; a successor that adopts the runtime touches it too.
When the lease is older than `--grace-s`, the guard stops the runtime (SIGTERM, then
SIGKILL) and exits. SIGTERM/SIGINT to the guard are forwarded to the runtime, and the
guard exits with the runtime's status, so to the agent the guard is the runtime.

    python -m workers.node.guard --lease PATH --grace-s 300 -- prewarm serve-model ...
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from prewarm.registry.embedded import stop_process


def lease_age(path: Path, started: float, now: float) -> float:
    """Seconds since the lease was last touched (since the guard started when it was never written)."""
    try:
        return now - max(path.stat().st_mtime, started)
    except FileNotFoundError:
        return now - started


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m workers.node.guard --lease PATH --grace-s S -- COMMAND ...", file=sys.stderr)
        return 2
    split = args.index("--")
    parser = argparse.ArgumentParser(prog="workers.guard")
    parser.add_argument("--lease", required=True, type=Path)
    parser.add_argument("--grace-s", required=True, type=float)
    parser.add_argument("--poll-s", type=float, default=1.0)
    opts = parser.parse_args(args[:split])
    command = args[split + 1:]
    if not command:
        parser.error("no command after --")
    started = time.time()
    proc = subprocess.Popen(command)

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            code = proc.wait(timeout=opts.poll_s)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        age = lease_age(opts.lease, started, time.time())
        if age > opts.grace_s:
            print(f"workers.node.guard: no agent refreshed {opts.lease} for {age:.0f}s (grace {opts.grace_s:.0f}s): "
                  f"stopping the orphaned runtime (pid {proc.pid})", file=sys.stderr, flush=True)
            stop_process(proc)
            return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
