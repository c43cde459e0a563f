"""`prewarm plan --dry-run`: the events the planner would emit now, per model, and nothing done."""

from __future__ import annotations

import json
import time

import pytest
import redis

from prewarm.cli import main
from prewarm.core import keys
from tests.celery_helpers import steady_counters


def test_plan_dry_run_prints_the_events_and_changes_nothing(redis_client: "redis.Redis[str]", redis_url: str,
                                                            clean_env: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["tiny@r1"]')
    clean_env.setenv("PREWARM_PLANNER_MARGIN_INITIAL", "1.5")  # the staffing beta this arithmetic was written for
    steady_counters(redis_client, "tiny")  # an hour of 20 requests in flight, and a few buckets ahead for a slow clock
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


def test_plan_dry_run_with_a_fleet_budget_prints_the_pool_round_and_changes_nothing(
        redis_client: "redis.Redis[str]", redis_url: str, clean_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With `planner.fleet_budget_gb` the planner worker runs one fleet round over the pool: the dry run prints
    that round (each model's tier, nodes and the actions the agents would get), not each model planned alone."""
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["a@r1","b@r1"]')
    clean_env.setenv("PREWARM_PLANNER_FLEET_BUDGET_GB", "40")
    clean_env.setenv("PREWARM_PLANNER_MODEL_MEMORY_GB", json.dumps({"a": 40.0, "b": 40.0}))
    redis_client.hset(keys.node_info("n1"), mapping={"name": "n1", "replica_slots": "2", "ready": "1",
                                                     "gpu_memory_gb": "100", "host_memory_gb": "0"})
    current = int(time.time() // 60) * 60
    for ago in range(1, 120):  # a: every minute; b: one request, long ago
        redis_client.set(keys.requests("a", 60, current - 60 * ago), 600)
    redis_client.set(keys.requests("b", 60, current - 60 * 110), 1)
    redis_client.sadd(keys.REQUEST_MODELS, "a", "b")
    before = {k: redis_client.dump(k) for k in redis_client.keys("*")}

    assert main(["plan", "--dry-run", "--json"]) == 0
    out = {o["model"]: o for o in (json.loads(line) for line in capsys.readouterr().out.splitlines()
                                   if line.startswith("{"))}
    assert set(out) == {"a", "b"} and all(o["fleet"] for o in out.values())
    assert out["a"]["tier"] == "gpu" and out["a"]["nodes"] == ["n1"] and out["a"]["actions"] == [
        {"kind": "load", "node": "n1"}]
    assert out["b"]["tier"] == "cold" and out["b"]["actions"] == []  # the budget holds one 40 GB model
    assert {k: redis_client.dump(k) for k in redis_client.keys("*")} == before  # no task, no price, no plan written

    assert main(["plan", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "fleet round:" in text and "within 40 GB" in text and "cold-start budget" in text and "nothing done" in text
    assert "a@r1: gpu on n1, 1 replica(s) on GPU" in text and "would load on n1" in text
