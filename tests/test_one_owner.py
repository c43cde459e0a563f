"""Issue 17 "one owner of scale, for the pool", and issue 18's per-revision lead, in a cluster.

The fleet round (many models under one GPU budget) in Kubernetes mode: every model's count goes
to its Deployment's one owner (`kubernetes.autoscaling`), as a single model's does, and no node
agent is asked to start anything. Real Redis, the real planner code (`fleet_and_plan`, the
`forecast_and_plan` inputs), the real `kubernetes` client against the HTTP-level API double
(tests/k8s_double.py: no API server runs here).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from forecasting.planner import PlannerParams, PlannerState, step
from prewarm.core import keys
from prewarm.core.domain import ModelSpec
from prewarm.core.settings import Settings
from prewarm.registry.targets import read_target
from tests.celery_helpers import queued_tasks
from tests.k8s_double import KubeDouble
from tests.test_cluster import NS, _kubeconfig
from tests.test_fleet_live import MEM, _counts, _node
from workers.app import make_app
from workers.context import WorkerContext
from workers.names import node_queue
from workers.planning.fleet import fleet_and_plan
from workers.planning.forecast import inputs, publish_cluster_target

DEPLOYMENTS = {"a": "dep-a", "b": "dep-b", "c": "dep-c"}


def _fleet_ctx(mp: pytest.MonkeyPatch, redis_url: str, kubeconfig: Path, mode: str, **extra: str) -> WorkerContext:
    for k, v in {
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_PLANNER_MODELS": '["a@r1","b@r1","c@r1"]',
        "PREWARM_PLANNER_FLEET_BUDGET_GB": "80",
        "PREWARM_PLANNER_MODEL_MEMORY_GB": json.dumps(MEM),
        "PREWARM_KUBERNETES_ENABLED": "true",
        "PREWARM_KUBERNETES_AUTOSCALING": mode,
        "PREWARM_KUBERNETES_NAMESPACE": NS,
        "PREWARM_KUBERNETES_DEPLOYMENTS": json.dumps(DEPLOYMENTS),
        "PREWARM_KUBERNETES_KUBECONFIG": str(kubeconfig),
        **extra,
    }.items():
        mp.setenv(k, v)
    return WorkerContext.build(Settings.load(), registry=CollectorRegistry())


def _traffic(ctx: WorkerContext) -> None:
    """Room on the nodes for all three, budget for two: `a` dense, `b` every other minute, `c` idle."""
    for node in ("n1", "n2"):
        _node(ctx.client, node, slots=2, gpu_gb=100.0)
    _counts(ctx.client, "a", {ago: 600 for ago in range(1, 120)})
    _counts(ctx.client, "b", {ago: 30 for ago in range(1, 120) if ago % 2})
    _counts(ctx.client, "c", {110: 1})


@pytest.mark.parametrize("mode", ["none", "keda"])
def test_the_fleet_rounds_counts_reach_each_deployments_one_owner(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path, mode: str) -> None:
    """Today the fleet round's per-model counts never reach Kubernetes: it sends prewarms to agents
    that host nothing in a cluster, and records no target for KEDA or the HPA to read."""
    with KubeDouble() as double:
        for dep in DEPLOYMENTS.values():
            double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
        ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), mode)
        _traffic(ctx)
        app = make_app(ctx.settings)
        try:
            now = time.time()
            plans = {p.model: p for p in fleet_and_plan(ctx, app, now=now)}
        finally:
            app.close()
        plan = json.loads(ctx.client.get(keys.FLEET_PLAN) or "{}")["models"]
        assert plan["a"]["replicas"] >= 1 and plan["c"]["replicas"] == 0, plan
        for node in ("n1", "n2"):  # no agent gets a task: the pods are Kubernetes' to start
            assert queued_tasks(ctx.client, node_queue(node)) == []
        for model, dep in DEPLOYMENTS.items():
            want = plan[model]["replicas"]
            assert plans[model].need_now == want
            target = read_target(ctx.client, model, now=now + 1.0, max_age_s=60.0)  # what KEDA and the HPA read
            assert (target.replicas, target.awake) == (want, want)
            # issue 19: and as the planned revision's own target (a trigger naming revision r1 reads the same)
            rev = read_target(ctx.client, model, now=now + 1.0, max_age_s=60.0, revision="r1")
            assert (rev.replicas, rev.awake) == (want, want)
            patched = double.replicas(NS, dep)
            assert patched == (want if mode == "none" else 1), (model, patched)  # KEDA's to set in keda mode
        if mode == "keda":
            assert double.requests("PATCH") == []


def test_pods_parked_asleep_stay_in_the_count_where_the_pods_can_sleep(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with KubeDouble() as double:
        for dep in DEPLOYMENTS.values():
            double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
        ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none",
                         PREWARM_KUBERNETES_POD_SLEEP_MODE="true")
        publish_cluster_target(ctx, "b", 0, 1, now=time.time())  # the round parked b asleep
        target = read_target(ctx.client, "b", now=time.time(), max_age_s=60.0)
        assert (target.replicas, target.awake) == (1, 0) and double.replicas(NS, "dep-b") == 1
        ctx.client.hset(keys.demand("b"), mapping={"count": "1", "last": repr(time.time())})  # a request waited
        publish_cluster_target(ctx, "b", 0, 1, now=time.time())
        target = read_target(ctx.client, "b", now=time.time(), max_age_s=60.0)
        assert (target.replicas, target.awake) == (1, 1)  # fresh demand: the parked pod is woken, none added


def test_the_planners_lead_is_its_revisions_then_its_models(redis_url: str, clean_env: pytest.MonkeyPatch) -> None:
    """Issue 18: the lead was one list per model, mixing revisions and node classes."""
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    ctx = WorkerContext.build(Settings.load(), registry=CollectorRegistry())
    params = PlannerParams.from_settings(ctx.settings.planner)
    new = ModelSpec("llama", "r2")
    assert inputs(ctx, new, PlannerState(), params, now=time.time()).cold_start_p95_s is None  # nothing measured
    ctx.registry.record_load_time("llama", 40.0, revision="r1", node_class="a10")
    ctx.registry.record_load_time("llama", 20.0, revision="r1", node_class="h100")
    # r2 not measured yet: its model's lead (the slowest class), not the 8.7 s default
    assert inputs(ctx, new, PlannerState(), params, now=time.time()).cold_start_p95_s == 40.0
    ctx.registry.record_load_time("llama", 12.0, revision="r2", node_class="h100")
    assert inputs(ctx, new, PlannerState(), params, now=time.time()).cold_start_p95_s == 12.0


def test_a_dense_models_count_in_the_pool_is_the_count_planners(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 17 "one planner": the pool round sizes a dense model with the count planner, on the inputs and state
    a model planned alone gets, so its count is what `step` decides for it (here more than one replica, two of
    them on one node) and the round saves the step's state where `plan_model` keeps it."""
    with KubeDouble() as double:
        for dep in DEPLOYMENTS.values():
            double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
        ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none",
                         PREWARM_PLANNER_FLEET_BUDGET_GB="400", PREWARM_PLANNER_MODEL_MEMORY_GB=json.dumps(
                             {"a": 20.0, "b": 40.0, "c": 40.0}))
        _traffic(ctx)
        now = time.time()
        fine = int(now // 10) * 10
        for k in range(1, 200):  # `a` holds 30 requests in flight on average, at 3 a second
            start = fine - 10 * k
            ctx.client.set(keys.requests("a", 10, start), 30)
            ctx.client.set(keys.inflight_peak("a", 10, start), 36)
            ctx.client.set(keys.busy("a", 10, start), 300.0)
        ctx.client.hset(keys.REQUESTS_FIRST, "a", fine - 2000)
        spec = ModelSpec("a", "r1", slots=ctx.settings.gateway.replica_concurrency,
                         capacity_rps=ctx.settings.planner.capacity_rps)
        params = PlannerParams.from_settings(ctx.settings.planner)
        alone, after = step(inputs(ctx, spec, PlannerState(), params, now=now), PlannerState())
        assert alone.cluster_target >= 3, alone  # the case at hand: a dense model needs several replicas
        app = make_app(ctx.settings)
        try:
            plans = {p.model: p for p in fleet_and_plan(ctx, app, now=now)}
        finally:
            app.close()
        plan = json.loads(ctx.client.get(keys.FLEET_PLAN) or "{}")["models"]
        assert plan["a"]["dense"] and plan["a"]["replicas"] == alone.cluster_target == plans["a"].need_now, plan
        assert len(set(plan["a"]["nodes"])) < len(plan["a"]["nodes"])  # more replicas than nodes: they share
        assert double.replicas(NS, "dep-a") == alone.cluster_target  # to its Deployment's one owner
        saved = PlannerState.from_json(ctx.client.get(keys.planner_state("a")))
        assert saved.margin == after.margin and saved.counted_end == after.counted_end


def test_a_dense_model_whose_inputs_cannot_be_read_is_planned_by_its_outlook(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One dense model's count-planner inputs failing (its history unreadable) does not fail the pool's round:
    that model is planned by its arrival outlook this round, the others as usual, and the log says so."""
    import workers.planning.fleet as fleet_mod
    from forecasting.data.traces import HistoryError

    with KubeDouble() as double:
        for dep in DEPLOYMENTS.values():
            double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
        ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none")
        _traffic(ctx)

        def broken(*args: object, **kw: object) -> object:
            raise HistoryError("counters of 'a' unreadable")

        clean_env.setattr(fleet_mod, "inputs", broken)
        app = make_app(ctx.settings)
        try:
            plans = {p.model: p for p in fleet_and_plan(ctx, app, now=time.time())}
        finally:
            app.close()
        plan = json.loads(ctx.client.get(keys.FLEET_PLAN) or "{}")["models"]
        assert set(plans) == {"a", "b", "c"} and not plan["a"]["dense"] and plan["a"]["tier"] == "gpu", plan
        assert "a not sized by the count planner this round: counters of 'a' unreadable" in caplog.text


def test_which_models_the_count_planner_sizes_is_a_setting(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`planner.fleet_dense_rps` / `planner.fleet_max_dense`: above the threshold `a` (10 requests a second) is dense;
    with the threshold above its rate, or no dense model allowed, its tier and count come from its outlook."""
    for extra, dense in (({}, True), ({"PREWARM_PLANNER_FLEET_DENSE_RPS": "50"}, False),
                         ({"PREWARM_PLANNER_FLEET_MAX_DENSE": "0"}, False)):
        with KubeDouble() as double:
            for dep in DEPLOYMENTS.values():
                double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
            ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "keda", **extra)
            ctx.client.flushdb()
            _traffic(ctx)
            app = make_app(ctx.settings)
            try:
                fleet_and_plan(ctx, app, now=time.time())
            finally:
                app.close()
            plan = json.loads(ctx.client.get(keys.FLEET_PLAN) or "{}")["models"]
            assert plan["a"]["dense"] is dense, (extra, plan)


def test_a_model_whose_saved_planner_holds_a_fall_stays_dense_in_the_live_round(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The live round reads the same rule as the replay (`held_models`): `c` is idle, far below the dense rate,
    but the last round sized it and its saved count-planner state holds a fall within its span, so the count
    planner sizes it this round too; with that span passed it is planned by its outlook."""
    from forecasting.fleet.round import RoundState
    from workers.planning.fleet import fleet_decide
    from workers.planning.forecast import save_planner_state

    with KubeDouble() as double:
        for dep in DEPLOYMENTS.values():
            double.add_deployment(NS, dep, replicas=1, labels={"app": dep})
        ctx = _fleet_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none")
        _traffic(ctx)
        now = time.time()
        last = RoundState(dense=("a", "c"))
        hold_s = ctx.settings.planner.interruption_hold_s
        save_planner_state(ctx, "c", PlannerState(quiet_since=now - hold_s / 2))
        decision, _ = fleet_decide(ctx, now=now, state=last)
        assert decision is not None and "c" in decision.result.dense and "a" in decision.result.dense
        save_planner_state(ctx, "c", PlannerState(quiet_since=now - 2 * hold_s))
        decision, _ = fleet_decide(ctx, now=now, state=last)
        assert decision is not None and "c" not in decision.result.dense
        decision, _ = fleet_decide(ctx, now=now, state=RoundState(dense=("a",)))  # not sized last round
        assert decision is not None and "c" not in decision.result.dense
