"""`prewarm plan --dry-run`: the events the planner would emit now, per model, and nothing done."""

from __future__ import annotations

import json
import time

import pytest
import redis

from prewarm.cli import main
from prewarm.core import keys


def test_plan_dry_run_prints_the_events_and_changes_nothing(redis_client: "redis.Redis[str]", redis_url: str,
                                                            clean_env: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["tiny@r1"]')
    clean_env.setenv("PREWARM_PLANNER_MARGIN_INITIAL", "1.5")  # the staffing beta this arithmetic was written for
    fine = int(time.time() // 10) * 10
    for i in range(-3, 361):  # an hour of 20 requests in flight, and a few buckets ahead for a slow clock
        start = fine - 10 * i
        redis_client.set(keys.requests("tiny", 10, start), 100)
        redis_client.set(keys.inflight_peak("tiny", 10, start), 24)
        redis_client.set(keys.busy("tiny", 10, start), 200.0)
    redis_client.hset(keys.REQUESTS_FIRST, "tiny", fine - 3600)
    redis_client.sadd(keys.REQUEST_MODELS, "tiny")
    before = set(redis_client.keys("*"))

    assert main(["plan", "--dry-run", "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [o["model"] for o in out] == ["tiny"]
    assert out[0]["mode"] == "predictive" and out[0]["target"] == 4 and out[0]["live"] == 0
    assert [(e["kind"], e["pool"], e["replicas"]) for e in out[0]["events"]] == [("scale_up", "serving", 4)]
    assert set(redis_client.keys("*")) == before  # no event queued, no state saved, no record written

    assert main(["plan", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "tiny@r1: predictive mode" in text and "would scale_up 4 (serving)" in text and "nothing done" in text
