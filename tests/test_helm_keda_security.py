"""The chart's values for the KEDA scaler's TLS and token (issue 20, major 4: the code had them, the
chart did not expose them).

Rendered with Helm's Go SDK as tests/test_helm.py does; the TriggerAuthentication and the
ScaledObject are checked against KEDA's documented fields (tests/keda_crd.py). Then what was
rendered is run: the real `prewarm keda-scaler` process started with the scaler container's
rendered arguments and environment (its Secrets' files in a temporary directory, certificates made
by openssl), and asked over gRPC the way KEDA asks: TLS with the TriggerAuthentication's CA and
client certificate, and the trigger's metadata with `tokenFromEnv` resolved from the scaled
Deployment's container, as KEDA's external scaler does. Kubernetes and KEDA are not here: the test
resolves Secrets, mounts and `…FromEnv` keys itself, by their documented rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import redis

from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.embedded import free_port
from tests.keda_crd import EXTERNAL_AUTH_PARAMS, check_scaled_object, check_trigger_authentication
from tests.test_helm import KUBE_VERSIONS, find, pod_spec, render
from tests.test_keda_scaler import record_plan

ROOT = Path(__file__).resolve().parents[1]
SECURE = {"autoscaling": {"mode": "keda", "scaler": {
    "tls": {"secret": "scaler-tls", "kedaClientSecret": "keda-client"}, "token": {"secret": "scaler-token"}}},
    "inference": {"model": "tiny"}}


def test_without_tls_or_token_nothing_changes() -> None:
    docs = render({"autoscaling": {"mode": "keda"}})
    assert not [d for d in docs if d["kind"] == "TriggerAuthentication"]
    trigger = find(docs, "ScaledObject", "-inference")["spec"]["triggers"][0]
    assert "authenticationRef" not in trigger and "tokenFromEnv" not in trigger["metadata"]
    env = {e["name"] for e in pod_spec(find(docs, "Deployment", "-keda-scaler"))["containers"][0]["env"]}
    assert not {n for n in env if n.startswith("PREWARM_KEDA_")}


def test_tls_and_token_values_render_a_trigger_authentication_and_the_scalers_files() -> None:
    docs = render(SECURE)
    auth = find(docs, "TriggerAuthentication", "-keda-scaler")
    check_trigger_authentication(auth)
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert refs == {"caCert": ("scaler-tls", "ca.crt"), "tlsClientCert": ("keda-client", "tls.crt"),
                    "tlsClientKey": ("keda-client", "tls.key")}
    assert set(refs) <= EXTERNAL_AUTH_PARAMS  # the parameters KEDA's external scaler reads
    so = find(docs, "ScaledObject", "-inference")
    check_scaled_object(so)
    trigger = so["spec"]["triggers"][0]
    assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
    assert trigger["metadata"]["tokenFromEnv"] == "PREWARM_KEDA_TOKEN"
    scaler = find(docs, "Deployment", "-keda-scaler")
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(scaler, version, strict=True)
        kubernetes_validate.validate(find(docs, "Deployment", "-inference"), version, strict=True)
    # without mutual TLS: no client CA for the scaler, no client certificate for KEDA
    one_way = render({"autoscaling": {"mode": "keda", "scaler": {"tls": {"secret": "scaler-tls"}}}})
    env = {e["name"] for e in pod_spec(find(one_way, "Deployment", "-keda-scaler"))["containers"][0]["env"]}
    assert {"PREWARM_KEDA_TLS_CERT_FILE", "PREWARM_KEDA_TLS_KEY_FILE"} <= env
    assert "PREWARM_KEDA_TLS_CLIENT_CA_FILE" not in env and "PREWARM_KEDA_TOKEN" not in env
    params = [r["parameter"] for r in find(one_way, "TriggerAuthentication", "-keda-scaler")["spec"]["secretTargetRef"]]
    assert params == ["caCert"]
    assert not [d for d in render({"autoscaling": {"mode": "hpa", "scaler": {"tls": {"secret": "scaler-tls"}}}})
                if d["kind"] == "TriggerAuthentication"]  # the HPA reads /metrics: no KEDA, no TriggerAuthentication


@pytest.mark.parametrize("bad", [{"tls": {"secret": "Not_A_Name"}}, {"token": {"key": "a/b"}},
                                 {"tls": {"secert": "x"}}])
def test_the_schema_refuses_bad_scaler_security_values(bad: dict[str, Any]) -> None:
    with pytest.raises(Exception):
        render({"autoscaling": {"mode": "keda", "scaler": bad}})


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _secrets(tmp: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets the values name: a CA, the scaler's certificate (SAN localhost) and KEDA's client certificate
    both signed by it (what cert-manager would issue), and the token."""
    ca_key, ca_crt = tmp / "ca.key", tmp / "ca.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(ca_key), "-out",
             str(ca_crt), "-subj", "/CN=test-ca")
    out: dict[str, dict[str, bytes]] = {}
    for name, cn in (("scaler", "localhost"), ("client", "keda-operator")):
        key, csr, crt, ext = (tmp / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        ext.write_text(f"subjectAltName=DNS:{cn}\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-days", "1", "-out", str(crt), "-extfile", str(ext))
        out[name] = {"tls.crt": crt.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca_crt.read_bytes()}
    return {"scaler-tls": out["scaler"], "keda-client": {k: out["client"][k] for k in ("tls.crt", "tls.key")},
            "scaler-token": {"token": b"t0ken-from-a-secret"}}


def _env_value(entry: dict[str, Any], secrets: dict[str, dict[str, bytes]]) -> str:
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["secretKeyRef"]
    return secrets[ref["name"]][ref["key"]].decode()


def test_the_rendered_scaler_serves_keda_over_mutual_tls_with_the_token(
        tmp_path: Path, redis_url: str, redis_client: "redis.Redis[str]") -> None:
    secrets = _secrets(tmp_path)
    docs = render(SECURE)
    scaler = pod_spec(find(docs, "Deployment", "-keda-scaler"))
    container = scaler["containers"][0]
    # the kubelet's part: each mounted Secret's keys as files
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        volume = next(v for v in scaler["volumes"] if v["name"] == mount["name"])
        folder = tmp_path / "mounts" / mount["name"]
        folder.mkdir(parents=True)
        for key, data in secrets[volume["secret"]["secretName"]].items():
            (folder / key).write_bytes(data)
        mounts[mount["mountPath"]] = folder
    env = {e["name"]: _env_value(e, secrets) for e in container["env"] if e["name"].startswith("PREWARM_KEDA_")}
    for name, value in env.items():
        for path, folder in mounts.items():
            if value.startswith(path + "/"):
                env[name] = str(folder / value[len(path) + 1:])
    assert set(env) == {"PREWARM_KEDA_TOKEN", "PREWARM_KEDA_TLS_CERT_FILE", "PREWARM_KEDA_TLS_KEY_FILE",
                        "PREWARM_KEDA_TLS_CLIENT_CA_FILE"}
    # the real planner's target for tiny now (it depends on the hour: PARAMS holds a daily batch rise)
    (_, want), *_ = record_plan(redis_client, live=4, now=time.time(), inflight=24.0)
    assert want > 0
    args = list(container["args"])
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--metrics-port") + 1] = str(free_port())
    proc = subprocess.Popen([sys.executable, "-m", "prewarm.cli", *args, "--host", "127.0.0.1"],
                            env={k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
                            | env | {"PREWARM_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening" in line, line
        # KEDA's part: the TriggerAuthentication's parameters, and tokenFromEnv resolved from the scaled container
        auth = find(docs, "TriggerAuthentication", "-keda-scaler")
        params = {r["parameter"]: secrets[r["name"]][r["key"]] for r in auth["spec"]["secretTargetRef"]}
        so = find(docs, "ScaledObject", "-inference")
        target_env = {e["name"]: e for e in pod_spec(find(docs, "Deployment", "-inference"))["containers"][0]["env"]}
        metadata = {k: (_env_value(target_env[v], secrets) if k.endswith("FromEnv") else v)
                    for k, v in so["spec"]["triggers"][0]["metadata"].items()}
        ref = pb.ScaledObjectRef(name=so["metadata"]["name"], namespace="inference", scalerMetadata=metadata)
        keda = grpc.ssl_channel_credentials(root_certificates=params["caCert"], private_key=params["tlsClientKey"],
                                            certificate_chain=params["tlsClientCert"])
        with grpc.secure_channel(f"localhost:{port}", keda) as channel:
            stub = pb_grpc.ExternalScalerStub(channel)
            assert stub.IsActive(ref, timeout=10).result is True
            spec = stub.GetMetricSpec(ref, timeout=10).metricSpecs[0]
            got = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=spec.metricName), timeout=10)
            assert got.metricValues[0].metricValueFloat == want
            no_token = pb.ScaledObjectRef(name="x", namespace="inference", scalerMetadata={"model": "tiny"})
            with pytest.raises(grpc.RpcError) as refused:
                stub.IsActive(no_token, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        without_client_cert = grpc.ssl_channel_credentials(root_certificates=params["caCert"])
        with grpc.secure_channel(f"localhost:{port}", without_client_cert) as channel:
            with pytest.raises(grpc.RpcError) as no_cert:
                pb_grpc.ExternalScalerStub(channel).IsActive(ref, timeout=10)
            assert no_cert.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
