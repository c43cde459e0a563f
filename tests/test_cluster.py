"""The plan carried to Kubernetes through one owner of the replica count.

Driven through the real `kubernetes` client against the HTTP-level API double
(`tests/k8s_double.py`, with its Deployment-controller switch that creates and deletes pods);
no API server can run here. The planning task itself (`forecast_and_plan`, hence
`_apply_to_cluster`) runs on a real Redis, reaching the double through a kubeconfig.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry

from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec, Pool, ScaleEvent, ScaleEventKind
from prewarm.core import keys
from prewarm.adapters.k8s import KubeActuator
from prewarm.registry.targets import read_target
from prewarm.core.settings import KubernetesSettings, Settings
from tests.k8s_double import KubeDouble
from workers.planning.kubernetes import apply_target, cluster_target, events_for_executor, target_schedule
from workers.context import WorkerContext
from workers.app import make_app
from workers.planning.forecast import forecast_and_plan
from workers.planning.tasks import handle_demand_for

NS = "inference"


@pytest.fixture()
def double() -> Iterator[KubeDouble]:
    with KubeDouble() as d:
        d.add_deployment(NS, "llm", replicas=2)
        d.add_hpa(NS, "llm", min_replicas=2, max_replicas=10, deployment="llm")
        yield d


def test_deployment_scaled_through_the_subresource_and_dry_run_changes_nothing(double: KubeDouble) -> None:
    act = KubeActuator(double.api_client(), NS, printer=lambda _s: None)
    res = apply_target(act, KubernetesSettings(enabled=True, namespace=NS, deployment="llm", dry_run=True), "m", 5)
    assert res is not None and res.dry_run and not res.applied and double.replicas(NS, "llm") == 2
    apply_target(act, KubernetesSettings(enabled=True, namespace=NS, deployment="llm"), "m", 5)
    assert double.replicas(NS, "llm") == 5
    many = KubernetesSettings(enabled=True, namespace=NS, deployment="other", deployments={"m": "llm"})
    apply_target(act, many, "m", 0)
    assert double.replicas(NS, "llm") == 0  # one Deployment per model; zero is a target like any other
    with pytest.raises(ValueError, match="Deployment of n"):
        apply_target(act, many, "n", 3)  # a model missing from the map never scales another model's Deployment
    with pytest.raises(ValueError, match="PREWARM_KUBERNETES_DEPLOYMENT"):
        apply_target(act, KubernetesSettings(enabled=True, namespace=NS), "m", 3)


@pytest.mark.parametrize("mode", ["keda", "hpa"])
def test_with_keda_or_the_hpa_the_planner_patches_nothing(double: KubeDouble, mode: str) -> None:
    act = KubeActuator(double.api_client(), NS)
    cfg = KubernetesSettings(enabled=True, namespace=NS, deployment="llm", autoscaling=mode)
    assert apply_target(act, cfg, "m", 7) is None
    assert double.requests("PATCH") == [] and double.replicas(NS, "llm") == 2


def test_with_a_cluster_the_agents_get_only_keep_warm_events() -> None:
    up = ScaleEvent(event_id="u", kind=ScaleEventKind.SCALE_UP, model="m", revision="r1", at=0.0, replicas=2,
                    pool=Pool.SERVING)
    hold = ScaleEvent(event_id="h", kind=ScaleEventKind.HOLD, model="m", revision="r1", at=0.0, replicas=1,
                      pool=Pool.SERVING)
    assert events_for_executor(KubernetesSettings(enabled=False), [up, hold]) == [up, hold]
    assert events_for_executor(KubernetesSettings(enabled=True), [up, hold]) == [hold]


def test_cluster_target_is_the_serving_target_plus_the_pool_and_goes_down_too() -> None:
    model = ModelSpec("m", "r1", slots=8)
    params = PlannerParams(warm_pool_size=1, budget_share=1.0, margin_initial=1.5)
    y = np.full(400, 40.0)
    inp = StepInputs(model, 1_700_004_000.0, observed_from_counts(1_700_000_000.0, 10.0, y, y, y * 10.0),
                     ReplicaCounts(ready=12), params)
    decision, _ = step(inp, PlannerState())
    assert decision.target == 7 and cluster_target(decision) == 7 + 1  # below the 12 live: the plan releases
    assert target_schedule(decision, 1_700_004_000.0) == [(1_700_004_000.0, 8)]


# --- the live planning task against the double: `_apply_to_cluster` for real -------------------------
#: 13:20 past an hour (epoch 1_700_000_000 % 3600 == 800 s); the batch job below starts at minute 30.
T0 = 1_700_000_000.0
JOB_AT = T0 + 1000.0


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "double",
        "clusters": [{"name": "double", "cluster": {"server": url}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "nobody", "namespace": NS}}],
    }))
    return path


def _planner_ctx(mp: pytest.MonkeyPatch, redis_url: str, kubeconfig: Path, mode: str) -> WorkerContext:
    for k, v in {
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_KUBERNETES_ENABLED": "true",
        "PREWARM_KUBERNETES_AUTOSCALING": mode,
        "PREWARM_KUBERNETES_NAMESPACE": NS,
        "PREWARM_KUBERNETES_DEPLOYMENT": "tiny",
        "PREWARM_KUBERNETES_KUBECONFIG": str(kubeconfig),
        "PREWARM_PLANNER_MODELS": '["tiny@r1"]',
        "PREWARM_PLANNER_MIN_SERVING": "0",  # no traffic, no batch: scale to zero
        "PREWARM_PLANNER_WARM_POOL_SIZE": "0",
        "PREWARM_PLANNER_STABILIZATION_S": "0",
        "PREWARM_PLANNER_BUDGET_SHARE": "1",
        # a scheduled batch job: a rise the planner knows of in advance, whatever the forecast says
        "PREWARM_PLANNER_BATCH_JOBS": '[{"cron": "30 * * * *", "model": "tiny", "replicas": 3, "duration_s": 120}]',
    }.items():
        mp.setenv(k, v)
    return WorkerContext.build(Settings.load(), registry=CollectorRegistry())


def test_a_planned_rise_creates_each_pod_once_through_the_scale_subresource(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with KubeDouble() as double:
        double.add_deployment(NS, "tiny", replicas=1, labels={"app": "tiny"}, controller=True)
        ctx = _planner_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none")
        lead = ctx.settings.planner.default_cold_start_s + ctx.settings.planner.lead_margin_s
        assert double.created() == ["tiny-1"]  # the pod the Deployment started with
        assert forecast_and_plan(ctx, now=T0)[0].need_now == 0
        assert double.replicas(NS, "tiny") == 0 and double.pod_names(NS) == []  # scaled to zero
        rise = JOB_AT - lead + 1.0  # the batch job's replicas are due one lead ahead of it
        forecast_and_plan(ctx, now=rise)
        assert double.replicas(NS, "tiny") == 3 and double.created() == ["tiny-1", "tiny-2", "tiny-3", "tiny-4"]
        forecast_and_plan(ctx, now=rise + 5.0)  # a re-plan (no pod is registered yet) changes nothing
        forecast_and_plan(ctx, now=JOB_AT + 30.0)
        assert double.created() == ["tiny-1", "tiny-2", "tiny-3", "tiny-4"]  # each pod of the rise created once
        # the node agents got nothing to start: only the Deployment's pods come up (the pod warmer registers them)
        queued = ctx.client.zrange(keys.PLANNED_EVENTS, 0, -1)
        assert not [e for e in queued if e.startswith(("scale_up", "scale_down"))]
        assert ctx.registry.models() == [] or all(not ctx.registry.replicas_of(m) for m in ctx.registry.models())
        forecast_and_plan(ctx, now=JOB_AT + 200.0)  # the job is over: back to zero
        assert double.replicas(NS, "tiny") == 0 and double.pod_names(NS) == []
        record = ctx.client.hgetall(keys.last_forecast("tiny"))
        assert record["target"] == "0"


def test_with_keda_the_planner_only_records_the_target(redis_url: str, clean_env: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    with KubeDouble() as double:
        double.add_deployment(NS, "tiny", replicas=1, labels={"app": "tiny"}, controller=True)
        ctx = _planner_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "keda")
        forecast_and_plan(ctx, now=JOB_AT - 60.0)
        assert double.requests("PATCH") == [] and double.replicas(NS, "tiny") == 1
        got = read_target(ctx.client, "tiny", now=JOB_AT - 60.0, max_age_s=180.0)
        assert (got.replicas, got.next_replicas) == (0, 3) and got.next_at is not None and got.next_at < JOB_AT
        assert read_target(ctx.client, "tiny", now=JOB_AT, max_age_s=180.0).replicas == 3


def test_unmet_demand_brings_a_deployment_back_from_zero_without_an_agent(
        redis_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Scale from zero in a cluster: the gateway's unmet demand re-plans the model at once with a
    floor of one replica, which reaches the Deployment's one owner (here the scale subresource)."""
    with KubeDouble() as double:
        double.add_deployment(NS, "tiny", replicas=0, labels={"app": "tiny"}, controller=True)
        ctx = _planner_ctx(clean_env, redis_url, _kubeconfig(tmp_path / "kubeconfig", double.url), "none")
        app = make_app(ctx.settings)
        forecast_and_plan(ctx, now=T0)
        assert double.replicas(NS, "tiny") == 0
        ctx = dataclasses.replace(ctx, clock=lambda: T0 + 30.0)
        ctx.client.hset(keys.demand("tiny"), mapping={"count": "3", "last": repr(T0 + 29.0)})  # as the gateway records
        out = handle_demand_for(ctx, app, "tiny")
        assert out["outcome"] == "planned"
        assert double.replicas(NS, "tiny") == 1 and double.created() == ["tiny-1"]
        assert ctx.client.zcard(keys.PLANNED_EVENTS) == 0  # no agent was asked to prewarm anything
        assert read_target(ctx.client, "tiny", now=T0 + 60.0, max_age_s=180.0).replicas == 1
        forecast_and_plan(ctx, now=T0 + 100.0)  # still fresh demand: the floor holds (no flapping to zero)
        assert double.replicas(NS, "tiny") == 1 and double.created() == ["tiny-1"]
        forecast_and_plan(ctx, now=T0 + 29.0 + 121.0)  # stale demand, no traffic in the history: back to zero
        assert double.replicas(NS, "tiny") == 0
