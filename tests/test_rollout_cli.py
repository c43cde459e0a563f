"""`prewarm rollout` against a real Redis: start, status, pause, resume, abort; bad input changes nothing."""

from __future__ import annotations

import json
import time

import pytest
import redis

from prewarm.cli import main
from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.rollouts import RolloutStore


def ready(reg: ReplicaRegistry, rev: str, node: str, slot: int) -> None:
    r = Replica("llama", rev, node, slot, endpoint=f"http://127.0.0.1:{9000 + slot}")
    now = time.time()
    reg.register(r, now=now)
    for st in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        reg.transition(r.id, st, now=now)


@pytest.fixture()
def cluster(redis_client: "redis.Redis[str]", redis_url: str, clean_env: pytest.MonkeyPatch) -> "redis.Redis[str]":
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    reg = ReplicaRegistry(redis_client)
    ready(reg, "r1", "n1", 0)
    ready(reg, "r1", "n1", 1)
    # the node holds r2 on disk (its agent's view), so r2 is a known revision
    redis_client.sadd(keys.NODES, "n1")
    redis_client.hset(keys.node_info("n1"), "residency", json.dumps({"llama@r1": "gpu", "llama@r2": "disk"}))
    return redis_client


def snapshot(client: "redis.Redis[str]") -> dict[str, str | None]:
    return {k: client.get(k) for k in (keys.rollout("llama"), keys.revision_weights("llama"))}


def test_start_status_pause_resume_abort(cluster: "redis.Redis[str]", capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "start", "llama", "--revision", "r2", "--steps", "5,25,50,100", "--pause", "10m",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["stable"], out["canary"], out["phase"], out["pause_s"]) == ("r1", "r2", "running", 600.0)
    assert RolloutStore(cluster).weights("llama") == [("r2", 0.0), ("r1", 100.0)]  # nothing shifted before capacity
    assert main(["rollout", "pause", "llama"]) == 0
    assert main(["rollout", "status", "llama", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["phase"] == "paused"
    assert main(["rollout", "resume", "llama"]) == 0
    assert main(["rollout", "abort", "llama", "--reason", "changed my mind"]) == 0
    st = RolloutStore(cluster).get("llama")
    assert st is not None and st.phase.value == "rolled_back" and st.reason == "changed my mind"
    assert RolloutStore(cluster).weights("llama") == [("r2", 0.0), ("r1", 100.0)]


def test_a_restarted_reader_sees_the_same_rollout(cluster: "redis.Redis[str]", redis_url: str) -> None:
    assert main(["rollout", "start", "llama", "--revision", "r2", "--pause", "90s"]) == 0
    fresh = redis.Redis.from_url(redis_url, decode_responses=True)  # another process, after a restart
    try:
        st = RolloutStore(fresh).get("llama")
    finally:
        fresh.close()
    assert st is not None and st.spec.canary == "r2" and st.spec.pause_s == 90.0 and st.phase.value == "running"


@pytest.mark.parametrize("argv, message", [
    (["rollout", "start", "llama", "--revision", "r9"], "unknown revision 'r9'"),
    (["rollout", "start", "llama", "--revision", "r2", "--steps", "25,5,100"], "steps out of order"),
    (["rollout", "start", "llama", "--revision", "r2", "--steps", "5,50"], "not 100"),
    (["rollout", "start", "llama", "--revision", "r2", "--from", "r0"], "no live revision 'r0'"),
    (["rollout", "start", "nomodel", "--revision", "r2"], "no live replica"),
    (["rollout", "pause", "llama"], "no rollout of llama"),
])
def test_bad_input_is_refused_and_changes_nothing(cluster: "redis.Redis[str]", capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], message: str) -> None:
    before = snapshot(cluster)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert snapshot(cluster) == before


def test_a_second_rollout_while_one_runs_is_refused(cluster: "redis.Redis[str]",
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cluster.hset(keys.node_info("n1"), "residency", json.dumps({"llama@r1": "gpu", "llama@r2": "disk",
                                                                "llama@r3": "disk"}))
    assert main(["rollout", "start", "llama", "--revision", "r2"]) == 0
    before = snapshot(cluster)
    assert main(["rollout", "start", "llama", "--revision", "r3"]) == 2
    assert "is running" in capsys.readouterr().err
    assert snapshot(cluster) == before


def test_a_bad_duration_is_an_argument_error(cluster: "redis.Redis[str]", capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["rollout", "start", "llama", "--revision", "r2", "--pause", "ten minutes"])
    assert exc.value.code == 2 and "not a duration" in capsys.readouterr().err
