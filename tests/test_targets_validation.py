"""Issue 20 (minor, KEDA): a planner record is checked before any number of it is served.

Before: a record whose `target_at` was in the future or NaN was never stale (a day-old schedule
served as current, the age gauge at -20 s); counts that were not whole numbers, NaN or beyond
int64 escaped as an unhandled error (gRPC UNKNOWN instead of UNAVAILABLE), and for 1e300
`IsActive` said true while `GetMetrics` failed. Real Redis; the last test asks the real gRPC
scaler the way KEDA does. Every check holds for a model's record and for a revision's
(`keys.revision_target`, issue 19: a rollout's stable and canary Deployments each read their own).
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
from prewarm.registry.targets import PLANNED_AT_FIELD, SCHEDULE_FIELD, TARGET_FIELD, TargetStale, TargetUnknown, \
    read_target

NOW = 1_000_000.0
MAX_AGE = 30.0


@pytest.fixture(params=[None, "r2"], ids=["model", "revision"])
def revision(request: pytest.FixtureRequest) -> str | None:
    """The record under test: the model's own (None) or one revision's."""
    value: str | None = request.param
    return value


def _write(client: "redis.Redis[str]", revision: str | None, *, at: Any = NOW, schedule: Any = None,
           target: Any = None) -> None:
    fields = {PLANNED_AT_FIELD: str(at)}
    if schedule is not None:
        fields[SCHEDULE_FIELD] = schedule if isinstance(schedule, str) else json.dumps(schedule)
    if target is not None:
        fields[TARGET_FIELD] = str(target)
    key = keys.last_forecast("m") if revision is None else keys.revision_target("m", revision)
    client.delete(key)
    client.hset(key, mapping=fields)


@pytest.mark.parametrize("at", ["nan", "inf", repr(NOW + 86400.0), repr(NOW + MAX_AGE + 1)])
def test_a_record_from_the_future_or_without_a_time_is_refused(redis_client: "redis.Redis[str]",
                                                            revision: str | None, at: str) -> None:
    _write(redis_client, revision, at=at, schedule=[[NOW - 86400.0, 3]])
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision)


def test_a_record_a_little_ahead_is_fresh_with_age_zero(redis_client: "redis.Redis[str]",
                                                       revision: str | None) -> None:
    _write(redis_client, revision, at=repr(NOW + 2.0), schedule=[[NOW + 2.0, 3]])
    target = read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision)
    assert target.replicas == 3 and target.age_s == 0.0


def test_a_record_older_than_the_max_age_is_stale(redis_client: "redis.Redis[str]", revision: str | None) -> None:
    _write(redis_client, revision, at=repr(NOW - MAX_AGE - 1), schedule=[[NOW - MAX_AGE - 1, 3]])
    with pytest.raises(TargetStale):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision)


@pytest.mark.parametrize("count", [1.5, "NaN", 1e300, 2**63, -1, "3", True, None])
def test_counts_that_are_not_whole_replica_numbers_are_refused(redis_client: "redis.Redis[str]",
                                                              revision: str | None, count: Any) -> None:
    schedule = f"[[{NOW}, {count}]]" if count == "NaN" else [[NOW, count]]
    _write(redis_client, revision, schedule=schedule)
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision)


@pytest.mark.parametrize("target", ["nan", "1e300", "2.5", "-3"])
def test_the_plain_target_field_is_checked_the_same_way(redis_client: "redis.Redis[str]", revision: str | None,
                                                       target: str) -> None:
    _write(redis_client, revision, target=target)
    with pytest.raises(TargetUnknown):
        read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision)
    _write(redis_client, revision, target="4")
    assert read_target(redis_client, "m", now=NOW, max_age_s=MAX_AGE, revision=revision).replicas == 4


@pytest.mark.parametrize("count", ["1e300", "NaN", "2.5"])
def test_keda_gets_unavailable_from_isactive_and_getmetrics_alike(redis_client: "redis.Redis[str]",
                                                                  revision: str | None, count: str) -> None:
    _write(redis_client, revision, schedule=f"[[{NOW}, {count}]]")
    servicer = TargetScaler(redis_client, max_age_s=MAX_AGE, clock=lambda: NOW)
    server, port = build_server(servicer, host="127.0.0.1", port=0)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.ExternalScalerStub(channel)
        meta = {"model": "m"} | ({"revision": revision} if revision else {})
        ref = pb.ScaledObjectRef(name="m", namespace="ns", scalerMetadata=meta)
        for call in (lambda: stub.IsActive(ref, timeout=10),
                     lambda: stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName="x"), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
    finally:
        servicer.stopping.set()
        channel.close()
        server.stop(grace=None)
