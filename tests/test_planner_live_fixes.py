"""Fixes on the live planner path (issue 17), each against a real Redis: the executor's scale-down
order, the counter resolutions the planner reads, the catalog's per-class times, the Kubernetes
targets. What the pure planner decides is in tests/test_planner.py; here its decisions meet the
registry and the broker the way `forecast_and_plan` and `apply_scale_event` meet them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client import CollectorRegistry

from forecasting.fleet.catalog import Tier
from forecasting.planner import BatchJob, PlannerParams, PlannerState, ReplicaCounts, StepInputs, \
    observed_from_counts, step
from prewarm.core import keys
from prewarm.core.domain import ModelSpec, Pool, Replica, ReplicaState, ScaleEvent, ScaleEventKind
from prewarm.core.errors import SettingsError
from prewarm.core.settings import RedisSettings, Settings
from prewarm.policy.validation import Outcome, check_performance
from prewarm.registry.counters import RequestCounter
from tests.celery_helpers import publish_node, queued_tasks
from tests.k8s_double import KubeDouble
from workers.app import make_app
from workers.context import WorkerContext
from workers.names import KEEP_WARM, PREWARM, RETIRE, SLEEP, WAKE, node_queue
from workers.planning.executor import apply_event, live_counts, submit_events
from workers.planning.fleet import fleet_catalog
from workers.planning.forecast import forecast_and_plan, history
from workers.planning.forecast import inputs as inputs_of
from workers.planning.kubernetes import actuator_for, apply_target
from workers.planning.nodes import live_nodes, release_slot, reserve_slots

T0 = 1_700_000_000.0


@pytest.fixture()
def ctx(redis_url: str) -> Iterator[WorkerContext]:
    c = WorkerContext.build(Settings(redis=RedisSettings(url=redis_url)))
    yield c
    c.client.close()


def _replica(ctx: WorkerContext, model: str, node: str, slot: int, created_at: float, state: ReplicaState) -> str:
    rep = Replica(model, "r1", node, slot, state=ReplicaState.PENDING, created_at=created_at)
    ctx.registry.register(rep, now=created_at)
    path = [ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY]
    for s in path[: path.index(state) + 1] if state in path else []:
        ctx.registry.transition(rep.id, s, now=time.time())
    return rep.id


def test_scale_down_cancels_loading_replicas_and_never_retires_one_a_hold_keeps(ctx: WorkerContext) -> None:
    """5 ready and 4 loading, a batch rise within the lead: the decision (SCALE_DOWN 4, HOLD 3) is carried
    out over disjoint replicas: the 4 loading are cancelled, 3 of the 5 ready are kept warm, none retired."""
    publish_node(ctx.client, "n1", 9)
    now = time.time()
    ready = [_replica(ctx, "m", "n1", i, now - 100 + i, ReplicaState.READY) for i in range(5)]
    loading = [_replica(ctx, "m", "n1", 5 + i, now - 10 + i, ReplicaState.LOADING) for i in range(4)]
    counts = live_counts(ctx.registry.replicas_of("m"))
    assert counts == {"ready": 5, "loading": 4, "warm": 0, "asleep": 0}
    params = PlannerParams(budget_share=1.0, margin_initial=1.5, batch_jobs=(BatchJob(cron="*/10 * * * *", model="m", replicas=3,
                                                                   duration_s=300.0),))
    t = float(int(now // 600) * 600 + 590)  # 10 s before a run of the job: a rise within the 18.7 s lead
    y = np.full(400, 8.0)
    inp = StepInputs(ModelSpec("m", "r1", slots=8), t, observed_from_counts(t - 4000, 10.0, y, y, y * 10),
                     ReplicaCounts(ready=counts["ready"], loading=counts["loading"], warm=counts["warm"],
                                   asleep=counts["asleep"]), params)
    d, _ = step(inp, PlannerState())
    assert [(e.kind.value, e.replicas) for e in d.events] == [("scale_down", 4), ("hold", 3)]
    assert submit_events(ctx, d.events) == [e.event_id for e in d.events]
    app = make_app(ctx.settings)
    try:
        for ev in d.events:
            assert apply_event(ctx, app, ev.event_id).outcome == "applied"
    finally:
        app.close()
    tasks = queued_tasks(ctx.client, node_queue("n1"))
    retired = {m["args"][0] for m in tasks if m["task"] == RETIRE}
    kept = {m["args"][0] for m in tasks if m["task"] == KEEP_WARM}
    assert retired == set(loading)
    assert kept == set(ready[:3]) and not kept & retired


def test_two_scale_ups_applied_before_any_agent_registers_never_pick_one_slot(ctx: WorkerContext) -> None:
    """One plan's serving rise (x2) and warm-pool start (x1), applied at once: each slot is reserved for its
    replica until the agent registers it, so the three prewarms name three replicas (before, the warm pool's
    replica and a serving one were both the first slot of the emptiest node: the plan's 3 became 2)."""
    publish_node(ctx.client, "n1", 2)
    publish_node(ctx.client, "n2", 2)
    now = time.time()
    serving = ScaleEvent("up-serving", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=2)
    warm = ScaleEvent("up-warm", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=1, pool=Pool.WARM)
    submit_events(ctx, [serving, warm])
    app = make_app(ctx.settings)
    try:
        chosen = apply_event(ctx, app, "up-serving").replica_ids + apply_event(ctx, app, "up-warm").replica_ids
    finally:
        app.close()
    assert len(set(chosen)) == 3, chosen
    queued = [m["args"][0] for n in ("n1", "n2") for m in queued_tasks(ctx.client, node_queue(n))
              if m["task"] == PREWARM]
    assert sorted(queued) == sorted(chosen)
    # the agent registers the replica and releases its slot's claim: the registry holds the slot from then on
    rid = chosen[0]
    node, slot = rid.split("/")[-2], int(rid.split("/")[-1])
    assert ctx.client.get(keys.slot_claim(node, slot)) == rid
    ctx.registry.register(Replica("m", "r1", node, slot, state=ReplicaState.PENDING, created_at=now), now=now)
    release_slot(ctx, node, slot, rid)
    assert ctx.client.get(keys.slot_claim(node, slot)) is None
    assert slot in next(ns for ns in live_nodes(ctx) if ns.node == node).used


def test_a_dry_run_chooses_slots_as_the_live_path_does_and_reserves_none(ctx: WorkerContext) -> None:
    """`prewarm plan --dry-run` says which slots a scale from zero or a placement elsewhere would take
    (`reserve_slots`'s choice) and claims none of them: a dry run leaves the next live choice unchanged."""
    publish_node(ctx.client, "n1", 2)

    def replica_of(node: str, slot: int) -> str:
        return f"m@r1/{node}/{slot}"

    ctx.settings.planner.dry_run = True
    try:
        dry = reserve_slots(ctx, 2, replica_of)
    finally:
        ctx.settings.planner.dry_run = False
    assert dry == [("n1", 0), ("n1", 1)]
    assert ctx.client.get(keys.slot_claim("n1", 0)) is None and ctx.client.get(keys.slot_claim("n1", 1)) is None
    assert reserve_slots(ctx, 1, replica_of) == [("n1", 0)]  # the live choice, which a claim now holds
    assert ctx.client.get(keys.slot_claim("n1", 0)) == "m@r1/n1/0"
    release_slot(ctx, "n1", 0, "m@r1/n1/0")


# --- Kubernetes: the pods are one Deployment, the warm pool among them ------------------------------------
NS = "inference"


def _cluster_ctx(mp: pytest.MonkeyPatch, redis_url: str, kubeconfig: Path, **extra: str) -> WorkerContext:
    env = {
        "PREWARM_REDIS_URL": redis_url, "PREWARM_KUBERNETES_ENABLED": "true", "PREWARM_KUBERNETES_AUTOSCALING": "none",
        "PREWARM_KUBERNETES_NAMESPACE": NS, "PREWARM_KUBERNETES_DEPLOYMENT": "tiny",
        "PREWARM_KUBERNETES_KUBECONFIG": str(kubeconfig), "PREWARM_PLANNER_MODELS": '["tiny@r1"]',
        "PREWARM_PLANNER_WARM_POOL_SIZE": "1", "PREWARM_PLANNER_BUDGET_SHARE": "1", **extra,
    }
    for k, v in env.items():
        mp.setenv(k, v)
    return WorkerContext.build(Settings.load(), registry=CollectorRegistry())


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "double",
        "clusters": [{"name": "double", "cluster": {"server": url}}], "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "nobody", "namespace": NS}}],
    }))
    return path


def test_cluster_target_does_not_grow_by_the_pool_at_every_ready_pod(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """9 pods (8 serving + a pool of 1), under 300 s of history (reactive, nothing released): as each pod the
    Deployment runs turns Ready and is registered (as the pod warmer does), the target stays 9. Counted as
    all serving, the pool came on top at every step: 9 -> 17 in 8 steps."""
    with KubeDouble() as double:
        double.add_deployment(NS, "tiny", replicas=9, labels={"app": "tiny"}, controller=True)
        ctx = _cluster_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url),
                           PREWARM_KUBERNETES_MAX_REPLICAS="20")
        now = T0
        ctx.client.hset(keys.REQUESTS_FIRST, "tiny", repr(T0))  # the gateway began counting now: short history
        for i in range(9):
            _replica(ctx, "tiny", f"pod-node-{i}", i, now, ReplicaState.READY)
        seen = []
        for k in range(8):
            now += 10.0
            forecast_and_plan(ctx, now=now)
            want = double.replicas(NS, "tiny")
            seen.append(want)
            registered = len(ctx.registry.replicas_of("tiny"))
            if registered < want:  # the next pod of the Deployment turns Ready and is registered
                _replica(ctx, "tiny", f"pod-node-{registered}", registered, now, ReplicaState.READY)
        assert seen == [9] * 8
        record = ctx.client.hgetall(keys.last_forecast("tiny"))
        assert (record["serving_target"], record["pool_target"], record["target"]) == ("8", "1", "9")
        ctx.client.close()


def test_the_scale_subresource_is_capped_at_max_replicas(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Mode `none`: the planner is the Deployment's only scaler, so its target is capped as KEDA's
    maxReplicaCount or the HPA's maxReplicas cap theirs (per model where the chart names one)."""
    with KubeDouble() as double:
        double.add_deployment(NS, "tiny", replicas=1)
        ctx = _cluster_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url),
                           PREWARM_KUBERNETES_MAX_REPLICAS="4")
        act = actuator_for(ctx.settings.kubernetes)
        apply_target(act, ctx.settings.kubernetes, "tiny", 30)
        assert double.replicas(NS, "tiny") == 4
        per_model = ctx.settings.kubernetes.model_copy(update={"max_replicas_by_model": {"tiny": 6}})
        apply_target(act, per_model, "tiny", 30)
        assert double.replicas(NS, "tiny") == 6
        apply_target(act, per_model, "tiny", 2)
        assert double.replicas(NS, "tiny") == 2
        ctx.client.close()


# --- bucket sizes: the planner reads what the gateway records, summed to its buckets ----------------------

def _count(redis_url: str, model: str, t0: float, seconds: int) -> None:
    """One request a second for `seconds`, each 0.5 s in flight, counted and flushed by the gateway's counter."""
    counter = RequestCounter()
    for i in range(seconds):
        counter.add(model, t0 + i)
        counter.begin(model, t0 + i)
        counter.end(model, t0 + i + 0.5, t0 + i)

    async def flush() -> None:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            await counter.flush(client)
        finally:
            await client.aclose()

    asyncio.run(flush())


@pytest.mark.parametrize("fine,coarse", [(30, 120), (10, 60), (20, 600)])
def test_the_planner_reads_the_gateways_counters_at_any_counted_bucket_size(
        redis_url: str, clean_env: pytest.MonkeyPatch, fine: int, coarse: int) -> None:
    """fine_bucket_s 30 or bucket_s 120 once made the planner read keys nobody writes (zeros): the gateway
    counts at 10 s (and 60 s) only. Now the planner sums the recorded buckets into its own."""
    t0 = 1_700_000_400.0  # a multiple of 600 s
    _count(redis_url, "m", t0, 600)
    ctx = _cluster_ctx(clean_env, redis_url, Path("/nonexistent"), PREWARM_KUBERNETES_ENABLED="false",
                       PREWARM_PLANNER_FINE_BUCKET_S=str(fine), PREWARM_PLANNER_BUCKET_S=str(coarse))
    params = PlannerParams.from_settings(ctx.settings.planner)
    observed, profile = history(ctx, "m", PlannerState(), params, now=t0 + 600.0, cold_start_p95_s=None)
    assert observed.start == t0 and observed.requests.size == 600 // fine
    assert np.all(observed.requests == fine) and np.all(observed.busy == 0.5 * fine) and np.all(observed.peak == 1.0)
    assert observed.now_load is None  # a bucket just begun: nothing of it elapsed
    assert profile is not None
    _, bucket, rates = profile
    assert bucket == coarse and rates.size == 600 // coarse and np.allclose(rates, 1.0)
    ctx.client.close()


def test_the_planner_reads_the_load_so_far_in_the_bucket_in_progress(redis_url: str,
                                                                     clean_env: pytest.MonkeyPatch) -> None:
    """The planner read complete buckets only: a rise began up to a bucket before any step saw it. The gateway
    credits busy time at every flush, so the bucket in progress says what is in flight now."""
    t0 = 1_700_000_400.0
    _count(redis_url, "m", t0, 600)
    _count(redis_url, "m", t0 + 600.0, 4)  # ... and one request a second in the first 4 s of the next bucket
    ctx = _cluster_ctx(clean_env, redis_url, Path("/nonexistent"), PREWARM_KUBERNETES_ENABLED="false")
    params = PlannerParams.from_settings(ctx.settings.planner)
    observed, _ = history(ctx, "m", PlannerState(), params, now=t0 + 605.0, cold_start_p95_s=None)
    assert observed.end == t0 + 600.0  # the complete buckets end where the one in progress begins
    assert observed.now_load == pytest.approx(4 * 0.5 / 5.0)  # 2 request-seconds over its 5 s so far
    ctx.client.close()


@pytest.mark.parametrize("field,value", [("FINE_BUCKET_S", "15"), ("BUCKET_S", "45")])
def test_a_bucket_size_the_gateway_does_not_count_is_refused_by_name(clean_env: pytest.MonkeyPatch, field: str,
                                                                    value: str) -> None:
    clean_env.setenv(f"PREWARM_PLANNER_{field}", value)
    with pytest.raises(SettingsError, match=f"{field.lower()}.*whole multiple"):
        Settings.load()


# --- the fleet catalog reads per-tier times where the agents record them ------------------------------------

def test_fleet_catalog_reads_the_tier_times_agents_record_under_their_own_node_class(ctx: WorkerContext) -> None:
    """The planner process runs with agent.node_class "cpu"; agents on "h200" and "l4" nodes time their
    wakes under their own class. The catalog holds each class's figure and plans with the slowest."""
    assert ctx.settings.agent.node_class == "cpu"
    for node, cls in (("g1", "h200"), ("g2", "l4")):
        publish_node(ctx.client, node, 2)
        ctx.client.hset(keys.node_info(node), "node_class", cls)
    ctx.registry.record_ready_time("m", "asleep", "h200", 1.5)  # as workers/node/tiers.py does after a wake
    ctx.registry.record_ready_time("m", "asleep", "l4", 4.0)
    ctx.registry.record_ready_time("m", "cached", "h200", 9.0)
    card = fleet_catalog(ctx, ["m"]).card("m")
    assert card.time_to_ready(Tier.ASLEEP, "h200") == 1.5 and card.time_to_ready(Tier.ASLEEP, "l4") == 4.0
    assert card.time_to_ready(Tier.ASLEEP) == 4.0 and card.time_to_ready(Tier.CACHED) == 9.0


# --- the speed baseline: a robust statistic over the first validated replicas -------------------------------

def test_a_slow_first_replica_does_not_set_the_speed_baseline(ctx: WorkerContext) -> None:
    """The bring-up's order (workers/node/bringup.py): read the baseline, check the speed, record a sample
    when there is none. The first replica is 10x slow: with the baseline the first replica's alone, a later
    replica 5x slower than normal passed for 7 days; with the median of the first 5 it fails."""
    samples, factor = ctx.settings.warmup.baseline_samples, ctx.settings.warmup.latency_factor
    assert samples == 5

    def validate_one(latency_s: float) -> Outcome:
        check = check_performance([latency_s] * 3, ctx.registry.baseline("m", "cpu", "r1"), factor=factor)
        if "record_baseline" in check.measured:
            ctx.registry.record_baseline_sample("m", "cpu", float(check.measured["record_baseline"]), "r1",
                                                samples=samples)
        return check.outcome

    outcomes = [validate_one(s) for s in (0.50, 0.05, 0.052, 0.048, 0.051)]
    assert outcomes == [Outcome.NO_BASELINE] * 5
    assert ctx.registry.baseline("m", "cpu", "r1") == 0.051
    assert validate_one(0.25) is Outcome.FAILED
    assert validate_one(0.055) is Outcome.PASSED


# --- parking: PARK sleeps the newest ready, a later SCALE_UP wakes parked replicas before it loads ----------

def test_park_sleeps_the_newest_ready_and_a_scale_up_wakes_parked_replicas_first(ctx: WorkerContext) -> None:
    publish_node(ctx.client, "n1", 8)
    now = time.time()
    ready = [_replica(ctx, "m", "n1", i, now - 100 + i, ReplicaState.READY) for i in range(4)]
    park = ScaleEvent("park-1", ScaleEventKind.PARK, "m", "r1", at=now - 1, replicas=2)
    assert submit_events(ctx, [park]) == ["park-1"]
    app = make_app(ctx.settings)
    try:
        assert apply_event(ctx, app, "park-1").replica_ids == tuple(reversed(ready[2:]))
        queued = queued_tasks(ctx.client, node_queue("n1"))
        assert sorted((m["task"], m["args"][0]) for m in queued) == [(SLEEP, ready[2]), (SLEEP, ready[3])]
        ctx.client.delete(node_queue("n1"))
        for rid in ready[2:]:  # what the agent's sleep_replica does (workers/node/tiers.py)
            ctx.registry.transition(rid, ReplicaState.DRAINING, now=time.time())
            ctx.registry.transition(rid, ReplicaState.ASLEEP, now=time.time())
        assert live_counts(ctx.registry.replicas_of("m")) == {"ready": 2, "loading": 0, "warm": 0, "asleep": 2}
        up = ScaleEvent("up-1", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=3)
        submit_events(ctx, [up])
        chosen = apply_event(ctx, app, "up-1").replica_ids
    finally:
        app.close()
    assert set(chosen[:2]) == set(ready[2:]) and len(chosen) == 3
    queued = queued_tasks(ctx.client, node_queue("n1"))
    assert sorted(m["args"][0] for m in queued if m["task"] == WAKE) == sorted(ready[2:])  # woken, not loaded
    assert [m["args"][0] for m in queued if m["task"] == PREWARM] == [chosen[2]] and chosen[2] not in ready


def test_the_live_inputs_count_parked_replicas_and_their_measured_wake(ctx: WorkerContext) -> None:
    publish_node(ctx.client, "g1", 4)
    ctx.client.hset(keys.node_info("g1"), "node_class", "h200")
    now = time.time()
    for i in range(3):
        rid = _replica(ctx, "m", "g1", i, now - 50 + i, ReplicaState.READY)
        if i:  # two of them parked, as sleep_replica leaves them
            ctx.registry.transition(rid, ReplicaState.DRAINING, now=time.time())
            ctx.registry.transition(rid, ReplicaState.ASLEEP, now=time.time())
    params = PlannerParams.from_settings(ctx.settings.planner)
    inp = inputs_of(ctx, ModelSpec("m", "r1", slots=8), PlannerState(), params, now=now)
    assert inp.replicas.asleep == 2 and inp.wake_p95_s is None  # no wake measured yet
    ctx.registry.record_ready_time("m", "asleep", "h200", 0.8)  # the agent on g1 timed a wake
    inp = inputs_of(ctx, ModelSpec("m", "r1", slots=8), PlannerState(), params, now=now)
    assert (inp.replicas.ready, inp.replicas.asleep, inp.wake_p95_s) == (1, 2, 0.8)
