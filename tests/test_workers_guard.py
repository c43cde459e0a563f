"""The runtime guard as a real process: it stops an orphaned child once nobody refreshes its lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.celery_helpers import wait_for

CHILD = (
    "import os, signal, sys, time\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "def term(*_):\n"
    "    open(sys.argv[1] + '.term', 'w').write('1'); sys.exit(3)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "time.sleep(60)\n"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _guard(tmp: Path, grace: float) -> tuple["subprocess.Popen[bytes]", Path, Path]:
    lease, pidfile = tmp / "slot.lease", tmp / "child.pid"
    lease.touch()
    proc = subprocess.Popen([sys.executable, "-m", "workers.node.guard", "--lease", str(lease), "--grace-s", str(grace),
                             "--poll-s", "0.1", "--", sys.executable, "-c", CHILD, str(pidfile)],
                            cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE)
    wait_for(lambda: pidfile.exists() and pidfile.read_text(), 20, "the guarded child to start")
    return proc, lease, pidfile


def test_a_refreshed_lease_keeps_the_runtime_and_a_stale_one_stops_it(tmp_path: Path) -> None:
    proc, lease, pidfile = _guard(tmp_path, grace=1.0)
    child = int(pidfile.read_text())
    try:
        for _ in range(15):  # an agent heartbeating: 3 s, well past the grace
            os.utime(lease)
            time.sleep(0.2)
        assert proc.poll() is None and _alive(child)
        code = proc.wait(timeout=20)  # the agent is gone: nobody touches the lease
        assert code == 0
        assert b"stopping the orphaned runtime" in proc.stderr.read()  # type: ignore[union-attr]
        assert not _alive(child)
        assert (tmp_path / "child.pid.term").exists()  # stopped with SIGTERM, cleanly
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_is_forwarded_and_the_runtime_status_returned(tmp_path: Path) -> None:
    proc, lease, pidfile = _guard(tmp_path, grace=60.0)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 3
    assert not _alive(child)
