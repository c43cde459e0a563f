"""benchmarks/load.py's readers of wrk and hey, run against real servers for a second.

The load benchmark's figures are only as good as its parsing of the load generators, so
the real `wrk` (with `wrk_post.lua`) and the real `hey` run here against a small real
upstream that answers 200, and one that answers 500: every request must be counted, and
every 500 counted as an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Iterator

import pytest

from benchmarks.common import cpu_list, pinned
from benchmarks.load import rate_plan, run_hey, run_wrk, split_cpus
from tests.httpservers import AppThread, Upstream

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("hey") is None,
                                reason="the Debian packages wrk and hey are not installed")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[AppThread, Upstream, AppThread, Upstream]]:
    ok, failing = Upstream("ok"), Upstream("fail", mode="fail")
    a, b = AppThread(ok.app()).start(), AppThread(failing.app()).start()
    yield a, ok, b, failing
    a.stop()
    b.stop()


def test_wrk_counts_every_request_and_every_error(servers: tuple[AppThread, Upstream, AppThread, Upstream]) -> None:
    a, ok, b, failing = servers
    before = len(ok.received)
    good = run_wrk(f"{a.url}/v1/completions", 1, connections=4)
    assert good.requests > 0 and good.errors == 0 and good.rps > 0
    assert len(ok.received) - before >= good.requests  # wrk does not count requests still in flight at the end
    assert ok.received[-1]["max_tokens"] == 1 and ok.received[-1]["model"] == "loadbench"
    bad = run_wrk(f"{b.url}/v1/completions", 1, connections=4)
    assert bad.requests > 0 and bad.non2xx == bad.requests == bad.errors


def test_hey_at_a_fixed_rate_splits_over_urls(servers: tuple[AppThread, Upstream, AppThread, Upstream]) -> None:
    a, ok, b, failing = servers
    workers, q = rate_plan(40.0, parts=2)
    assert workers % 2 == 0 and workers * q == pytest.approx(40.0)
    result = run_hey([f"{a.url}/v1/completions", f"{b.url}/v1/completions"], 1, workers, q)
    assert result.statuses.get("200", 0) > 0 and result.statuses.get("500", 0) > 0
    assert result.errors == result.statuses["500"]
    assert len(result.latencies_s) == result.statuses["200"]
    with pytest.raises(ValueError, match="split evenly"):
        run_hey([f"{a.url}/v1/completions"] * 2, 1, 3, 1.0)


def test_replica_cpus_split_the_machine_and_pin_what_is_started_there() -> None:
    """`--replica-cpus`: the replicas on the CPUs named, the rest of this process's CPUs for everything else;
    a list naming a CPU this process may not use, or every one of them, is refused, saying why."""
    assert cpu_list("0-2,5") == {0, 1, 2, 5} and split_cpus(None) == (None, None)
    mine = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="not available"):
        split_cpus(str(max(mine) + 1))
    with pytest.raises(ValueError, match="leaves no CPU"):
        split_cpus(",".join(map(str, mine)))
    with pytest.raises(ValueError, match="not a CPU list"):
        cpu_list("first")
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split")
    pin, rest = split_cpus(str(mine[0]))
    assert pin == str(mine[0]) and rest is not None and cpu_list(rest) == set(mine[1:])
    proc = subprocess.Popen(pinned(["sleep", "30"], pin))
    try:
        def allowed() -> str:
            status = open(f"/proc/{proc.pid}/status").read()
            return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                        if line.startswith("Cpus_allowed_list"))
        deadline = time.monotonic() + 10
        while not open(f"/proc/{proc.pid}/cmdline").read().startswith("sleep") and time.monotonic() < deadline:
            time.sleep(0.05)  # until taskset has set the mask and exec'd the command
        assert allowed() == pin
    finally:
        proc.kill()
        proc.wait()
