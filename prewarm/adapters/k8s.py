"""The Kubernetes actuator: a thin adapter over the official `kubernetes` client.

The planner decides how many replicas a model needs and when; this module only carries
that out against the cluster:

- scale an inference Deployment through its scale subresource (`deployments/scale`), the
  same call `kubectl scale` makes, so no other field of the Deployment is touched (the
  planner's path when neither KEDA nor an HPA owns the count, `kubernetes.autoscaling: none`);
- raise an HPA's `minReplicas` and restore it afterwards (`prewarm k8s min-replicas` /
  `restore`, an operator's tool: the planner no longer raises floors, since a raised floor
  and the HPA's own scaling were two owners of one count); the operator's original value
  is kept in an annotation on the HPA itself, so anyone with kubectl can still restore it;
- list the GPU nodes (label `gpu.feature/preload=true`, `model.type`, allocatable
  `nvidia.com/gpu`) as `NodeView`s for placement.

Watching the pods of a Deployment lives in `prewarm.adapters.k8s_watch`.

Every patch carries the `resourceVersion` it was computed from, so a concurrent writer
makes the API server answer 409; the actuator then reads again and recomputes (bounded).
404 and 403 become `PermanentError`s naming the verb and the object; with `dry_run` the
actuator reads, prints the patch it would send and changes nothing. `API_CALLS` lists
every (group, resource, verb) this adapter and the watcher use: the Helm chart's RBAC is
tested against it, so the two cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, TypeVar

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from urllib3.exceptions import HTTPError as Urllib3Error

from prewarm.core.domain import NodeView
from prewarm.core.errors import PermanentError, SettingsError, TemporaryError

#: Annotation on an HPA holding the operator's minReplicas while prewarm has raised it.
ORIGINAL_MIN_ANNOTATION = "prewarm.io/original-min-replicas"
#: Label that marks a node as a preload target, and the label naming its model type.
PRELOAD_LABEL = "gpu.feature/preload"
MODEL_TYPE_LABEL = "model.type"
GPU_RESOURCE = "nvidia.com/gpu"
#: Patches that lost a race (409) are recomputed from a fresh read at most this many times.
DEFAULT_CONFLICT_RETRIES = 5


@dataclass(frozen=True)
class ApiCall:
    """One kind of request the actuator makes: what RBAC must allow, and nothing more."""

    group: str  # "" for the core API group
    resource: str  # plural, with "/subresource" when one is used
    verbs: tuple[str, ...]
    cluster_scoped: bool = False


#: Every call this module and `prewarm.adapters.k8s_watch` make. The chart's RBAC is checked against it.
API_CALLS: tuple[ApiCall, ...] = (
    ApiCall("apps", "deployments/scale", ("get", "patch")),
    ApiCall("autoscaling", "horizontalpodautoscalers", ("get", "patch")),
    ApiCall("", "pods", ("list", "watch")),
    ApiCall("", "events", ("list",)),  # a new pod's image pulls, kept out of the planner's lead
    ApiCall("", "nodes", ("list",), cluster_scoped=True),
)


class K8sNotFound(PermanentError):
    """The object does not exist (404)."""


class K8sForbidden(PermanentError):
    """RBAC refused the call (403)."""


class K8sConflict(TemporaryError):
    """Every retry of a patch lost a race with another writer (409)."""


class ActionKind(str, Enum):
    SCALE = "scale"  # set a Deployment's replicas through the scale subresource
    RAISE_MIN = "raise_min"  # raise an HPA's minReplicas, remembering the original
    RESTORE_MIN = "restore_min"  # put the remembered minReplicas back


@dataclass(frozen=True)
class PatchResult:
    """What the actuator did (or, in dry-run, would do) to one object."""

    kind: ActionKind
    namespace: str
    target: str  # e.g. "deployments/llm/scale" or "horizontalpodautoscalers/llm"
    patch: dict[str, Any] | None  # the body sent (or that would be sent); None: nothing to change
    before: int
    after: int
    applied: bool  # False in dry-run and when nothing needed to change
    dry_run: bool
    attempts: int = 1  # reads+patches made; > 1 when conflicts were retried

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "namespace": self.namespace,
            "target": self.target,
            "patch": self.patch,
            "before": self.before,
            "after": self.after,
            "applied": self.applied,
            "dry_run": self.dry_run,
            "attempts": self.attempts,
        }


T = TypeVar("T")


def api_client_from_settings(kubeconfig: str | None = None) -> k8s_client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (explicit path or default)."""
    configuration = k8s_client.Configuration()
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        except ConfigException:
            pass
    try:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except (ConfigException, OSError) as exc:
        where = kubeconfig or "~/.kube/config (or $KUBECONFIG)"
        raise SettingsError(
            f"PREWARM_KUBERNETES_KUBECONFIG: no in-cluster service account and no usable kubeconfig at {where}: {exc}"
        ) from exc
    return k8s_client.ApiClient(configuration)


def wrap_api_error(exc: BaseException, verb: str, what: str) -> Exception:
    """Map a client-library error to prewarm's error types, naming the verb and the object."""
    if isinstance(exc, ApiException):
        status = exc.status or 0
        if status == 404:
            return K8sNotFound(f"{verb} {what}: not found (404)")
        if status == 403:
            return K8sForbidden(
                f"{verb} {what}: forbidden (403); the service account's RBAC must allow '{verb}' on it"
            )
        if status == 409:
            return K8sConflict(f"{verb} {what}: conflict (409), the object changed under us", retry_after=0.5)
        if status == 429 or status >= 500:
            return TemporaryError(f"{verb} {what}: API server answered {status} {exc.reason}", retry_after=2.0)
        return PermanentError(f"{verb} {what}: API server answered {status} {exc.reason}: {exc.body}")
    if isinstance(exc, (Urllib3Error, OSError)):
        return TemporaryError(f"{verb} {what}: cannot reach the API server: {exc}", retry_after=2.0)
    return PermanentError(f"{verb} {what}: {exc}")


def call(fn: Callable[[], T], verb: str, what: str) -> T:
    try:
        return fn()
    except (ApiException, Urllib3Error, OSError) as exc:
        raise wrap_api_error(exc, verb, what) from exc


class KubeActuator:
    """Scale Deployments and HPAs, and read GPU nodes, in one namespace."""

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        namespace: str = "default",
        *,
        conflict_retries: int = DEFAULT_CONFLICT_RETRIES,
        printer: Callable[[str], None] = print,
    ) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.conflict_retries = conflict_retries
        self.printer = printer
        self.apps = k8s_client.AppsV1Api(api_client)
        self.autoscaling = k8s_client.AutoscalingV2Api(api_client)
        self.core = k8s_client.CoreV1Api(api_client)

    # --- Deployments through the scale subresource -------------------------------------
    def read_replicas(self, deployment: str) -> int:
        scale = self._read_scale(deployment)
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def scale(self, deployment: str, replicas: int, *, dry_run: bool = False) -> PatchResult:
        """Set `deployment`'s replicas to `replicas` (through deployments/scale)."""
        if replicas < 0:
            raise PermanentError(f"replicas must be >= 0, got {replicas}")
        target = f"deployments/{deployment}/scale"

        def attempt() -> tuple[dict[str, Any] | None, int, int]:
            scale = self._read_scale(deployment)
            before = int(scale.spec.replicas or 0) if scale.spec else 0
            if before == replicas:
                return None, before, before
            body = {"metadata": {"resourceVersion": scale.metadata.resource_version}, "spec": {"replicas": replicas}}
            return body, before, replicas

        def send(body: dict[str, Any]) -> None:
            call(
                lambda: self.apps.patch_namespaced_deployment_scale(deployment, self.namespace, body),
                "patch",
                self._what(target),
            )

        return self._patch_loop(ActionKind.SCALE, target, attempt, send, dry_run)

    # --- HPA minReplicas ------------------------------------------------------------------
    def raise_min_replicas(self, hpa: str, min_replicas: int, *, dry_run: bool = False) -> PatchResult:
        """Raise `hpa`'s minReplicas to `min_replicas`, remembering the operator's value.

        The original is written once (into ORIGINAL_MIN_ANNOTATION); raising again keeps it.
        A value under the original is raised to the original: this never lowers the floor
        the operator set. A value above maxReplicas is refused (the API server would too).
        """
        if min_replicas < 1:
            raise PermanentError(f"minReplicas must be >= 1, got {min_replicas}")
        target = f"horizontalpodautoscalers/{hpa}"

        def attempt() -> tuple[dict[str, Any] | None, int, int]:
            obj = self._read_hpa(hpa)
            before = int(obj.spec.min_replicas or 1)
            annotations = dict(obj.metadata.annotations or {})
            original = _original_min(annotations, hpa, before)
            wanted = max(min_replicas, original)
            if wanted > int(obj.spec.max_replicas):
                raise PermanentError(
                    f"raise minReplicas of {self._what(target)}: {wanted} is above its maxReplicas {obj.spec.max_replicas}"
                )
            metadata: dict[str, Any] = {"resourceVersion": obj.metadata.resource_version}
            if ORIGINAL_MIN_ANNOTATION not in annotations:
                metadata["annotations"] = {ORIGINAL_MIN_ANNOTATION: str(before)}
            if wanted == before and "annotations" not in metadata:
                return None, before, before
            return {"metadata": metadata, "spec": {"minReplicas": wanted}}, before, wanted

        return self._patch_loop(ActionKind.RAISE_MIN, target, attempt, self._hpa_sender(hpa, target), dry_run)

    def restore_min_replicas(self, hpa: str, *, dry_run: bool = False) -> PatchResult:
        """Put back the minReplicas remembered by `raise_min_replicas` and drop the annotation."""
        target = f"horizontalpodautoscalers/{hpa}"

        def attempt() -> tuple[dict[str, Any] | None, int, int]:
            obj = self._read_hpa(hpa)
            before = int(obj.spec.min_replicas or 1)
            annotations = dict(obj.metadata.annotations or {})
            if ORIGINAL_MIN_ANNOTATION not in annotations:
                return None, before, before
            original = _original_min(annotations, hpa, before)
            body = {
                "metadata": {
                    "resourceVersion": obj.metadata.resource_version,
                    "annotations": {ORIGINAL_MIN_ANNOTATION: None},
                },
                "spec": {"minReplicas": original},
            }
            return body, before, original

        return self._patch_loop(ActionKind.RESTORE_MIN, target, attempt, self._hpa_sender(hpa, target), dry_run)

    def read_min_replicas(self, hpa: str) -> tuple[int, int | None]:
        """(current minReplicas, remembered original or None when prewarm has not raised it)."""
        obj = self._read_hpa(hpa)
        current = int(obj.spec.min_replicas or 1)
        annotations = dict(obj.metadata.annotations or {})
        if ORIGINAL_MIN_ANNOTATION not in annotations:
            return current, None
        return current, _original_min(annotations, hpa, current)

    # --- nodes ------------------------------------------------------------------------------
    def list_gpu_nodes(self, label_selector: str = f"{PRELOAD_LABEL}=true") -> list[NodeView]:
        """The labeled GPU nodes as NodeViews (one replica slot per allocatable GPU)."""
        nodes = call(
            lambda: self.core.list_node(label_selector=label_selector),
            "list",
            f"nodes (labelSelector {label_selector})",
        )
        return sorted((node_view(n) for n in nodes.items or []), key=lambda v: v.name)

    # --- internals --------------------------------------------------------------------------
    def _what(self, target: str) -> str:
        return f"{target} in namespace {self.namespace}"

    def _read_scale(self, deployment: str) -> Any:
        target = f"deployments/{deployment}/scale"
        return call(
            lambda: self.apps.read_namespaced_deployment_scale(deployment, self.namespace), "get", self._what(target)
        )

    def _read_hpa(self, hpa: str) -> Any:
        target = f"horizontalpodautoscalers/{hpa}"
        return call(
            lambda: self.autoscaling.read_namespaced_horizontal_pod_autoscaler(hpa, self.namespace),
            "get",
            self._what(target),
        )

    def _hpa_sender(self, hpa: str, target: str) -> Callable[[dict[str, Any]], None]:
        def send(body: dict[str, Any]) -> None:
            call(
                lambda: self.autoscaling.patch_namespaced_horizontal_pod_autoscaler(hpa, self.namespace, body),
                "patch",
                self._what(target),
            )

        return send

    def _patch_loop(
        self,
        kind: ActionKind,
        target: str,
        attempt: Callable[[], tuple[dict[str, Any] | None, int, int]],
        send: Callable[[dict[str, Any]], None],
        dry_run: bool,
    ) -> PatchResult:
        """Read, compute, patch; on 409 read again, at most `conflict_retries` more times."""
        tries = 0
        while True:
            tries += 1
            body, before, after = attempt()
            if body is None or dry_run:
                result = PatchResult(kind, self.namespace, target, body, before, after, False, dry_run, tries)
                if dry_run:
                    self.printer(
                        f"dry-run: would PATCH {target} in namespace {self.namespace}: "
                        + (json.dumps(body, sort_keys=True) if body is not None else "(nothing to change)")
                    )
                return result
            try:
                send(body)
            except K8sConflict:
                if tries > self.conflict_retries:
                    raise K8sConflict(
                        f"patch {self._what(target)}: still conflicting after {tries} attempts; another writer keeps changing it",
                        retry_after=1.0,
                    ) from None
                continue
            return PatchResult(kind, self.namespace, target, body, before, after, True, False, tries)


def _original_min(annotations: dict[str, str], hpa: str, default: int) -> int:
    raw = annotations.get(ORIGINAL_MIN_ANNOTATION)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise PermanentError(
            f"horizontalpodautoscalers/{hpa}: annotation {ORIGINAL_MIN_ANNOTATION}={raw!r} is not an integer"
        ) from None
    if value < 1:
        raise PermanentError(f"horizontalpodautoscalers/{hpa}: annotation {ORIGINAL_MIN_ANNOTATION}={raw!r} is below 1")
    return value


def node_view(node: Any) -> NodeView:
    """A V1Node as the planner's NodeView: allocatable GPUs, model type, readiness."""
    labels = dict(node.metadata.labels or {})
    allocatable = dict(node.status.allocatable or {}) if node.status else {}
    try:
        gpus = int(str(allocatable.get(GPU_RESOURCE, "0")))
    except ValueError:
        gpus = 0
    conditions = (node.status.conditions or []) if node.status else []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    unschedulable = bool(node.spec.unschedulable) if node.spec else False
    return NodeView(
        name=node.metadata.name,
        gpus=gpus,
        replica_slots=gpus,
        model_type=labels.get(MODEL_TYPE_LABEL, ""),
        ready=ready and not unschedulable,
    )

