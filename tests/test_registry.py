"""The replica registry against a real Redis server: idempotence, the state machine, heartbeats."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from prewarm.core import keys
from prewarm.core.domain import LoadPhase, Pool, Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.core.errors import IllegalTransition, RegistryUnavailable, ReplicaNotFound
from prewarm.registry.references import EnginePhases
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import RegistrySettings

SETTINGS = RegistrySettings(heartbeat_interval_s=1.0, heartbeat_ttl_s=3.0)


def _replica(slot: int = 0, pool: Pool = Pool.SERVING, node: str = "n1") -> Replica:
    return Replica("llama", "r1", node, slot, endpoint=f"http://127.0.0.1:{9000 + slot}", pool=pool)


def _to_ready(reg: ReplicaRegistry, rid: str, now: float) -> None:
    for state in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        reg.transition(rid, state, now=now)


def test_twenty_concurrent_registrations_produce_exactly_one(redis_url: str) -> None:
    barrier = threading.Barrier(20)
    results: list[bool] = []
    lock = threading.Lock()

    def register() -> None:
        reg = ReplicaRegistry(redis.Redis.from_url(redis_url, decode_responses=True), SETTINGS)
        barrier.wait()
        created = reg.register(_replica(), now=time.time())
        with lock:
            results.append(created)

    threads = [threading.Thread(target=register) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 19 + [True]
    reg = ReplicaRegistry(redis.Redis.from_url(redis_url, decode_responses=True), SETTINGS)
    assert reg.counts() == {("llama", "pending", "serving"): 1}
    registered = [e for _, e in reg.events() if e["reason"] == "registered"]
    assert len(registered) == 1


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], ReplicaState.READY),  # pending -> ready skips loading and validation
        ([ReplicaState.LOADING], ReplicaState.READY),  # loading -> ready skips warmup/validation
        ([ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY], ReplicaState.LOADING),
        ([ReplicaState.LOADING, ReplicaState.FAILED], ReplicaState.READY),  # failed is terminal
        ([ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY, ReplicaState.DRAINING], ReplicaState.READY),
    ],
)
def test_illegal_transitions_are_refused(redis_client: "redis.Redis[str]", path: list[ReplicaState], illegal: ReplicaState) -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    r = _replica()
    now = time.time()
    reg.register(r, now=now)
    for state in path:
        reg.transition(r.id, state, now=now)
    before = reg.get(r.id)
    with pytest.raises(IllegalTransition, match=f"-> {illegal.value} is not a legal transition"):
        reg.transition(r.id, illegal, now=now)
    assert reg.get(r.id) == before


def test_full_lifecycle_and_event_stream(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    r = _replica()
    now = time.time()
    assert reg.register(r, now=now)
    reg.transition(r.id, ReplicaState.LOADING, now=now)
    assert reg.set_progress(r.id, 0.4, LoadPhase.FIRST_LAYERS, now=now)
    loading = reg.loading("llama", now=now)
    assert [(x.id, x.progress, x.phase) for x in loading] == [(r.id, 0.4, LoadPhase.FIRST_LAYERS)]
    reg.transition(r.id, ReplicaState.WARMING, now=now)
    ready = reg.transition(r.id, ReplicaState.READY, now=now)
    assert ready.progress == 1.0 and ready.phase is LoadPhase.DONE
    assert [x.id for x in reg.ready("llama", Pool.SERVING, now=now)] == [r.id]
    assert reg.loading("llama", now=now) == []
    assert not reg.set_progress(r.id, 0.9, LoadPhase.REST, now=now)  # not loading any more
    reg.transition(r.id, ReplicaState.DRAINING, now=now)
    assert reg.ready("llama", Pool.SERVING, now=now) == []
    reg.transition(r.id, ReplicaState.RETIRED, now=now, reason="scale down")
    transitions = [(e["from"], e["to"]) for _, e in reg.events()]
    assert transitions == [
        ("", "pending"), ("pending", "loading"), ("loading", "warming"), ("warming", "ready"),
        ("ready", "draining"), ("draining", "retired"),
    ]
    # a retired id may be registered again (a new replica in the same slot)
    assert reg.register(r, now=now + 1)


def test_unknown_replica_and_expected_state(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    with pytest.raises(ReplicaNotFound):
        reg.transition("llama@r1/n1/7", ReplicaState.LOADING, now=time.time())
    r = _replica()
    reg.register(r, now=time.time())
    with pytest.raises(IllegalTransition, match="expected loading"):
        reg.transition(r.id, ReplicaState.FAILED, now=time.time(), expected=ReplicaState.LOADING)


def _active_for(client: "redis.Redis[str]", seconds: float, silent_s: float = 0.0) -> None:
    """Make the registry's activity record say: heartbeats and reaps have reached Redis without a gap for
    `seconds`, the last one `silent_s` ago (in Redis's own clock, as the scripts read it)."""
    sec, usec = client.time()
    clock = sec + usec / 1e6
    client.hset(keys.REGISTRY_ACTIVITY, mapping={"since": repr(clock - seconds), "seen": repr(clock - silent_s)})


def test_expired_heartbeat_drops_from_ready_view_and_reaper_fails_it(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    _active_for(redis_client, 600)
    fresh, stale = _replica(0), _replica(1, pool=Pool.WARM)
    t0 = 1_000_000.0
    for r in (fresh, stale):
        reg.register(r, now=t0)
        _to_ready(reg, r.id, t0)
    assert len(reg.ready("llama", Pool.WARM, now=t0 + 1)) == 1
    reg.heartbeat(fresh.with_(state=ReplicaState.READY), now=t0 + 2)
    # within the TTL of its last heartbeat the stale one is still routable; after it, never
    later = t0 + SETTINGS.heartbeat_ttl_s + 0.5
    assert reg.ready("llama", Pool.WARM, now=later) == []
    assert [x.id for x in reg.ready("llama", Pool.SERVING, now=later)] == [fresh.id]
    assert reg.reap(now=later) == [stale.id]
    got = reg.get(stale.id)
    assert got is not None and got.state is ReplicaState.FAILED and got.reason == "heartbeat expired"
    assert reg.reap(now=later) == []


def test_reaper_waits_a_ttl_after_the_registry_was_silent(redis_client: "redis.Redis[str]") -> None:
    """Issue 13: Redis stalled past the TTL (SIGSTOP, a slow failover). When it resumes, a reap queued
    meanwhile must not fail replicas whose agents are alive and about to heartbeat."""
    reg = ReplicaRegistry(redis_client, SETTINGS)
    r = _replica(0)
    t0 = time.time()
    reg.register(r, now=t0)
    _to_ready(reg, r.id, t0)
    _active_for(redis_client, 600, silent_s=60)  # nothing reached Redis for a minute
    later = t0 + SETTINGS.heartbeat_ttl_s * 2
    assert reg.reap(now=later) == []  # the first reap after the silence: settling, not reaping
    rec = reg.get(r.id)
    assert rec is not None and rec.state is ReplicaState.READY
    reg.heartbeat(rec, now=later)  # the agent was alive: it heartbeats within an interval
    assert reg.reap(now=later + 0.1) == []
    rec = reg.get(r.id)
    assert rec is not None and rec.state is ReplicaState.READY
    # an agent that really died is reaped once the registry has been active for a TTL again
    _active_for(redis_client, SETTINGS.heartbeat_ttl_s + 1)
    assert reg.reap(now=later + SETTINGS.heartbeat_ttl_s + 1) == [r.id]


def test_heartbeat_of_failed_replica_reports_it(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    r = _replica()
    reg.register(r, now=time.time())
    reg.transition(r.id, ReplicaState.FAILED, now=time.time(), reason="bad weights")
    stored = reg.heartbeat(r.with_(state=ReplicaState.LOADING), now=time.time())
    assert stored.state is ReplicaState.FAILED  # the agent must stop hosting it
    assert reg.loading("llama", now=time.time()) == []


def test_counts_per_model_and_node(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    now = time.time()
    for slot, node in ((0, "n1"), (1, "n1"), (0, "n2")):
        reg.register(_replica(slot, node=node), now=now)
    _to_ready(reg, _replica(0).id, now)
    assert reg.counts() == {("llama", "ready", "serving"): 1, ("llama", "pending", "serving"): 2}
    assert {r.id for r in reg.live_on_node("n1")} == {_replica(0).id, _replica(1).id}


def test_load_times_and_baseline(redis_client: "redis.Redis[str]") -> None:
    reg = ReplicaRegistry(redis_client, SETTINGS)
    assert reg.load_time_p95("llama") is None
    for s in range(1, 21):
        reg.record_load_time("llama", float(s), revision="r1", node_class="h200")
    assert reg.load_time_p95("llama") == 19.0
    # issue 18: the lead is kept per revision and node class; read for one revision, it is the slowest class's
    for secs in (30.0, 31.0, 32.0):
        reg.record_load_time("llama", secs, revision="r1", node_class="a10")
    reg.record_load_time("llama", 90.0, revision="r2", node_class="h200")
    assert reg.load_time_p95("llama", "r1", "h200") == 19.0 and reg.load_time_p95("llama", "r1", "a10") == 32.0
    assert reg.load_time_p95("llama", "r1") == 32.0 and reg.load_time_p95("llama", "r2") == 90.0
    assert reg.load_time_p95("llama", "r3") is None and reg.load_time_p95("llama", "r2", "a10") is None
    assert reg.load_time_p95("llama") == 90.0
    # issue 17: the baseline is the median of the first validated replicas, so a slow first one does not set it
    assert reg.record_baseline_sample("llama", "h200", 0.50, samples=5) is None  # slow first replica
    assert reg.baseline("llama", "h200") is None
    for latency in (0.05, 0.06, 0.04):
        assert reg.record_baseline_sample("llama", "h200", latency, samples=5) is None
    assert reg.record_baseline_sample("llama", "h200", 0.055, samples=5) == 0.055  # median of 5
    assert reg.baseline("llama", "h200") == 0.055 and not redis_client.exists(keys.baseline_samples("llama", "h200"))
    assert reg.record_baseline_sample("llama", "h200", 0.9, samples=5) == 0.055  # made: later samples change nothing
    assert reg.baseline("llama", "cpu") is None
    assert reg.record_baseline_sample("llama", "l4", 0.02, samples=2) is None
    assert reg.record_baseline_sample("llama", "l4", 0.04, samples=2) == pytest.approx(0.03)  # even: the mean of two
    # issue 13: per revision and node class, and refreshed (it expires, then is measured again)
    assert reg.record_baseline_sample("llama", "h200", 0.07, "r2", samples=1) == 0.07
    assert reg.baseline("llama", "h200", "r2") == 0.07 and reg.baseline("llama", "h200", "r3") is None
    assert 0 < redis_client.ttl(keys.baseline("llama", "h200", "r2")) <= keys.BASELINE_TTL_S
    reg.record_baseline_sample("llama", "h200", 0.07, "r3", samples=3)
    assert 0 < redis_client.ttl(keys.baseline_samples("llama", "h200", "r3")) <= keys.BASELINE_TTL_S


def test_measured_durations_are_kept_newest_first_and_capped(redis_client: "redis.Redis[str]") -> None:
    """Image pulls, per-tier times to ready and an engine's phases keep the last `LOADTIMES_KEEP` figures each."""
    reg = ReplicaRegistry(redis_client, SETTINGS)
    phases = EnginePhases(redis_client)
    for s in range(keys.LOADTIMES_KEEP + 5):
        reg.record_image_pull("llama", "r1", "h200", float(s))
        reg.record_ready_time("llama", "asleep", "h200", float(s))
        phases.record("llama", EnginePhases.SERVER_START, "h200", float(s))
    newest = [float(s) for s in range(keys.LOADTIMES_KEEP + 4, 4, -1)]
    assert reg.image_pulls("llama", "r1", "h200") == newest
    assert phases.times("llama", EnginePhases.SERVER_START, "h200") == newest
    assert phases.times("llama", EnginePhases.WARM_VALIDATE, "h200") == []
    assert reg.ready_time_p95("llama", "asleep", "h200") is not None
    assert reg.ready_time_p95("llama", "disk", "h200") is None


def test_redis_restart_is_repopulated_by_heartbeats() -> None:
    """A Redis restarted without persistence: errors are RegistryUnavailable, then heartbeats rebuild it."""
    with EmbeddedRedis() as server:
        reg = ReplicaRegistry(
            redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1, socket_connect_timeout=1), SETTINGS
        )
        hosted = []
        now = time.time()
        for slot in range(3):
            r = _replica(slot)
            reg.register(r, now=now)
            _to_ready(reg, r.id, now)
            hosted.append(reg.get(r.id))
        server.stop()
        with pytest.raises(RegistryUnavailable):
            reg.view("llama", now=now)
        with pytest.raises(RegistryUnavailable):
            reg.heartbeat(hosted[0], now=now)  # type: ignore[arg-type]
        server.start()
        assert reg.ready("llama", Pool.SERVING, now=time.time()) == []
        for h in hosted:
            assert h is not None
            reg.heartbeat(h, now=time.time())
        assert {r.id for r in reg.ready("llama", Pool.SERVING, now=time.time())} == {h.id for h in hosted if h}


def test_an_engines_speed_baseline_is_the_median_of_its_first_replicas(redis_client: "redis.Redis[str]") -> None:
    """issue 18: a vLLM revision's TTFT and decode baselines were its first replica's (HSETNX): a first replica
    measured on a quiet machine failed every later one under load. Now each is the median of the first N."""
    from prewarm.registry.references import ReferenceStore

    store, reg = ReferenceStore(redis_client), ReplicaRegistry(redis_client, SETTINGS)
    quiet = {"ttft_s": 0.010, "decode_s_per_token": 0.0039}  # the first replica, alone on the machine
    got = store.record_speed_sample("tiny", "cpu", "r1", quiet, samples=3)
    assert got.ttft_s is None and got.decode_s_per_token is None  # one sample sets nothing
    store.record_speed_sample("tiny", "cpu", "r1", {"ttft_s": 0.030, "decode_s_per_token": 0.012}, samples=3)
    got = store.record_speed_sample("tiny", "cpu", "r1", {"ttft_s": 0.025, "decode_s_per_token": 0.052}, samples=3)
    assert got.ttft_s == pytest.approx(0.025) and got.decode_s_per_token == pytest.approx(0.012)
    # made: later samples change nothing; a figure a replica did not measure is left to the others
    got = store.record_speed_sample("tiny", "cpu", "r1", {"ttft_s": 9.0}, samples=3)
    assert got.ttft_s == pytest.approx(0.025)
    # beside the built-in warm latency in the same hash, which keeps its own samples
    assert reg.record_baseline_sample("tiny", "cpu", 0.5, "r1", samples=1) == 0.5
    assert store.speed_baseline("tiny", "cpu", "r1").ttft_s == pytest.approx(0.025)
    assert store.record_speed_sample("tiny", "cpu", "r2", quiet, samples=1).ttft_s == pytest.approx(0.010)
    with pytest.raises(ValueError, match="unknown speed figure"):
        store.record_speed_sample("tiny", "cpu", "r1", {"latency_s": 1.0}, samples=1)
