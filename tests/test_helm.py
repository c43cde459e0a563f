"""The Helm chart, rendered and linted offline with Helm's own Go SDK (`helm_python`, the
helm-python-sdk wheel; there is no `helm` binary here), every object validated against
the Kubernetes OpenAPI schemas (`kubernetes_validate`, strict: unknown fields fail), and
the values the seed names checked to change what they should."""

from __future__ import annotations

import argparse
import base64
import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from prewarm.cli import _build_parser
from prewarm.adapters.k8s import API_CALLS
from prewarm.gateway.keda import MODEL_KEY, TARGET_METRIC
from tests.keda_crd import check_scaled_object
from prewarm.core.planner_settings import PlannerSettings
from prewarm.core.settings import _GROUPS, KubernetesSettings

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "prewarm"
SEED_SET = "autoscaling.warmupPoolSize=2,hpa.behavior.scaleDown.stabilizationWindowSeconds=300"
KUBE_VERSIONS = ("1.28.0", "1.33.0")
NS = "inference"


@lru_cache(maxsize=None)
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    chart = _chart()
    merged = chart.merge_values(values or {})
    chart.validate_schema(merged)
    out = chart.render(merged, name="pw", namespace=NS, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if not path.endswith(".yaml"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def seed_values() -> dict[str, Any]:
    return helm_python.parse_set_string(SEED_SET)


def find(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def env_of(doc: dict[str, Any], container: int = 0) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec(doc)["containers"][container]["env"]}


def known_env_vars() -> set[str]:
    names: set[str] = set()
    for cls in _GROUPS.values():
        prefix = str(cls.model_config["env_prefix"])
        names.update(f"{prefix}{field}".upper() for field in cls.model_fields)
    return names


def cli_subcommands() -> set[str]:
    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def cli_refuses(args: list[str]) -> str | None:
    """None when `prewarm <args>` parses with the CLI as it is, else why not."""
    if args[0] not in cli_subcommands():
        return f"no subcommand {args[0]!r}"
    try:
        _build_parser().parse_args(args)
    except SystemExit:
        return f"the CLI refuses the arguments {args}"
    return None


@pytest.mark.parametrize("values", [None, "seed"], ids=["defaults", "seed-overrides"])
def test_chart_lints_clean(values: str | None) -> None:
    report = helm_python.lint(str(CHART), seed_values() if values else None, strict=True, namespace=NS)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values", [None, "seed", "external-redis"])
def test_every_rendered_object_is_valid_kubernetes(values: str | None) -> None:
    chosen: dict[str, Any] | None = None
    if values == "seed":
        chosen = seed_values()
    elif values == "external-redis":
        chosen = {"redis": {"enabled": False, "existingSecret": "redis-conn"}, "agent": {"modelTypes": ["llama"]},
                  "warmup": {"existingSecret": "warm"}, "planner": {"models": ["tiny@v1"]}}
    docs = render(chosen)
    assert len(docs) >= 12
    for doc in docs:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("mode", ["keda", "hpa", "none"])
def test_each_autoscaling_mode_renders_lints_and_validates(mode: str) -> None:
    values = {"autoscaling": {"mode": mode}}
    report = helm_python.lint(str(CHART), values, strict=True, namespace=NS)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    for doc in render(values):
        if doc["kind"] == "ScaledObject":
            check_scaled_object(doc)  # a CRD: checked against KEDA's documented fields (tests/keda_crd.py)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_refuses_bad_values() -> None:
    chart = _chart()
    for bad in (
        {"autoscaling": {"warmupPoolSize": -1}},
        {"autoscaling": {"warmupPoolSize": "two"}},
        {"hpa": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": -5}}}},
        {"gateway": {"port": 70000}},
        {"redis": {"url": "http://not-redis"}},
        {"warmupPoolSize": 2},  # a misspelt path (not under autoscaling) is refused, not ignored
        {"podWarmer": {"pool": "hot"}},
        {"podWarmer": {"port": 0}},
        {"podWarmer": {"deploymnet": "vllm"}},
        {"autoscaling": {"mode": "cron"}},
        {"autoscaling": {"targets": [{"model": "llama"}]}},  # a target names its Deployment
        {"autoscaling": {"keda": {"pollingIntervall": 5}}},
        {"hpa": {"enabled": True}},  # gone: autoscaling.mode chooses the owner of the count
    ):
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(chart.merge_values(bad))


def test_seed_values_reach_the_planner_and_the_hpa() -> None:
    default = render()
    seeded = render(seed_values())
    assert "PREWARM_PLANNER_WARM_POOL_SIZE" not in env_of(find(default, "Deployment", "-planner"))
    assert env_of(find(seeded, "Deployment", "-planner"))["PREWARM_PLANNER_WARM_POOL_SIZE"] == "2"
    assert env_of(find(seeded, "Deployment", "-beat"))["PREWARM_PLANNER_WARM_POOL_SIZE"] == "2"
    hpa = find(render({"autoscaling": {"mode": "hpa"}}), "HorizontalPodAutoscaler", "-inference")
    # issue 17: the seed's 300 s is the planner's reactive fallback, not a second window behind its plan
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 0
    assert env_of(find(seeded, "Deployment", "-planner"))["PREWARM_PLANNER_STABILIZATION_S"] == "300"
    other = render({"hpa": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}}},
                    "autoscaling": {"warmupPoolSize": 0, "mode": "hpa"}})
    assert find(other, "HorizontalPodAutoscaler", "-inference")["spec"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"
    ] == 0
    planner_env = env_of(find(other, "Deployment", "-planner"))
    assert planner_env["PREWARM_PLANNER_STABILIZATION_S"] == "120"
    assert planner_env["PREWARM_PLANNER_WARM_POOL_SIZE"] == "0"  # zero is a value, not "unset"
    assert planner_env["PREWARM_KUBERNETES_AUTOSCALING"] == "hpa"
    assert planner_env["PREWARM_KUBERNETES_DEPLOYMENT"] == hpa["spec"]["scaleTargetRef"]["name"]
    keda = find(render({"autoscaling": {"mode": "keda"},
                        "hpa": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 90}}}}),
                "ScaledObject", "-inference")
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 0}
    assert keda["spec"]["cooldownPeriod"] <= 1  # no second window before scaling to zero either
    keda_env = env_of(find(render({"autoscaling": {"mode": "keda"},
                                   "hpa": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 90}}}}),
                           "Deployment", "-planner"))
    assert keda_env["PREWARM_PLANNER_STABILIZATION_S"] == "90"


def test_the_cold_start_budget_and_the_reactive_knobs_reach_the_planner_as_its_settings_read_them() -> None:
    """The operator's goal (issue 17) is set from the chart: the budget, the reactive fallback's tolerance and
    the interruption hold reach the planner and the beat, and the planner's own settings parse them."""
    values = {"planner": {"coldStartBudget": 0.0005, "scaleDownTolerance": 0.2, "marginRule": "quantile", "releaseBand": 0.5,
                          "interruption": {"share": 0.05, "minRequests": 40, "holdSeconds": 1800, "pauseMemory": 16}}}
    docs = render(values)
    for name in ("-planner", "-beat"):
        env = env_of(find(docs, "Deployment", name))
        planner = {k: v for k, v in env.items() if k.startswith("PREWARM_PLANNER_") and isinstance(v, str)}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in planner.items():
                mp.setenv(k, v)
            s = PlannerSettings()
        assert (s.cold_start_budget, s.scale_down_tolerance, s.margin_rule) == (0.0005, 0.2, "quantile")
        assert (s.interruption_share, s.interruption_min_requests, s.interruption_hold_s) == (0.05, 40.0, 1800.0)
        assert s.pause_memory == 16 and s.release_band == 0.5
    default = env_of(find(render(), "Deployment", "-planner"))
    assert default["PREWARM_PLANNER_COLD_START_BUDGET"] == str(PlannerSettings().cold_start_budget)
    assert default["PREWARM_PLANNER_MARGIN_RULE"] == PlannerSettings().margin_rule
    chart = _chart()
    for bad in ({"planner": {"coldStartBudget": 0}}, {"planner": {"scaleDownTolerance": 1}},
                {"planner": {"marginRule": "pid"}},
                {"planner": {"interruption": {"share": -0.1}}}):
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(chart.merge_values(bad))


def test_the_outbox_settings_reach_every_process_as_its_settings_read_them() -> None:
    """The task outbox's four settings (issue 20) are set from the chart: how many Redis replicas must hold a
    record (WAIT) and for how long, when a lost task is sent again and how often the sweep looks. Every process
    that sends tasks gets them, and the settings classes parse the rendered env."""
    from prewarm.core.settings import AgentSettings, RedisSettings

    values = {"redis": {"enabled": False, "url": "sentinel://s1:26379/0", "sentinelMaster": "main",
                        "waitReplicas": 2, "waitTimeoutMs": 250},
              "outbox": {"resendAfterSeconds": 45, "sweepIntervalSeconds": 2}}
    docs = render(values)
    for kind, name in (("Deployment", "-planner"), ("Deployment", "-beat"), ("Deployment", "-gateway"),
                       ("DaemonSet", "-agent")):
        env = {k: v for k, v in env_of(find(docs, kind, name)).items() if isinstance(v, str)}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                if k.startswith(("PREWARM_REDIS_", "PREWARM_AGENT_OUTBOX_")):
                    mp.setenv(k, v)
            redis_s, agent_s = RedisSettings(), AgentSettings()
        assert (redis_s.wait_replicas, redis_s.wait_timeout_ms) == (2, 250), name
        assert (agent_s.outbox_resend_after_s, agent_s.outbox_sweep_interval_s) == (45.0, 2.0), name
    default = env_of(find(render(), "Deployment", "-beat"))
    assert "PREWARM_REDIS_WAIT_REPLICAS" not in default  # unset: the settings' own rule (1 with sentinel://, else 0)
    assert float(default["PREWARM_AGENT_OUTBOX_RESEND_AFTER_S"]) == AgentSettings().outbox_resend_after_s
    assert int(default["PREWARM_REDIS_WAIT_TIMEOUT_MS"]) == RedisSettings().wait_timeout_ms
    chart = _chart()
    for bad in ({"redis": {"waitReplicas": -1}}, {"redis": {"waitTimeoutMs": 0}},
                {"outbox": {"resendAfterSeconds": 0}}, {"outbox": {"sweepIntervalSeconds": -5}}):
        with pytest.raises(helm_python.HelmValuesError):
            chart.validate_schema(chart.merge_values(bad))


def test_agent_daemonset_runs_on_labeled_gpu_nodes() -> None:
    docs = render({"agent": {"modelTypes": ["llama", "mistral"], "replicaSlots": 2}})
    ds = find(docs, "DaemonSet", "-agent")
    spec = pod_spec(ds)
    assert spec["nodeSelector"] == {"gpu.feature/preload": "true"}
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "model.type", "operator": "In", "values": ["llama", "mistral"]}]
    container = spec["containers"][0]
    assert container["args"] == ["agent"]
    assert container["resources"]["limits"]["memory"]
    env = env_of(ds)
    assert env["PREWARM_AGENT_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["PREWARM_AGENT_REPLICA_SLOTS"] == "2"
    assert [p["containerPort"] for p in container["ports"] if p["name"].startswith("runtime-")] == [18000, 18001]
    assert "affinity" not in pod_spec(find(render(), "DaemonSet", "-agent"))


def test_agents_ask_for_a_gpu_only_when_they_host_replicas() -> None:
    """Issue 18: in Kubernetes mode (the default) the agents host nothing; a GPU request on every labelled
    node would leave a one-GPU node's inference pod unschedulable. Without Kubernetes they host the replicas."""
    k8s_mode = render()
    agent = pod_spec(find(k8s_mode, "DaemonSet", "-agent"))["containers"][0]
    assert "nvidia.com/gpu" not in agent["resources"]["limits"]
    assert pod_spec(find(k8s_mode, "Deployment", "-inference"))["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 1  # the pod that serves gets the node's one GPU
    hosting = render({"kubernetes": {"enabled": False}, "agent": {"gpus": 2}})
    agent = pod_spec(find(hosting, "DaemonSet", "-agent"))["containers"][0]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_exactly_one_beat_and_the_planner_workers() -> None:
    docs = render({"planner": {"replicas": 3}})
    runners = {d["metadata"]["name"]: pod_spec(d)["containers"][0]["args"][0] for d in docs
               if d["kind"] in ("Deployment", "DaemonSet")}
    beats = [name for name, cmd in runners.items() if cmd == "beat"]
    assert beats == ["pw-prewarm-beat"]
    beat = find(docs, "Deployment", "-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
    assert find(docs, "Deployment", "-planner")["spec"]["replicas"] == 3
    assert set(runners.values()) >= {"agent", "planner", "beat", "gateway", "flower", "serve-model"}
    service = find(docs, "Service", "-gateway")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_runtime_readiness_is_the_runtimes_readyz() -> None:
    inference = find(render(), "Deployment", "-inference")
    runtime = pod_spec(inference)["containers"][0]
    assert runtime["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_runtime_validates_itself_and_serves_the_model_it_made() -> None:
    spec = pod_spec(find(render({"inference": {"model": "llama", "revision": "v2"}}), "Deployment", "-inference"))
    made = spec["initContainers"][0]["args"]
    assert made[made.index("--name") + 1] == "llama" and made[made.index("--revision") + 1] == "v2"
    # no agent validates a pod Kubernetes started: without this its /readyz never turns 200
    assert "--self-validate" in spec["containers"][0]["args"]


def test_pod_warmer_warms_the_inference_pods() -> None:
    """One watcher (`prewarm k8s prewarm-pods`) per release, on the chart's inference Deployment
    by default, registering its pods under the model and revision the runtime was made with."""
    docs = render({"inference": {"model": "llama", "revision": "v2", "port": 8002}})
    warmer = find(docs, "Deployment", "-pod-warmer")
    assert warmer["spec"]["replicas"] == 1 and warmer["spec"]["strategy"] == {"type": "Recreate"}
    args = pod_spec(warmer)["containers"][0]["args"]
    assert args[:2] == ["k8s", "prewarm-pods"]
    opts = dict(zip(args[2::2], args[3::2]))
    assert opts == {"--deployment": find(docs, "Deployment", "-inference")["metadata"]["name"], "--model": "llama",
                    "--revision": "v2", "--pool": "serving", "--metrics-port": "9400"}
    env = env_of(warmer)
    assert env["PREWARM_KUBERNETES_POD_PORT"] == "8002"
    assert env["PREWARM_KUBERNETES_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # issue 13: the chart's serve-model pods listen on 0.0.0.0 with their own control token, which the
    # warmer uses; the gateway holds only their API key, never the control token
    runtime_secret = find(docs, "Secret", "-runtime")["metadata"]["name"]
    assert env["PREWARM_KUBERNETES_POD_API_KEY"] == {"secretKeyRef": {"name": runtime_secret, "key": "control-token"}}
    pods = env_of(find(docs, "Deployment", "-inference"))
    assert pods["PREWARM_RUNTIME_TOKEN"]["secretKeyRef"]["key"] == "control-token"
    assert pods["PREWARM_RUNTIME_API_KEY"]["secretKeyRef"]["key"] == "api-key"
    gateway = env_of(find(docs, "Deployment", "-gateway"))
    assert gateway["PREWARM_RUNTIME_API_KEY"]["secretKeyRef"]["name"] == runtime_secret
    assert "PREWARM_RUNTIME_TOKEN" not in gateway

    # a vLLM Deployment of the operator's instead, with its API key in a Secret
    vllm = find(render({"inference": {"enabled": False},
                        "podWarmer": {"deployment": "vllm-llama", "model": "llama3", "revision": "2024-06",
                                      "servedModel": "meta-llama/Meta-Llama-3-8B-Instruct", "port": 8000,
                                      "pool": "warm", "sleepMode": True, "apiKeySecret": "vllm-key"}}),
                "Deployment", "-pod-warmer")
    args = pod_spec(vllm)["containers"][0]["args"]
    opts = dict(zip(args[2::2], args[3::2]))
    assert opts["--deployment"] == "vllm-llama" and opts["--served-model"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert opts["--model"] == "llama3" and opts["--revision"] == "2024-06" and opts["--pool"] == "warm"
    env = env_of(vllm)
    assert env["PREWARM_KUBERNETES_POD_PORT"] == "8000" and env["PREWARM_KUBERNETES_POD_SLEEP_MODE"] == "true"
    assert env["PREWARM_KUBERNETES_POD_API_KEY"] == {"secretKeyRef": {"name": "vllm-key", "key": "api-key"}}
    assert cli_refuses(args) is None

    with pytest.raises(Exception, match="podWarmer.deployment is required when inference.enabled=false"):
        render({"inference": {"enabled": False}})
    for off in ({"podWarmer": {"enabled": False}}, {"kubernetes": {"enabled": False}}):
        assert not [d for d in render(off) if d["metadata"]["name"].endswith("-pod-warmer")]


def test_each_models_key_secret_reaches_its_warmer_and_the_gateway() -> None:
    """Issue 18: a model's Deployment names its key Secret; its pod warmer registers the reference and the
    gateway mounts the key under that reference (the registry never holds the key)."""
    docs = render({"autoscaling": {"mode": "keda", "targets": [
        {"model": "llama3", "deployment": "vllm-llama3", "revision": "2024-06", "apiKeySecret": "llama-key",
         "apiKeySecretKey": "token"},
        {"model": "qwen", "deployment": "vllm-qwen", "revision": "q1"}]},
        "podWarmer": {"apiKeySecret": "shared-key"}})
    warmers = {pod_spec(d)["containers"][0]["args"][3]: env_of(d) for d in docs
               if d["kind"] == "Deployment" and "-pod-warmer" in d["metadata"]["name"]}
    assert warmers["vllm-llama3"]["PREWARM_KUBERNETES_POD_API_KEY"] == {
        "secretKeyRef": {"name": "llama-key", "key": "token"}}
    assert warmers["vllm-llama3"]["PREWARM_KUBERNETES_POD_API_KEY_REF"] == "llama-key/token"
    assert warmers["vllm-qwen"]["PREWARM_KUBERNETES_POD_API_KEY_REF"] == "shared-key/api-key"  # podWarmer's default
    assert warmers["pw-prewarm-inference"]["PREWARM_KUBERNETES_POD_API_KEY_REF"] == "shared-key/api-key"
    gateway = find(docs, "Deployment", "-gateway")
    keys_dir = env_of(gateway)["PREWARM_GATEWAY_UPSTREAM_KEYS_DIR"]
    (mount,) = pod_spec(gateway)["containers"][0]["volumeMounts"]
    assert mount["mountPath"] == keys_dir and mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(gateway)["volumes"] if v["name"] == mount["name"]]
    mounted = {src["secret"]["items"][0]["path"]: (src["secret"]["name"], src["secret"]["items"][0]["key"],
                                                   src["secret"]["optional"]) for src in volume["projected"]["sources"]}
    assert mounted == {"llama-key/token": ("llama-key", "token", True), "shared-key/api-key": ("shared-key", "api-key", True)}
    for ref in mounted:  # every path the gateway reads is a reference a replica may carry
        KubernetesSettings(pod_api_key_ref=ref)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(gateway, version, strict=True)
    plain = find(render(), "Deployment", "-gateway")  # no key Secret named: nothing mounted, the runtimes' key only
    assert "volumes" not in pod_spec(plain) and "PREWARM_GATEWAY_UPSTREAM_KEYS_DIR" not in env_of(plain)
    with pytest.raises(helm_python.HelmValuesError):
        _chart().validate_schema(_chart().merge_values({"podWarmer": {"apiKeySecret": "../etc"}}))


def test_the_gateway_mounts_the_clients_keys_secret_and_asks_for_keys() -> None:
    """Issue 20: fair shares per client need clients that cannot rename themselves: the clients' keys
    Secret is mounted (one file per client) and the gateway pointed at it, beside the upstreams' keys."""
    docs = render({"gateway": {"clientKeysSecret": "prewarm-clients"}, "autoscaling": {"mode": "keda", "targets": [
        {"model": "qwen", "deployment": "vllm-qwen", "revision": "q1", "apiKeySecret": "qwen-key"}]}})
    gateway = find(docs, "Deployment", "-gateway")
    env = env_of(gateway)
    mounts = {m["name"]: m for m in pod_spec(gateway)["containers"][0]["volumeMounts"]}
    assert mounts["client-keys"]["mountPath"] == env["PREWARM_GATEWAY_CLIENT_KEYS_DIR"]
    assert mounts["client-keys"]["readOnly"] is True and "upstream-keys" in mounts
    volumes = {v["name"]: v for v in pod_spec(gateway)["volumes"]}
    assert volumes["client-keys"]["secret"] == {"secretName": "prewarm-clients"}  # required: never open for want of it
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(gateway, version, strict=True)
    alone = find(render({"gateway": {"clientKeysSecret": "prewarm-clients"}}), "Deployment", "-gateway")
    assert [m["name"] for m in pod_spec(alone)["containers"][0]["volumeMounts"]] == ["client-keys"]
    assert "PREWARM_GATEWAY_CLIENT_KEYS_DIR" not in env_of(find(render(), "Deployment", "-gateway"))


def test_redis_is_optional_with_an_external_url_or_secret() -> None:
    bundled = render()
    assert env_of(find(bundled, "Deployment", "-gateway"))["PREWARM_REDIS_URL"] == "redis://pw-prewarm-redis:6379/0"
    external = render({"redis": {"enabled": False, "existingSecret": "redis-conn"}})
    assert not [d for d in external if d["metadata"]["name"].endswith("-redis")]
    assert env_of(find(external, "Deployment", "-gateway"))["PREWARM_REDIS_URL"] == {
        "secretKeyRef": {"name": "redis-conn", "key": "redis-url"}
    }
    by_url = render({"redis": {"enabled": False, "url": "rediss://cache:6380/0"}})
    assert env_of(find(by_url, "DaemonSet", "-agent"))["PREWARM_REDIS_URL"] == "rediss://cache:6380/0"
    with pytest.raises(helm_python.HelmRenderError, match="redis.url"):
        render({"redis": {"enabled": False}})
    # issue 20: a highly available Redis behind Sentinels
    ha = render({"redis": {"enabled": False, "url": "sentinel://s1:26379,s2:26379,s3:26379/0",
                           "sentinelMaster": "prewarm"}})
    for kind, suffix in (("Deployment", "-gateway"), ("DaemonSet", "-agent")):
        env = env_of(find(ha, kind, suffix))
        assert env["PREWARM_REDIS_URL"].startswith("sentinel://") and env["PREWARM_REDIS_SENTINEL_MASTER"] == "prewarm"
    assert "PREWARM_REDIS_SENTINEL_MASTER" not in env_of(find(bundled, "Deployment", "-gateway"))


def test_bundled_redis_persists_its_data() -> None:
    """Issue 13: a restart of the bundled Redis must not lose the forecast history and the planner's state."""
    docs = render()
    dep = find(docs, "Deployment", "-redis")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--save") + 1] != "" and args[args.index("--dir") + 1] == "/data"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    claim = dep["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    pvc = find(docs, "PersistentVolumeClaim", "-redis")
    assert pvc["metadata"]["name"] == claim and pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    off = render({"redis": {"persistence": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "PersistentVolumeClaim"]


def test_flower_is_behind_basic_auth() -> None:
    """Issue 13 (minor): Flower's UI was open with no auth."""
    docs = render({"flower": {"basicAuth": "ops:pw"}})
    ref = env_of(find(docs, "Deployment", "-flower"))["FLOWER_BASIC_AUTH"]["secretKeyRef"]
    secret = find(docs, "Secret", "-flower")
    assert secret["metadata"]["name"] == ref["name"]
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == "ops:pw"
    generated = find(render(), "Secret", "-flower")
    assert base64.b64decode(generated["data"]["basic-auth"]).decode().startswith("admin:")


def _rbac_rules(docs: list[dict[str, Any]], sa: str) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """(namespaced, cluster-wide) (group, resource, verb) triples granted to service account `sa`."""
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    namespaced: set[tuple[str, str, str]] = set()
    cluster: set[tuple[str, str, str]] = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        target = cluster if binding["kind"] == "ClusterRoleBinding" else namespaced
        for rule in role["rules"]:
            assert "resourceNames" not in rule or rule["resourceNames"]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"wildcard in {role['metadata']['name']}"
                        target.add((group, resource, verb))
    return namespaced, cluster


def test_rbac_grants_exactly_the_actuators_calls() -> None:
    docs = render()
    sa = "pw-prewarm-actuator"
    namespaced, cluster = _rbac_rules(docs, sa)
    want_ns = {(c.group, c.resource, v) for c in API_CALLS if not c.cluster_scoped for v in c.verbs}
    want_cluster = {(c.group, c.resource, v) for c in API_CALLS if c.cluster_scoped for v in c.verbs}
    assert namespaced == want_ns
    assert cluster == want_cluster
    # only the planner and the pod warmer run as the actuator; every other pod has no API token at all
    for doc in (d for d in docs if d["kind"] in ("Deployment", "DaemonSet")):
        spec = pod_spec(doc)
        if doc["metadata"]["name"].endswith("-planner") or "-pod-warmer" in doc["metadata"]["name"]:
            assert spec["serviceAccountName"] == sa
        else:
            assert spec.get("serviceAccountName") != sa and spec.get("automountServiceAccountToken") is False
    # the bundle of other accounts has no bindings at all
    assert _rbac_rules(docs, "pw-prewarm") == (set(), set())
    no_k8s = render({"kubernetes": {"enabled": False}})
    assert not [d for d in no_k8s if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]


def test_every_variable_and_command_exists() -> None:
    docs = render({"planner": {"models": ["tiny@v1"]}, "redis": {"enabled": False, "url": "redis://r:6379/0"}})
    known = known_env_vars()
    commands = cli_subcommands()
    used_vars: set[str] = set()
    used_cmds: set[str] = set()
    for doc in (d for d in docs if d["kind"] in ("Deployment", "DaemonSet")):
        spec = pod_spec(doc)
        for container in spec.get("initContainers", []) + spec["containers"]:
            if container["image"].startswith("redis:") or "command" in container:
                continue  # not a `prewarm` subcommand (Redis; the agent's chown of its hostPath dirs)
            used_cmds.add(container["args"][0])
            assert cli_refuses(container["args"]) is None, (doc["metadata"]["name"], cli_refuses(container["args"]))
            used_vars.update(e["name"] for e in container.get("env", []) if e["name"].startswith("PREWARM_"))
    assert used_vars - known == set(), f"variables not in prewarm.core.settings: {sorted(used_vars - known)}"
    assert used_cmds - commands == set(), f"`prewarm` subcommands missing from the CLI: {sorted(used_cmds - commands)}"


def test_keda_mode_points_one_scaled_object_per_model_at_the_scaler_service() -> None:
    values = {"autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 6,
                              "targets": [{"model": "llama3", "deployment": "vllm-llama3", "maxReplicas": 4},
                                          {"model": "qwen", "deployment": "vllm-qwen", "minReplicas": 1}]},
              "inference": {"model": "tiny"}}
    docs = render(values)
    objects = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(objects) == {"pw-prewarm-inference", "vllm-llama3", "vllm-qwen"}  # one per model's Deployment
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes its own; nothing else scales
    service = find(docs, "Service", "-keda-scaler")
    scaler = find(docs, "Deployment", "-keda-scaler")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    for deployment, model, lo, hi in (("pw-prewarm-inference", "tiny", 0, 6), ("vllm-llama3", "llama3", 0, 4),
                                      ("vllm-qwen", "qwen", 1, 6)):
        so = objects[deployment]
        check_scaled_object(so)
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "external" and trigger["metadata"][MODEL_KEY] == model
        assert trigger["metadata"]["scalerAddress"] == f"{service['metadata']['name']}.{NS}.svc.cluster.local:{grpc_port}"
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (lo, hi)
    assert service["spec"]["selector"] == scaler["spec"]["selector"]["matchLabels"]
    args = pod_spec(scaler)["containers"][0]["args"]
    assert cli_refuses(args) is None and args[args.index("--port") + 1] == str(grpc_port)
    planner_env = env_of(find(docs, "Deployment", "-planner"))
    assert planner_env["PREWARM_KUBERNETES_AUTOSCALING"] == "keda"
    assert json.loads(planner_env["PREWARM_KUBERNETES_DEPLOYMENTS"]) == {
        "tiny": "pw-prewarm-inference", "llama3": "vllm-llama3", "qwen": "vllm-qwen"}
    # the planner's own cap (autoscaling "none") is each Deployment's maxReplicas, as KEDA's is
    assert json.loads(planner_env["PREWARM_KUBERNETES_MAX_REPLICAS_BY_MODEL"]) == {"tiny": 6, "llama3": 4, "qwen": 6}
    assert planner_env["PREWARM_KUBERNETES_MAX_REPLICAS"] == "6"
    assert "replicas" not in find(docs, "Deployment", "-inference")["spec"]  # KEDA's to set, not Helm's
    push = find(render({"autoscaling": {"mode": "keda", "keda": {"push": True}}}), "ScaledObject", "-inference")
    assert push["spec"]["triggers"][0]["type"] == "external-push"  # KEDA then also holds StreamIsActive open


def test_hpa_mode_scales_each_deployment_on_the_planners_target_metric() -> None:
    docs = render({"autoscaling": {"mode": "hpa", "minReplicas": 0,
                                   "targets": [{"model": "llama3", "deployment": "vllm-llama3"}]}})
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {"pw-prewarm-inference", "vllm-llama3"}
    for deployment, model in (("pw-prewarm-inference", "tiny"), ("vllm-llama3", "llama3")):
        spec = hpas[deployment]["spec"]
        assert spec["minReplicas"] == 1  # an HPA cannot hold zero (without the alpha HPAScaleToZero gate)
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {"name": TARGET_METRIC, "selector": {"matchLabels": {"model": model}}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    # the gauge's source is scraped: the scaler's pod carries the scrape annotations on its metrics port
    scaler = find(docs, "Deployment", "-keda-scaler")
    annotations = scaler["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9400" and "--metrics-port" in pod_spec(scaler)["containers"][0]["args"]
    assert not [d for d in docs if d["kind"] == "ScaledObject"]


def test_mode_none_leaves_the_count_to_the_planner() -> None:
    docs = render({"autoscaling": {"mode": "none"}})
    assert not [d for d in docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-keda-scaler")]
    assert find(docs, "Deployment", "-inference")["spec"]["replicas"] == 2
    env = env_of(find(docs, "Deployment", "-planner"))
    assert env["PREWARM_KUBERNETES_AUTOSCALING"] == "none" and env["PREWARM_KUBERNETES_DEPLOYMENT"] == "pw-prewarm-inference"
    namespaced, _ = _rbac_rules(docs, "pw-prewarm-actuator")
    assert {("apps", "deployments/scale", "get"), ("apps", "deployments/scale", "patch")} <= namespaced


@pytest.mark.parametrize("mode", ["keda", "hpa"])
def test_every_variable_and_command_exists_in_each_mode(mode: str) -> None:
    docs = render({"autoscaling": {"mode": mode, "targets": [{"model": "m", "deployment": "d"}]}})
    known = known_env_vars()
    for doc in (d for d in docs if d["kind"] in ("Deployment", "DaemonSet")):
        for container in pod_spec(doc).get("initContainers", []) + pod_spec(doc)["containers"]:
            if container["image"].startswith("redis:") or "command" in container:
                continue
            assert cli_refuses(container["args"]) is None, (doc["metadata"]["name"], container["args"])
            names = {e["name"] for e in container.get("env", []) if e["name"].startswith("PREWARM_")}
            assert names <= known, sorted(names - known)


def test_the_scaled_object_check_refuses_what_keda_does_not_define() -> None:
    good = find(render({"autoscaling": {"mode": "keda"}}), "ScaledObject", "-inference")
    check_scaled_object(good)
    for path, value in ((("spec", "minReplicas"), 1),  # an HPA field name, not KEDA's minReplicaCount
                        (("spec", "triggers", 0, "metadata", "model"), 3),  # metadata is map[string]string
                        (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown",
                          "stabilizationWindowSeconds"), "300"),
                        (("spec", "fallback"), {"replicas": 2})):
        bad = copy.deepcopy(good)
        node: Any = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(Exception):
            check_scaled_object(bad)


def test_each_target_with_a_revision_gets_its_own_pod_warmer() -> None:
    """Multi-model: every model's Deployment has one owner of its count and one pod warmer registering its pods."""
    docs = render({"autoscaling": {"mode": "keda", "targets": [
        {"model": "llama3", "deployment": "vllm-llama3", "revision": "2024-06", "servedModel": "meta/llama3",
         "port": 8000},
        {"model": "qwen", "deployment": "vllm-qwen"}]}})  # no revision: its pods are warmed elsewhere
    warmers = {dict(zip(a[2::2], a[3::2]))["--deployment"]: (d, a) for d in docs if d["kind"] == "Deployment"
               and "-pod-warmer" in d["metadata"]["name"] for a in [pod_spec(d)["containers"][0]["args"]]}
    assert set(warmers) == {"pw-prewarm-inference", "vllm-llama3"}
    doc, args = warmers["vllm-llama3"]
    opts = dict(zip(args[2::2], args[3::2]))
    assert (opts["--model"], opts["--revision"], opts["--served-model"]) == ("llama3", "2024-06", "meta/llama3")
    assert env_of(doc)["PREWARM_KUBERNETES_POD_PORT"] == "8000" and cli_refuses(args) is None
    selectors = [json.dumps(d["spec"]["selector"], sort_keys=True) for d, _ in warmers.values()]
    assert len(set(selectors)) == 2  # no two warmers' Deployments select each other's pods
    for d, _ in warmers.values():
        assert pod_spec(d)["serviceAccountName"] == "pw-prewarm-actuator"
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(d, version, strict=True)
