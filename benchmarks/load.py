"""Load benchmark: the gateway under saturation and at a fixed rate, next to one replica reached directly.

Why: the gateway is the one process every user request crosses, so it must neither fail
(no 5xx, no socket errors under 200 connections) nor add latency that matters (p99
overhead under 5 ms at a sustainable rate). On a shared machine absolute numbers mean
little, so every figure is paired with the same measurement against one replica
directly, taken in the same run.

What runs — real processes, all started here and stopped at the end, also on an error,
Ctrl-C or SIGTERM: an embedded Redis, two `prewarm serve-model` runtimes serving a tiny
random-weight model (CUDA when available), and one `prewarm gateway` routing by the
registry.

How the replicas come up: NOT through the Celery node agents. This script drives each
runtime itself through the agent's own bring-up (`workers.node.bringup.bring_up`), so the
benchmark measures serving and nothing of the task machinery: register `pending` →
`loading` (POST /load through `BuiltinRuntimeAdapter`, progress into the registry) →
`warming` (signed warmup requests, validation inputs, the pure checks of
`prewarm.policy.validation`) → mark ready on the runtime (`/readyz` 200) → `ready` in the
registry. A thread heartbeats them while the load runs, as the agent would.

Load generators (Debian packages): `wrk` for saturation (200 connections, 60 s, 10 s with
--quick; `wrk_post.lua` sends POST /v1/completions with a short prompt and max_tokens=1)
and `hey` for latency at a fixed rate of half the slower path's saturation throughput
(`-q` per worker × `-c` workers, `-z` duration, `-o csv`: percentiles computed here from
every request; the workers split over hey processes started a fraction of a tick apart, since
one hey's workers all fire at once — see `run_hey`). The latency paths run interleaved in
rounds so all see the same machine.

Keys: `requests`, `errors` (non-2xx + socket errors through the gateway; target 0),
`throughput_rps`, `direct_throughput_rps` (one replica), `throughput_ratio`; at the fixed
rate `p50_ms`, `p99_ms` (through the gateway), `direct_p99_ms`, `overhead_p99_ms` (target
< 5 ms), and what explains them. Which "direct" the latency overhead is taken against:
the same rate sent straight to the same replicas, split evenly (one hey per replica), so
each replica sees the same load with and without the gateway and the difference is the
gateway's hop. Against one replica alone the gateway would look faster than direct (it has
twice the capacity behind it), which says nothing about its cost; that figure is still
reported as `one_replica_p99_ms`.

`--replica-cpus LIST` runs the replicas on those CPUs only (`taskset -c`, and for vLLM its
own OpenMP binding) and everything else on the rest, as in a deployment where the engine
has its GPU node and the gateway its own pod: on a 2-core machine two vLLM processes per
replica otherwise hold both cores, and the gateway's "overhead" is its wait for one.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from benchmarks import load_vllm
from benchmarks.common import cpu_list, parser, percentile, prewarm_process, report, wait_http
from prewarm.adapters.runtimes import BuiltinRuntimeAdapter
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis, free_port, stop_process
from prewarm.runtime.manifest import load_manifest
from prewarm.runtime.model import make_model
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import Settings
from prewarm.core.metrics import Metrics
from prewarm.policy.validation import tensor_specs
from workers.context import WorkerContext
from workers.node.bringup import BringUpSpec, ValidationFailed
from workers.node.bringup import bring_up as bring_up_replica

MODEL = "loadbench"
NODE = "bench-node"
CONNECTIONS = 200
LUA = Path(__file__).with_name("wrk_post.lua")
PHASES = 5  # hey processes per URL, started a fraction of a tick apart (see run_hey)
BODY = json.dumps({"model": MODEL, "prompt": "Hello, how are you today?", "max_tokens": 1})
AUTH: list[str] = []  # -H arguments of wrk and hey: the replicas' API key (--engine vllm), for the direct paths


# --- bringing replicas up the agent's way ------------------------------------------------------


def bring_up(reg: ReplicaRegistry, adapter: BuiltinRuntimeAdapter, replica: Replica, model_dir: Path,
             settings: Settings, timeout_s: float = 120.0, attempts: int = 3) -> Replica:
    """pending → loading → warming → validated → ready through `workers.node.bringup.bring_up`, the
    bring-up the node agents and the pod warmer run.

    One difference: a failed validation is warmed and checked again (bring-up resumes from
    `warming`), up to `attempts` times, because on a shared machine a noisy neighbour can push
    one warm batch past the 1.2 × baseline latency rule (the agent would fail the replica and
    prewarm a new one).
    """
    ctx = WorkerContext(settings=settings, client=reg.client, registry=reg, metrics=Metrics(CollectorRegistry()))
    rid = replica.id
    now = time.time()
    reg.register(replica, now=now)
    spec = BringUpSpec(model=MODEL, node=NODE, node_class=settings.agent.node_class, served_model=MODEL,
                       expected=tensor_specs(load_manifest(model_dir).tensors), started_at=now,
                       load_timeout_s=timeout_s)

    def transition(to: ReplicaState, expected: ReplicaState, reason: str) -> Replica:
        return reg.transition(rid, to, now=time.time(), expected=expected, reason=reason)

    for attempt in range(1, attempts + 1):
        rec = reg.get(rid)
        if rec is None:
            raise RuntimeError(f"replica {rid} vanished from the registry")
        try:
            done = bring_up_replica(ctx, rec, spec, connect=lambda _rec: adapter, transition=transition)
        except ValidationFailed as exc:
            print(f"replica {rid}: validation attempt {attempt} failed: {exc}", file=sys.stderr)
            continue
        if not adapter.ready():
            raise RuntimeError(f"runtime of {rid} does not report /readyz 200 after validation")
        return done.replica
    raise RuntimeError(f"replica {rid} failed validation {attempts} times")


class Heartbeats(threading.Thread):
    """Keeps the ready replicas routable (the gateway skips a replica whose heartbeat expired)."""

    def __init__(self, reg: ReplicaRegistry, replicas: list[Replica], interval_s: float) -> None:
        super().__init__(name="heartbeats", daemon=True)
        self.reg, self.replicas, self.interval_s = reg, replicas, interval_s
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.interval_s):
            for r in self.replicas:
                try:
                    self.reg.heartbeat(r, now=time.time())
                except Exception as exc:  # noqa: BLE001 - a missed beat shows up as errors in the figures
                    print(f"heartbeat of {r.id} failed: {exc}", file=sys.stderr)


# --- the load generators --------------------------------------------------------------------------


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    non2xx: int  # "Non-2xx or 3xx responses"
    socket_errors: dict[str, int]  # "Socket errors: connect, read, write, timeout"
    p50_ms: float
    p99_ms: float

    @property
    def errors(self) -> int:
        return self.non2xx + sum(self.socket_errors.values())

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


_NON2XX = re.compile(r"Non-2xx or 3xx responses:\s*(\d+)")
_SOCKET = re.compile(r"Socket errors:\s*connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def parse_wrk(text: str) -> WrkResult:
    """Read wrk's text summary (error lines) and the WRK_JSON line of wrk_post.lua (exact counts)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no WRK_JSON line (did wrk_post.lua run?):\n{text[-2000:]}")
    data = json.loads(line[len("WRK_JSON "):])
    m = _NON2XX.search(text)
    non2xx = int(m.group(1)) if m else 0
    s = _SOCKET.search(text)
    sock = dict(zip(("connect", "read", "write", "timeout"), map(int, s.groups()))) if s else \
        {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    exact = {k: int(data[k]) for k in ("connect", "read", "write", "timeout")}
    if non2xx != int(data["status"]) or sock != exact:
        raise RuntimeError(f"wrk's text summary ({non2xx} non-2xx, {sock}) disagrees with its "
                           f"done() counts ({data['status']} non-2xx, {exact})")
    return WrkResult(int(data["requests"]), data["duration_us"] / 1e6, non2xx, sock,
                     data["p50_us"] / 1000, data["p99_us"] / 1000)


def run_wrk(url: str, seconds: int, connections: int = CONNECTIONS) -> WrkResult:
    threads = 2
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s",
           *AUTH, "-s", str(LUA), url, "--", MODEL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return parse_wrk(done.stdout)


@dataclass(frozen=True)
class HeyResult:
    latencies_s: list[float]  # successful requests only
    statuses: dict[str, int]
    seconds: float

    @property
    def errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if not code.startswith("2"))

    @property
    def rate(self) -> float:
        return sum(self.statuses.values()) / self.seconds if self.seconds > 0 else 0.0


def parse_hey_csv(text: str, seconds: float) -> HeyResult:
    """hey -o csv: one row per request (response-time in seconds, status-code, ...)."""
    rows = csv.DictReader(io.StringIO(text))
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    for row in rows:
        code = row.get("status-code", "").strip() or "error"
        statuses[code] = statuses.get(code, 0) + 1
        if code.startswith("2"):
            latencies.append(float(row["response-time"]))
    if not statuses:
        raise RuntimeError(f"hey printed no requests:\n{text[-2000:]}")
    return HeyResult(latencies, statuses, seconds)


def rate_plan(rate: float, parts: int = 1, per_worker: float = 10.0) -> tuple[int, float]:
    """(workers in total, q per worker) for a total rate, workers a multiple of `parts`.

    Each hey worker sends one request, waits for the answer, and sleeps until its next tick
    (1/q), so q is kept low enough that an answer always comes back within a tick; the same
    workers and q for every path keep the arrivals the same whether the gateway spreads them
    or the client splits them over replicas."""
    workers = max(4, math.ceil(rate / per_worker))
    workers = parts * math.ceil(workers / parts)
    return workers, rate / workers


def run_hey(urls: list[str], seconds: int, workers: int, q: float, phases: int = PHASES) -> HeyResult:
    """`workers` hey workers at `q` requests/s each, split evenly over `urls`; `workers` must be
    a multiple of len(urls).

    hey starts its workers together and they tick together: one hey process sends bursts of
    all its workers at once, which is not a fixed rate. So each URL's workers are split over
    `phases` hey processes started 1/(q x phases) apart: the same rate, in bursts `phases`
    times smaller, evenly spaced (the arrivals are the same for every path measured)."""
    if workers % len(urls):
        raise ValueError(f"{workers} workers do not split evenly over {len(urls)} URLs")
    share = workers // len(urls)
    phases = max(1, min(phases, share))
    groups = [share // phases + (1 if i < share % phases else 0) for i in range(phases)]
    procs = []
    began = time.monotonic()
    for i, group in enumerate(groups):
        delay = began + i / (q * phases) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for url in urls:
            cmd = ["hey", "-z", f"{seconds}s", "-c", str(group), "-q", f"{q:.4f}", "-t", "10", "-m", "POST", *AUTH,
                   "-T", "application/json", "-d", BODY, "-o", "csv", url]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + 60)
            if proc.returncode != 0:
                raise RuntimeError(f"hey exited {proc.returncode}: {err[-2000:]}")
            part = parse_hey_csv(out, seconds)
            latencies += part.latencies_s
            for code, n in part.statuses.items():
                statuses[code] = statuses.get(code, 0) + n
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return HeyResult(latencies, statuses, seconds)


# --- what the servers say ---------------------------------------------------------------------


def gateway_counts(port: int) -> dict[str, float]:
    """From the gateway's own /metrics: user requests by status code ("code 200") and
    routing decisions by outcome ("route serving", "route registry_unavailable", ...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^gateway_(requests|routing_decisions)_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if m.group(1) == "requests" and labels.get("kind") == "user":
            key = f"code {labels['code']}"
        elif m.group(1) == "routing_decisions":
            key = f"route {labels['outcome']}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; NaN where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def user_requests(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as resp:
        return int(json.loads(resp.read())["user"])


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


# --- the run ------------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_all(procs: list[tuple[str, subprocess.Popen[bytes]]], say: Callable[[str], None]) -> None:
    """SIGTERM every process first, then wait for each: shutdowns overlap instead of adding up."""
    began = time.monotonic()
    for _, proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for _, proc in procs:
        stop_process(proc)
    if time.monotonic() - began > 3.0:
        say(f"{', '.join(n for n, _ in procs)} took {time.monotonic() - began:.1f}s to stop")


def split_cpus(replica_cpus: str | None) -> tuple[str | None, str | None]:
    """(the replicas' CPU list, everything else's) for `--replica-cpus`; (None, None): no pinning.
    Everything else (the gateway, Redis, wrk, hey) gets the CPUs this process may use beside the replicas'."""
    if replica_cpus is None:
        return None, None
    mine = os.sched_getaffinity(0)
    want = cpu_list(replica_cpus)
    if not want <= mine:
        raise ValueError(f"--replica-cpus {replica_cpus}: CPUs {sorted(want - mine)} are not available "
                         f"(this process may use {sorted(mine)})")
    rest = mine - want
    if not rest:
        raise ValueError(f"--replica-cpus {replica_cpus} leaves no CPU for the gateway and the load generators")
    return ",".join(map(str, sorted(want))), ",".join(map(str, sorted(rest)))


def measure(quick: bool, replicas: int, say: Callable[[str], None], engine: str = "builtin",
            replica_cpus: str | None = None, rounds: int | None = None) -> dict[str, Any]:
    pin, rest = split_cpus(replica_cpus)
    if rest is not None:  # the gateway, Redis, wrk and hey are started from here: they inherit it
        os.sched_setaffinity(0, cpu_list(rest))
    sat_s = 10 if quick else 60
    lat_s, default_rounds = (3, 1) if quick else (5, 6)
    rounds = rounds or default_rounds
    secret = secrets.token_hex(16)
    settings = Settings.load()
    settings.warmup.secret = SecretStr(secret)  # the warmup requests are signed with the runtimes' secret
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="prewarm-load-"))
        stack.callback(shutil.rmtree, tmp, True)
        model_dir = make_model(tmp / "model", "tiny", name=MODEL)
        server = stack.enter_context(EmbeddedRedis())
        env = {"PREWARM_REDIS_URL": server.url, "PREWARM_WARMUP_SECRET": secret,
               "PREWARM_RUNTIME_SNAPSHOT_DIR": str(tmp / "snapshots"), "PREWARM_GATEWAY_HOST": "127.0.0.1",
               "PREWARM_RUNTIME_HOST": "127.0.0.1"}
        ports = [free_port() for _ in range(replicas)]
        procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        stack.callback(_stop_all, procs, say)
        served_by = user_requests
        if engine == "vllm":  # real vLLM servers, with a key the gateway sends and the direct paths too
            key = secrets.token_hex(8)
            AUTH[:] = ["-H", f"Authorization: Bearer {key}"]
            env["PREWARM_RUNTIME_API_KEY"] = key
            vllm_dir, vllm_procs = load_vllm.start_servers(tmp, MODEL, ports, key, settings, cpus=pin)
            procs += [(f"vllm {slot}", p) for slot, p in enumerate(vllm_procs)]
            served_by = load_vllm.served_requests
        for slot, port in enumerate(ports if engine == "builtin" else []):
            procs.append((f"runtime {slot}", prewarm_process(
                ["serve-model", "--model-dir", str(model_dir), "--port", str(port), "--model-name", MODEL,
                 "--node", NODE, "--no-autoload"], env, log=tmp / f"runtime-{slot}.log", cpus=pin)))
        gw_port = free_port()
        procs.insert(0, ("gateway", prewarm_process(["gateway", "--port", str(gw_port)], env, log=tmp / "gateway.log")))
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/{'healthz' if engine == 'builtin' else 'health'}",
                      timeout=120 if engine == "builtin" else 900)
        wait_http(f"http://127.0.0.1:{gw_port}/healthz", timeout=60)
        say(f"redis, {replicas} runtimes and the gateway answer")

        client = redis.Redis.from_url(server.url, decode_responses=True)
        stack.callback(client.close)
        reg = ReplicaRegistry(client, settings.registry)
        revision = load_manifest(model_dir).revision or "0"
        ready: list[Replica] = []
        t0 = time.monotonic()
        for slot, port in enumerate(ports):
            endpoint = f"http://127.0.0.1:{port}"
            replica = Replica(MODEL, revision, NODE, slot, endpoint=endpoint)
            if engine == "vllm":
                ready.append(load_vllm.bring_up_vllm(reg, replica, vllm_dir, key, settings, settings.agent.node_class))
                continue
            adapter = BuiltinRuntimeAdapter(endpoint, token=secret, model=MODEL)
            ready.append(bring_up(reg, adapter, replica, model_dir, settings))
        say(f"{len(ready)} replicas ready in {time.monotonic() - t0:.1f}s (registry: "
            f"{', '.join(r.id for r in ready)})")
        beats = Heartbeats(reg, ready, settings.registry.heartbeat_interval_s)
        beats.start()
        stack.callback(beats.halt.set)

        direct_url = f"{ready[0].endpoint}/v1/completions"
        gw_url = f"http://127.0.0.1:{gw_port}/v1/completions"
        run_wrk(direct_url, 1 if quick else 3)  # open connections, warm caches and threads on both paths
        run_wrk(gw_url, 1 if quick else 3)

        say(f"saturation: {CONNECTIONS} connections for {sat_s}s, direct then through the gateway")
        direct = run_wrk(direct_url, sat_s)
        codes_before = gateway_counts(gw_port)
        served_before = [served_by(p) for p in ports]
        via = run_wrk(gw_url, sat_s)
        codes = _diff(gateway_counts(gw_port), codes_before)
        served = [served_by(p) - b for p, b in zip(ports, served_before)]

        # half what the slower path sustains: both paths must run below saturation, or the latencies are
        # queueing and their difference says nothing of the hop (vLLM batches the 200 connections sent to it
        # directly, while the gateway admits `gateway.replica_concurrency` per replica)
        rate = min(direct.rps, via.rps) / 2
        workers, q = rate_plan(rate, len(ready))
        say(f"latency: {rate:.0f} req/s ({workers} workers x {q:.2f}/s), {rounds} x {lat_s}s per path "
            "(one replica, split straight over the replicas, through the gateway), interleaved")
        replica_urls = [f"{r.endpoint}/v1/completions" for r in ready]
        lat_one: list[HeyResult] = []
        lat_direct: list[HeyResult] = []
        lat_via: list[HeyResult] = []
        gw_pid = procs[0][1].pid
        gw_cpu = 0.0
        for _ in range(rounds):
            lat_one.append(run_hey([direct_url], lat_s, workers, q))
            lat_direct.append(run_hey(replica_urls, lat_s, workers, q))
            before = cpu_seconds(gw_pid)
            lat_via.append(run_hey([gw_url], lat_s, workers, q))
            gw_cpu += cpu_seconds(gw_pid) - before
        say("measured; stopping everything")
        gw_log = (tmp / "gateway.log").read_text(errors="replace")[-2000:] if via.errors else ""

    o_lat = [x for r in lat_one for x in r.latencies_s]
    d_lat = [x for r in lat_direct for x in r.latencies_s]
    v_lat = [x for r in lat_via for x in r.latencies_s]
    total = sum(served) or 1
    return {
        "requests": via.requests,
        "errors": via.errors,
        "non2xx": via.non2xx,
        "socket_errors": via.socket_errors,
        "gateway_codes": codes,
        "throughput_rps": via.rps,
        "direct_throughput_rps": direct.rps,
        "throughput_ratio": via.rps / direct.rps if direct.rps else math.nan,
        "direct_errors": direct.errors,
        "saturation_p99_ms": via.p99_ms,
        "direct_saturation_p99_ms": direct.p99_ms,
        "replica_share": [n / total for n in served],
        "rate_rps": workers * q,
        "hey_workers": workers,
        "hey_burst": math.ceil(workers / PHASES),
        "achieved_rate_rps": sum(r.rate for r in lat_via) / len(lat_via),
        "direct_achieved_rate_rps": sum(r.rate for r in lat_direct) / len(lat_direct),
        "p50_ms": percentile(v_lat, 50) * 1000,
        "p99_ms": percentile(v_lat, 99) * 1000,
        "direct_p50_ms": percentile(d_lat, 50) * 1000,
        "direct_p99_ms": percentile(d_lat, 99) * 1000,
        "overhead_p50_ms": (percentile(v_lat, 50) - percentile(d_lat, 50)) * 1000,
        "overhead_p99_ms": (percentile(v_lat, 99) - percentile(d_lat, 99)) * 1000,
        "gateway_cpu_ms_per_request": 1000 * gw_cpu / max(1, sum(sum(r.statuses.values()) for r in lat_via)),
        "one_replica_p50_ms": percentile(o_lat, 50) * 1000,
        "one_replica_p99_ms": percentile(o_lat, 99) * 1000,
        "latency_errors": sum(r.errors for r in lat_via),
        "direct_latency_errors": sum(r.errors for r in lat_direct) + sum(r.errors for r in lat_one),
        "latency_samples": len(v_lat),
        "direct_latency_samples": len(d_lat),
        "replicas": replicas,
        "engine": engine,
        "replica_cpus": pin,
        "other_cpus": rest,
        "saturation_s": sat_s,
        "latency_s": lat_s * rounds,
        "quick": quick,
        "gateway_log_tail": gw_log,
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2, help="runtime replicas behind the gateway (default 2)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: the replicas are real vLLM servers (benchmarks/load_vllm.py; `make vllm-env`)")
    p.add_argument("--replica-cpus", metavar="LIST",
                   help="run the replicas on these CPUs only (e.g. 0) and the gateway, Redis and the load "
                        "generators on the others, as where the engine has its own machine: the gateway's "
                        "overhead without the replicas' compute taking its cores")
    p.add_argument("--rounds", type=int, default=None,
                   help="latency rounds per path (default 6, 1 with --quick): more samples for a steadier p99")
    args = p.parse_args()
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        split_cpus(args.replica_cpus)
    except ValueError as exc:
        p.error(str(exc))
    for tool in ("wrk", "hey"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not installed (Debian package '{tool}')")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    began = time.monotonic()
    result = measure(args.quick, args.replicas,
                     lambda s: print(f"load [{time.monotonic() - began:5.1f}s] {s}", file=sys.stderr, flush=True),
                     args.engine, args.replica_cpus, args.rounds)
    print(f"load [{time.monotonic() - began:5.1f}s] everything stopped", file=sys.stderr, flush=True)
    share = ", ".join(f"{x:.0%}" for x in result["replica_share"])
    rows = [
        ("requests", result["requests"], f"through the gateway in {result['saturation_s']}s at {CONNECTIONS} connections"),
        ("replica_cpus", result["replica_cpus"] or "any",
         f"the gateway, Redis, wrk and hey on {result['other_cpus']}" if result["other_cpus"] else
         "not pinned: replicas, gateway and load generators share every CPU"),
        ("errors", result["errors"], f"target 0; non-2xx {result['non2xx']}, socket {result['socket_errors']}"),
        ("gateway", json.dumps(result["gateway_codes"]), "its /metrics during saturation: codes, routing outcomes"),
        ("throughput_rps", result["throughput_rps"], f"gateway -> {result['replicas']} replicas (share {share})"),
        ("direct_throughput_rps", result["direct_throughput_rps"], "one replica, no gateway, same run"),
        ("throughput_ratio", result["throughput_ratio"], "gateway / direct"),
        ("saturation_p99_ms", result["saturation_p99_ms"], f"direct {result['direct_saturation_p99_ms']:.4g} ms"),
        ("rate_rps", result["rate_rps"], f"half the slower path's saturation throughput; achieved "
                                         f"{result['achieved_rate_rps']:.4g} (direct {result['direct_achieved_rate_rps']:.4g})"),
        ("p50_ms", result["p50_ms"], f"through the gateway; direct {result['direct_p50_ms']:.4g} ms"),
        ("p99_ms", result["p99_ms"], f"through the gateway, {result['latency_samples']} requests"),
        ("direct_p99_ms", result["direct_p99_ms"], f"same rate split straight over the same replicas, "
                                                   f"{result['direct_latency_samples']} requests"),
        ("overhead_p99_ms", result["overhead_p99_ms"], f"target < 5 ms (p50: {result['overhead_p50_ms']:.3g} ms)"),
        ("gateway_cpu_ms_per_request", result["gateway_cpu_ms_per_request"],
         f"its CPU time at the fixed rate ({result['hey_workers']} hey workers, arriving in bursts of "
         f"{result['hey_burst']}, which its one event loop handles one after the other)"),
        ("one_replica_p99_ms", result["one_replica_p99_ms"], f"the whole rate to one replica (p50 "
                                                             f"{result['one_replica_p50_ms']:.4g} ms)"),
        ("latency_errors", result["latency_errors"], f"non-2xx at the fixed rate; direct {result['direct_latency_errors']}"),
    ]
    if result["gateway_log_tail"]:
        print(f"gateway log (tail):\n{result['gateway_log_tail']}", file=sys.stderr)
    report("prewarm load benchmark", rows, result, args.json)


if __name__ == "__main__":
    main()
