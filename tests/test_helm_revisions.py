"""The chart for a rollout across two Deployments of one model (issue 19): each Deployment's
ScaledObject or HPA reads its own revision's share of the planner's target.

Rendered with Helm's Go SDK and validated as tests/test_helm.py does (Kubernetes OpenAPI schemas,
KEDA's documented ScaledObject fields). That the scaler serves what these objects ask for is
tests/test_rollout_keda.py.
"""

from __future__ import annotations

import json
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from prewarm.gateway.keda import MODEL_KEY, REVISION_KEY, REVISION_TARGET_METRIC, TARGET_METRIC, target_ref
from tests.keda_crd import check_scaled_object
from tests.test_helm import CHART, KUBE_VERSIONS, NS, env_of, find, render

ROLLOUT = [{"model": "tiny", "deployment": "tiny-canary", "revision": "r2"},
           {"model": "llama3", "deployment": "vllm-llama3", "revision": "2024-06"}]
INFERENCE = {"model": "tiny", "revision": "r1"}  # the chart's own inference Deployment: the stable revision


def _by_deployment(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == kind}


def test_keda_mode_names_the_revision_of_each_deployment_of_a_model_served_twice() -> None:
    """The chart's inference Deployment serves tiny@r1; a canary Deployment of tiny@r2 is added for a rollout."""
    docs = render({"autoscaling": {"mode": "keda", "targets": ROLLOUT}, "inference": INFERENCE})
    objects = _by_deployment(docs, "ScaledObject")
    assert set(objects) == {"pw-prewarm-inference", "tiny-canary", "vllm-llama3"}
    metadata = {dep: so["spec"]["triggers"][0]["metadata"] for dep, so in objects.items()}
    stable = metadata["pw-prewarm-inference"]
    assert (stable[MODEL_KEY], stable[REVISION_KEY]) == ("tiny", "r1")
    assert (metadata["tiny-canary"][MODEL_KEY], metadata["tiny-canary"][REVISION_KEY]) == ("tiny", "r2")
    assert REVISION_KEY not in metadata["vllm-llama3"]  # the only Deployment of its model: the model's target
    # what the scaler makes of each trigger's metadata (prewarm.gateway.keda.target_ref)
    assert {dep: target_ref(m) for dep, m in metadata.items()} == {
        "pw-prewarm-inference": ("tiny", "r1"), "tiny-canary": ("tiny", "r2"), "vllm-llama3": ("llama3", None)}
    for so in objects.values():
        check_scaled_object(so)
    env = env_of(find(docs, "Deployment", "-planner"))
    # the planner's map: the model's first Deployment, and each revision's own (autoscaling none scales these)
    assert json.loads(env["PREWARM_KUBERNETES_DEPLOYMENTS"]) == {
        "tiny": "pw-prewarm-inference", "tiny@r1": "pw-prewarm-inference", "tiny@r2": "tiny-canary",
        "llama3": "vllm-llama3"}
    assert set(json.loads(env["PREWARM_KUBERNETES_MAX_REPLICAS_BY_MODEL"])) == {"tiny", "tiny@r1", "tiny@r2", "llama3"}


def test_hpa_mode_reads_each_revisions_gauge_for_a_model_served_twice() -> None:
    docs = render({"autoscaling": {"mode": "hpa", "targets": ROLLOUT}, "inference": INFERENCE})
    hpas = _by_deployment(docs, "HorizontalPodAutoscaler")
    metrics = {dep: h["spec"]["metrics"][0]["external"]["metric"] for dep, h in hpas.items()}
    assert metrics == {
        "pw-prewarm-inference": {"name": REVISION_TARGET_METRIC,
                                 "selector": {"matchLabels": {"model": "tiny", "revision": "r1"}}},
        "tiny-canary": {"name": REVISION_TARGET_METRIC,
                        "selector": {"matchLabels": {"model": "tiny", "revision": "r2"}}},
        "vllm-llama3": {"name": TARGET_METRIC, "selector": {"matchLabels": {"model": "llama3"}}},
    }
    for doc in hpas.values():
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_two_entries_of_one_model_render_and_lint_in_both_modes_without_the_inference_deployment() -> None:
    targets = [{"model": "m", "deployment": "m-stable", "revision": "a"},
               {"model": "m", "deployment": "m-canary", "revision": "b", "maxReplicas": 3}]
    for mode in ("keda", "hpa"):
        values = {"autoscaling": {"mode": mode, "targets": targets}, "inference": {"enabled": False},
                  "podWarmer": {"enabled": False}}
        report = helm_python.lint(str(CHART), values, strict=True, namespace=NS)
        assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
        kind = "ScaledObject" if mode == "keda" else "HorizontalPodAutoscaler"
        objects = _by_deployment(render(values), kind)
        assert set(objects) == {"m-stable", "m-canary"}
        top = "maxReplicaCount" if mode == "keda" else "maxReplicas"
        assert (objects["m-stable"]["spec"][top], objects["m-canary"]["spec"][top]) == (8, 3)


@pytest.mark.parametrize("targets, words", [
    ([{"model": "tiny", "deployment": "tiny-canary"}], "each must name its revision"),
    ([{"model": "tiny", "deployment": "tiny-canary", "revision": "r1"}], "both name tiny@r1"),
])
def test_two_deployments_of_one_model_without_their_own_revisions_are_refused(
        targets: list[dict[str, str]], words: str) -> None:
    with pytest.raises(Exception) as err:
        render({"autoscaling": {"mode": "keda", "targets": targets}, "inference": INFERENCE})
    assert words in str(err.value)
