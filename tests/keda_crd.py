"""A strict check of a KEDA `ScaledObject` (keda.sh/v1alpha1) against the fields KEDA defines.

Written from KEDA's documentation ("ScaledObject specification", KEDA 2.15+, and the
"External" scaler page), not from its CRD file: `kubernetes_validate` knows only built-in
kinds, and no KEDA operator or API server can run here. Unknown fields fail, as they would
be pruned or refused by the CRD's structural schema; the HPA behavior KEDA passes through
(`advanced.horizontalPodAutoscalerConfig.behavior`) is validated as the real
`autoscaling/v2` type it becomes, with `kubernetes_validate`.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate

# field -> expected Python type, or a nested spec (dict), or a list spec ([item spec])
_SCALE_TARGET = {"apiVersion": str, "kind": str, "name": str, "envSourceContainerName": str}
_FALLBACK = {"failureThreshold": int, "replicas": int, "behavior": str}
_HPA_CONFIG = {"name": str, "behavior": dict}
_MODIFIERS = {"formula": str, "target": str, "activationTarget": str, "metricType": str}
_ADVANCED = {"restoreToOriginalReplicaCount": bool, "horizontalPodAutoscalerConfig": _HPA_CONFIG,
             "scalingModifiers": _MODIFIERS}
_AUTH_REF = {"name": str, "kind": str}
_TRIGGER = {"type": str, "name": str, "metadata": dict, "useCachedMetrics": bool, "metricType": str,
            "authenticationRef": _AUTH_REF}
_SPEC = {"scaleTargetRef": _SCALE_TARGET, "pollingInterval": int, "cooldownPeriod": int,
         "initialCooldownPeriod": int, "idleReplicaCount": int, "minReplicaCount": int, "maxReplicaCount": int,
         "fallback": _FALLBACK, "advanced": _ADVANCED, "triggers": [_TRIGGER]}
_METADATA = {"name": str, "namespace": str, "labels": dict, "annotations": dict}

#: Metadata keys KEDA's `external` / `external-push` scalers read themselves.
EXTERNAL_KEYS = {"scalerAddress", "tlsCertFile", "caCert", "tlsClientCert", "tlsClientKey", "unsafeSsl",
                 "enableTLS"}


def _check(obj: Any, spec: Any, path: str) -> None:
    if isinstance(spec, dict):
        assert isinstance(obj, dict), f"{path}: expected an object, got {obj!r}"
        unknown = set(obj) - set(spec)
        assert not unknown, f"{path}: fields KEDA does not define: {sorted(unknown)}"
        for key, value in obj.items():
            _check(value, spec[key], f"{path}.{key}")
    elif isinstance(spec, list):
        assert isinstance(obj, list) and obj, f"{path}: expected a non-empty list"
        for i, item in enumerate(obj):
            _check(item, spec[0], f"{path}[{i}]")
    else:
        ok = isinstance(obj, spec) and not (spec is int and isinstance(obj, bool))
        assert ok, f"{path}: expected {spec.__name__}, got {obj!r}"


def check_scaled_object(doc: dict[str, Any], kube_version: str = "1.33.0") -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    _check(doc["metadata"], _METADATA, "metadata")
    spec = doc["spec"]
    _check(spec, _SPEC, "spec")
    assert spec["scaleTargetRef"].get("name"), "spec.scaleTargetRef.name is mandatory"
    assert spec.get("triggers"), "spec.triggers is mandatory"
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    assert 0 <= lo <= hi, f"minReplicaCount {lo} must be <= maxReplicaCount {hi}"
    if "idleReplicaCount" in spec:
        assert spec["idleReplicaCount"] < lo, "idleReplicaCount must be less than minReplicaCount"
    if "fallback" in spec:
        assert {"failureThreshold", "replicas"} <= set(spec["fallback"]), "fallback needs failureThreshold and replicas"
    for i, trigger in enumerate(spec["triggers"]):
        assert trigger.get("type") and "metadata" in trigger, f"triggers[{i}]: type and metadata are mandatory"
        for key, value in trigger["metadata"].items():  # map[string]string in the CRD
            assert isinstance(key, str) and isinstance(value, str), f"triggers[{i}].metadata.{key}: {value!r}"
        if trigger["type"] in ("external", "external-push"):
            assert trigger["metadata"].get("scalerAddress"), f"triggers[{i}]: the external scaler needs scalerAddress"
        if "metricType" in trigger:
            assert trigger["metricType"] in ("AverageValue", "Value", "Utilization")
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa"},
               "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": hi,
                        "behavior": behavior}}
        kubernetes_validate.validate(hpa, kube_version, strict=True)


_SECRET_REF = {"parameter": str, "name": str, "key": str}
_ENV_REF = {"parameter": str, "name": str, "containerName": str}
_TRIGGER_AUTH_SPEC = {"podIdentity": dict, "secretTargetRef": [_SECRET_REF], "env": [_ENV_REF],
                      "configMapTargetRef": [_SECRET_REF], "hashiCorpVault": dict, "azureKeyVault": dict,
                      "awsSecretManager": dict, "gcpSecretManager": dict, "boundServiceAccountToken": [dict]}
#: The authentication parameters KEDA's `external` / `external-push` scalers read from a TriggerAuthentication.
EXTERNAL_AUTH_PARAMS = {"caCert", "tlsClientCert", "tlsClientKey"}


def check_trigger_authentication(doc: dict[str, Any]) -> None:
    """A `TriggerAuthentication` (keda.sh/v1alpha1) against KEDA's documented fields ("Authentication"):
    unknown fields fail, each secretTargetRef names a parameter, a Secret and a key."""
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "TriggerAuthentication"
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    _check(doc["metadata"], _METADATA, "metadata")
    _check(doc["spec"], _TRIGGER_AUTH_SPEC, "spec")
    for i, ref in enumerate(doc["spec"].get("secretTargetRef", [])):
        assert ref.get("parameter") and ref.get("name") and ref.get("key"), f"spec.secretTargetRef[{i}]: {ref}"
