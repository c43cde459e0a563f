"""Unit tests of the Celery pipeline's pure parts: payload validation, routing, placement, app settings."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from prewarm.core import keys
from prewarm.core.domain import Pool
from prewarm.core.errors import InvalidPayload, PermanentError, SettingsError, TemporaryError, WeightsError
from prewarm.runtime.manifest import CorruptWeights
from prewarm.core.settings import AgentSettings, RedisSettings, Settings
from workers import payload
from workers.beat import BeatLock
from workers.app import make_app
from workers.names import DEMAND_QUEUE, HANDLE_DEMAND, KEEP_WARM, PLANNER_QUEUE, PREWARM, REAP, route_task
from workers.node.supervision import RuntimeExited
from prewarm.core.errors import failure_reason
from workers.node.bringup import DeadlineExceeded
from workers.planning.nodes import NodeSlots, pick_slots
from workers.planning.tasks import resolve_revision


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "missing required argument(s) replica_id"),
        ((1,), {}, "replica_id must be a string"),
        (("m@r/n/x",), {}, "replica_id must look like"),
        (("m@r/n/0", "cold"), {}, "pool must be one of"),
        (("m@r/n/0",), {"replica_id": "m@r/n/0"}, "given twice"),
        (("m@r/n/0", "serving", None, "extra"), {}, "takes at most 3 arguments"),
        (("m@r/n/0",), {"model_dir": ""}, "model_dir must be a non-empty path"),
        (("m@r/n/0",), {"priority": 1}, "unknown argument 'priority'"),
        (("bad name@r/n/0",), {}, "model must be"),
    ],
)
def test_prewarm_payload_refusals_name_the_field(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPayload) as err:
        payload.parse_prewarm(args, kwargs)
    assert message in str(err.value)


def test_prewarm_payload_accepts_positional_and_keyword_forms() -> None:
    a = payload.parse_prewarm(("m@r1/n1/2", "warm", "/models/m"), {})
    b = payload.parse_prewarm((), {"replica_id": "m@r1/n1/2", "pool": "warm", "model_dir": "/models/m"})
    assert a == b
    assert (a.replica.model, a.replica.revision, a.replica.node, a.replica.slot) == ("m", "r1", "n1", 2)
    assert a.pool is Pool.WARM
    assert payload.parse_prewarm(("m@r1/n1/0",), {}).model_dir is None


@pytest.mark.parametrize("until", ["soon", float("nan"), float("inf"), True, None])
def test_keep_warm_until_must_be_a_finite_number(until: Any) -> None:
    with pytest.raises(InvalidPayload, match="until must be a finite number"):
        payload.parse_keep_warm(("m@r/n/0", until), {})


def test_retire_reason_is_bounded() -> None:
    assert payload.parse_retire(("m@r/n/0",), {}).reason == ""
    with pytest.raises(InvalidPayload, match="reason"):
        payload.parse_retire(("m@r/n/0", "x" * 201), {})


def test_node_tasks_route_to_the_node_named_in_the_replica_id() -> None:
    assert route_task(PREWARM, ["m@r/gpu-7/0"], {}, {}) == {"queue": "prewarm.node.gpu-7"}
    assert route_task(KEEP_WARM, [], {"replica_id": "m@r/gpu-3/1", "until": 1.0}, {}) == {"queue": "prewarm.node.gpu-3"}
    # unreadable ids go where a worker refuses them clearly, not to a queue nobody consumes
    assert route_task(PREWARM, ["garbage"], {}, {}) == {"queue": PLANNER_QUEUE}
    assert route_task(PREWARM, [], {}, {}) == {"queue": PLANNER_QUEUE}
    assert route_task(REAP, [], {}, {}) == {"queue": PLANNER_QUEUE}
    assert route_task(HANDLE_DEMAND, ["m"], {}, {}) == {"queue": DEMAND_QUEUE}  # issue 20: apart from the periodic tasks


def test_app_follows_the_delivery_decisions() -> None:
    settings = Settings(redis=RedisSettings(url="redis://127.0.0.1:1/0"),
                        agent=AgentSettings(task_time_limit_s=100))
    app = make_app(settings)
    conf = app.conf
    assert conf.task_serializer == "json" and conf.accept_content == ["json"] and conf.result_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.task_ignore_result
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit == 100
    # a worker killed inside kombu's restore must not hold up redeliveries for kombu's default 300 s
    assert conf.broker_transport_options["unacked_mutex_expire"] < conf.broker_transport_options["visibility_timeout"]
    assert not conf.task_always_eager
    task = app.tasks[PREWARM]
    assert task.acks_late and task.reject_on_worker_lost and task.ignore_result and not task.typing
    app.close()


def test_visibility_timeout_must_exceed_the_time_limit() -> None:
    with pytest.raises(Exception, match="greater than task_time_limit_s"):
        AgentSettings(task_time_limit_s=60, visibility_timeout_s=60)
    assert AgentSettings(task_time_limit_s=60).effective_visibility_timeout_s == 120


def test_agent_command_needs_a_shared_redis(clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from prewarm.cli import main

    assert main(["agent", "--node", "n1"]) == 2
    assert "PREWARM_REDIS_URL is not set" in capsys.readouterr().err
    assert main(["agent", "--node", "bad node"]) == 2
    assert "--node must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (CorruptWeights("layers.0.w", "sha256 mismatch"), "bad_weights"),
        (WeightsError("runtime of x failed to load: tensor 'a' is corrupt: sha256 mismatch"), "bad_weights"),
        (PermanentError("a message that says corrupt and checksum"), "permanent"),  # types decide, never text
        (InvalidPayload("pool"), "invalid_payload"),
        (RuntimeExited("status 1"), "runtime_exited"),
        (DeadlineExceeded("late"), "timeout"),
        (PermanentError("illegal"), "permanent"),
        (TemporaryError("later"), "temporary"),
        (ValueError("bug"), "internal"),
    ],
)
def test_failure_reasons_are_low_cardinality_codes(exc: BaseException, reason: str) -> None:
    assert failure_reason(exc) == reason


def test_placement_prefers_the_node_with_most_free_slots() -> None:
    nodes = [NodeSlots("a", 2, frozenset({0})), NodeSlots("b", 3, frozenset({1})), NodeSlots("c", 1, frozenset({0}))]
    assert pick_slots(nodes, 1) == [("b", 0)]
    assert pick_slots([NodeSlots("a", 1, frozenset({0}))], 1) == []
    assert pick_slots([NodeSlots("z", 2, frozenset()), NodeSlots("y", 2, frozenset())], 1) == [("y", 0)]


def test_revision_comes_from_configuration_then_history() -> None:
    assert resolve_revision("m", ["x@1", "m@r7"], [("r1", 5.0)]) == "r7"
    assert resolve_revision("m", ["x@1"], [("r1", 5.0), ("r2", 9.0)]) == "r2"
    assert resolve_revision("m", [], []) is None


def test_settings_error_is_a_permanent_error() -> None:
    assert issubclass(SettingsError, PermanentError)


def test_beat_lock_on_real_redis(redis_client: "redis.Redis[str]") -> None:
    a = BeatLock(redis_client, "a", ttl_s=2)
    b = BeatLock(redis_client, "b", ttl_s=2)
    assert a.wait_acquire(timeout_s=1)
    assert not b.wait_acquire(poll_s=0.1, timeout_s=0.5)
    a.release()
    assert b.wait_acquire(timeout_s=1)
    b.release()


def test_beat_lock_release_never_deletes_a_successors_lock(redis_client: "redis.Redis[str]") -> None:
    """A beat whose lock expired (it stalled) and was taken over must leave the new holder's lock."""
    a = BeatLock(redis_client, "a", ttl_s=1)
    assert a.wait_acquire(timeout_s=1)
    a._stop.set()  # a stalls: no refresh
    b = BeatLock(redis_client, "b", ttl_s=30)
    assert b.wait_acquire(poll_s=0.1, timeout_s=5)
    a.release()
    assert redis_client.get(keys.BEAT_LOCK) == "b"
    b.release()
    assert redis_client.get(keys.BEAT_LOCK) is None


def test_worker_processes_never_import_torch() -> None:
    """CUDA is initialised in each replica's runtime process, never in an agent or planner worker."""
    import subprocess
    import sys

    code = ("import sys, workers.node.agent, workers.node.tasks, workers.node.bringup, workers.node.operations, workers.planning.executor, "
            "workers.beat; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_live_counts_a_loading_warm_replica_counts_as_warm() -> None:
    """Otherwise every plan while it loads would start another warm replica."""
    from prewarm.core.domain import Replica, ReplicaState
    from workers.planning.executor import live_counts

    reps = [Replica("m", "r", "n", 0, state=ReplicaState.READY, pool=Pool.SERVING),
            Replica("m", "r", "n", 1, state=ReplicaState.LOADING, pool=Pool.SERVING),
            Replica("m", "r", "n", 2, state=ReplicaState.LOADING, pool=Pool.WARM),
            Replica("m", "r", "n", 3, state=ReplicaState.READY, pool=Pool.WARM),
            Replica("m", "r", "n", 4, state=ReplicaState.RETIRED, pool=Pool.WARM)]
    assert live_counts(reps) == {"ready": 1, "loading": 1, "warm": 2, "asleep": 0}


def test_placement_slots_follow_the_planners_rule_and_its_wish() -> None:
    from workers.planning.nodes import pick_slots

    nodes = [NodeSlots("a", 4, frozenset({0})), NodeSlots("b", 4, frozenset({0, 1, 2}))]
    assert pick_slots(nodes, 3, wanted=("b",)) == [("b", 3), ("a", 1), ("a", 2)]
    snap = {"b": frozenset({"m@r"})}
    assert pick_slots(nodes, 1, model_key="m@r", snapshots=snap) == [("b", 3)]  # the snapshot holder first
