"""Carry the plan to Kubernetes, when `kubernetes.enabled`: one owner of the replica count.

In a cluster the Deployment's replica count has exactly one owner, chosen by
`kubernetes.autoscaling`:

- `keda`: KEDA's external scaler (`prewarm keda-scaler`) serves the planner's target;
- `hpa`: the HPA scales on the External metric `prewarm_planner_target_replicas`;
- `none`: the planner sets the Deployment's replicas through the scale subresource.

Either way the planner only computes and records a target schedule (`target_schedule`,
written into its Redis record through `prewarm.registry.targets`); with `none` it also
patches the Deployment. It also records a target per revision (`publish_revision_target`,
`keys.revision_target`): the model's whole target for the revision it plans and 0 for the
model's other revisions with a Deployment of their own (`publish_planned_revision`), or, while a
canary rollout splits the model across two Deployments (stable and canary), each revision's
share. A ScaledObject or HPA naming a revision reads that one; with `none` the rollout patches
each revision's Deployment (`kubernetes.deployments["model@revision"]`).
The planner's own SCALE_UP / SCALE_DOWN events are not sent to
the node agents then (`events_for_executor`): Kubernetes starts and stops the pods, and
the pod warmer warms, validates and registers each one, so a planned rise creates each
pod once. HOLD events still go out: they keep ready replicas (pods included) warm. Unmet
demand for a model with nothing running (scale from zero) re-plans it at once, and fresh
unmet demand keeps its target at one or more (`with_demand_floor`), instead of a prewarm
on a node agent.
With `none` the target set is capped at `kubernetes.max_replicas` (per model:
`kubernetes.max_replicas_by_model`), as KEDA's and the HPA's own maximum caps theirs.
`kubernetes.dry_run` prints the patches and changes nothing.
"""

from __future__ import annotations

import logging
from typing import Iterable

from forecasting.planner import Decision
from prewarm.core.domain import ScaleEvent, ScaleEventKind
from prewarm.adapters.k8s import KubeActuator, PatchResult, api_client_from_settings
from prewarm.core.settings import KubernetesSettings
from prewarm.registry.targets import schedule_fields, write_revision_target
from workers.context import WorkerContext

log = logging.getLogger("prewarm.planner.cluster")


def cluster_target(decision: Decision) -> int:
    """Replicas the cluster should run now: the planner's serving target plus the warm pool (0 is allowed)."""
    return max(0, decision.cluster_target)


def target_schedule(decision: Decision, now: float) -> list[tuple[float, int]]:
    """The target now, then each later step the planner already knows of (a batch job's rise, due one
    lead ahead of it, and its end): what the scaler and the metric read between two planning steps."""
    return [(now, cluster_target(decision))] + [(t, max(0, n)) for t, n in decision.schedule if t > now]


#: Unmet demand (the gateway found nothing ready) this recent keeps at least one replica wanted in a
#: cluster: the gateway's counters reach the forecast only once their bucket is complete.
DEMAND_FLOOR_S = 120.0


def with_demand_floor(schedule: list[tuple[float, int]], demand_last: float | None,
                      now: float) -> list[tuple[float, int]]:
    """Scale from zero in a cluster: while unmet demand is fresh, every step until it goes stale is at least 1."""
    if demand_last is None or demand_last < now - DEMAND_FLOOR_S:
        return schedule
    until = demand_last + DEMAND_FLOOR_S
    return [(t, max(n, 1) if t < until else n) for t, n in schedule]


def owns_replicas(cfg: KubernetesSettings) -> bool:
    """True when Kubernetes, not the node agents, owns the planned model's replica count."""
    return cfg.enabled


def events_for_executor(cfg: KubernetesSettings, events: Iterable[ScaleEvent]) -> list[ScaleEvent]:
    """The events the executor carries out: all of them without a cluster; only HOLDs (keep-warm) with one."""
    if not owns_replicas(cfg):
        return list(events)
    return [ev for ev in events if ev.kind is ScaleEventKind.HOLD]


def deployment_for(cfg: KubernetesSettings, model: str) -> str | None:
    """The Deployment serving `model`: its entry in `kubernetes.deployments` when that map is set (a model
    missing from it has none: never someone else's), else the one `kubernetes.deployment`."""
    if cfg.deployments:
        return cfg.deployments.get(model)
    return cfg.deployment


def apply_target(actuator: KubeActuator, cfg: KubernetesSettings, model: str, target: int) -> PatchResult | None:
    """With `autoscaling: none`, set the model's Deployment to `target` replicas; with KEDA or the HPA,
    nothing (they read the recorded target) and None is returned."""
    if cfg.autoscaling != "none":
        return None
    deployment = deployment_for(cfg, model)
    if not deployment:
        raise ValueError(f"kubernetes.autoscaling=none needs the Deployment of {model}: set "
                         "PREWARM_KUBERNETES_DEPLOYMENT (or PREWARM_KUBERNETES_DEPLOYMENTS)")
    cap = max_replicas_for(cfg, model)
    if target > cap:
        log.warning("planner target %d for %s is above kubernetes.max_replicas %d: %s is set to %d",
                    target, model, cap, deployment, cap)
    return actuator.scale(deployment, max(0, min(target, cap)), dry_run=cfg.dry_run)


def deployment_key(cfg: KubernetesSettings, model: str, revision: str | None) -> str:
    """The key of `kubernetes.deployments` (and `max_replicas_by_model`) for one revision of a model:
    `model@revision` where that map has it (each revision its own Deployment), else `model`."""
    key = f"{model}@{revision}"
    return key if revision and key in cfg.deployments else model


def publish_revision_target(ctx: WorkerContext, model: str, revision: str, schedule: list[tuple[float, int]], *,
                            now: float, awake: int | None = None) -> None:
    """Record the planner's target for one revision of `model` (what KEDA and the HPA read for a trigger
    naming the revision, and the pod warmer of that revision's Deployment); nothing with `planner.dry_run`."""
    if ctx.settings.planner.dry_run:
        log.info("dry run: would record %s@%s's target of %d pod(s)", model, revision, schedule[0][1])
        return
    write_revision_target(ctx.client, model, revision, schedule_fields(schedule, planned_at=now, awake=awake))


def publish_planned_revision(ctx: WorkerContext, model: str, revision: str, schedule: list[tuple[float, int]], *,
                             now: float, awake: int | None = None) -> None:
    """No rollout owns `model`'s scaling: the revision planned gets the model's whole target, and every other
    revision of it with its own Deployment (`kubernetes.deployments["model@other"]`: a canary created before
    its rollout starts, the revision a finished rollout retired) a renewed 0, so its ScaledObject or HPA reads
    a fresh 0, never a missing record (and KEDA's fallback replicas on a canary nothing has proved)."""
    publish_revision_target(ctx, model, revision, schedule, now=now, awake=awake)
    for key in ctx.settings.kubernetes.deployments:
        name, sep, other = key.partition("@")
        if sep and name == model and other != revision:
            publish_revision_target(ctx, model, other, [(now, 0)], now=now)


def max_replicas_for(cfg: KubernetesSettings, model: str) -> int:
    """The most replicas the planner sets on `model`'s Deployment (autoscaling "none"): its own cap in
    `kubernetes.max_replicas_by_model`, else `kubernetes.max_replicas`."""
    return int(cfg.max_replicas_by_model.get(model, cfg.max_replicas))


def actuator_for(cfg: KubernetesSettings) -> KubeActuator:
    return KubeActuator(api_client_from_settings(cfg.kubeconfig), cfg.namespace, printer=log.info)
