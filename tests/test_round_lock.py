"""One planning round at a time: the beat's round is skipped while another holds the round's lock, and
`prewarm plan` waits for it (`workers.planning.round_lock`)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from prewarm.cli import main
from prewarm.core import keys
from prewarm.core.planner_settings import PlannerSettings
from prewarm.core.settings import RedisSettings, Settings
from tests.test_rollout_planner import steady_load
from workers import names
from workers.app import make_app
from workers.planning.round_lock import MIN_TTL_S, planning_round, ttl_s


def test_the_lock_is_held_for_the_round_only_and_expires_after_three_intervals(
        redis_client: "redis.Redis[str]") -> None:
    assert ttl_s(5.0) == MIN_TTL_S and ttl_s(60.0) == 180.0
    with planning_round(redis_client, 60.0) as mine:
        assert mine
        assert 170_000 < redis_client.pttl(keys.PLAN_ROUND_LOCK) <= 180_000
        with planning_round(redis_client, 60.0) as second:  # another thread or pod meanwhile
            assert not second
        assert redis_client.exists(keys.PLAN_ROUND_LOCK)  # the loser did not release the holder's lock
    assert not redis_client.exists(keys.PLAN_ROUND_LOCK)
    with pytest.raises(RuntimeError):
        with planning_round(redis_client, 60.0):
            raise RuntimeError("a round that fails")
    assert not redis_client.exists(keys.PLAN_ROUND_LOCK)  # released on the way out


def test_the_beats_round_is_skipped_while_another_runs(redis_url: str, redis_client: "redis.Redis[str]") -> None:
    steady_load(redis_client)  # an hour of 20 requests in flight for tiny: a round plans it
    app = make_app(Settings(redis=RedisSettings(url=redis_url), planner=PlannerSettings(models=["tiny@r1"])))
    try:
        task = app.tasks[names.FORECAST]
        holder = redis_client.lock(keys.PLAN_ROUND_LOCK, timeout=30)
        assert holder.acquire(blocking=False)
        out = task.apply().get()
        assert out["skipped"] and out["models"] == []
        assert not redis_client.exists(keys.last_forecast("tiny"))  # nothing planned, nothing queued
        assert redis_client.zcard(keys.PLANNED_EVENTS) == 0
        holder.release()
        out = task.apply().get()
        assert "skipped" not in out and [m["model"] for m in out["models"]] == ["tiny"]
        assert redis_client.hget(keys.last_forecast("tiny"), "status") == "planned"
        assert not redis_client.exists(keys.PLAN_ROUND_LOCK)
    finally:
        app.close()


def test_prewarm_plan_waits_for_the_round_in_progress(redis_url: str, redis_client: "redis.Redis[str]",
                                                      clean_env: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    clean_env.setenv("PREWARM_PLANNER_MODELS", '["tiny@r1"]')
    steady_load(redis_client)  # an hour of 20 requests in flight for tiny: a round plans it
    holder = redis_client.lock(keys.PLAN_ROUND_LOCK, timeout=30, thread_local=False)  # released by a timer thread
    assert holder.acquire(blocking=False)
    released = threading.Timer(1.0, holder.release)
    released.start()
    t0 = time.monotonic()
    try:
        assert main(["plan"]) == 0
    finally:
        released.join()
    assert time.monotonic() - t0 >= 0.9  # it waited for the holder
    assert '"model": "tiny"' in capsys.readouterr().out
    assert redis_client.hget(keys.last_forecast("tiny"), "status") == "planned"
