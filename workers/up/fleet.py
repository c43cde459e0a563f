"""`prewarm up --models N`: several models of different sizes on the two nodes, one GPU budget.

Model 0 is dense (steady Poisson traffic); the others are sparse: bursts of requests
separated by idle gaps, each on its own period. The fleet budget (`planner.fleet_budget_gb`)
cannot hold every model, so the planner's fleet round decides each round which models
stay on GPU, and the gateway holds a request for a cold model while it is loaded (scale
from zero). The live view shows every model's tier (from `keys.FLEET_PLAN`), its ready
replicas and its requests; the end report gives, per model, what was measured through the
gateway, and compares keep-alive (10 min), the hybrid histogram, the fleet planner and the
oracle on the same arrivals in the fleet simulator (same catalog, same nodes).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_ready_s
from forecasting.fleet.policies import FleetEnv, make_fleet_policy
from forecasting.fleet.simulate import simulate
from forecasting.fleet.traces import FleetTrace
from prewarm.core import keys
from prewarm.core.settings import Settings
from prewarm.runtime.model import load_manifest, make_model
from workers.up.run import UpRun, run_to_end
from workers.up.traffic import TrafficStats, drive
from workers.up.workload import UpOptions

SIZES = ("small", "tiny", "tiny", "small", "tiny")
BUCKET_S = 10.0


def fleet_arrivals(n: int, duration_s: float, seed: int) -> list[np.ndarray]:
    """Model 0: steady Poisson; the others: bursts on their own period (sparse)."""
    rng = np.random.default_rng(seed)
    out = [np.sort(rng.uniform(0, duration_s, rng.poisson(1.0 * duration_s)))]
    for i in range(1, n):
        period = 20.0 + 15.0 * i  # a compressed timeline: several bursts per model in a few minutes
        phase = 5.0 + 7.0 * i
        t: list[float] = []
        start = phase
        while start < duration_s:
            k = rng.poisson(5)
            t += list(start + rng.uniform(0, 5.0, k))
            start += period * rng.uniform(0.85, 1.15)
        out.append(np.sort(np.asarray([x for x in t if x < duration_s])))
    return out


class FleetUpRun(UpRun):
    """The demo with several models (see the module docstring)."""

    def __init__(self, settings: Settings, opts: UpOptions, console: Console, n_models: int) -> None:
        super().__init__(settings, opts, console)
        self.n = n_models
        self.models: list[tuple[str, str, float]] = []  # name, revision, GB
        self.per_model: dict[str, TrafficStats] = {}

    def _build(self) -> None:
        root = Path(self.settings.runtime.models_dir)
        for i in range(self.n):
            name, size = f"fleet{i}", SIZES[i % len(SIZES)]
            found = [m.parent for m in sorted((root / name).glob("*/demo-size")) if m.read_text().strip() == size]
            if found:
                path = found[0]
            else:
                building = root / name / "_building"
                shutil.rmtree(building, ignore_errors=True)
                self.console.print(f"building {name} ({size}, random weights) ...")
                make_model(building, size, seed=self.opts.seed + i, name=name)
                (building / "demo-size").write_text(size)
                path = root / name / load_manifest(building).revision
                if path.exists():
                    shutil.rmtree(building)
                else:
                    building.rename(path)
            gb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
            self.models.append((name, path.name, max(gb, 1e-4)))

    def _fleet_env(self) -> dict[str, str]:
        name, revision, _ = self.models[0]
        from workers.up.workload import Workload

        env = self._env(revision, Workload(np.zeros(0), "fleet"))
        env.update({
            "PREWARM_PLANNER_MODELS": json.dumps([f"{n}@{r}" for n, r, _ in self.models]),
            "PREWARM_PLANNER_MODEL_MEMORY_GB": json.dumps({n: gb for n, _, gb in self.models}),
            "PREWARM_PLANNER_FLEET_BUDGET_GB": repr(self.budget_gb),
            "PREWARM_AGENT_GPU_MEMORY_GB": repr(self.budget_gb),  # each node could take the whole budget
            "PREWARM_AGENT_REPLICA_SLOTS": str(max(2, self.n)),
        })
        return env

    @property
    def budget_gb(self) -> float:
        """Room for the dense model and about half of the rest: it cannot hold them all."""
        sizes = [gb for _, _, gb in self.models]
        return sizes[0] + 0.5 * sum(sizes[1:]) if len(sizes) > 1 else sizes[0]

    def _fleet_plan(self) -> dict[str, Any]:
        try:
            raw = self.client.get(keys.FLEET_PLAN)
            return dict(json.loads(raw)) if raw else {}
        except Exception:  # noqa: BLE001 - the view must survive a Redis hiccup
            return {}

    def _fleet_view(self, phase: str) -> Group:
        plan = self._fleet_plan()
        counts = self._sample()
        table = Table(title=f"models (fleet budget {self.budget_gb * 1e3:.1f} MB; on GPU now "
                            f"{plan.get('gpu_gb', 0.0) * 1e3:.1f} MB)", expand=True)
        for col in ("model", "MB", "tier", "ready", "loading", "sent", "2xx", "503", "slow > 0.5 s", "p99 ms"):
            table.add_column(col, justify="right")
        for name, _, gb in self.models:
            s = self.per_model.get(name, TrafficStats())
            tier = plan.get("models", {}).get(name, {}).get("tier", "-")
            ready = counts.get((name, "ready", "serving"), 0)
            loading = sum(counts.get((name, st, "serving"), 0) for st in ("pending", "loading", "warming"))
            p99 = s.percentile(99)
            table.add_row(name, f"{gb * 1e3:.1f}", tier, str(ready), str(loading), str(s.sent), str(s.ok),
                          str(s.statuses.get(503, 0)), str(s.waits_over), "-" if math.isnan(p99) else f"{p99 * 1e3:.0f}")
        return Group(Panel(f"{phase} — {time.monotonic() - self.started:.0f} s — gateway {self.gateway_url}"), table)

    async def run_fleet(self) -> dict[str, Any]:
        self._build()
        arrivals = fleet_arrivals(self.n, self.opts.duration_s, self.opts.seed)
        self._start_stack(self._fleet_env())
        self.started = time.monotonic()
        with Live(console=self.console, refresh_per_second=2, transient=False) as live:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(self.client.keys(keys.node_info("*"))) < 2:
                self._check_children()
                live.update(self._fleet_view("starting: waiting for both agents"))
                await asyncio.sleep(0.5)
            tasks: list[asyncio.Task[TrafficStats]] = []
            for (name, _, _), times in zip(self.models, arrivals):
                self.per_model[name] = TrafficStats()
                tasks.append(asyncio.create_task(drive(self.gateway_url, name, times, self.per_model[name],
                                                        max_tokens=4)))
            while not all(task.done() for task in tasks):
                self._check_children()
                live.update(self._fleet_view("replaying (model 0 dense, the others sparse bursts)"))
                await asyncio.sleep(1.0)
            for task in tasks:
                task.result()
        return self._fleet_report(arrivals)

    def _fleet_report(self, arrivals: list[np.ndarray]) -> dict[str, Any]:
        measured = {}
        for name, _, gb in self.models:
            s = self.per_model[name]
            measured[name] = {"mem_mb": gb * 1e3, "sent": s.sent, "ok": s.ok, "503": s.statuses.get(503, 0),
                              "statuses": {str(k): v for k, v in sorted(s.statuses.items())},
                              "errors": dict(s.errors),
                              "slow_share": s.waits_over / max(1, s.ok), "p99_s": s.percentile(99)}
        sim = simulate_same_arrivals(self, arrivals)
        table = Table(title="the same arrivals in the fleet simulator (same models, nodes and budget; "
                            "the first third is every policy's warm-up)")
        for col in ("policy", "cold %", "TTFT p99 s", "warm MB·s", "wasted MB·s"):
            table.add_column(col, justify="right")
        for row in sim:
            table.add_row(row["policy"], f"{row['cold_share']:.2%}", f"{row['ttft_p99_s']:.2f}",
                          f"{row['warm_gb_h'] * 3.6e6:.1f}", f"{row['wasted_gb_h'] * 3.6e6:.1f}")
        self.console.print(table)
        mt = Table(title="measured through the gateway (a request slower than 0.5 s waited for a cold model)")
        for col in ("model", "MB", "sent", "2xx", "503", "slow %", "p99 s"):
            mt.add_column(col, justify="right")
        for name, m in measured.items():
            mt.add_row(name, f"{m['mem_mb']:.1f}", str(m["sent"]), str(m["ok"]), str(m["503"]),
                       f"{m['slow_share']:.1%}", f"{m['p99_s']:.2f}")
        self.console.print(mt)
        out = {"models": measured, "simulated": sim, "budget_mb": self.budget_gb * 1e3}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "fleet-report.json").write_text(json.dumps(out, indent=2, default=float))
        self.console.print(f"report: {self.run_dir / 'fleet-report.json'}")
        return out


def simulate_same_arrivals(run: FleetUpRun, arrivals: list[np.ndarray]) -> list[dict[str, Any]]:
    """Keep-alive, hybrid histogram, the fleet planner and the oracle on these arrivals, 10 s steps."""
    steps = max(1, int(math.ceil(run.opts.duration_s / BUCKET_S)))
    counts = np.zeros((steps, len(arrivals)))
    for j, t in enumerate(arrivals):
        np.add.at(counts[:, j], np.minimum((t // BUCKET_S).astype(int), steps - 1), 1.0)
    names = tuple(n for n, _, _ in run.models)
    cold = None
    try:
        values = [run.registry.load_time_p95(n) for n in names]
        cold = max(v for v in values if v is not None)
    except (ValueError, TypeError):
        cold = None
    cards = []
    for name, _, gb in run.models:
        ready = default_ready_s(gb)
        if cold is not None:
            ready = {Tier.ASLEEP: 0.2 * cold, Tier.CACHED: cold, Tier.DISK: cold, Tier.GPU: 0.0}
        cards.append(ModelCard(name=name, mem_gb=gb, ready_s={"default": ready}))
    catalog = Catalog(tuple(cards))
    total = sum(gb for _, _, gb in run.models)
    env = FleetEnv(catalog=catalog, step_s=BUCKET_S, n_nodes=1, node_gpu_gb=run.budget_gb, node_host_gb=0.0,
                   counts=counts)
    trace = FleetTrace(names, counts, BUCKET_S, "prewarm up --models", "demo")
    rows = []
    for name, knob in (("keepalive", 600.0), ("hybrid_histogram", None), ("fleet", run.budget_gb), ("oracle", None)):
        score = simulate(trace, make_fleet_policy(name, knob), env, score_after_s=run.opts.duration_s / 3)
        rows.append(dict(score.row(), all_models_gb=total))
    return rows


def run(settings: Settings, opts: UpOptions, n_models: int) -> int:
    up = FleetUpRun(settings, opts, Console(), n_models)
    return run_to_end(up, up.run_fleet())
