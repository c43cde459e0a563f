"""benchmarks/load.py's readers of wrk and hey, run against real servers for a second.

The load benchmark's figures are only as good as its parsing of the load generators, so
the real `wrk` (with `wrk_post.lua`) and the real `hey` run here against a small real
upstream that answers 200, and one that answers 500: every request must be counted, and
every 500 counted as an error.
"""

from __future__ import annotations

import shutil
from typing import Iterator

import pytest

from benchmarks.load import rate_plan, run_hey, run_wrk
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
