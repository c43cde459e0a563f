"""The agent's memory ledger and node residency (workers.node.memory), and the asleep state in the registry."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from prewarm.core.domain import TRANSITIONS, Replica, ReplicaState
from prewarm.core.errors import IllegalTransition
from prewarm.core.settings import RegistrySettings, Settings
from prewarm.registry.replicas import ReplicaRegistry
from workers.node.memory import (ASLEEP, CACHED, DISK, GB, GPU, InsufficientMemory, MemoryLedger, footprint_bytes,
                                 in_snapshot, models_on_disk, residency, warmest)


def test_a_load_that_does_not_fit_is_refused_naming_what_holds_the_memory() -> None:
    ledger = MemoryLedger(gpu_budget_gb=10.0, host_budget_gb=5.0, node="n1")
    ledger.book_gpu("a@r/n1/0", "a", int(4 * GB))
    ledger.book_gpu("b@r/n1/1", "b", int(4 * GB))
    with pytest.raises(InsufficientMemory) as err:
        ledger.book_gpu("c@r/n1/2", "c", int(4 * GB))
    msg = str(err.value)
    assert "c needs 4 GB of GPU memory" in msg and "2 of 10 GB free" in msg and "a@r/n1/0 4 GB" in msg
    assert err.value.reason == "insufficient_memory"
    assert ledger.used(GPU) == int(8 * GB) and ledger.get("c@r/n1/2") is None
    ledger.book_gpu("a@r/n1/0", "a", int(4 * GB))  # booking again is idempotent
    assert ledger.used(GPU) == int(8 * GB)


def test_sleep_moves_the_booking_to_host_memory_and_wake_moves_it_back() -> None:
    ledger = MemoryLedger(gpu_budget_gb=8.0, host_budget_gb=4.0)
    ledger.book_gpu("a", "a", int(4 * GB))
    ledger.book_gpu("b", "b", int(4 * GB))
    ledger.move("a", ASLEEP, what="sleep of")
    assert ledger.free(GPU) == int(4 * GB) and ledger.used(ASLEEP) == int(4 * GB)
    with pytest.raises(InsufficientMemory):
        ledger.check("b", ASLEEP, what="sleep of")  # host memory holds one sleeping replica
    ledger.book_gpu("c", "c", int(4 * GB))  # the GPU memory the sleep freed
    with pytest.raises(InsufficientMemory):
        ledger.move("a", GPU, what="wake of")
    ledger.release("c")
    ledger.move("a", GPU, what="wake of")
    assert ledger.used(ASLEEP) == 0 and ledger.used(GPU) == int(8 * GB)


def test_measured_footprint_replaces_a_smaller_estimate_and_unaccounted_memory_admits_all() -> None:
    ledger = MemoryLedger(gpu_budget_gb=0.0, host_budget_gb=0.0)
    for i in range(10):
        ledger.book_gpu(f"r{i}", "m", int(100 * GB))
    assert ledger.free(GPU) is None and ledger.free(ASLEEP) is None
    ledger.measured("r0", int(150 * GB))
    ledger.measured("r1", int(50 * GB))
    assert ledger.get("r0").nbytes == int(150 * GB) and ledger.get("r1").nbytes == int(100 * GB)  # type: ignore[union-attr]


def test_concurrent_loads_never_overbook() -> None:
    ledger = MemoryLedger(gpu_budget_gb=10.0, host_budget_gb=0.0)
    admitted: list[str] = []

    def load(i: int) -> None:
        try:
            ledger.book_gpu(f"r{i}", "m", int(3 * GB))
            admitted.append(f"r{i}")
        except InsufficientMemory:
            pass

    threads = [threading.Thread(target=load, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 3 and ledger.used(GPU) == int(9 * GB)


def test_residency_and_footprint_from_the_model_and_snapshot_directories(tmp_path: Path) -> None:
    from prewarm.runtime.manifest import load_manifest
    from prewarm.runtime.model import make_model

    models = tmp_path / "models"
    a = make_model(models / "a" / "r1", "tiny", name="a", revision="r1")
    make_model(models / "b", "tiny", seed=1, name="b", revision="r2")  # <models_dir>/<model>/ layout
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "b_r2.float32.0123456789abcdef.snap").write_bytes(b"x")
    assert models_on_disk(models) == {"a@r1", "b@r2"}
    assert in_snapshot(snaps, "b@r2") and not in_snapshot(snaps, "a@r1")
    assert residency({"c@r1": ASLEEP}, models_on_disk(models), snaps) == {"a@r1": DISK, "b@r2": CACHED,
                                                                          "c@r1": ASLEEP}
    assert warmest([ASLEEP, GPU]) == GPU and warmest([]) == DISK
    settings = Settings()
    assert footprint_bytes(settings, "a", a) == load_manifest(a).total_bytes
    settings.planner.model_memory_gb["a"] = 1.0  # the catalog's figure, when larger, wins
    assert footprint_bytes(settings, "a", a) == int(GB)


def test_asleep_is_a_live_unroutable_state_woken_straight_to_ready(redis_client: "redis.Redis[str]") -> None:
    assert ReplicaState.ASLEEP in TRANSITIONS[ReplicaState.DRAINING]
    assert TRANSITIONS[ReplicaState.ASLEEP] == {ReplicaState.READY, ReplicaState.RETIRED, ReplicaState.FAILED}
    reg = ReplicaRegistry(redis_client, RegistrySettings())
    rep = Replica("m", "r1", "n1", 0, endpoint="http://127.0.0.1:1", state=ReplicaState.PENDING)
    reg.register(rep, now=100.0)
    for state in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY, ReplicaState.DRAINING,
                  ReplicaState.ASLEEP):
        reg.transition(rep.id, state, now=101.0)
    view = reg.view("m", now=101.0)
    assert not view.serving and not view.warm and not view.loading
    assert [r.id for r in reg.live_on_node("n1")] == [rep.id]
    with pytest.raises(IllegalTransition):
        reg.transition(rep.id, ReplicaState.LOADING, now=102.0)
    reg.transition(rep.id, ReplicaState.READY, now=102.0)
    assert [r.id for r in reg.view("m", now=102.0).serving] == [rep.id]
    reg.record_ready_time("m", "asleep", "cpu", 0.2)
    reg.record_ready_time("m", "asleep", "cpu", 0.4)
    assert reg.ready_time_p95("m", "asleep", "cpu") == 0.4 and reg.ready_time_p95("m", "disk", "cpu") is None


def test_host_memory_holds_the_snapshot_store_and_a_sleep_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    """Host memory is enforced: asleep replicas AND the node's snapshots (the cached tier, in RAM under
    /dev/shm) count against `agent.host_memory_gb`; a sleep that does not fit names what holds it."""
    store = tmp_path / "snapshots"
    store.mkdir()
    kb = 1000 / GB  # budgets in GB, files of a few kB
    ledger = MemoryLedger(gpu_budget_gb=8 * kb, host_budget_gb=5 * kb, node="n1", snapshot_dir=store)
    ledger.book_gpu("a@r1/n1/0", "a", 2000)
    ledger.book_gpu("b@r1/n1/1", "b", 2000)
    ledger.move("a@r1/n1/0", ASLEEP, what="sleep of")  # 2 of 5 kB of host memory
    (store / "c_r1.float32.snap").write_bytes(b"\0" * 2500)  # a prefetched snapshot of c: 4.5 of 5 kB
    assert ledger.used(ASLEEP) == 4500 and ledger.free(ASLEEP) == 500
    with pytest.raises(InsufficientMemory) as err:
        ledger.check("b@r1/n1/1", ASLEEP, what="sleep of")
    msg = str(err.value)
    assert "sleep of b@r1/n1/1" in msg and "host memory" in msg
    assert "snapshot c_r1.float32.snap" in msg and "a@r1/n1/0" in msg
    with pytest.raises(InsufficientMemory):
        ledger.move("b@r1/n1/1", ASLEEP, what="sleep of")
    assert ledger.get("b@r1/n1/1").tier == GPU  # type: ignore[union-attr]  # refused: left where it was
    (store / "c_r1.float32.snap").unlink()  # the store evicted it: the sleep fits now
    ledger.move("b@r1/n1/1", ASLEEP, what="sleep of")
    assert ledger.used(ASLEEP) == 4000
