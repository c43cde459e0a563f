"""What the KEDA external scaler adds to reading the planner's target: a gRPC round trip.

KEDA asks each ScaledObject's scaler on every polling interval (15-30 s) and the HPA it
manages reads the metric every 15 s, so the scaler's speed only matters in that it must
never be the slow part of a scale-up. This script measures, in one run on one machine,
`GetMetrics` and `IsActive` through a real gRPC channel to `prewarm.gateway.keda` (the server
and the client in this process, on loopback) against the baseline of reading the same
record straight from Redis (`prewarm.registry.targets.read_target`, what the scaler does
inside each call). Everything else about a scale-up (KEDA's poll, the HPA's sync, the pod's
cold start) is seconds; these are milliseconds.

Keys: `read_p50_ms`, `read_p99_ms` (the baseline), `grpc_p50_ms`, `grpc_p99_ms`
(GetMetrics), `isactive_p99_ms`, `overhead_p50_ratio` (gRPC p50 / read p50).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import redis

from benchmarks.common import parser, percentile, report
from prewarm.core import keys
from prewarm.gateway.keda import TargetScaler, build_server, metric_name
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.targets import read_target, schedule_fields

MODEL = "bench"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def main() -> None:
    args = parser(__doc__.splitlines()[0] if __doc__ else "").parse_args()
    n = 500 if args.quick else 5000
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        now = time.time()
        client.hset(keys.last_forecast(MODEL), mapping=schedule_fields([(now, 2), (now + 30.0, 5)], planned_at=now))
        scaler = TargetScaler(client, max_age_s=3600.0)
        grpc_server, port = build_server(scaler, host="127.0.0.1", port=0)
        grpc_server.start()
        ref = pb.ScaledObjectRef(name="bench", namespace="bench", scalerMetadata={"model": MODEL})
        request = pb.GetMetricsRequest(scaledObjectRef=ref, metricName=metric_name(MODEL))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ExternalScalerStub(channel)
                for _ in range(50):  # connection set up, threads warm
                    stub.GetMetrics(request, timeout=5)
                    read_target(client, MODEL, now=time.time(), max_age_s=3600.0)
                reads, calls, actives = [], [], []
                for _ in range(5):  # interleaved rounds: both paths see the same machine
                    reads += timed(lambda: read_target(client, MODEL, now=time.time(), max_age_s=3600.0), n // 5)
                    calls += timed(lambda: stub.GetMetrics(request, timeout=5), n // 5)
                    actives += timed(lambda: stub.IsActive(ref, timeout=5), n // 5)
        finally:
            grpc_server.stop(grace=None)
            client.close()
    result = {
        "samples": len(calls),
        "read_p50_ms": percentile(reads, 50), "read_p99_ms": percentile(reads, 99),
        "grpc_p50_ms": percentile(calls, 50), "grpc_p99_ms": percentile(calls, 99),
        "isactive_p99_ms": percentile(actives, 99),
        "quick": args.quick,
    }
    result["overhead_p50_ratio"] = result["grpc_p50_ms"] / result["read_p50_ms"]
    rows = [
        ("read_p50_ms", result["read_p50_ms"], "baseline: the record read from Redis directly"),
        ("read_p99_ms", result["read_p99_ms"], ""),
        ("grpc_p50_ms", result["grpc_p50_ms"], "GetMetrics over gRPC on loopback (what KEDA calls)"),
        ("grpc_p99_ms", result["grpc_p99_ms"], ""),
        ("isactive_p99_ms", result["isactive_p99_ms"], "IsActive over gRPC"),
        ("overhead_p50_ratio", result["overhead_p50_ratio"], "gRPC p50 / direct read p50, same run"),
    ]
    report("KEDA external scaler: the planner's target over gRPC vs read directly", rows, result, args.json)


if __name__ == "__main__":
    main()
