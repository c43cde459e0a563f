"""`prewarm up`: the whole system on one machine, driven by a traffic replay.

It starts two node agents (two "GPU nodes", on CPU here), the planner worker, exactly one
beat, the gateway and Flower (when installed) as child processes on the embedded (or
configured) Redis; builds a small local model on first run; replays a trace — or a
synthetic workload that says it is synthetic — through the gateway, while the forecaster
learns from the gateway's own counters and the planner prewarms ahead of each rise. The
terminal shows replicas per state, requests, cold-start waits and warm cost live; the end
report compares what happened with what a reactive policy would have paid on the same
replay (from the simulator) and says where the plots are. Ctrl-C or the end of the replay
stops every process it started.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Coroutine

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from forecasting.budget import warm_cost
from prewarm.core import keys
from prewarm.registry.embedded import claim_port_block, free_port
from prewarm.runtime.model import load_manifest, make_model
from prewarm.registry.connection import sync_client
from prewarm.registry.replicas import ReplicaRegistry
from workers.up.seed import seed_history
from workers.up import vllm as up_vllm
from workers.up.traffic import TrafficStats, drive
from prewarm.core.settings import Settings
from workers.up.report import report
from workers.up.rollout import RolloutWatch, rollout_watch
from workers.up.supervisor import Supervisor
from workers.up.workload import Timeline, UpOptions, Workload, from_trace, synthetic

MODEL = "demo"
NODES = ("node-a", "node-b")
#: Where `prewarm up` claims its agents' runtime port blocks (the tests claim theirs in 30000-32760).
UP_PORT_RANGE = (20000, 30000)


# --- the run ------------------------------------------------------------------------------------
class UpRun:
    def __init__(self, settings: Settings, opts: UpOptions, console: Console) -> None:
        self.settings = settings
        self.opts = opts
        self.console = console
        self.run_dir = opts.out_dir / time.strftime("run-%Y%m%d-%H%M%S")
        self.sup = Supervisor(self.run_dir / "logs", env={})
        self.client = sync_client(settings.redis)
        self.registry = ReplicaRegistry(self.client, settings.registry)
        self.timeline = Timeline()
        self.stats = TrafficStats()
        self.gateway_url = ""
        self.nodes: tuple[str, ...] = NODES
        self.started = 0.0
        self.warm_s = 0.0
        self.total_s = 0.0
        self.live_dt: list[float] = []  # replica-seconds per sample
        self.need_dt: list[float] = []  # the planner's need (replica-seconds) per sample
        self._sent_before = 0
        self.replay_t0 = 0.0
        self.replay_epoch = 0.0
        self.stack_epoch = 0.0
        self.history_epoch = 0.0
        self.rollout: RolloutWatch | None = None

    # -- setup ---------------------------------------------------------------------------------
    def _model(self) -> str:
        """The demo model of the requested size, built once (random weights, nothing downloaded)."""
        if self.opts.engine == "vllm":
            self.console.print("the vLLM engine: a local tiny Llama checkpoint (random weights, nothing downloaded)")
            return up_vllm.model_dir(self.settings, MODEL, self.opts.seed)
        models = Path(self.settings.runtime.models_dir)
        for marker in sorted((models / MODEL).glob("*/demo-size")):
            if marker.read_text().strip() == self.opts.model_size:
                return marker.parent.name
        building = models / MODEL / "_building"
        shutil.rmtree(building, ignore_errors=True)
        self.console.print(f"building a local {self.opts.model_size} model (random weights, nothing downloaded) ...")
        make_model(building, self.opts.model_size, seed=self.opts.seed, name=MODEL)
        (building / "demo-size").write_text(self.opts.model_size)
        revision = load_manifest(building).revision
        target = models / MODEL / revision
        if target.exists():
            shutil.rmtree(building)
        else:
            building.rename(target)
        return revision

    def _env(self, revision: str, wl: Workload) -> dict[str, str]:
        secret = self.settings.warmup.secret.get_secret_value() if self.settings.warmup.secret else secrets.token_hex(16)
        env = {
            "PREWARM_REDIS_URL": self.settings.redis.url or "",
            "PREWARM_WARMUP_SECRET": secret,
            "PREWARM_RUNTIME_MODELS_DIR": str(Path(self.settings.runtime.models_dir).resolve()),
            "PREWARM_PLANNER_MODELS": json.dumps([f"{MODEL}@{revision}"]),
            "PREWARM_AGENT_REPLICA_SLOTS": "4",
            "PREWARM_GATEWAY_HOLD_TIMEOUT_S": "30",
            # Every process shares this machine's cores: one compute thread each, so that
            # replicas do not fight over cores they do not have.
            "OMP_NUM_THREADS": "1",
        }
        # The demo compresses days into minutes: plan on 10 s buckets, short windows.
        demo = {
            "PREWARM_PLANNER_INTERVAL_S": "5",
            "PREWARM_PLANNER_BUCKET_S": "10",
            "PREWARM_PLANNER_STABILIZATION_S": "20",
            "PREWARM_PLANNER_LEAD_MARGIN_S": "3",
            "PREWARM_PLANNER_CAPACITY_RPS": "1.5",
            # Warm latency is compared with the first replica's; on a shared CPU it varies far
            # more than on a dedicated GPU, so the demo allows 5x (production default: 1.2x).
            "PREWARM_WARMUP_LATENCY_FACTOR": "5",
            "PREWARM_PLANNER_WARM_POOL_SIZE": "1",
            # One warm replica beside two or three serving ones is far above the 12% a large
            # fleet can afford; the demo allows it so that the pool is visible.
            "PREWARM_PLANNER_BUDGET_SHARE": "0.5",
            "PREWARM_REGISTRY_HEARTBEAT_INTERVAL_S": "2",
            "PREWARM_REGISTRY_HEARTBEAT_TTL_S": "6",
        }
        if wl.batch_cron:
            demo["PREWARM_PLANNER_BATCH_JOBS"] = json.dumps(
                [{"cron": wl.batch_cron, "model": MODEL, "replicas": 2, "duration_s": wl.batch_len_s, "name": "batch"}]
            )
        for k, v in demo.items():
            env.setdefault(k, os.environ.get(k, v))
        if self.opts.engine == "vllm":
            env.update(up_vllm.env(self.settings, MODEL))
        return env

    def _start_stack(self, env: dict[str, str]) -> None:
        self.sup.env = env
        slots = max(8, int(env.get("PREWARM_AGENT_REPLICA_SLOTS", "8")))
        gw_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{gw_port}"
        self.sup.start("gateway", ["gateway", "--port", str(gw_port)])
        for node in NODES:
            state = self.run_dir / "agents" / node
            self.sup.pid_dirs.append(state)
            self.sup.start(f"agent-{node}", ["agent", "--node", node, "--metrics-port", str(free_port())], {
                # a block of free ports no other `prewarm up` or test worker holds: runtimes on a port another
                # run's agent uses are stopped by it as unrecorded (two concurrent runs whose pids agreed modulo 50
                # did that to each other under the old `20000 + 200 * (pid % 50)`)
                "PREWARM_AGENT_PORT_BASE": str(claim_port_block(slots, *UP_PORT_RANGE)),
                "PREWARM_AGENT_STATE_DIR": str(state),
                "PREWARM_RUNTIME_SNAPSHOT_DIR": str(self.run_dir / "snapshots" / node),
            })
        self.sup.start("planner", ["planner", "--metrics-port", "0"])
        self.sup.start("beat", ["beat", "--schedule-file", str(self.run_dir / "beat-schedule")])
        if self.opts.flower:
            try:
                import flower  # noqa: F401

                port = free_port()
                self.sup.start("flower", ["flower", "--port", str(port)])
                self.console.print(f"Flower: http://127.0.0.1:{port}")
            except ImportError:
                self.console.print("Flower is not installed (pip install 'llm-prewarm[flower]'); skipping it")

    def _check_children(self) -> None:
        dead = self.sup.dead()
        if dead:
            c = dead[0]
            raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; last lines of {c.log_path}:\n{self.sup.tail(c)}")

    # -- sampling and the live view -------------------------------------------------------------------
    def _sample(self) -> dict[tuple[str, str, str], int]:
        try:
            counts = self.registry.counts()
        except Exception:  # noqa: BLE001 - the view must survive a Redis hiccup
            return {}
        def n(state: str, pool: str) -> int:
            return counts.get((MODEL, state, pool), 0)
        serving = n("ready", "serving")
        loading = sum(n(s, "serving") + n(s, "warm") for s in ("pending", "loading", "warming"))
        warm = n("ready", "warm")
        t = time.monotonic() - self.started
        prev = self.timeline.t[-1] if self.timeline.t else 0.0
        dt = t - prev
        self.timeline.t.append(t)
        self.timeline.serving.append(serving)
        self.timeline.loading.append(loading)
        self.timeline.warm.append(warm)
        self.timeline.rps.append((self.stats.sent - self._sent_before) / dt if dt > 0 else 0.0)
        self._sent_before = self.stats.sent
        self.total_s += (serving + loading + warm) * dt
        self.warm_s += warm * dt
        try:
            need = int(self._last_plan().get("need_now") or 0)
        except ValueError:
            need = 0
        self.live_dt.append((serving + loading + warm) * dt)
        self.need_dt.append(need * dt)
        return counts

    @property
    def warm_cost(self) -> float:
        """The one warm-cost definition (`forecasting.budget.warm_cost`) over this run: replica-time above need."""
        return warm_cost(self.live_dt, self.need_dt) if self.live_dt else 0.0

    def _view(self, counts: dict[tuple[str, str, str], int], phase: str) -> Group:
        reps = Table(title="replicas (registry)", expand=True)
        for col in ("state", "serving", "warm"):
            reps.add_column(col)
        for state in ("pending", "loading", "warming", "ready", "draining", "retired", "failed"):
            reps.add_row(state, str(counts.get((MODEL, state, "serving"), 0)), str(counts.get((MODEL, state, "warm"), 0)))
        s = self.stats
        req = Table(title="requests (through the gateway)", expand=True)
        req.add_column("figure")
        req.add_column("value", justify="right")
        p50, p99 = s.percentile(50), s.percentile(99)
        req.add_row("sent / planned", f"{s.sent} / {s.planned}")
        req.add_row("answered 2xx", str(s.ok))
        req.add_row("503 / errors", f"{s.statuses.get(503, 0)} / {sum(s.errors.values())}")
        req.add_row("latency p50 / p99", f"{p50 * 1000:.0f} ms / {p99 * 1000:.0f} ms" if s.latencies else "-")
        req.add_row("slower than 0.5 s", f"{s.waits_over} ({s.waits_over / max(1, s.ok):.1%})")
        req.add_row("warm cost (replica-time above need)", f"{self.warm_cost:.1%}" if self.total_s else "-")
        plan = self._last_plan()
        planner = Table(title="planner (last forecast_and_plan)", expand=True)
        planner.add_column("figure")
        planner.add_column("value", justify="right")
        for k in ("status", "mode", "forecast_error", "rps_q0.5", "rps_q0.9", "need_now", "target", "events", "dropped",
                  "pool_target"):
            planner.add_row(k, str(plan.get(k, "-")))
        grid = Table.grid(expand=True)
        grid.add_row(reps, req, planner)
        elapsed = time.monotonic() - self.started
        return Group(Panel(f"{phase} — {elapsed:.0f} s — gateway {self.gateway_url}"), grid)

    def _last_plan(self) -> dict[str, str]:
        """The planner's last record; empty while Redis cannot be read (the view keeps drawing)."""
        try:
            return dict(self.client.hgetall(keys.last_forecast(MODEL)))
        except redis.RedisError:
            return {}

    # -- the stages ---------------------------------------------------------------------------
    async def _wait_baseline(self, live: Live, timeout_s: float = 240.0) -> None:
        """Wait for the planner's first replica to be ready before traffic starts."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_children()
            counts = self._sample()
            live.update(self._view(counts, "starting: agents up, first replica loading"))
            if counts.get((MODEL, "ready", "serving"), 0) >= 1:
                return
            await asyncio.sleep(1.0)
        raise RuntimeError(f"no replica became ready within {timeout_s:.0f} s; see the logs in {self.sup.log_dir}")

    async def _replay(self, live: Live, wl: Workload, start_epoch: float) -> None:
        delay = start_epoch - time.time()
        while delay > 0:
            counts = self._sample()
            live.update(self._view(counts, f"replay starts in {delay:.0f} s (aligned with the batch job's cron)"))
            await asyncio.sleep(min(1.0, delay))
            delay = start_epoch - time.time()
        task = asyncio.create_task(drive(self.gateway_url, MODEL, wl.arrivals, self.stats, max_tokens=8))
        # the replay's offset 0 on the timeline and on the wall clock: the report's window, the simulator's epoch
        self.replay_t0, self.replay_epoch = time.monotonic() - self.started, time.time()
        day_s = wl.day_s
        t0 = time.monotonic()
        watch = None if self.rollout is None else asyncio.create_task(  # midway through the replay
            self.rollout.watch(self.gateway_url, self.stats, float(wl.arrivals[-1]) / 2 if len(wl.arrivals) else 0.0,
                               t0, task.done))
        while not task.done():
            self._check_children()
            counts = self._sample()
            el = time.monotonic() - t0
            phase = f"replaying: {wl.description}"
            if day_s:
                phase = f"day {int(el // day_s) + 1}/{self.opts.days}" + (" (learning)" if el < day_s else " (forecasting ahead)")
            if self.rollout is not None:
                phase += f" — rollout to {self.rollout.canary}: {self.rollout.phase}"
            live.update(self._view(counts, phase))
            await asyncio.sleep(1.0)
        task.result()
        if watch is not None:
            await watch

    async def run(self) -> dict[str, Any]:
        revision = self._model()
        if self.opts.rollout:
            self.rollout = rollout_watch(self, revision)
        start_epoch = time.time() + 60.0
        if self.opts.history_s and not self.opts.trace:
            raise RuntimeError("--history needs --trace (a request-level trace whose first part is the history)")
        if self.opts.trace:
            try:
                wl = from_trace(self.opts)
            except ValueError as exc:
                raise RuntimeError(str(exc)) from exc
        else:
            wl, start_epoch = synthetic(self.opts, start_epoch)
        self.console.print(f"workload: {wl.description}")
        self.history_epoch = start_epoch
        if wl.history.size:
            # the first counted request falls on a coarse bucket's edge: the simulator's clock starts at the first
            # request, so its buckets and the gateway's then align
            first = math.ceil((start_epoch + float(wl.history.min())) / 60.0) * 60.0
            start_epoch = self.history_epoch = first - float(wl.history.min())
            n = await seed_history(self.settings.redis.url or "", MODEL, start_epoch + wl.history,
                                   self.opts.history_service_s)
            self.console.print(f"history: {n} requests counted into the gateway's counters before the replay")
        self.stack_epoch = time.time()  # the planner's first step is after this: the simulator plans from here
        self._start_stack(self._env(revision, wl))
        self.started = time.monotonic()
        with Live(console=self.console, refresh_per_second=2, transient=False) as live:
            await self._wait_baseline(live, 900.0 if self.opts.engine == "vllm" else 240.0)
            await self._replay(live, wl, max(start_epoch, time.time()))
        return self._report(wl)

    def _report(self, wl: Workload) -> dict[str, Any]:
        return report(self, wl)

    def close(self) -> None:
        self.sup.stop_all()
        self.client.close()


def run(settings: Settings, opts: UpOptions) -> int:
    up = UpRun(settings, opts, Console())
    return run_to_end(up, up.run())


def run_to_end(up: UpRun, main: Coroutine[Any, Any, Any]) -> int:
    """Run `main` (a run's coroutine) to its end or Ctrl-C, then stop everything the run started."""
    console = up.console
    try:
        asyncio.run(main)
        return 0
    except KeyboardInterrupt:
        console.print("interrupted: stopping everything")
        return 130
    except RuntimeError as exc:
        console.print(f"[red]prewarm up failed:[/red] {exc}")
        return 1
    finally:
        up.close()
        console.print(f"all processes stopped; logs in {up.sup.log_dir}")
