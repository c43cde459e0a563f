"""The multi-model backtest: every policy on the same arrivals, its knob swept into a curve.

`run_fleet_backtest` builds the fleet (catalog, nodes sized so their GPU memory cannot hold
every model), replays the trace through each policy at its default setting, sweeps each
policy's knob (keep-alive seconds, the histogram's tail percentile, the planner's budget)
into a curve of cold-start share against warm GPU-memory-time, and reports the target
comparison: the fleet planner at its cold-start budget against the hybrid histogram (its
waits and its memory-time, each as they are). `at_equal` reads every
policy's curve (the sleep-enabled baselines' too) at the planner's point, both ways.
Rate traces become seeded Poisson counts per step (`FleetSetup.poisson`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from forecasting.charges import ACTUATION_S, COLD_START_CV, LOAD_SHARE
from forecasting.curves import at_equal_share
from forecasting.fleet.capacity import throughput_gb
from forecasting.fleet.catalog import Catalog, default_catalog
from forecasting.fleet.policies import FLEET_POLICIES, FleetEnv, make_fleet_policy
from forecasting.fleet.simulate import FleetScore, simulate
from forecasting.fleet.traces import FleetTrace
from forecasting.parallel import check_jobs, run_all

#: Each policy's knob values for the curve.
KEEPALIVE_S = (60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0, 4 * 3600.0)
HH_TAIL_PCT = (50.0, 75.0, 90.0, 95.0, 99.0, 99.9)
#: The planner's memory budgets (its curve's points with one: the price steered by it, not by the cold-start budget):
#: reactive's average warm GB plus these shares of the hybrid histogram's extra over it.
FLEET_BUDGET_SHARE = (0.25, 0.5, 0.75, 1.0, 1.5)
#: The HPA targets each baseline's curve also sweeps, at its default knob: more replicas of its busy models for
#: fewer requests waiting for a slot (the planner's dense models are sized by its cold-start budget instead).
HPA_TARGETS = (0.5, 0.35, 0.25)
#: The cold-start budgets the planner's curve also sweeps, without a memory budget: what its dense models are sized on
#: and its memory price is steered by (the baselines' HPA target, the planner's budget: each side's own knob).
COLD_START_BUDGETS = (0.0003, 0.003, 0.01)


def resample(trace: FleetTrace, step_s: float) -> FleetTrace:
    """The same trace on a finer step (requests spread evenly) or a coarser one (summed)."""
    if math.isclose(step_s, trace.step_s):
        return trace
    if trace.step_s > step_s:
        k = int(round(trace.step_s / step_s))
        if not math.isclose(k * step_s, trace.step_s):
            raise ValueError(f"step {step_s} s does not divide the trace's {trace.step_s} s")
        counts = np.repeat(trace.counts / k, k, axis=0)
    else:
        k = int(round(step_s / trace.step_s))
        n = trace.n_steps // k * k
        counts = trace.counts[:n].reshape(-1, k, trace.n_models).sum(axis=1)
    return replace(trace, counts=counts, step_s=float(step_s))


@dataclass(frozen=True)
class FleetSetup:
    """The fleet a backtest runs on: nodes and their memory, sized from the catalog when not given."""

    # 0: enough nodes of ``node_gpu_gb`` for ``capacity_share`` of all footprints, plus the replicas beyond each
    # model's first that its busiest steps need (`forecasting.fleet.capacity.throughput_gb`)
    n_nodes: int = 0
    node_gpu_gb: float = 640.0
    node_host_gb: float = 1024.0
    capacity_share: float = 0.4
    # the share of a model's steps whose rate the pool is sized to serve (its replicas beyond the first, at the HPA's
    # target): high enough that the pool holds a busy model's ordinary peaks, not so high that one step's outlier sizes it
    throughput_quantile: float = 0.99
    step_s: float = 60.0
    score_after_s: float = 86_400.0
    sizes_gb: tuple[float, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    # rate traces (per-client windows) become seeded Poisson counts per step, so no model's idle times are
    # exact multiples of a window (False: the window's mean spread evenly, the old yardstick)
    poisson: bool = True
    seed: int = 0
    sleep_share: float = 0.75  # host memory share for sleeping models (planner and sleep baselines alike)
    sleep_gbps: float = 1.75  # the copy to host memory when a model is put to sleep (docs/fleet.md)
    planner: Mapping[str, Any] = field(default_factory=dict)  # the fleet policy's round settings (the live planner's)
    # what the replay charges as the single-model replay does (`forecasting.charges`; the same flags)
    actuation_s: float = ACTUATION_S
    cold_start_cv: float = COLD_START_CV
    load_share: float = LOAD_SHARE

    def __post_init__(self) -> None:
        if not 0 <= self.sleep_share <= 1:
            raise ValueError(f"sleep_share must be within [0, 1], got {self.sleep_share}")
        if not 0 < self.throughput_quantile <= 1:
            raise ValueError(f"throughput_quantile must be within (0, 1], got {self.throughput_quantile}")
        if not self.sleep_gbps > 0:
            raise ValueError(f"sleep_gbps must be > 0, got {self.sleep_gbps}")
        if self.actuation_s < 0 or self.cold_start_cv < 0 or not 0 <= self.load_share <= 1:
            raise ValueError(f"actuation_s and cold_start_cv must be >= 0 and load_share within [0, 1], got "
                             f"{self.actuation_s}, {self.cold_start_cv}, {self.load_share}")

    def env(self, catalog: Catalog, counts: np.ndarray | None) -> FleetEnv:
        gb = self.capacity_share * catalog.total_gb()
        if counts is not None:  # the busy models' replicas beyond their first fit on top: tiers stay the question
            gb += throughput_gb(catalog.mem_array, catalog.capacity_array, counts, self.step_s,
                                target=FleetEnv.hpa_target, q=self.throughput_quantile)
        n = self.n_nodes or max(1, int(math.ceil(gb / self.node_gpu_gb)))
        return FleetEnv(catalog=catalog, step_s=self.step_s, n_nodes=n, node_gpu_gb=self.node_gpu_gb,
                        node_host_gb=self.node_host_gb, counts=counts, sleep_share=self.sleep_share,
                        sleep_gbps=self.sleep_gbps, actuation_s=self.actuation_s, cold_start_cv=self.cold_start_cv,
                        load_share=self.load_share, seed=self.seed)


#: One replay of the backtest: (policy, knob, HPA target, cold-start budget); None: the policy's default.
Run = tuple[str, float | None, float | None, float | None]


def _label(run: Run) -> str:
    name, knob, hpa_target, cold_start_budget = run
    return (f"{name}{'' if knob is None else f' {knob}'}{'' if hpa_target is None else f' hpa {hpa_target}'}"
            f"{'' if cold_start_budget is None else f' cold-start budget {cold_start_budget}'}")


def _replay(shared: tuple[FleetTrace, FleetEnv, FleetSetup], run: Run) -> FleetScore:
    """One replay (`forecasting.parallel.run_all`'s function: module-level, so a process can import it)."""
    trace, env, setup = shared
    name, knob, hpa_target, cold_start_budget = run
    kw = dict(setup.planner) if name == "fleet" else {}
    if cold_start_budget is not None:
        kw["cold_start_budget"] = cold_start_budget
    policy = make_fleet_policy(name, knob, hpa_target=hpa_target, **kw)
    score = simulate(trace, policy, env, score_after_s=min(setup.score_after_s, trace.duration_s / 2))
    return replace(score, knob=knob, cold_start_budget=policy.cold_start_budget)


def run_fleet_backtest(trace: FleetTrace, *, catalog: Catalog | None = None, setup: FleetSetup = FleetSetup(),
                       policies: Sequence[str] = FLEET_POLICIES, curve: bool = True,
                       progress: Callable[[str], None] | None = None,
                       knobs: Mapping[str, Sequence[float]] | None = None,
                       hpa_targets: Sequence[float] = HPA_TARGETS,
                       cold_start_budgets: Sequence[float] = COLD_START_BUDGETS, jobs: int = 1) -> dict[str, Any]:
    """Every policy on ``trace``; the curve over knobs; the target comparison against the hybrid histogram.

    ``knobs`` replaces the curve's settings per policy (the planner's as shares of the
    hybrid histogram's extra warm memory over reactive's, as `FLEET_BUDGET_SHARE`); each
    baseline's curve also has its default at each of ``hpa_targets``, the planner's at each of
    ``cold_start_budgets`` (no memory budget: the cold-start budget steers its memory price too).

    The planner's row runs on its cold-start budget alone, as it runs live without a memory budget:
    its dense models' counts and the price of every other model's warmth are both steered by it
    (`forecasting.fleet.planner.steer`); its memory-time is what that costs, compared with the
    hybrid histogram's as it is (``within_budget``: not above it).

    The replays run in up to ``jobs`` processes (`forecasting.parallel`), the same figures as in one; ``progress``
    is told each replay as it starts (one job) or ends (several)."""
    check_jobs(jobs)
    trace = resample(trace, setup.step_s)
    if setup.poisson and trace.kind == "client_rates":
        rng = np.random.default_rng(setup.seed)
        trace = replace(trace, counts=rng.poisson(trace.counts).astype(np.float64))
    if catalog is None:
        catalog = default_catalog(trace.names, setup.sizes_gb) if setup.sizes_gb else default_catalog(trace.names)
    env = setup.env(catalog, trace.counts)
    shared = (trace, env, setup)

    def replays(runs: Sequence[Run]) -> list[FleetScore]:
        if jobs > 1:
            return run_all(_replay, shared, runs, jobs, done=None if progress is None else
                           lambda r: progress(f"{_label(r)}: done"))
        out = []
        for r in runs:  # in this process, each told as it starts
            if progress is not None:
                progress(_label(r))
            out.append(_replay(shared, r))
        return out

    # the defaults first (the curve's planner points are read from reactive's and the hybrid histogram's)
    first = [name for name in policies if name != "fleet"]
    first += [name for name in ("hybrid_histogram", "reactive") if name not in first and (curve or name != "reactive")]
    first += ["fleet"] if "fleet" in policies else []
    done = dict(zip(first, replays([(name, None, None, None) for name in first])))
    rows: dict[str, FleetScore] = {name: done[name] for name in policies if name != "fleet"}
    hh = done["hybrid_histogram"]
    target: dict[str, Any] = {}
    if "fleet" in policies:
        fleet = done["fleet"]
        rows["fleet"] = fleet
        target = {
            "cold_start_budget": fleet.cold_start_budget,
            "hybrid_cold_share": hh.cold_share, "fleet_cold_share": fleet.cold_share,
            "cold_ratio": fleet.cold_share / hh.cold_share if hh.cold_share > 0 else float("nan"),
            "hybrid_warm_gb_h": hh.warm_gb_h, "fleet_warm_gb_h": fleet.warm_gb_h,
            "within_budget": bool(fleet.warm_gb_h <= hh.warm_gb_h * 1.0001),
            "met": bool(fleet.warm_gb_h <= hh.warm_gb_h * 1.0001 and fleet.cold_share <= 0.5 * hh.cold_share),
        }
    curves: dict[str, list[dict[str, Any]]] = {}
    if curve:
        floor = done["reactive"].avg_warm_gb
        chosen: dict[str, Sequence[float]] = {
            "keepalive": KEEPALIVE_S, "hybrid_histogram": HH_TAIL_PCT,
            "keepalive_sleep": KEEPALIVE_S, "hybrid_histogram_sleep": HH_TAIL_PCT, "fleet": FLEET_BUDGET_SHARE,
        } | dict(knobs or {})
        extra = max(hh.avg_warm_gb - floor, 0.05 * hh.avg_warm_gb)
        chosen["fleet"] = tuple(floor + s * extra for s in chosen["fleet"])
        points: dict[str, list[Run]] = {}
        for name, values in chosen.items():
            if name in policies:
                points[name] = [(name, v, None, None) for v in values]
                points[name] += [(name, None, h, None) for h in hpa_targets] if name != "fleet" else \
                    [(name, None, None, b) for b in cold_start_budgets]
        scores = iter(replays([r for runs in points.values() for r in runs]))
        curves = {name: [next(scores).row() for _ in runs] for name, runs in points.items()}
    return {
        "trace": trace.source, "kind": trace.kind, "models": trace.n_models, "steps": trace.n_steps,
        "step_s": trace.step_s, "requests": trace.total_requests,
        "fleet": {"nodes": env.n_nodes, "node_gpu_gb": env.node_gpu_gb, "gpu_capacity_gb": env.gpu_capacity_gb,
                  "all_models_gb": catalog.total_gb(), "node_host_gb": env.node_host_gb},
        "score_after_s": min(setup.score_after_s, trace.duration_s / 2),
        "poisson_counts": bool(setup.poisson and trace.kind == "client_rates"),
        "charges": {"actuation_s": env.actuation_s, "cold_start_cv": env.cold_start_cv, "load_share": env.load_share},
        "rows": [r.row() for r in rows.values()], "target": target, "curves": curves,
        "at_equal": equal_points(rows, curves),
    }


def equal_points(rows: Mapping[str, FleetScore], curves: Mapping[str, Sequence[Mapping[str, Any]]],
                 anchor: str = "fleet") -> dict[str, Any]:
    """Every policy on its curve (default included) at the planner's default point, both ways: its cold
    share at the planner's warm GB·h, and its warm GB·h at the planner's cold share (None outside its curve)."""
    base = rows.get(anchor)
    out: dict[str, Any] = {"anchor": anchor, "warm_gb_h": None, "cold_share": None,
                           "cold_share_at_equal_warm_gb_h": {}, "warm_gb_h_at_equal_cold_share": {}}
    if base is None:
        return out
    out["warm_gb_h"], out["cold_share"] = base.warm_gb_h, base.cold_share
    for name, r in rows.items():
        pts = [r.row(), *curves.get(name, ())]
        same = name == anchor
        out["cold_share_at_equal_warm_gb_h"][name] = base.cold_share if same else at_equal_share(
            pts, base.warm_gb_h, x="warm_gb_h", y="cold_share")
        out["warm_gb_h_at_equal_cold_share"][name] = base.warm_gb_h if same else at_equal_share(
            pts, base.cold_share, x="cold_share", y="warm_gb_h")
    return out
