"""A rollout across two Deployments (stable and canary) of one model, against the Kubernetes API double.

Only the API server is a double (tests/k8s_double.py, at the HTTP level); the registry is a
real Redis and the rollout tick the planner's own code. The pod warmer's part (it registers
a pod as a ready replica only once it is warmed and validated) is played by the test.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import KubernetesSettings, RedisSettings, Settings
from prewarm.policy import rollout as rp
from prewarm.registry.rollouts import RolloutStore
from tests.k8s_double import KubeDouble
from workers.app import make_app
from workers.context import WorkerContext
from workers.planning.forecast import forecast_and_plan
from workers.planning.rollout import tick

NS = "inference"


@pytest.fixture()
def double() -> Iterator[KubeDouble]:
    with KubeDouble() as d:
        d.add_deployment(NS, "tiny-stable", replicas=4, labels={"app": "tiny", "rev": "r1"})
        d.add_deployment(NS, "tiny-canary", replicas=0, labels={"app": "tiny", "rev": "r2"})
        yield d


@pytest.fixture()
def ctx(double: KubeDouble, redis_url: str, tmp_path: Path) -> Iterator[WorkerContext]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "double", "cluster": {"server": double.url}}],
        "users": [{"name": "u", "user": {"token": "test"}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "u", "namespace": NS}}],
        "current-context": "double",
    }))
    settings = Settings(redis=RedisSettings(url=redis_url), kubernetes=KubernetesSettings(
        enabled=True, namespace=NS, autoscaling="none", kubeconfig=str(kubeconfig),
        deployments={"tiny": "tiny-stable", "tiny@r1": "tiny-stable", "tiny@r2": "tiny-canary"}))
    c = WorkerContext.build(settings)
    yield c
    c.client.close()


def pod_ready(ctx: WorkerContext, rev: str, slot: int, *, fail: str | None = None) -> None:
    """The pod warmer registers a pod once warmed and validated (or fails it)."""
    r = Replica("tiny", rev, f"pod-{rev}-{slot}", 0, endpoint=f"http://10.0.0.{slot}:8000")
    now = time.time()
    ctx.registry.register(r, now=now)
    ctx.registry.transition(r.id, ReplicaState.LOADING, now=now)
    if fail:
        ctx.registry.transition(r.id, ReplicaState.FAILED, now=now, reason=fail)
        return
    for st in (ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(r.id, st, now=now)


def test_the_targets_split_by_weight_across_two_deployments(ctx: WorkerContext, double: KubeDouble) -> None:
    app = make_app(ctx.settings)
    for slot in range(4):
        pod_ready(ctx, "r1", slot)
    ctx.client.hset(keys.last_forecast("tiny"), mapping={"serving_target": "4", "pool_target": "0", "lead_s": "30"})
    spec = rp.RolloutSpec(model="tiny", stable="r1", canary="r2", steps=(50, 100), pause_s=0.5, logprob_tolerance=0.05,
                          speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2, min_requests=20)
    store = RolloutStore(ctx.client)
    store.update("tiny", lambda running: rp.start(spec, now=time.time(), live_revisions=["r1"],
                                                  known_revisions=["r2"], running=running))
    t = tick(ctx, app, "tiny", now=time.time())
    assert t is not None and t.action == "prepare"
    assert (double.replicas(NS, "tiny-canary"), double.replicas(NS, "tiny-stable")) == (2, 4)
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]  # the canary's pods are not warmed yet
    pod_ready(ctx, "r2", 1)
    pod_ready(ctx, "r2", 2)
    t = tick(ctx, app, "tiny", now=time.time())
    assert t is not None and t.action == "shift" and store.weights("tiny") == [("r2", 50.0), ("r1", 50.0)]
    assert double.replicas(NS, "tiny-stable") == 4  # shrunk only after the gateway has the new weights
    tick(ctx, app, "tiny", now=time.time())
    assert double.replicas(NS, "tiny-stable") == 2
    pod_ready(ctx, "r2", 3, fail="validation: top logprobs differ from r1 by 2.5 > 0.05")  # the next step's pod
    t = tick(ctx, app, "tiny", now=time.time() + 1)
    assert t is not None and t.action == "rollback"
    assert double.replicas(NS, "tiny-canary") == 0
    assert double.replicas(NS, "tiny-stable") == 4  # the whole demand back on the stable revision
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]
    tick(ctx, app, "tiny", now=time.time() + 2)
    assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]  # canary pods still registered: the split holds
    for r in ctx.registry.replicas_of("tiny"):  # the pod warmer drains and retires the deleted canary pods
        if r.revision == "r2" and r.state is ReplicaState.READY:
            ctx.registry.transition(r.id, ReplicaState.DRAINING, now=time.time())
            ctx.registry.transition(r.id, ReplicaState.RETIRED, now=time.time())
    tick(ctx, app, "tiny", now=time.time() + 3)
    assert store.weights("tiny") == []  # no split left: any ready revision is routed again
    app.close()


def test_a_completed_rollout_hands_the_models_target_to_the_canarys_deployment(
        ctx: WorkerContext, double: KubeDouble) -> None:
    """After the rollout the planner plans the canary revision: its target goes to that revision's own
    Deployment (`kubernetes.deployments["tiny@r2"]`), not back to the stable one the model's key names."""
    app = make_app(ctx.settings)
    for slot in range(4):
        pod_ready(ctx, "r1", slot)
    spec = rp.RolloutSpec(model="tiny", stable="r1", canary="r2", steps=(100,), pause_s=0.2, logprob_tolerance=0.05,
                          speed_ratio=1.2, error_rate_margin=0.01, latency_ratio=1.2, min_requests=20)
    store = RolloutStore(ctx.client)
    t = time.time()
    forecast_and_plan(ctx, now=t)
    target = int(ctx.client.hget(keys.last_forecast("tiny"), "target") or -1)
    assert target >= 1 and double.replicas(NS, "tiny-stable") == target
    store.update("tiny", lambda running: rp.start(spec, now=t, live_revisions=["r1"], known_revisions=["r2"],
                                                  running=running))
    actions = []
    for _ in range(7):
        t += 0.3
        forecast_and_plan(ctx, now=t)
        tick_result = tick(ctx, app, "tiny", now=t)
        actions.append(tick_result.action if tick_result else "-")
        if tick_result is not None and tick_result.action == "prepare":
            for slot in range(double.replicas(NS, "tiny-canary")):
                pod_ready(ctx, "r2", 10 + slot)
    assert "complete" in actions, actions
    assert double.replicas(NS, "tiny-stable") == 0
    forecast_and_plan(ctx, now=t + 1.0)
    assert ctx.client.hget(keys.last_forecast("tiny"), "revision") == "r2"
    assert double.replicas(NS, "tiny-canary") == int(ctx.client.hget(keys.last_forecast("tiny"), "target") or -1)
    assert double.replicas(NS, "tiny-stable") == 0  # the retired revision is not brought back
    app.close()
