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


def target_for(cfg: KubernetesSettings, model: str | None) -> tuple[str, str] | None:
    """("hpa" | "deployment", name) that carries ``model``'s target: its own (`kubernetes.hpas` /
    `kubernetes.deployments`) first; the global one only when no model has its own (else
    every model would overwrite one Deployment in turn); None when the model has none."""
    if model is not None and model in cfg.hpas:
        return "hpa", cfg.hpas[model]
    if model is not None and model in cfg.deployments:
        return "deployment", cfg.deployments[model]
    if cfg.hpas or cfg.deployments:
        return None
    if cfg.hpa:
        return "hpa", cfg.hpa
    if cfg.deployment:
        return "deployment", cfg.deployment
    raise ValueError("kubernetes.enabled needs PREWARM_KUBERNETES_HPA or PREWARM_KUBERNETES_DEPLOYMENT "
                     "(or per model: PREWARM_KUBERNETES_HPAS / PREWARM_KUBERNETES_DEPLOYMENTS)")


def apply_target(actuator: KubeActuator, cfg: KubernetesSettings, target: int, model: str | None = None) -> PatchResult:
    """Set the model's HPA floor (or, without an HPA, its Deployment's replicas) to `target`."""
    chosen = target_for(cfg, model)
    if chosen is None:
        raise ValueError(f"no Deployment or HPA is configured for {model} (kubernetes.deployments / kubernetes.hpas)")
    kind, name = chosen
    if kind == "hpa":
        return actuator.raise_min_replicas(name, max(1, target), dry_run=cfg.dry_run)
    return actuator.scale(name, max(0, target), dry_run=cfg.dry_run)


def actuator_for(cfg: KubernetesSettings) -> KubeActuator:
    return KubeActuator(api_client_from_settings(cfg.kubeconfig), cfg.namespace, printer=log.info)
