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
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_ready_s
from forecasting.fleet.policies import FleetEnv, fleet_policy_settings, make_fleet_policy
from forecasting.fleet.simulate import FleetScore, simulate
from forecasting.fleet.traces import FleetTrace
from prewarm.core import keys
from prewarm.core.settings import Settings
from prewarm.runtime.model import load_manifest, make_model
from workers.up.fidelity import (REPLICA_SECONDS_TOLERANCE, WAITED_MIN_SLACK, WAITED_TOLERANCE,
                                 demand_delays, gateway_waits_over, judge, replica_seconds, summary)
from workers.up.run import UpRun, run_to_end
from workers.up.traffic import TrafficStats, drive
from workers.up.workload import UpOptions

SIZES = ("small", "tiny", "tiny", "small", "tiny")
BUCKET_S = 10.0
#: Replica states that hold a model's weights on GPU (the simulator charges loading as on GPU too).
ON_GPU = ("pending", "loading", "warming", "ready", "draining")
#: A request the gateway held longer than this for a replica waited for a load or a wake (a bucket bound of
#: its wait histogram; a warm request is not held at all); the simulator counts every request that arrived
#: before its model was ready.
FIDELITY_WAIT_S = 0.1
#: A registration is matched to the arrivals that found its model cold at most this long before it.
DEMAND_WINDOW_S = 30.0
#: The demo's `planner.fleet_dense_rps` (unless the environment or the settings file sets it). Model 0 sends 1
#: request/s, the default threshold's own rate, so counted from its first request over a short run it fell under it as
#: often as not and most rounds sized no model by the count planner. A sparse model's bursts (5 requests in 5 s every
#: 35-50 s) stay under it but for a round or two at its first burst: a new model's rate counts from its first request.
DENSE_RPS = 0.8


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
        if "fleet_dense_rps" not in settings.planner.model_fields_set:  # not set: the demo's (the round and its replay)
            self.settings.planner = settings.planner.model_copy(update={"fleet_dense_rps": DENSE_RPS})
        self.n = n_models
        self.models: list[tuple[str, str, float]] = []  # name, revision, GB
        self.per_model: dict[str, TrafficStats] = {}
        self.gpu_t: list[float] = []  # monotonic sample times of `gpu_n`
        self.gpu_n: dict[str, list[int]] = {}  # model -> replicas on GPU at each sample
        self.dense_rounds: dict[str, int] = {}  # model -> rounds seen (one per plan record) that sized it as dense
        self.plan_at: float | None = None

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
            "PREWARM_PLANNER_FLEET_DENSE_RPS": repr(self.settings.planner.fleet_dense_rps),
            "PREWARM_AGENT_GPU_MEMORY_GB": repr(self.budget_gb),  # each node could take the whole budget
            "PREWARM_AGENT_REPLICA_SLOTS": str(max(2, self.n)),
        })
        return env

    @property
    def budget_gb(self) -> float:
        """Room for the dense model and about half of the rest: it cannot hold them all."""
        sizes = [gb for _, _, gb in self.models]
        return sizes[0] + 0.5 * sum(sizes[1:]) if len(sizes) > 1 else sizes[0]

    def _sample_gpu(self) -> None:
        """One sample of the replicas each model holds on GPU (monotonic time), for the fidelity check."""
        try:
            counts = self.registry.counts()
        except Exception:  # noqa: BLE001 - a missed sample holds the previous one
            return
        self.gpu_t.append(time.monotonic())
        for name, _, _ in self.models:
            self.gpu_n.setdefault(name, []).append(sum(n for (m, state, _), n in counts.items()
                                                       if m == name and state in ON_GPU))

    def _fleet_plan(self) -> dict[str, Any]:
        try:
            raw = self.client.get(keys.FLEET_PLAN)
            return dict(json.loads(raw)) if raw else {}
        except Exception:  # noqa: BLE001 - the view must survive a Redis hiccup
            return {}

    def _fleet_view(self, phase: str) -> Group:
        plan = self._fleet_plan()
        if plan.get("at") is not None and plan["at"] != self.plan_at:  # a new round: count the models it sized
            self.plan_at = plan["at"]
            for name, m in plan.get("models", {}).items():
                self.dense_rounds[name] = self.dense_rounds.get(name, 0) + int(bool(m.get("dense")))
        counts = self._sample()
        table = Table(title=f"models (fleet budget {self.budget_gb * 1e3:.1f} MB; on GPU now "
                            f"{plan.get('gpu_gb', 0.0) * 1e3:.1f} MB)", expand=True)
        for col in ("model", "MB", "tier", "ready", "loading", "sent", "2xx", "503", "slow > 0.5 s", "p99 ms"):
            table.add_column(col, justify="right")
        for name, _, gb in self.models:
            s = self.per_model.get(name, TrafficStats())
            entry = plan.get("models", {}).get(name, {})
            tier = str(entry.get("tier", "-")) + (" (dense)" if entry.get("dense") else "")
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
                self._sample_gpu()
                live.update(self._fleet_view("replaying (model 0 dense, the others sparse bursts)"))
                await asyncio.sleep(1.0)
            self._sample_gpu()
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
        all_gb = sum(gb for _, _, gb in self.models)
        sim = [dict(score.row(), all_models_gb=all_gb) for score in simulate_same_arrivals(self, arrivals)]
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
        fidelity = self._fidelity(arrivals)
        ft = Table(title="the fleet planner, simulated vs measured over the whole replay "
                         f"(bar: GPU MB·s within {REPLICA_SECONDS_TOLERANCE:.0%}, waited within "
                         f"max({WAITED_MIN_SLACK}, {WAITED_TOLERANCE:.0%}))")
        for col in ("model", "GPU MB·s measured", "simulated", "waited > 0.1 s measured", "simulated"):
            ft.add_column(col, justify="right")
        for name, row in fidelity["by_model"].items():
            ft.add_row(name, f"{row['gpu_mb_seconds_measured']:.1f}", f"{row['gpu_mb_seconds_simulated']:.1f}",
                       str(row["waited_measured"]), f"{row['waited_simulated']:.1f}")
        ft.add_row("all", f"{fidelity['gpu_mb_seconds_measured']:.1f}", f"{fidelity['gpu_mb_seconds_simulated']:.1f}",
                   str(fidelity["waited_measured"]), str(fidelity["waited_simulated"]))
        self.console.print(ft)
        self.console.print(f"demand to load start, measured: mean {fidelity['actuation_s']:.2f} s over "
                           f"{fidelity['demand_delays']['n']} on-demand loads (the replay charges it)")
        self.console.print(f"fidelity: GPU MB·s ratio {fidelity['gpu_mb_seconds_ratio']:.3f} "
                           f"({'within' if fidelity['gpu_mb_seconds_within'] else 'OUTSIDE'} the bar), waited "
                           f"{fidelity['waited_simulated']} simulated vs {fidelity['waited_measured']} measured "
                           f"({'within' if fidelity['waited_within'] else 'OUTSIDE'} the bar)")
        self.console.print("rounds that sized a model by the count planner (dense): " +
                           ", ".join(f"{name} {self.dense_rounds.get(name, 0)}" for name, _, _ in self.models))
        out = {"models": measured, "simulated": sim, "budget_mb": self.budget_gb * 1e3, "sim_vs_measured": fidelity,
               "dense_rounds": {name: self.dense_rounds.get(name, 0) for name, _, _ in self.models}}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "fleet-report.json").write_text(json.dumps(out, indent=2, default=float))
        self.console.print(f"report: {self.run_dir / 'fleet-report.json'}")
        return out

    def _fidelity(self, arrivals: list[np.ndarray]) -> dict[str, Any]:
        """`sim_vs_measured` of the fleet: the fleet planner replayed over the whole run (from the same cold
        start) against what the run held on GPU (MB·s, each model's replicas weighted by its size) and the
        requests the gateway held for a load or a wake, both per model and in all, judged by issue 16's bar."""
        start = min(s.started_at for s in self.per_model.values())
        end = start + self.opts.duration_s
        with urllib.request.urlopen(self.gateway_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        wall0 = time.time() - time.monotonic() + start  # the replay's start, epoch s (registry events' clock)
        events = self.registry.events(count=100_000)
        delays = [d for (name, _, _), t in zip(self.models, arrivals)
                  for d in demand_delays((wall0 + t).tolist(), events, name, window_s=DEMAND_WINDOW_S)]
        actuation = float(np.mean(delays)) if delays else 0.0  # as the single-model check charges its delays
        score = simulate_same_arrivals(self, arrivals, policies=("fleet",), score_after_s=0.0,
                                       actuation_s=actuation)[0]
        by_model: dict[str, Any] = {}
        for j, (name, _, gb) in enumerate(self.models):
            mb_s = gb * 1e3 * replica_seconds(self.gpu_t, self.gpu_n.get(name, []), start, end)
            by_model[name] = judge(mb_s, score.warm_gb_h_by_model[j] * 3.6e6,
                                   gateway_waits_over(text, name, FIDELITY_WAIT_S), score.cold_by_model[j],
                                   quantity="gpu_mb_seconds")
        total = judge(sum(r["gpu_mb_seconds_measured"] for r in by_model.values()), score.warm_gb_h * 3.6e6,
                      sum(r["waited_measured"] for r in by_model.values()), score.cold_requests,
                      quantity="gpu_mb_seconds")
        return total | {"wait_threshold_s": FIDELITY_WAIT_S, "actuation_s": actuation, "demand_delays": summary(delays),
                        "by_model": by_model}


def simulate_same_arrivals(run: FleetUpRun, arrivals: list[np.ndarray], *,
                           policies: tuple[str, ...] = ("keepalive", "hybrid_histogram", "fleet", "oracle"),
                           score_after_s: float | None = None, actuation_s: float = 0.0) -> list[FleetScore]:
    """Keep-alive, hybrid histogram, the fleet planner and the oracle on these arrivals, 10 s steps, scored
    after the first third unless told; every load starts `actuation_s` after its decision or its first request."""
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
    # the catalog's times are the run's measured p95s: charged as they are, not spread again
    env = FleetEnv(catalog=catalog, step_s=BUCKET_S, n_nodes=1, node_gpu_gb=run.budget_gb, node_host_gb=0.0,
                   counts=counts, actuation_s=actuation_s, cold_start_cv=0.0)
    trace = FleetTrace(names, counts, BUCKET_S, "prewarm up --models", "demo")
    knobs: dict[str, float | None] = {"keepalive": 600.0, "hybrid_histogram": None, "fleet": run.budget_gb,
                                      "oracle": None}
    after = run.opts.duration_s / 3 if score_after_s is None else score_after_s
    return [simulate(trace, make_fleet_policy(name, knobs[name], **(fleet_policy_settings(run.settings.planner)
                                                                    if name == "fleet" else {})),
                     env, score_after_s=after) for name in policies]


def run(settings: Settings, opts: UpOptions, n_models: int) -> int:
    up = FleetUpRun(settings, opts, Console(), n_models)
    return run_to_end(up, up.run_fleet())
