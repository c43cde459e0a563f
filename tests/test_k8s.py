"""The Kubernetes actuator and pod watcher, driven through the real `kubernetes` client
against the HTTP-level API double in tests/k8s_double.py (see its docstring for what it
does and does not stand for)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from prewarm import cli

from prewarm.core.errors import PermanentError
from prewarm.adapters.k8s import (
    API_CALLS,
    ORIGINAL_MIN_ANNOTATION,
    ActionKind,
    K8sConflict,
    K8sForbidden,
    K8sNotFound,
    KubeActuator,
)
from prewarm.adapters.k8s_watch import ImagePull, PodWatcher, ReadyPod, image_pulls, pulls_in_events
from tests.k8s_double import KubeDouble, Request
from tests.k8s_events import KubeDoubleWithEvents

NS = "inference"


@pytest.fixture()
def double() -> Iterator[KubeDoubleWithEvents]:
    with KubeDoubleWithEvents() as d:
        d.add_deployment(NS, "llm", replicas=2, labels={"app": "llm", "tier": "gpu"})
        d.add_hpa(NS, "llm", min_replicas=2, max_replicas=10, deployment="llm")
        yield d


@pytest.fixture()
def actuator(double: KubeDouble) -> KubeActuator:
    printed: list[str] = []
    act = KubeActuator(double.api_client(), NS, conflict_retries=3, printer=printed.append)
    act.printed = printed  # type: ignore[attr-defined]
    return act


def test_scale_patches_the_scale_subresource_with_its_resource_version(double: KubeDouble, actuator: KubeActuator) -> None:
    result = actuator.scale("llm", 5)
    assert result.applied and result.kind is ActionKind.SCALE
    assert (result.before, result.after, result.attempts) == (2, 5, 1)
    assert double.replicas(NS, "llm") == 5
    patches = double.requests("PATCH")
    assert len(patches) == 1
    assert patches[0].path == f"/apis/apps/v1/namespaces/{NS}/deployments/llm/scale"
    assert patches[0].content_type in ("application/strategic-merge-patch+json", "application/merge-patch+json")
    assert patches[0].body["spec"] == {"replicas": 5}
    assert patches[0].body["metadata"]["resourceVersion"]  # optimistic concurrency
    assert actuator.read_replicas("llm") == 5


def test_scale_to_the_current_count_sends_no_patch(double: KubeDouble, actuator: KubeActuator) -> None:
    result = actuator.scale("llm", 2)
    assert not result.applied and result.patch is None
    assert double.requests("PATCH") == []


def test_dry_run_prints_the_patch_and_changes_nothing(double: KubeDouble, actuator: KubeActuator) -> None:
    result = actuator.scale("llm", 7, dry_run=True)
    assert result.dry_run and not result.applied
    assert result.patch is not None and result.patch["spec"] == {"replicas": 7}
    assert double.replicas(NS, "llm") == 2
    raised = actuator.raise_min_replicas("llm", 6, dry_run=True)
    assert raised.patch is not None and raised.patch["spec"] == {"minReplicas": 6}
    assert double.hpa(NS, "llm")["spec"]["minReplicas"] == 2
    assert double.requests("PATCH") == []
    printed = actuator.printed  # type: ignore[attr-defined]
    assert len(printed) == 2 and "deployments/llm/scale" in printed[0] and '"replicas": 7' in printed[0]


def test_conflicts_are_retried_with_a_fresh_read(double: KubeDouble, actuator: KubeActuator) -> None:
    double.inject_conflicts(2)
    result = actuator.scale("llm", 4)
    assert result.applied and result.attempts == 3
    assert double.replicas(NS, "llm") == 4
    patches = double.requests("PATCH")
    assert len(patches) == 3
    # each retry re-read and carried a newer resourceVersion
    rvs = [int(p.body["metadata"]["resourceVersion"]) for p in patches]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    assert len(double.requests("GET")) == 3


def test_conflicts_beyond_the_bound_raise_a_temporary_error(double: KubeDouble, actuator: KubeActuator) -> None:
    double.inject_conflicts(10)
    with pytest.raises(K8sConflict, match="still conflicting after 4 attempts") as info:
        actuator.scale("llm", 4)
    assert info.value.retry_after > 0
    assert double.replicas(NS, "llm") == 2


def test_missing_objects_and_rbac_refusals_are_permanent_and_named(double: KubeDouble, actuator: KubeActuator) -> None:
    with pytest.raises(K8sNotFound, match=r"get deployments/nope/scale in namespace inference: not found \(404\)"):
        actuator.scale("nope", 3)
    with pytest.raises(K8sNotFound, match="horizontalpodautoscalers/ghost"):
        actuator.raise_min_replicas("ghost", 3)
    double.inject(403, method="PATCH", path_contains="/scale")
    with pytest.raises(K8sForbidden, match=r"patch deployments/llm/scale in namespace inference: forbidden \(403\)"):
        actuator.scale("llm", 3)
    double.inject(403, path_contains="/nodes")
    with pytest.raises(K8sForbidden, match="list nodes"):
        actuator.list_gpu_nodes()
    assert issubclass(K8sForbidden, PermanentError) and issubclass(K8sNotFound, PermanentError)


def test_raise_and_restore_min_replicas_remembers_the_original(double: KubeDouble, actuator: KubeActuator) -> None:
    raised = actuator.raise_min_replicas("llm", 6)
    assert raised.applied and (raised.before, raised.after) == (2, 6)
    hpa = double.hpa(NS, "llm")
    assert hpa["spec"]["minReplicas"] == 6
    assert hpa["metadata"]["annotations"][ORIGINAL_MIN_ANNOTATION] == "2"
    # raising again (a later peak) keeps the operator's original, not our raised value
    again = actuator.raise_min_replicas("llm", 8)
    assert again.after == 8
    assert double.hpa(NS, "llm")["metadata"]["annotations"][ORIGINAL_MIN_ANNOTATION] == "2"
    assert actuator.read_min_replicas("llm") == (8, 2)
    # a new actuator (a restarted planner) restores from the annotation alone
    fresh = KubeActuator(double.api_client(), NS)
    restored = fresh.restore_min_replicas("llm")
    assert restored.applied and (restored.before, restored.after) == (8, 2)
    hpa = double.hpa(NS, "llm")
    assert hpa["spec"]["minReplicas"] == 2
    assert ORIGINAL_MIN_ANNOTATION not in hpa["metadata"]["annotations"]
    # the stabilization window the operator set is untouched
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # restoring twice is a no-op
    assert not fresh.restore_min_replicas("llm").applied


def test_raise_never_lowers_the_operators_floor_and_respects_max(double: KubeDouble, actuator: KubeActuator) -> None:
    double.add_hpa(NS, "big", min_replicas=4, max_replicas=6)
    result = actuator.raise_min_replicas("big", 2)
    assert result.after == 4  # the floor stays; only the annotation is written
    assert double.hpa(NS, "big")["metadata"]["annotations"][ORIGINAL_MIN_ANNOTATION] == "4"
    with pytest.raises(PermanentError, match="above its maxReplicas 6"):
        actuator.raise_min_replicas("big", 9)


def test_hpa_conflicts_are_retried(double: KubeDouble, actuator: KubeActuator) -> None:
    double.inject_conflicts(1)
    result = actuator.raise_min_replicas("llm", 5)
    assert result.attempts == 2 and double.hpa(NS, "llm")["spec"]["minReplicas"] == 5


def test_list_gpu_nodes_reads_labels_and_allocatable_gpus(double: KubeDouble, actuator: KubeActuator) -> None:
    double.add_node("gpu-a", {"gpu.feature/preload": "true", "model.type": "llama"}, gpus=2)
    double.add_node("gpu-b", {"gpu.feature/preload": "true", "model.type": "mistral"}, gpus=1, ready=False)
    double.add_node("gpu-c", {"gpu.feature/preload": "true"}, gpus=4, unschedulable=True)
    double.add_node("cpu-x", {"kubernetes.io/os": "linux"}, gpus=0)
    double.add_node("gpu-off", {"gpu.feature/preload": "false", "model.type": "llama"}, gpus=8)
    views = actuator.list_gpu_nodes()
    assert [v.name for v in views] == ["gpu-a", "gpu-b", "gpu-c"]
    a, b, c = views
    assert (a.gpus, a.replica_slots, a.model_type, a.ready) == (2, 2, "llama", True)
    assert (b.model_type, b.ready) == ("mistral", False)
    assert (c.gpus, c.model_type, c.ready) == (4, "", False)
    nodes_get = double.requests("GET")[-1]
    assert nodes_get.query["labelSelector"] == ["gpu.feature/preload=true"]


def test_watch_hands_each_ready_pod_to_the_callback_once(double: KubeDouble) -> None:
    labels = {"app": "llm", "tier": "gpu"}
    double.put_pod(NS, "llm-already", labels, ready=True, ip="10.0.0.1", node="gpu-a")
    double.put_pod(NS, "other", {"app": "other"}, ready=True, ip="10.0.0.9")
    seen: list[ReadyPod] = []
    watcher = PodWatcher(double.api_client(), NS, "llm", pod_port=8000, watch_timeout_s=2)
    assert watcher.selector() == "app=llm,tier=gpu"
    stop = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        result["stats"] = watcher.run(seen.append, stop=stop, max_ready=3)

    t = threading.Thread(target=run)
    t.start()
    double.wait_for_watch()
    double.put_pod(NS, "llm-new", labels, ready=False, node="gpu-b")  # scheduled, not ready
    double.put_pod(NS, "llm-new", labels, ready=False, ip="10.0.0.2", node="gpu-b")  # has an IP, not ready
    double.put_pod(NS, "llm-new", labels, ready=True, ip="10.0.0.2", node="gpu-b")  # ready: handed over
    double.put_pod(NS, "llm-new", labels, ready=True, ip="10.0.0.2", node="gpu-b")  # still ready: not again
    double.put_pod(NS, "llm-new", labels, ready=False, ip="10.0.0.2", node="gpu-b")  # container restarted
    double.put_pod(NS, "llm-new", labels, ready=True, ip="10.0.0.2", node="gpu-b")  # ready again: handed over
    t.join(timeout=15)
    stop.set()
    assert not t.is_alive()
    assert [p.name for p in seen] == ["llm-already", "llm-new", "llm-new"]
    assert seen[0].endpoint == "http://10.0.0.1:8000" and seen[0].node == "gpu-a"
    assert seen[1].endpoint == "http://10.0.0.2:8000" and seen[1].node == "gpu-b"
    stats = result["stats"]
    assert stats.ready_calls == 3 and stats.callback_failures == 0  # type: ignore[attr-defined]
    watches = [r for r in double.requests("GET") if r.query.get("watch") == ["true"]]
    assert watches and watches[0].query["labelSelector"] == ["app=llm,tier=gpu"]


def test_watch_survives_a_failing_callback_and_an_expired_resource_version(double: KubeDouble) -> None:
    labels = {"app": "llm", "tier": "gpu"}
    calls: list[str] = []

    def on_ready(pod: ReadyPod) -> None:
        calls.append(pod.name)
        if pod.name == "bad":
            raise RuntimeError("warmup failed")

    watcher = PodWatcher(double.api_client(), NS, "llm", watch_timeout_s=1)
    stop = threading.Event()
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("s", watcher.run(on_ready, stop=stop, max_ready=2)))
    double.put_pod(NS, "bad", labels, ready=True, ip="10.0.0.3")
    double.compact()  # the watcher's first list is older than this: its watch gets 410 and lists again
    t.start()
    double.wait_for_watch(2)  # the first watch got 410 Gone; the second follows a new list
    double.put_pod(NS, "good", labels, ready=True, ip="10.0.0.4")
    t.join(timeout=15)
    stop.set()
    assert not t.is_alive()
    assert sorted(calls) == ["bad", "good"]
    stats = out["s"]
    assert stats.callback_failures == 1  # type: ignore[attr-defined]


def test_watch_of_a_missing_deployment_is_a_permanent_error(double: KubeDouble) -> None:
    watcher = PodWatcher(double.api_client(), NS, "absent", watch_timeout_s=1)
    with pytest.raises(K8sNotFound, match="deployments/absent/scale"):
        watcher.run(lambda pod: None, max_ready=1)
    double.inject(403, path_contains="/pods")
    with pytest.raises(K8sForbidden, match="list pods"):
        PodWatcher(double.api_client(), NS, "llm", watch_timeout_s=1).run(lambda pod: None, max_ready=1)


def test_api_calls_cover_every_endpoint_the_actuator_used(double: KubeDouble, actuator: KubeActuator) -> None:
    """Every request the adapter made maps to an entry of API_CALLS (which RBAC is tested against)."""
    double.add_node("gpu-a", {"gpu.feature/preload": "true"}, gpus=1)
    actuator.scale("llm", 3)
    actuator.raise_min_replicas("llm", 4)
    actuator.restore_min_replicas("llm")
    actuator.list_gpu_nodes()
    watcher = PodWatcher(double.api_client(), NS, "llm", watch_timeout_s=1)
    t = threading.Thread(target=lambda: watcher.run(lambda pod: None, max_ready=1))
    t.start()
    double.wait_for_watch()
    double.put_pod(NS, "p", {"app": "llm", "tier": "gpu"}, ready=True, ip="10.0.0.5")
    t.join(timeout=10)
    assert not t.is_alive()
    pod = double.state.pods[(NS, "p")]["metadata"]
    assert image_pulls(watcher.core, ReadyPod("p", NS, pod["uid"], "gpu-1", "10.0.0.5", "http://10.0.0.5:8000", {},
                                              "1")) == ()  # the pod warmer's read of its image pulls
    allowed = {(c.group, c.resource, v) for c in API_CALLS for v in c.verbs}
    assert {_rbac_of(r) for r in double.requests()} == allowed


def _rbac_of(r: Request) -> tuple[str, str, str]:
    """The (apiGroup, resource[/subresource], verb) an RBAC rule must allow for a request."""
    parts = r.path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2 :] if "namespaces" in parts else parts[2 if parts[0] == "api" else 3 :]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) == 3 else "")
    if r.method == "PATCH":
        verb = "patch"
    elif len(rest) >= 2:
        verb = "get"
    elif r.query.get("watch") == ["true"]:
        verb = "watch"
    else:
        verb = "list"
    return group, resource, verb


def _kubeconfig(tmp_path: Path, double: KubeDouble) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "double", "cluster": {"server": double.url}}],
                "users": [{"name": "u", "user": {"token": "test"}}],
                "contexts": [{"name": "double", "context": {"cluster": "double", "user": "u", "namespace": NS}}],
                "current-context": "double",
            }
        )
    )
    return str(path)


def test_cli_scale_dry_run_and_apply(
    double: KubeDouble, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch
) -> None:
    kubeconfig = _kubeconfig(tmp_path, double)
    base = ["k8s", "--kubeconfig", kubeconfig, "--namespace", NS]
    assert cli.main([*base, "scale", "--deployment", "llm", "--replicas", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dry-run: would PATCH deployments/llm/scale")
    assert json.loads(out[-1])["patch"]["spec"] == {"replicas": 4}
    assert double.replicas(NS, "llm") == 2 and double.requests("PATCH") == []
    assert cli.main([*base, "scale", "--deployment", "llm", "--replicas", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["applied"] is True
    assert double.replicas(NS, "llm") == 4
    assert cli.main([*base, "min-replicas", "--hpa", "llm", "--min", "5"]) == 0
    assert double.hpa(NS, "llm")["spec"]["minReplicas"] == 5
    assert cli.main([*base, "restore", "--hpa", "llm"]) == 0
    assert double.hpa(NS, "llm")["spec"]["minReplicas"] == 2
    capsys.readouterr()
    double.add_node("gpu-a", {"gpu.feature/preload": "true", "model.type": "llama"}, gpus=2)
    assert cli.main([*base, "nodes"]) == 0
    node = json.loads(capsys.readouterr().out)
    assert (node["name"], node["gpus"], node["model_type"]) == ("gpu-a", 2, "llama")
    assert cli.main([*base, "scale", "--deployment", "absent", "--replicas", "1"]) == 1
    assert "deployments/absent/scale" in capsys.readouterr().err


def test_image_pulls_are_read_from_the_pods_kubelet_events(double: KubeDoubleWithEvents) -> None:
    """Issue 18: a pod's first start of an image on a node waits for the pull; the pod warmer keeps that
    wait out of the planner's lead. The kubelet's wordings across versions; a present image is no pull."""
    double.put_pod(NS, "p", {"app": "llm"}, ready=True, ip="10.0.0.5")
    double.put_pod(NS, "q", {"app": "llm"}, ready=True, ip="10.0.0.6")
    for message in ('Pulling image "init:1"', 'Successfully pulled image "init:1" in 1m2.5s',
                    'Successfully pulled image "vllm:0.6" in 20.1s (21.25s including waiting). Image size: 9 bytes.',
                    'Container image "vllm:0.6" already present on machine'):
        double.add_pod_event(NS, "p", message.split(" ", 1)[0].replace("Successfully", "Pulled")
                             .replace("Container", "Pulled"), message, 0.0)
    double.add_pod_event(NS, "q", "Pulled", 'Successfully pulled image "other:1" in 3s', 0.0)
    meta = double.state.pods[(NS, "p")]["metadata"]
    watcher = PodWatcher(double.api_client(), NS, "llm", watch_timeout_s=1)
    pod = ReadyPod("p", NS, meta["uid"], "gpu-1", "10.0.0.5", "http://10.0.0.5:8000", {}, "1")
    assert image_pulls(watcher.core, pod) == (ImagePull("init:1", 62.5), ImagePull("vllm:0.6", 21.25))
    assert pulls_in_events([]) == ()
