"""Issue 20 (minor, KEDA): a planner record is checked before any number of it is served.

Before: a record whose `target_at` was in the future or NaN was never stale (a day-old schedule
served as current, the age gauge at -20 s); counts that were not whole numbers, NaN or beyond
int64 escaped as an unhandled error (gRPC UNKNOWN instead of UNAVAILABLE), and for 1e300
`IsActive` said true while `GetMetrics` failed. Real Redis; the last test asks the real gRPC
scaler the way KEDA does.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
import redis

from prewarm.core import keys
from prewarm.gateway.keda import TargetScaler, build_server
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.targets import PLANNED_AT_FIELD, SCHEDULE_FIELD, TARGET_FIELD, TargetUnknown, read_target

NOW = 1_000_000.0
MAX_AGE = 30.0


def _write(client: "redis.Redis[str]", *, at: Any = NOW, schedule: Any = None, target: Any = None) -> None:
    fields = {PLANNED_AT_FIELD: str(at)}
    if schedule is not None:
        fields[SCHEDULE_FIELD] = schedule if isinstance(schedule, str) else json.dumps(schedule)
    if target is not None:
        fields[TARGET_FIELD] = str(target)
    client.delete(keys.last_forecast("m"))
    client.hset(keys.last_forecast("m"), mapping=fields)


@pytest.mark.parametrize("at", ["nan", "inf", repr(NOW + 86400.0), repr(NOW + MAX_AGE + 1)])
def test_a_record_from_the_future_or_without_a_time_is_refused(redis_client: "redis.Redis[str]", at: str) -> None:
    _write(redis_client, at=at, schedule=[[NOW - 86400.0, 3]])
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE)


def test_a_record_a_little_ahead_is_fresh_with_age_zero(redis_client: "redis.Redis[str]") -> None:
    _write(redis_client, at=repr(NOW + 2.0), schedule=[[NOW + 2.0, 3]])
    target = read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE)
    assert target.replicas == 3 and target.age_s == 0.0


@pytest.mark.parametrize("count", [1.5, "NaN", 1e300, 2**63, -1, "3", True, None])
def test_counts_that_are_not_whole_replica_numbers_are_refused(redis_client: "redis.Redis[str]", count: Any) -> None:
    schedule = f"[[{NOW}, {count}]]" if count == "NaN" else [[NOW, count]]
    _write(redis_client, schedule=schedule)
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE)


@pytest.mark.parametrize("target", ["nan", "1e300", "2.5", "-3"])
def test_the_plain_target_field_is_checked_the_same_way(redis_client: "redis.Redis[str]", target: str) -> None:
    _write(redis_client, target=target)
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE)
    _write(redis_client, target="4")
    assert read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE).replicas == 4


@pytest.mark.parametrize("count", ["1e300", "NaN", "2.5"])
def test_keda_gets_unavailable_from_isactive_and_getmetrics_alike(redis_client: "redis.Redis[str]",
                                                                  count: str) -> None:
    _write(redis_client, schedule=f"[[{NOW}, {count}]]")
    servicer = TargetScaler(redis_client, max_age_s=MAX_AGE, clock=lambda: NOW)
    server, port = build_server(servicer, host="127.0.0.1", port=0)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.ExternalScalerStub(channel)
        ref = pb.ScaledObjectRef(name="m", namespace="ns", scalerMetadata={"model": "m"})
        for call in (lambda: stub.IsActive(ref, timeout=10),
                     lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName="x"), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
    finally:
        servicer.stopping.set()
        channel.close()
        server.stop(grace=None)
