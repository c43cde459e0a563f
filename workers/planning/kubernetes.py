"""Carry the plan to Kubernetes, when `kubernetes.enabled`: the cron-scaler way.

Each `forecast_and_plan` ends with a target for the model: the planner's serving target
(`Decision.cluster_target`: what the forecast needs over the next lead, plus the warm
pool), which goes down as well as up. With an HPA configured (`kubernetes.hpa`) the
target becomes the HPA's `minReplicas` — raised ahead of a forecast peak, lowered again
as the need falls, never under the operator's own floor (the actuator remembers it in an
annotation) — so the HPA keeps reacting to load above the forecast. Without an HPA the
Deployment (`kubernetes.deployment`) is scaled through its scale subresource.
`kubernetes.dry_run` prints the patches and changes nothing.
"""

from __future__ import annotations

import logging

from prewarm.adapters.k8s import KubeActuator, PatchResult, api_client_from_settings
from prewarm.core.settings import KubernetesSettings

log = logging.getLogger("prewarm.planner.cluster")


def apply_target(actuator: KubeActuator, cfg: KubernetesSettings, target: int) -> PatchResult:
    """Set the HPA floor (or, without an HPA, the Deployment's replicas) to `target`."""
    if cfg.hpa:
        return actuator.raise_min_replicas(cfg.hpa, max(1, target), dry_run=cfg.dry_run)
    if cfg.deployment:
        return actuator.scale(cfg.deployment, max(0, target), dry_run=cfg.dry_run)
    raise ValueError("kubernetes.enabled needs PREWARM_KUBERNETES_HPA or PREWARM_KUBERNETES_DEPLOYMENT")


def actuator_for(cfg: KubernetesSettings) -> KubeActuator:
    return KubeActuator(api_client_from_settings(cfg.kubeconfig), cfg.namespace, printer=log.info)
