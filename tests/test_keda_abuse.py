"""Issue 20, major 4: the KEDA scaler could be starved (8 open streams held its 8 threads) by anyone.

A real grpc.aio server over real sockets, a real Redis holding the planner's record; TLS with
certificates openssl makes. Assertions are on answers and their order, never on durations.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import redis

from prewarm.core.errors import SettingsError
from prewarm.core.settings import KedaSettings
from prewarm.gateway.keda import ScalerServer, TargetScaler, build_server, metric_name, server_credentials
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from tests.test_keda_scaler import MODEL, Clock, record_plan, ref


def _serve(client: "redis.Redis[str]", credentials: grpc.ServerCredentials | None = None,
           **kw: object) -> tuple[ScalerServer, int, TargetScaler]:
    scaler = TargetScaler(client, max_age_s=180.0, clock=Clock(), stream_poll_s=0.05, **kw)  # type: ignore[arg-type]
    server, port = build_server(scaler, host="127.0.0.1", port=0, credentials=credentials)
    server.start()
    return server, port, scaler


@pytest.fixture()
def planned(redis_client: "redis.Redis[str]") -> Iterator["redis.Redis[str]"]:
    record_plan(redis_client, live=4, now=0.0, inflight=24.0)
    yield redis_client


def _metrics(stub: pb_grpc.ExternalScalerStub, r: pb.ScaledObjectRef | None = None, **kw: object) -> float:
    got = stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r or ref(), metricName=metric_name(MODEL)),
                          timeout=10, **kw)
    return float(got.metricValues[0].metricValueFloat)


def test_open_streams_do_not_starve_is_active_and_get_metrics(planned: "redis.Redis[str]") -> None:
    """12 streams open (the old server had 8 threads, one per stream): each gets its first answer,
    and IsActive/GetMetrics are still answered while they stay open."""
    server, port, scaler = _serve(planned)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    streams = [stub.StreamIsActive(ref(), timeout=60) for _ in range(12)]
    try:
        firsts = [next(s).result for s in streams]
        assert len(firsts) == 12 and scaler.streams == 12
        assert stub.IsActive(ref(), timeout=10).result is firsts[0]
        assert _metrics(stub) == 4.0
    finally:
        for s in streams:
            s.cancel()
        channel.close()
        server.stop(grace=None)
    assert scaler.streams == 0


def test_streams_past_the_bound_are_refused_and_calls_need_the_token(planned: "redis.Redis[str]") -> None:
    server, port, scaler = _serve(planned, max_streams=2, token="s3cret")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    with_token = pb.ScaledObjectRef(name="x", namespace="y", scalerMetadata={"model": MODEL, "token": "s3cret"})
    try:
        with pytest.raises(grpc.RpcError) as no_token:
            stub.IsActive(ref(), timeout=10)
        assert no_token.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            _metrics(stub, metadata=(("authorization", "Bearer nope"),))
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert _metrics(stub, with_token) == 4.0
        assert _metrics(stub, metadata=(("authorization", "Bearer s3cret"),)) == 4.0
        # KEDA resolves `tokenFromEnv: PREWARM_KEDA_TOKEN` from the scaled Deployment's environment and sends the
        # value under the same key (its external scaler passes trigger metadata only, no TriggerAuthentication)
        from_env = pb.ScaledObjectRef(name="x", namespace="y",
                                      scalerMetadata={"model": MODEL, "tokenFromEnv": "s3cret"})
        assert _metrics(stub, from_env) == 4.0
        with pytest.raises(grpc.RpcError) as wrong_env:
            stub.IsActive(pb.ScaledObjectRef(name="x", namespace="y",
                                             scalerMetadata={"model": MODEL, "tokenFromEnv": "nope"}), timeout=10)
        assert wrong_env.value.code() is grpc.StatusCode.UNAUTHENTICATED
        open_ = [stub.StreamIsActive(with_token, timeout=60) for _ in range(2)]
        assert [next(s).result for s in open_] == [True, True]
        extra = stub.StreamIsActive(with_token, timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            next(extra)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.IsActive(with_token, timeout=10).result is True  # still answered
        for s in open_:
            s.cancel()
    finally:
        channel.close()
        server.stop(grace=None)


def _cert(tmp: Path, name: str) -> tuple[Path, Path]:
    key, crt = tmp / f"{name}.key", tmp / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(crt), "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return key, crt


def test_tls_and_mutual_tls_as_keda_speaks_them(planned: "redis.Redis[str]", tmp_path: Path) -> None:
    key, crt = _cert(tmp_path, "server")
    ckey, ccrt = _cert(tmp_path, "client")
    cfg = KedaSettings(tls_cert_file=str(crt), tls_key_file=str(key), tls_client_ca_file=str(ccrt))
    server, port, _ = _serve(planned, server_credentials(cfg))
    try:
        good = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes(), private_key=ckey.read_bytes(),
                                            certificate_chain=ccrt.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", good) as channel:
            assert _metrics(pb_grpc.ExternalScalerStub(channel)) == 4.0
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", no_client_cert) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                _metrics(pb_grpc.ExternalScalerStub(channel))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext is not served
            with pytest.raises(grpc.RpcError):
                _metrics(pb_grpc.ExternalScalerStub(channel))
    finally:
        server.stop(grace=None)
    with pytest.raises(SettingsError, match="go together"):
        server_credentials(KedaSettings(tls_cert_file=str(crt)))
