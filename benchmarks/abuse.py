"""Fair under abuse (issue 20): a well-behaved client's latency and the planner's schedule, with
and without the abuse, in one run.

A real Redis, a real `prewarm gateway`, `prewarm planner`, `prewarm beat` and `prewarm
keda-scaler`, and a token-paced upstream (`abuse_upstream.py`). The well-behaved client
(127.0.0.1, its own API key) sends 4-token requests one after another, first alone (the
baseline), then while, from other loopback addresses:

- slow bodies: connections trickling their bodies a byte at a time (127.0.0.2);
- unread streams: streams of a verbose model that are never read (127.0.0.3);
- a greedy client: many concurrent 500-token requests under one key (127.0.0.4);
- KEDA streams: more open `StreamIsActive` streams than the old server had threads;
- a demand flood: requests for a model with nothing ready (the planner's demand path).

Keys: `good_p99_ms_unloaded`, `good_p99_ms_abused`, `good_p99_ratio` (target <= 2),
`good_errors_abused`, `isactive_p99_ms_unloaded`/`_abused`, `isactive_failed_abused`,
`periodic_late_max_s` (the latest a beat-scheduled `reap`/`forecast_and_plan` started after
the beat sent it, during the abuse; target <= 2), `greedy_429`, `greedy_200`.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import redis

from benchmarks.common import parser, percentile, prewarm_process, report, wait_http
from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.gateway.keda import metric_name
from prewarm.gateway.kedaproto import externalscaler_pb2 as pb
from prewarm.gateway.kedaproto import externalscaler_pb2_grpc as pb_grpc
from prewarm.registry.embedded import EmbeddedRedis, free_port, stop_process, wait_for_port
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.targets import schedule_fields

MODEL = "bench"


def _conn(port: int, source: str, timeout: float = 60.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))


def good_client(port: int, n: int, errors: list[int]) -> list[float]:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4})
    out = []
    for _ in range(n):
        conn = _conn(port, "127.0.0.1")
        t = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                        "Authorization": "Bearer polite"})
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t)
        if resp.status != 200:
            errors.append(resp.status)
        conn.close()
    return out


def slow_bodies(port: int, n: int, stop: threading.Event) -> None:
    socks = []
    body = json.dumps({"model": MODEL, "prompt": "x" * 200}).encode()
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode())
            socks.append(s)
        except OSError:
            pass
    i = 0
    while not stop.is_set():
        for s in list(socks):
            try:
                s.send(body[i % len(body):i % len(body) + 1])
            except OSError:
                socks.remove(s)
        i += 1
        stop.wait(0.5)
    for s in socks:
        s.close()


def unread_streams(port: int, n: int, stop: threading.Event) -> None:
    socks: list[socket.socket] = []
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5000, "stream": True}).encode()
    while not stop.is_set():
        socks = [s for s in socks if s.fileno() >= 0]
        while len(socks) < n:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind(("127.0.0.3", 0))
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(s)
        stop.wait(1.0)
        for s in socks:  # a cut stream is replaced: the abuse goes on
            s.setblocking(False)
            try:
                if s.recv(1, socket.MSG_PEEK) == b"" and True:
                    s.close()
            except (BlockingIOError, OSError):
                pass
    for s in socks:
        s.close()


def greedy(port: int, threads: int, stop: threading.Event, codes: dict[int, int]) -> list[threading.Thread]:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 500})

    def loop() -> None:
        while not stop.is_set():
            try:
                conn = _conn(port, "127.0.0.4")
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                                "Authorization": "Bearer greedy"})
                resp = conn.getresponse()
                resp.read()
                codes[resp.status] = codes.get(resp.status, 0) + 1
                conn.close()
                if resp.status == 429:  # retries as told, but never waits less than a tenth of a second
                    stop.wait(min(float(resp.getheader("Retry-After") or 1), 0.1))
            except OSError:
                stop.wait(0.1)

    out = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in out:
        t.start()
    return out


def demand_flood(port: int, stop: threading.Event) -> None:
    body = json.dumps({"model": "cold", "prompt": "hi", "max_tokens": 1})
    while not stop.is_set():
        try:
            conn = _conn(port, "127.0.0.5", timeout=10)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            conn.getresponse().read()
            conn.close()
        except OSError:
            stop.wait(0.05)


def attackers(gw_port: int, keda_port: int, running: Any, stop: Any, counts: Any) -> None:
    """Every abuser, in a process of its own: their threads must not share the measuring client's GIL."""
    halt = threading.Event()
    codes: dict[int, int] = {}
    threads = [threading.Thread(target=slow_bodies, args=(gw_port, 50, halt), daemon=True),
               threading.Thread(target=unread_streams, args=(gw_port, 16, halt), daemon=True),
               threading.Thread(target=demand_flood, args=(gw_port, halt), daemon=True)]
    for t in threads:
        t.start()
    threads += greedy(gw_port, 16, halt, codes)
    channel = grpc.insecure_channel(f"127.0.0.1:{keda_port}")
    stub = pb_grpc.ExternalScalerStub(channel)
    ref = pb.ScaledObjectRef(name="s", namespace="n", scalerMetadata={"model": MODEL})
    streams = [stub.StreamIsActive(ref, timeout=600) for _ in range(12)]
    for s in streams:
        next(s)  # each stream is open and answered
    while sum(codes.values()) < 20:  # the greedy client is at it
        time.sleep(0.1)
    running.set()
    stop.wait()
    halt.set()
    for s in streams:
        s.cancel()
    channel.close()
    counts.put(codes)


def keda_probe(stub: pb_grpc.ExternalScalerStub, n: int, failed: list[str]) -> list[float]:
    ref = pb.ScaledObjectRef(name="b", namespace="n", scalerMetadata={"model": MODEL})
    out = []
    for _ in range(n):
        t = time.perf_counter()
        try:
            stub.IsActive(ref, timeout=2)
            stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=metric_name(MODEL)), timeout=2)
        except grpc.RpcError as exc:
            failed.append(exc.code().name)
        out.append(time.perf_counter() - t)
        time.sleep(0.05)
    return out


def _times(log: str, pattern: str) -> list[tuple[float, str]]:
    out = []
    for line in log.splitlines():
        m = re.search(pattern, line)
        if m:
            ts = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((ts, m.group(1)))
    return out


def periodic_lateness(beat_log: str, planner_log: str, since: float) -> float:
    """The latest a beat-sent reap/forecast_and_plan was received by the planner after it was sent."""
    sent = [t for t, _ in _times(beat_log, r"Sending due task (reap-expired-replicas|forecast-and-plan)") if t >= since]
    got = [t for t, _ in _times(planner_log, r"Task prewarm\.(reap|forecast_and_plan)\[")]
    late = 0.0
    for t in sent:
        after = [g for g in got if g >= t - 0.05]
        late = max(late, (min(after) - t) if after else float("inf"))
    return late


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    n_good = 80 if args.quick else 400
    tmp = Path(tempfile.mkdtemp(prefix="prewarm-abuse-"))
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedRedis() as server:
        up_port, gw_port, keda_port = free_port(), free_port(), free_port()
        env = {"PREWARM_REDIS_URL": server.url, "PREWARM_GATEWAY_HOST": "127.0.0.1",
               "PREWARM_GATEWAY_BODY_TIMEOUT_S": "2", "PREWARM_GATEWAY_WRITE_TIMEOUT_S": "2",
               "PREWARM_GATEWAY_HEADER_TIMEOUT_S": "2", "PREWARM_GATEWAY_MAX_CONNECTIONS_PER_CLIENT": "64",
               "PREWARM_GATEWAY_MAX_QUEUE_WAIT_S": "2", "PREWARM_PLANNER_INTERVAL_S": "2",
               "PREWARM_GATEWAY_REPLICA_CONCURRENCY": "4",  # what the upstream serves at once (its SLOTS)
               "PREWARM_REGISTRY_REAPER_INTERVAL_S": "1", "PREWARM_PLANNER_MODELS": f'["{MODEL}@r1","cold@r1"]',
               "PREWARM_AGENT_STATE_DIR": str(tmp / "agent")}
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("abuse_upstream.py")),
                                       str(up_port)]))
        procs.append(prewarm_process(["gateway", "--port", str(gw_port)], env, tmp / "gateway.log"))
        procs.append(prewarm_process(["keda-scaler", "--port", str(keda_port), "--host", "127.0.0.1"], env,
                                     tmp / "keda.log"))
        procs.append(prewarm_process(["planner", "--metrics-port", "0"], env, tmp / "planner.log"))
        procs.append(prewarm_process(["beat", "--schedule-file", str(tmp / "beat")], env, tmp / "beat.log"))
        client: "redis.Redis[str]" = redis.Redis.from_url(server.url, decode_responses=True)
        stop = threading.Event()
        try:
            wait_http(f"http://127.0.0.1:{up_port}/healthz")
            wait_http(f"http://127.0.0.1:{gw_port}/healthz")
            wait_for_port("127.0.0.1", keda_port, 30.0, "keda-scaler")
            reg = ReplicaRegistry(client)
            now = time.time()
            r = Replica(MODEL, "r1", "n0", 0, endpoint=f"http://127.0.0.1:{up_port}")
            reg.register(r, now=now)
            for s in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
                r = reg.transition(r.id, s, now=now)

            def beat() -> None:
                while not stop.wait(1.0):
                    reg.heartbeat(r, now=time.time())
                    client.hset(keys.last_forecast(MODEL), mapping=schedule_fields(
                        [(time.time(), 1)], planned_at=time.time()))

            threading.Thread(target=beat, daemon=True).start()
            client.hset(keys.last_forecast(MODEL), mapping=schedule_fields([(time.time(), 1)], planned_at=time.time()))
            channel = grpc.insecure_channel(f"127.0.0.1:{keda_port}")
            stub = pb_grpc.ExternalScalerStub(channel)
            time.sleep(5)  # the planner worker and the beat have settled: the baseline is not their start-up
            good_client(gw_port, 10, [])  # warm
            base_err: list[int] = []
            base = good_client(gw_port, n_good, base_err)
            keda_fail_base: list[str] = []
            keda_base = keda_probe(stub, 20, keda_fail_base)
            abuse_from = time.time()
            ctx = multiprocessing.get_context("spawn")
            running, abuse_stop, counts = ctx.Event(), ctx.Event(), ctx.Queue()
            abuser = ctx.Process(target=attackers, args=(gw_port, keda_port, running, abuse_stop, counts), daemon=True)
            abuser.start()
            if not running.wait(180):
                raise RuntimeError("the abusers did not get going")
            time.sleep(4)  # the abuse in full: bodies trickling, streams stalled, the greedy queue full
            abused_err: list[int] = []
            abused = good_client(gw_port, n_good, abused_err)
            keda_fail: list[str] = []
            keda_abused = keda_probe(stub, 20, keda_fail)
            abuse_to = time.time()
            abuse_stop.set()
            codes: dict[int, int] = counts.get(timeout=60)
            abuser.join(30)
            stop.set()
            channel.close()
            time.sleep(1.0)
            cut = (tmp / "gateway.log").read_text(errors="replace").count("cut: the client read nothing")
            late = periodic_lateness((tmp / "beat.log").read_text(errors="replace"),
                                     (tmp / "planner.log").read_text(errors="replace"), abuse_from)
        finally:
            stop.set()
            for p in reversed(procs):
                stop_process(p)
            client.close()
    result: dict[str, Any] = {
        "good_p50_ms_unloaded": percentile(base, 50) * 1000, "good_p99_ms_unloaded": percentile(base, 99) * 1000,
        "good_p50_ms_abused": percentile(abused, 50) * 1000, "good_p99_ms_abused": percentile(abused, 99) * 1000,
        "good_p99_ratio": percentile(abused, 99) / percentile(base, 99),
        "good_errors_unloaded": len(base_err), "good_errors_abused": len(abused_err),
        "isactive_p99_ms_unloaded": percentile(keda_base, 99) * 1000,
        "isactive_p99_ms_abused": percentile(keda_abused, 99) * 1000, "isactive_failed_abused": len(keda_fail),
        "periodic_late_max_s": late, "abuse_s": abuse_to - abuse_from,
        "unread_streams_cut": cut, "greedy_200": codes.get(200, 0), "greedy_429": codes.get(429, 0), "quick": args.quick,
    }
    rows = [(k, v, "") for k, v in result.items()]
    report("prewarm: fair under abuse", rows, result, args.json)


if __name__ == "__main__":
    main()
