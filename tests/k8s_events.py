"""The Kubernetes API double (`tests.k8s_double.KubeDouble`) with `core/v1` events, for what the pod
warmer reads of a new pod's image pulls.

What it stands for: the kubelet's `Pulled` events of a pod, as the real API server lists them for
`GET /api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name=<pod>,involvedObject.uid=<uid>`
(the only field selectors the pod warmer sends; other selectors answer 400, as an unsupported field
label does on the real server). The messages are the kubelet's own wording, set by the test.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from tests.k8s_double import KubeDouble, _rfc3339, _status

_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_FIELDS = {"involvedObject.name": "name", "involvedObject.uid": "uid"}


class KubeDoubleWithEvents(KubeDouble):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def add_pod_event(self, namespace: str, pod: str, reason: str, message: str, at: float) -> None:
        """An event of `pod` (which must exist: its uid is the involved object's)."""
        with self.lock:
            uid = self.state.pods[(namespace, pod)]["metadata"]["uid"]
            self.events.append({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{pod}.{uuid.uuid4().hex[:12]}", "namespace": namespace,
                             "resourceVersion": self._next_rv()},
                "involvedObject": {"kind": "Pod", "namespace": namespace, "name": pod, "uid": uid},
                "reason": reason, "message": message, "type": "Normal", "count": 1,
                "firstTimestamp": _rfc3339(at), "lastTimestamp": _rfc3339(at),
                "source": {"component": "kubelet"},
            })

    def _route(self, method: str, path: str, query: dict[str, list[str]], content_type: str,
               body: Any) -> tuple[int, dict[str, Any]]:
        m = _EVENTS.match(path)
        if not (m and method == "GET"):
            return super()._route(method, path, query, content_type, body)
        wanted: dict[str, str] = {}
        for term in filter(None, query.get("fieldSelector", [""])[0].split(",")):
            name, _, value = term.partition("=")
            if name not in _FIELDS:
                return 400, _status(400, "BadRequest", f'field label not supported: "{name}"')
            wanted[_FIELDS[name]] = value
        items = [e for e in self.events if e["metadata"]["namespace"] == m.group(1)
                 and all(e["involvedObject"][k] == v for k, v in wanted.items())]
        return 200, {"apiVersion": "v1", "kind": "EventList", "metadata": {"resourceVersion": str(self.state.rv)},
                     "items": items}
