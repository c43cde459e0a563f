"""A node's replica slots under the agent's runtime supervisor, with real runtime processes.

The planner hands a slot to a new replica once the old one has left the registry's live
states, which can be before the agent has stopped the old runtime (the retire runs beside
the prewarm). The new replica then waits for the slot (a temporary error, retried by the
task) instead of being failed for good.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from prewarm.core.domain import Replica
from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.runtime.model import make_model
from tests.celery_helpers import settings_from_env, worker_env
from workers.node.supervision import RuntimeSupervisor, SlotBusy


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
