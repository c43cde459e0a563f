"""The plan carried to Kubernetes: the HPA floor (or the Deployment) follows the planner's target.

Driven through the real `kubernetes` client against the HTTP-level API double
(`tests/k8s_double.py`); no API server can run here.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec
from prewarm.adapters.k8s import KubeActuator
from prewarm.core.settings import KubernetesSettings
from tests.k8s_double import KubeDouble
from workers.planning.kubernetes import apply_target

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


def test_cluster_target_is_the_serving_target_plus_the_pool_and_goes_down_too() -> None:
    model = ModelSpec("m", "r1", slots=8)
    params = PlannerParams(warm_pool_size=1, budget_share=1.0)
    y = np.full(400, 40.0)
    inp = StepInputs(model, 1_700_004_000.0, observed_from_counts(1_700_000_000.0, 10.0, y, y, y * 10.0),
                     ReplicaCounts(ready=12), params)
    decision, _ = step(inp, PlannerState())
    assert decision.target == 7 and decision.cluster_target == 7 + 1  # below the 12 live: the plan releases
