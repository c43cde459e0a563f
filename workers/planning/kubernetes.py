"""Carry the plan to Kubernetes, when `kubernetes.enabled`: the cron-scaler way.

Each `forecast_and_plan` ends with a serving target for the model: the live serving count
after every scale event whose time has come (scale-ups are scheduled one cold start
ahead of the need), plus the warm pool. With an HPA configured (`kubernetes.hpa`) the
target becomes the HPA's `minReplicas` — raised ahead of a forecast peak, lowered again
as the need falls, never under the operator's own floor (the actuator remembers it in an
annotation) — so the HPA keeps reacting to load above the forecast. Without an HPA the
Deployment (`kubernetes.deployment`) is scaled through its scale subresource.
`kubernetes.dry_run` prints the patches and changes nothing.
"""

from __future__ import annotations

import logging

from forecasting.planner import PlanResult
from prewarm.adapters.k8s import KubeActuator, PatchResult, api_client_from_settings
from prewarm.core.settings import KubernetesSettings

log = logging.getLogger("prewarm.planner.cluster")


def cluster_target(result: PlanResult, live_serving: int, now: float) -> int:
    """Replicas the cluster should run now: the serving target at `now` plus the warm pool, at least 1."""
    return max(1, result.serving_target(live_serving, now) + result.pool_target)


def apply_target(actuator: KubeActuator, cfg: KubernetesSettings, target: int) -> PatchResult:
    """Set the HPA floor (or, without an HPA, the Deployment's replicas) to `target`."""
    if cfg.hpa:
        return actuator.raise_min_replicas(cfg.hpa, max(1, target), dry_run=cfg.dry_run)
    if cfg.deployment:
        return actuator.scale(cfg.deployment, max(0, target), dry_run=cfg.dry_run)
    raise ValueError("kubernetes.enabled needs PREWARM_KUBERNETES_HPA or PREWARM_KUBERNETES_DEPLOYMENT")


def actuator_for(cfg: KubernetesSettings) -> KubeActuator:
    return KubeActuator(api_client_from_settings(cfg.kubeconfig), cfg.namespace, printer=log.info)
