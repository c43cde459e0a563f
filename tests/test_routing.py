"""The routing policy, table-driven: pure, no network."""

from __future__ import annotations

import pytest

from prewarm.core.domain import LoadPhase, Pool, Replica, ReplicaState
from prewarm.policy.routing import RouteOutcome, choose_replica


def rep(slot: int, *, pool: Pool = Pool.SERVING, state: ReplicaState = ReplicaState.READY,
        progress: float = 1.0, phase: LoadPhase = LoadPhase.DONE) -> Replica:
    return Replica("m", "r", "n", slot, endpoint=f"http://h:{slot}", pool=pool, state=state, progress=progress, phase=phase)


S0, S1 = rep(0), rep(1)
W5 = rep(5, pool=Pool.WARM)
L_LOW = rep(2, state=ReplicaState.LOADING, progress=0.5, phase=LoadPhase.FIRST_LAYERS)
L_HIGH = rep(3, state=ReplicaState.LOADING, progress=0.8, phase=LoadPhase.REST)
L_EMB = rep(4, state=ReplicaState.LOADING, progress=0.9, phase=LoadPhase.EMBEDDINGS)


@pytest.mark.parametrize(
    ("serving", "warm", "loading", "inflight", "warmup", "exclude", "outcome", "slot"),
    [
        ([S0, S1], [W5], [], {S0.id: 3, S1.id: 1}, False, frozenset(), RouteOutcome.SERVING, 1),
        ([S0, S1], [W5], [], {S0.id: 1, S1.id: 1}, False, frozenset(), RouteOutcome.SERVING, 0),  # tie: stable
        ([S0, S1], [], [], {S1.id: 5}, False, frozenset({S0.id}), RouteOutcome.SERVING, 1),  # failing one skipped
        ([], [W5], [L_LOW], {}, False, frozenset(), RouteOutcome.WARM_POOL, 5),  # loading under 70% -> warm pool
        ([], [W5], [L_LOW, L_HIGH], {}, False, frozenset(), RouteOutcome.LOADING, 3),  # 80% -> pipelined serving
        ([], [W5], [L_EMB], {}, False, frozenset(), RouteOutcome.WARM_POOL, 5),  # embeddings only: cannot serve
        ([], [W5], [], {}, False, frozenset(), RouteOutcome.WARM_POOL, 5),  # no serving replica at all
        ([], [], [L_LOW], {}, False, frozenset(), RouteOutcome.UNAVAILABLE, None),
        ([], [], [], {}, False, frozenset(), RouteOutcome.UNAVAILABLE, None),
        ([S0], [W5], [], {}, True, frozenset(), RouteOutcome.WARM_POOL, 5),  # warmup keeps the pool warm
        ([S0], [], [], {}, True, frozenset(), RouteOutcome.SERVING, 0),
        ([S0], [W5], [], {}, False, frozenset({S0.id, W5.id}), RouteOutcome.UNAVAILABLE, None),
    ],
)
def test_choose_replica(serving, warm, loading, inflight, warmup, exclude, outcome, slot) -> None:
    d = choose_replica(serving, warm, loading, inflight, warm_threshold=0.7, warmup=warmup, exclude=exclude)
    assert d.outcome is outcome
    assert (d.replica.slot if d.replica else None) == slot
    assert d.reason


def test_saturated_serving_replicas_spill_into_the_warm_pool() -> None:
    busy = {S0.id: 8, S1.id: 9}
    d = choose_replica([S0, S1], [W5], [], busy, replica_concurrency=8)
    assert d.outcome is RouteOutcome.WARM_POOL and d.replica == W5 and "saturated" in d.reason
    # the pool is full too: the least busy serving replica queues it
    d = choose_replica([S0, S1], [W5], [], {**busy, W5.id: 8}, replica_concurrency=8)
    assert d.outcome is RouteOutcome.SERVING and d.replica == S0
    # below saturation the pool is left alone
    assert choose_replica([S0], [W5], [], {S0.id: 7}, replica_concurrency=8).replica == S0


def test_threshold_is_configurable() -> None:
    d = choose_replica([], [W5], [L_LOW], {}, warm_threshold=0.5)
    assert d.outcome is RouteOutcome.LOADING


def test_every_replica_at_its_limit_is_saturated_not_unavailable() -> None:
    a, b = Replica("m", "r", "n", 0, endpoint="http://a"), Replica("m", "r", "n", 1, endpoint="http://b", pool=Pool.WARM)
    full = {a.id: 4, b.id: 4}
    d = choose_replica([a], [b], [], full, replica_limit=4)
    assert d.outcome is RouteOutcome.SATURATED and d.replica is None
    d = choose_replica([a], [b], [], {a.id: 4, b.id: 3}, replica_limit=4)
    assert d.replica == b
    assert choose_replica([], [], [], {}, replica_limit=4).outcome is RouteOutcome.UNAVAILABLE
