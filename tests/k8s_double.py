"""An HTTP-level stand-in for the Kubernetes API server, for the actuator's tests.

What it stands for, honestly: no Kubernetes API server (or kind/k3s) can run on these
machines, so this is a small real HTTP server (`http.server` in a thread, on a free
loopback port) that implements exactly the endpoints `prewarm.adapters.k8s` and
`prewarm.adapters.k8s_watch` call, with the semantics those calls rely on:

- `apps/v1` `deployments/{name}/scale` GET and PATCH (merge-patch, strategic-merge-patch,
  which for a Scale are the same, and JSON-patch lists);
- `autoscaling/v2` `horizontalpodautoscalers/{name}` GET and PATCH (merge semantics: a
  null deletes a key, as in an annotation removal), refusing minReplicas > maxReplicas
  with 422 like the real validation;
- `core/v1` pods list and watch (`?watch=true`, a chunked stream of JSON lines, ending at
  `timeoutSeconds`; an `ERROR` event with code 410 for an expired resourceVersion);
- `core/v1` nodes list with label selectors (`k=v`, `k!=v`, `k`);
- optionally (`add_deployment(..., controller=True)`) the part of the Deployment/ReplicaSet
  controller the one-owner tests rely on: a change of `spec.replicas` creates pods (named
  `<deployment>-<n>`, never reused, not Ready, on node `gpu-1`) or deletes the newest ones,
  and every pod created is logged in `created` so a test can count creations.

One global resourceVersion counter is bumped by every write, as etcd's revision is; a
PATCH whose body carries a `metadata.resourceVersion` other than the object's current
one is answered 409 Conflict, as optimistic concurrency on the real server is. Switches
inject faults: `inject_conflicts(n)` makes a concurrent writer change the object just
before each of the next n PATCHes (so the 409 comes from the normal rule), and
`inject(status, ...)` answers the next matching requests with 403, 404 or any status.

What it does NOT do: authentication, admission, defaulting, the many fields a real
object carries, server-side apply, field managers, protobuf, or any endpoint not listed
above (those answer 404 with a Status body naming the path). It is driven through the
REAL `kubernetes` client configured with `host=http://127.0.0.1:PORT`, so the client's
serialisation, content types and error mapping are exercised for real.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s_client

from prewarm.registry.embedded import free_port

_SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
_HPA = re.compile(r"^/apis/autoscaling/v2/namespaces/([^/]+)/horizontalpodautoscalers/([^/]+)$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_NODES = re.compile(r"^/api/v1/nodes$")


@dataclass
class Fault:
    status: int
    remaining: int
    method: str | None = None
    path_contains: str | None = None


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


@dataclass
class _State:
    rv: int = 100
    deployments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    hpas: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pod_events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # names of pods the controller created, in order
    compacted: int = 0  # watches from a resourceVersion below this get 410 Gone
    faults: list[Fault] = field(default_factory=list)
    conflicts: int = 0
    requests: list[Request] = field(default_factory=list)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge is the same for the fields used here)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/replace/remove/test on object paths (enough for the fields used here)."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent = doc
        for p in parts[:-1]:
            parent = parent.setdefault(p, {})
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            parent[last] = op["value"]
        elif op["op"] == "remove":
            parent.pop(last, None)
        elif op["op"] == "test" and parent.get(last) != op["value"]:
            raise ValueError(f"test failed at {op['path']}")
    return doc


def _rfc3339(epoch_s: float) -> str:
    """A creationTimestamp as the API server writes it (whole seconds, UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


_REASONS = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Expired", 422: "Invalid", 500: "InternalError"}


class KubeDouble:
    """The server. Use as a context manager; `api_client()` gives a real client pointed at it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.state = _State()
        self.lock = threading.Condition()
        self._closing = False
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

            def do_GET(self) -> None:  # noqa: N802
                double._handle(self, "GET")

            def do_PATCH(self) -> None:  # noqa: N802
                double._handle(self, "PATCH")

            def do_POST(self) -> None:  # noqa: N802
                double._handle(self, "POST")

            def do_PUT(self) -> None:  # noqa: N802
                double._handle(self, "PUT")

            def do_DELETE(self) -> None:  # noqa: N802
                double._handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="k8s-double", daemon=True
        )

    # --- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self.thread.start()
        return self

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def api_client(self) -> k8s_client.ApiClient:
        configuration = k8s_client.Configuration(host=self.url)
        configuration.retries = 0
        return k8s_client.ApiClient(configuration)

    # --- fixtures and switches -------------------------------------------------------------
    def _next_rv(self) -> str:
        self.state.rv += 1
        return str(self.state.rv)

    def add_deployment(self, namespace: str, name: str, replicas: int, labels: dict[str, str] | None = None,
                       *, controller: bool = False) -> None:
        with self.lock:
            self.state.deployments[(namespace, name)] = {
                "replicas": replicas, "selector": labels or {"app": name}, "rv": self._next_rv(), "uid": str(uuid.uuid4()),
                "controller": controller, "serial": 0,
            }
            if controller:
                self._reconcile((namespace, name))

    def _reconcile(self, key: tuple[str, str]) -> None:
        """The controller's work for one Deployment (lock held): pods up or down to spec.replicas."""
        dep = self.state.deployments[key]
        ns, name = key
        mine = sorted((p for (pns, pname), p in self.state.pods.items()
                       if pns == ns and selector_matches(",".join(f"{k}={v}" for k, v in dep["selector"].items()),
                                                         p["metadata"]["labels"])),
                      key=lambda p: int(p["metadata"]["name"].rsplit("-", 1)[1]))
        for pod in mine[dep["replicas"]:][::-1]:
            pod = self.state.pods.pop((ns, pod["metadata"]["name"]))
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self.state.pod_events.append((self.state.rv, "DELETED", pod))
        for _ in range(dep["replicas"] - len(mine)):
            dep["serial"] += 1
            pod_name = f"{name}-{dep['serial']}"
            self.state.created.append(pod_name)
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": ns, "labels": dict(dep["selector"]),
                             "uid": str(uuid.uuid4()), "resourceVersion": self._next_rv(),
                             "creationTimestamp": _rfc3339(time.time())},
                "spec": {"nodeName": "gpu-1", "containers": [{"name": "server", "image": "vllm/vllm-openai"}]},
                "status": {"phase": "Pending", "podIP": None, "conditions": [{"type": "Ready", "status": "False"}]},
            }
            self.state.pods[(ns, pod_name)] = pod
            self.state.pod_events.append((self.state.rv, "ADDED", copy.deepcopy(pod)))
        self.lock.notify_all()

    def created(self) -> list[str]:
        with self.lock:
            return list(self.state.created)

    def pod_names(self, namespace: str) -> list[str]:
        with self.lock:
            return sorted(name for ns, name in self.state.pods if ns == namespace)

    def replicas(self, namespace: str, name: str) -> int:
        with self.lock:
            return int(self.state.deployments[(namespace, name)]["replicas"])

    def add_hpa(self, namespace: str, name: str, min_replicas: int, max_replicas: int, deployment: str = "",
                stabilization_s: int = 300, annotations: dict[str, str] | None = None) -> None:
        with self.lock:
            self.state.hpas[(namespace, name)] = {
                "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                             "resourceVersion": self._next_rv(), "annotations": dict(annotations or {})},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment or name},
                    "minReplicas": min_replicas, "maxReplicas": max_replicas,
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": stabilization_s}},
                },
                "status": {"currentReplicas": min_replicas, "desiredReplicas": min_replicas},
            }

    def hpa(self, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.state.hpas[(namespace, name)])

    def add_node(self, name: str, labels: dict[str, str], gpus: int = 1, ready: bool = True,
                 unschedulable: bool = False) -> None:
        with self.lock:
            self.state.nodes[name] = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": dict(labels), "uid": str(uuid.uuid4()),
                             "resourceVersion": self._next_rv()},
                "spec": {"unschedulable": unschedulable},
                "status": {
                    "allocatable": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
                    "capacity": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                },
            }

    def put_pod(self, namespace: str, name: str, labels: dict[str, str], *, ready: bool, ip: str = "",
                node: str = "gpu-1", created_at: float | None = None) -> None:
        """Create or update a pod and emit the watch event (ADDED or MODIFIED)."""
        created = _rfc3339(created_at) if created_at is not None else None
        with self.lock:
            key = (namespace, name)
            existing = self.state.pods.get(key)
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                             "uid": existing["metadata"]["uid"] if existing else str(uuid.uuid4()),
                             "creationTimestamp": existing["metadata"]["creationTimestamp"] if existing
                             else created or _rfc3339(time.time()),
                             "resourceVersion": self._next_rv()},
                "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm/vllm-openai"}]},
                "status": {"phase": "Running" if ip else "Pending", "podIP": ip or None,
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
            }
            self.state.pods[key] = pod
            self.state.pod_events.append((self.state.rv, "MODIFIED" if existing else "ADDED", copy.deepcopy(pod)))
            self.lock.notify_all()

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            pod = self.state.pods.pop((namespace, name))
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self.state.pod_events.append((self.state.rv, "DELETED", pod))
            self.lock.notify_all()

    def compact(self) -> None:
        """Forget history: a watch from any older resourceVersion now gets 410 Gone."""
        with self.lock:
            self.state.compacted = self.state.rv
            self.state.pod_events.clear()

    def inject(self, status: int, count: int = 1, method: str | None = None, path_contains: str | None = None) -> None:
        with self.lock:
            self.state.faults.append(Fault(status, count, method, path_contains))

    def inject_conflicts(self, count: int) -> None:
        """Before each of the next `count` PATCHes, another writer changes the target object."""
        with self.lock:
            self.state.conflicts = count

    def wait_for_watch(self, count: int = 1, timeout_s: float = 10.0) -> None:
        """Block until `count` watch requests have arrived (so events put next are streamed)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while sum(1 for r in self.state.requests if r.query.get("watch") == ["true"]) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {count} watch request(s) within {timeout_s}s")
                self.lock.wait(min(left, 0.05))

    def requests(self, method: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.state.requests if method is None or r.method == method]

    # --- request handling -------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        query = parse_qs(parts.query)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        content_type = (h.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            self._send(h, 400, _status(400, "BadRequest", "body is not JSON"))
            return
        with self.lock:
            self.state.requests.append(Request(method, parts.path, query, content_type, body))
            self.lock.notify_all()
            for fault in self.state.faults:
                if fault.remaining > 0 and (fault.method in (None, method)) and (
                    fault.path_contains is None or fault.path_contains in parts.path
                ):
                    fault.remaining -= 1
                    code = fault.status
                    self._send(h, code, _status(code, _REASONS.get(code, "Error"), f"injected {code} for {method} {parts.path}"))
                    return
        if method == "GET" and query.get("watch", ["false"])[0] in ("true", "1"):
            m = _PODS.match(parts.path)
            if m:
                self._watch_pods(h, m.group(1), query)
                return
        with self.lock:
            code, out = self._route(method, parts.path, query, content_type, body)
        self._send(h, code, out)

    def _route(self, method: str, path: str, query: dict[str, list[str]], content_type: str,
               body: Any) -> tuple[int, dict[str, Any]]:
        m = _SCALE.match(path)
        if m:
            key = (m.group(1), m.group(2))
            if key not in self.state.deployments:
                return 404, _status(404, "NotFound", f'deployments.apps "{key[1]}" not found')
            if method == "GET":
                return 200, self._scale(key)
            if method == "PATCH":
                if self.state.conflicts > 0:
                    self.state.conflicts -= 1
                    self.state.deployments[key]["rv"] = self._next_rv()
                current = self._scale(key)
                patched, err = self._apply_patch(current, content_type, body, key[1], "deployments.apps")
                if err:
                    return err
                dep = self.state.deployments[key]
                dep["replicas"] = int(patched["spec"]["replicas"])
                dep["rv"] = self._next_rv()
                if dep["controller"]:
                    self._reconcile(key)
                return 200, self._scale(key)
        m = _HPA.match(path)
        if m:
            key = (m.group(1), m.group(2))
            if key not in self.state.hpas:
                return 404, _status(404, "NotFound", f'horizontalpodautoscalers.autoscaling "{key[1]}" not found')
            if method == "GET":
                return 200, copy.deepcopy(self.state.hpas[key])
            if method == "PATCH":
                if self.state.conflicts > 0:
                    self.state.conflicts -= 1
                    self.state.hpas[key]["metadata"]["resourceVersion"] = self._next_rv()
                current = self.state.hpas[key]
                patched, err = self._apply_patch(current, content_type, body, key[1], "horizontalpodautoscalers.autoscaling")
                if err:
                    return err
                spec = patched["spec"]
                if int(spec.get("minReplicas", 1)) > int(spec["maxReplicas"]):
                    return 422, _status(422, "Invalid", f"spec.minReplicas: must be <= maxReplicas ({spec['maxReplicas']})")
                patched["metadata"]["resourceVersion"] = self._next_rv()
                self.state.hpas[key] = patched
                return 200, copy.deepcopy(patched)
        m = _PODS.match(path)
        if m and method == "GET":
            selector = query.get("labelSelector", [""])[0]
            items = [copy.deepcopy(p) for (ns, _), p in sorted(self.state.pods.items())
                     if ns == m.group(1) and selector_matches(selector, p["metadata"]["labels"])]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self.state.rv)},
                         "items": items}
        if _NODES.match(path) and method == "GET":
            selector = query.get("labelSelector", [""])[0]
            items = [copy.deepcopy(n) for _, n in sorted(self.state.nodes.items())
                     if selector_matches(selector, n["metadata"]["labels"])]
            return 200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": str(self.state.rv)},
                         "items": items}
        return 404, _status(404, "NotFound", f"the test double does not implement {method} {path}")

    def _scale(self, key: tuple[str, str]) -> dict[str, Any]:
        dep = self.state.deployments[key]
        selector = ",".join(f"{k}={v}" for k, v in sorted(dep["selector"].items()))
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": key[1], "namespace": key[0], "uid": dep["uid"], "resourceVersion": dep["rv"]},
                "spec": {"replicas": dep["replicas"]},
                "status": {"replicas": dep["replicas"], "selector": selector}}

    def _apply_patch(self, current: dict[str, Any], content_type: str, body: Any, name: str,
                     kind: str) -> tuple[dict[str, Any], tuple[int, dict[str, Any]] | None]:
        if content_type == "application/json-patch+json":
            if not isinstance(body, list):
                return current, (400, _status(400, "BadRequest", "json patch must be a list"))
            try:
                patched = json_patch(current, body)
            except (KeyError, ValueError) as exc:
                return current, (422, _status(422, "Invalid", str(exc)))
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(body, dict):
                return current, (400, _status(400, "BadRequest", "merge patch must be an object"))
            patched = merge_patch(current, body)
        else:
            return current, (415, _status(415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"))
        sent_rv = (patched.get("metadata") or {}).get("resourceVersion")
        if sent_rv is not None and sent_rv != current["metadata"]["resourceVersion"]:
            return current, (409, _status(
                409, "Conflict",
                f'Operation cannot be fulfilled on {kind} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again"))
        return patched, None

    def _watch_pods(self, h: BaseHTTPRequestHandler, namespace: str, query: dict[str, list[str]]) -> None:
        selector = query.get("labelSelector", [""])[0]
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(query.get("timeoutSeconds", ["30"])[0])
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()

        def chunk(data: bytes) -> None:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        try:
            with self.lock:
                if since < self.state.compacted:
                    err = _status(410, "Expired", f"too old resource version: {since} ({self.state.compacted})")
                    chunk((json.dumps({"type": "ERROR", "object": err}) + "\n").encode())
                else:
                    while not self._closing:
                        pending = [(rv, t, p) for rv, t, p in self.state.pod_events if rv > since]
                        for rv, kind, pod in pending:
                            since = rv
                            if pod["metadata"]["namespace"] == namespace and selector_matches(
                                selector, pod["metadata"]["labels"]
                            ):
                                chunk((json.dumps({"type": kind, "object": pod}) + "\n").encode())
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.lock.wait(min(left, 0.2))
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        h.close_connection = True

    def _send(self, h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
