"""Watch the pods of an inference Deployment and hand each newly Ready pod to a callback.

This is how replicas run by any OpenAI-compatible server (vLLM, TGI, prewarm's own
runtime) get prewarmed under Kubernetes: the caller's callback warms the pod over HTTP
through a runtime adapter, validates it and registers it in Redis. This module makes no
such decision itself; it only turns the API server's pod stream into "pod X became Ready
at endpoint http://ip:port" calls, once per readiness.

The pod selector is read from the Deployment's scale subresource (`status.selector`), so
the watcher needs no RBAC beyond `API_CALLS` in `prewarm.adapters.k8s`. It lists first (to learn the
pods already Ready and a resourceVersion), then watches from that version; when the
version has expired (410 Gone) it lists again. A pod that turns unready and Ready again
(a restarted container) is handed over again; a deleted pod is forgotten.

`image_pulls` reads what a pod waited for its images from its events, as the kubelet reports
them (`Pulled`: "Successfully pulled image "x" in 2.5s (3.1s including waiting)"): the first
start of an image on a node pays for the pull, later ones find it present, so a pull is a
different cost from the lead the planner plans with and is reported apart.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kubernetes import client as k8s_client
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.adapters.k8s import call, wrap_api_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadyPod:
    """A pod that just became Ready: where to reach its server."""

    name: str
    namespace: str
    uid: str
    node: str
    pod_ip: str
    endpoint: str  # http://<pod ip>:<port>
    labels: Mapping[str, str]
    resource_version: str
    created_at: float | None = None  # metadata.creationTimestamp (epoch s): the start of its time to ready


@dataclass(frozen=True)
class WatchStats:
    """What one `run` saw, for logs and tests."""

    events: int
    ready_calls: int
    callback_failures: int
    relists: int


def pod_is_ready(pod: Any) -> bool:
    """Ready condition True, an IP assigned, and not being deleted."""
    if pod.metadata is None or pod.metadata.deletion_timestamp is not None:
        return False
    status = pod.status
    if status is None or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


class PodWatcher:
    """Calls `on_ready(ReadyPod)` for every pod of `deployment` that becomes Ready."""

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        namespace: str,
        deployment: str,
        *,
        pod_port: int = 8000,
        watch_timeout_s: int = 30,
    ) -> None:
        self.namespace = namespace
        self.deployment = deployment
        self.pod_port = pod_port
        self.watch_timeout_s = watch_timeout_s
        self.apps = k8s_client.AppsV1Api(api_client)
        self.core = k8s_client.CoreV1Api(api_client)
        self._handled: set[str] = set()  # uids of pods handed over while Ready

    def selector(self) -> str:
        """The Deployment's pod label selector, as its scale subresource reports it."""
        what = f"deployments/{self.deployment}/scale in namespace {self.namespace}"
        scale = call(lambda: self.apps.read_namespaced_deployment_scale(self.deployment, self.namespace), "get", what)
        selector = scale.status.selector if scale.status else None
        if not selector:
            raise PermanentError(f"get {what}: status.selector is empty; cannot tell which pods belong to it")
        return str(selector)

    def run(
        self,
        on_ready: Callable[[ReadyPod], object],
        *,
        stop: threading.Event | None = None,
        max_ready: int | None = None,
    ) -> WatchStats:
        """Watch until `stop` is set (checked between events and at each watch timeout)
        or `max_ready` pods were handed over. Permanent errors (404, 403) are raised;
        temporary ones (API server unreachable, 5xx) are waited out and the list redone."""
        stop = stop or threading.Event()
        selector = self.selector()
        what = f"pods (labelSelector {selector}) in namespace {self.namespace}"
        events = ready_calls = failures = relists = 0

        def observe(pod: Any, deleted: bool) -> None:
            nonlocal ready_calls, failures
            uid = str(pod.metadata.uid or pod.metadata.name)
            if deleted or not pod_is_ready(pod):
                self._handled.discard(uid)
                return
            if uid in self._handled:
                return
            self._handled.add(uid)
            ready_calls += 1
            try:
                on_ready(self._ready_pod(pod))
            except Exception:  # noqa: BLE001 - one failing pod must not end the watch
                failures += 1
                log.exception("handling Ready pod %s/%s failed", self.namespace, pod.metadata.name)

        def done() -> bool:
            return stop.is_set() or (max_ready is not None and ready_calls >= max_ready)

        while not done():
            try:
                listing = call(
                    lambda: self.core.list_namespaced_pod(self.namespace, label_selector=selector), "list", what
                )
                rv = listing.metadata.resource_version if listing.metadata is not None else None
                for pod in listing.items or []:
                    observe(pod, deleted=False)
                while not done():
                    watcher = k8s_watch.Watch()
                    try:
                        for event in watcher.stream(
                            self.core.list_namespaced_pod,
                            self.namespace,
                            label_selector=selector,
                            resource_version=rv,
                            timeout_seconds=self.watch_timeout_s,
                            _request_timeout=self.watch_timeout_s + 5,
                        ):
                            events += 1
                            obj = event["object"]
                            rv = obj.metadata.resource_version or rv
                            observe(obj, deleted=event["type"] == "DELETED")
                            if done():
                                watcher.stop()
                                break
                    except (ApiException, Urllib3Error, OSError) as exc:
                        if isinstance(exc, ApiException) and exc.status == 410:
                            relists += 1
                            break  # the resourceVersion expired: list again
                        raise wrap_api_error(exc, "watch", what) from exc
            except TemporaryError as exc:
                log.warning("pod watch interrupted, retrying in %.1fs: %s", exc.retry_after, exc)
                relists += 1
                stop.wait(exc.retry_after)
        return WatchStats(events, ready_calls, failures, relists)

    def _ready_pod(self, pod: Any) -> ReadyPod:
        return ReadyPod(
            name=pod.metadata.name,
            namespace=pod.metadata.namespace or self.namespace,
            uid=str(pod.metadata.uid or ""),
            node=str(pod.spec.node_name or "") if pod.spec else "",
            pod_ip=pod.status.pod_ip,
            endpoint=f"http://{pod.status.pod_ip}:{self.pod_port}",
            labels=dict(pod.metadata.labels or {}),
            resource_version=str(pod.metadata.resource_version or ""),
            created_at=pod.metadata.creation_timestamp.timestamp() if pod.metadata.creation_timestamp else None,
        )


@dataclass(frozen=True)
class ImagePull:
    """An image a pod waited for the kubelet to pull, and how long."""

    image: str
    seconds: float  # the wait, pull slot included ("including waiting") when the kubelet reports it


_DUR = r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+"
# "... in 2.5s", "... in 2.5s (3.1s including waiting)", and since 1.30 ". Image size: 123 bytes." after it
_PULLED = re.compile(rf'^Successfully pulled image "(?P<image>[^"]+)" in (?P<took>{_DUR})'
                     rf'(?: \((?P<waited>{_DUR}) including waiting\))?(?:\.|$)')
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration_s(text: str) -> float | None:
    """Seconds of a Go `time.Duration` as printed ("1m2.5s", "350ms"); None if it is not one."""
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _GO_UNITS[u] for n, u in parts)


def pulls_in_events(events: Any) -> tuple[ImagePull, ...]:
    """The image pulls among a pod's events (`V1Event`s); events of images already present are none."""
    out = []
    for ev in events:
        m = _PULLED.match(str(ev.message or "")) if ev.reason == "Pulled" else None
        seconds = go_duration_s(m.group("waited") or m.group("took")) if m else None
        if m and seconds is not None:
            out.append(ImagePull(m.group("image"), seconds))
    return tuple(out)


def image_pulls(core: k8s_client.CoreV1Api, pod: ReadyPod) -> tuple[ImagePull, ...]:
    """The image pulls `pod` waited for (one list call on its events, by name and uid)."""
    what = f"events of pod {pod.namespace}/{pod.name}"
    selector = f"involvedObject.name={pod.name}" + (f",involvedObject.uid={pod.uid}" if pod.uid else "")
    listing = call(lambda: core.list_namespaced_event(pod.namespace, field_selector=selector, _request_timeout=10),
                   "list", what)
    return pulls_in_events(listing.items or [])
