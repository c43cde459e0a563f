"""The plan carried to Kubernetes: the HPA floor (or the Deployment) follows the planner's target.

Driven through the real `kubernetes` client against the HTTP-level API double
(`tests/k8s_double.py`); no API server can run here.
"""

from __future__ import annotations

from typing import Iterator

import pandas as pd
import pytest

from forecasting.planner import PlanContext, PlannerParams, PlannerState, ReplicaCounts, plan
from prewarm.core.domain import ModelSpec
from prewarm.adapters.k8s import KubeActuator
from prewarm.core.settings import KubernetesSettings
from tests.k8s_double import KubeDouble
from workers.planning.kubernetes import apply_target, cluster_target

NS = "inference"


@pytest.fixture()
def double() -> Iterator[KubeDouble]:
    with KubeDouble() as d:
        d.add_deployment(NS, "llm", replicas=2)
        d.add_hpa(NS, "llm", min_replicas=2, max_replicas=10, deployment="llm")
        yield d


def test_hpa_floor_rises_ahead_of_a_peak_and_returns_to_the_operators_floor(double: KubeDouble) -> None:
    act = KubeActuator(double.api_client(), NS)
    cfg = KubernetesSettings(enabled=True, namespace=NS, hpa="llm")
    assert apply_target(act, cfg, 6).after == 6
    assert double.hpa(NS, "llm")["spec"]["minReplicas"] == 6
    assert apply_target(act, cfg, 3).after == 3  # the need falls: the floor follows
    assert apply_target(act, cfg, 1).after == 2  # never under the operator's own floor
    assert double.hpa(NS, "llm")["spec"]["minReplicas"] == 2


def test_deployment_scaled_without_an_hpa_and_dry_run_changes_nothing(double: KubeDouble) -> None:
    act = KubeActuator(double.api_client(), NS, printer=lambda _s: None)
    res = apply_target(act, KubernetesSettings(enabled=True, namespace=NS, deployment="llm", dry_run=True), 5)
    assert res.dry_run and not res.applied and double.replicas(NS, "llm") == 2
    apply_target(act, KubernetesSettings(enabled=True, namespace=NS, deployment="llm"), 5)
    assert double.replicas(NS, "llm") == 5
    with pytest.raises(ValueError, match="PREWARM_KUBERNETES_HPA"):
        apply_target(act, KubernetesSettings(enabled=True, namespace=NS), 3)


def test_cluster_target_counts_due_scale_ups_and_the_pool() -> None:
    model = ModelSpec("m", "r1", capacity_rps=10.0)
    fc = pd.DataFrame({"q0.5": [5.0, 5.0, 35.0, 35.0], "q0.9": [5.0, 5.0, 35.0, 35.0]}, index=[0.0, 60.0, 120.0, 180.0])
    params = PlannerParams(warm_pool_size=1, budget_share=1.0, default_cold_start_s=20.0, lead_margin_s=10.0)
    result, _ = plan(PlanContext(model, fc, ReplicaCounts(ready=1), now=0.0, params=params), PlannerState())
    assert cluster_target(result, 1, now=0.0) == 1 + 1  # the rise at 120 s is not due yet; the pool is
    assert cluster_target(result, 1, now=90.0) == 4 + 1  # due at 120 - 30 s lead
