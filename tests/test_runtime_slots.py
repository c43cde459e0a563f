"""A node's replica slots under the agent's runtime supervisor, with real runtime processes.

The planner hands a slot to a new replica once the old one has left the registry's live
states, which can be before the agent has stopped the old runtime (the retire runs beside
the prewarm). The new replica then waits for the slot (a temporary error, retried by the
task) instead of being failed for good.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from prewarm.core.domain import Replica
from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.runtime.model import make_model
from tests.celery_helpers import settings_from_env, worker_env
from workers.node import supervision
from workers.node.supervision import RuntimeSupervisor, SlotBusy, recorded_pid


def test_a_slot_still_hosting_a_leaving_replica_is_busy_not_a_failure(tmp_path: Path) -> None:
    settings = settings_from_env(worker_env("redis://127.0.0.1:1/0", tmp_path))
    host = RuntimeSupervisor(settings)
    old, new = Replica("a", "r1", "n1", 0), Replica("b", "r1", "n1", 0)
    for name in ("a", "b"):
        make_model(tmp_path / "models" / name, "tiny", name=name, revision="r1")
    try:
        hosted = host.ensure(old, str(tmp_path / "models" / "a"), now=time.time())
        host.wait_healthy(hosted, deadline=time.monotonic() + 60)
        with pytest.raises(SlotBusy, match="slot 0 on node n1 still hosts a@r1/n1/0") as busy:
            host.ensure(new, str(tmp_path / "models" / "b"), now=time.time())
        assert isinstance(busy.value, TemporaryError) and not isinstance(busy.value, PermanentError)
        assert busy.value.retry_after > 0
        assert host.stop(old.id, grace_s=5.0)  # the retire's part
        took = host.ensure(new, str(tmp_path / "models" / "b"), now=time.time())  # the prewarm's retry
        assert took.replica.id == new.id and took.pid != hosted.pid
        host.wait_healthy(took, deadline=time.monotonic() + 60)
    finally:
        host.stop_all(grace_s=5.0)


def test_a_runtime_recorded_before_its_pid_is_adopted_by_the_next_agent(tmp_path: Path) -> None:
    """An agent killed between a runtime's spawn and its pid (a stall of its thread on a loaded machine) leaves
    the record it wrote before the spawn: the next agent finds the runtime by its port and adopts it."""
    settings = settings_from_env(worker_env("redis://127.0.0.1:1/0", tmp_path))
    host = RuntimeSupervisor(settings)
    replica = Replica("a", "r1", "n1", 1)
    make_model(tmp_path / "models" / "a", "tiny", name="a", revision="r1")
    successor = RuntimeSupervisor(settings)
    try:
        hosted = host.ensure(replica, str(tmp_path / "models" / "a"), now=time.time())
        host.wait_healthy(hosted, deadline=time.monotonic() + 60)
        record = host.state_dir / "slot-1.json"
        data = json.loads(record.read_text())
        record.write_text(json.dumps(data | {"pid": None}))  # as the agent left it had it died before the pid
        adopted = successor.adopt_orphans(lambda r: r)
        assert [(h.replica.id, h.pid) for h in adopted] == [(replica.id, hosted.pid)]
        assert json.loads(record.read_text())["pid"] == hosted.pid  # recorded with its pid again
        assert recorded_pid(data | {"pid": None}) == hosted.pid
    finally:
        successor.stop_all(grace_s=5.0)
        host.stop_all(grace_s=5.0)
    assert recorded_pid(data | {"pid": None}) is None  # nothing runs on the port any more


def test_the_pid_file_is_written_before_the_spawn_and_removed_if_it_fails(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from_env(worker_env("redis://127.0.0.1:1/0", tmp_path))
    host = RuntimeSupervisor(settings)
    replica = Replica("a", "r1", "n1", 2)
    seen: list[dict[str, object]] = []

    def no_exec(*args: object, **kwargs: object) -> None:
        seen.append(json.loads((host.state_dir / "slot-2.json").read_text()))
        raise OSError("exec failed")

    monkeypatch.setattr(supervision.subprocess, "Popen", no_exec)
    with pytest.raises(OSError, match="exec failed"):
        host.ensure(replica, str(tmp_path / "models" / "a"), now=time.time())
    assert seen and seen[0]["pid"] is None and seen[0]["replica_id"] == replica.id and seen[0]["port"]
    assert not (host.state_dir / "slot-2.json").exists()
