"""The backtest's rollout scenario: a canary rollout in the middle of a trace, two ways.

A rollout is a third source of cold starts: each step of a weighted shift needs canary
replicas that may not be there yet. This replays a trace with a rollout starting at
`at_s` and compares:

- `rollout_timer`: what Argo Rollouts (or Flagger) with an HPA do. One HPA (`reactive`)
  sizes the model's replicas on the observed load; the weight moves to the next step on a
  timer (every `pause_s`) and, at the same instant, the canary is scaled to its share of
  the replicas and the stable to the rest (Argo's `setCanaryScale` matching the weight,
  with `dynamicStableScale`). The canary's new replicas load while their traffic arrives.
- `rollout_prewarm`: prewarm's rollout. The shipped planner (`prewarm` policy) sizes the
  model; the shipped rollout state machine (`prewarm.policy.rollout.advance`, the one the
  live planner runs) asks for each step's canary replicas a lead ahead, shifts only once
  they are ready and the pause has run, and shrinks the stable revision after the shift.
- `rollout_timer_planned` (the ablation): the timer-driven shift with the planner's sizing
  instead of the HPA's, so the difference to `rollout_prewarm` is the shift waiting for
  capacity a lead ahead, and nothing else.

Both run on a two-pool version of the replay's fluid engine (`simulate._replay_fluid`):
each revision is its own per-second FIFO fluid queue over its share of the arrivals, with
the same cold starts, drains and GPU-time accounting. The good-revision case only: the
rollback path is exercised live (`prewarm up --rollout corrupt`), not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from forecasting.planner import lead_of
from forecasting.sim.interface import Observation, PolicyEnv
from forecasting.sim.policies import Prewarm, Reactive, cold_start_p95
from forecasting.sim.loads import cold_sampler
from forecasting.sim.simulate import _fluid_waits
from forecasting.sim.workload import SimParams, Workload
from prewarm.policy import rollout as rp

ROWS = ("rollout_prewarm", "rollout_timer")
#: The ablation: the timer-driven shift on the planner's sizing, so what waiting for capacity adds shows alone.
ABLATION = "rollout_timer_planned"


@dataclass(frozen=True)
class RolloutScenario:
    at_s: float  # the rollout starts here (trace seconds)
    steps: tuple[int, ...] = (5, 25, 50, 100)
    pause_s: float = 600.0  # each step runs this long

    def __post_init__(self) -> None:
        rp.check_steps(self.steps)
        if not self.pause_s > 0:
            raise ValueError(f"the rollout's pause must be positive, got {self.pause_s:g} s")


@dataclass
class _Pool:
    """One revision's replicas and FIFO fluid queue (the `_replay_fluid` bookkeeping, per pool)."""

    T: int
    per_replica: float  # requests/s one ready replica serves
    service_s: float
    cold: Callable[[], float]
    ready_starts: list[float] = field(default_factory=list)
    loading: list[tuple[float, float]] = field(default_factory=list)
    arriving: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    draining_until: list[float] = field(default_factory=list)
    gpu_s: float = 0.0
    starts: int = 0
    backlog: float = 0.0
    load_acc: float = 0.0
    partial: float = 0.0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.T)
        self.dep = np.zeros(self.T)
        self.live_s = np.zeros(self.T, dtype=np.int64)

    @property
    def live(self) -> int:
        return len(self.ready_starts) + len(self.loading)

    def arrive(self, t: int) -> None:
        self.partial = 0.0
        for item in self.arriving.pop(t, ()):
            if item in self.loading:
                self.loading.remove(item)
                self.ready_starts.append(item[0])
                self.partial += (t + 1) - item[1] - 1.0  # negative: the part of this second still loading

    def scale_to(self, want: int, t: int) -> None:
        live = self.live
        if want > live:
            for _ in range(want - live):
                ready_at = t + self.cold()
                item = (float(t), ready_at)
                self.loading.append(item)
                self.arriving.setdefault(int(ready_at), []).append(item)
                self.starts += 1
        elif want < live:
            remove = live - want
            while remove and self.loading:
                s0, _ = self.loading.pop()
                self.gpu_s += t - s0
                remove -= 1
            for _ in range(min(remove, len(self.ready_starts))):
                s0 = self.ready_starts.pop()
                self.gpu_s += t + self.service_s - s0  # drains: its in-flight requests finish first
                self.draining_until.append(t + self.service_s)

    def serve(self, t: int, arrivals: float) -> None:
        cap = max(0.0, len(self.ready_starts) + self.partial) * self.per_replica
        q = self.backlog + arrivals
        served = min(q, cap)
        self.backlog = q - served
        self.counts[t], self.dep[t] = arrivals, served
        self.load_acc += served * self.service_s + self.backlog
        while self.draining_until and self.draining_until[0] <= t:
            self.draining_until.pop(0)
        self.live_s[t] = self.live + len(self.draining_until)

    def waits(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-cohort waits and weights (`_fluid_waits` layout: parts x seconds)."""
        dep: list[float] = [float(x) for x in self.dep]
        cap = len(self.ready_starts) * self.per_replica
        if self.backlog > 1e-9 and cap > 0:  # the queue left at the end drains at the last capacity
            extra = int(math.ceil(self.backlog / cap))
            dep.extend([cap] * (extra - 1) + [self.backlog - cap * (extra - 1)])
        return _fluid_waits(self.counts, np.asarray(dep), self.T)

    def close(self) -> None:
        self.gpu_s += sum(self.T - s0 for s0 in self.ready_starts) + sum(self.T - s0 for s0, _ in self.loading)


@dataclass(frozen=True, eq=False)
class RolloutRun:
    name: str
    pools: tuple[_Pool, _Pool]  # stable, canary
    weight: np.ndarray  # the canary's weight (percent) each second
    completed_at: float | None  # when 100% had run its pause (None: not within the trace)
    shifts: tuple[tuple[float, int], ...]  # (time, weight) of each shift


def _observation(t: float, pools: tuple[_Pool, _Pool], period: float, since: float, arrivals: float) -> Observation:
    span = t - since
    load = sum(p.load_acc for p in pools)
    return Observation(t, sum(len(p.ready_starts) for p in pools), sum(len(p.loading) for p in pools),
                       load / span if span > 0 else sum(p.backlog for p in pools), arrivals, period)


def replay_rollout(work: Workload, params: SimParams, scenario: RolloutScenario, mode: str,
                   planner_settings: Any = None) -> RolloutRun:
    """Replay `work` with a rollout at `scenario.at_s`; `mode` is `prewarm` or `timer` (see the module doc)."""
    if mode not in ("prewarm", "timer", "timer_planned"):
        raise ValueError(f"rollout mode must be prewarm, timer or timer_planned, got {mode!r}")
    timer = mode.startswith("timer")
    T = int(work.counts.size)
    if not 0 <= scenario.at_s < T:
        raise ValueError(f"--rollout-at {scenario.at_s:g} s is outside the trace (0 to {T} s)")
    rng = np.random.default_rng(params.seed + 1)
    cold = cold_sampler(params, rng)
    S = work.mean_service_s
    stable, canary = (_Pool(T, params.slots / S, S, cold) for _ in range(2))
    pools = (stable, canary)
    env = PolicyEnv(work=work, params=params)
    policy: Prewarm | Reactive = (Prewarm(planner_settings=planner_settings) if planner_settings is not None
                                  else Prewarm()) if mode != "timer" else Reactive()
    for _ in range(policy.start(env)):
        stable.ready_starts.append(0.0)
    period = policy.period_s
    lead = lead_of(policy.params, cold_start_p95(params)) if isinstance(policy, Prewarm) else 0.0
    spec = rp.RolloutSpec(model="trace", stable="stable", canary="canary", steps=scenario.steps,
                          pause_s=scenario.pause_s, logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.0,
                          latency_ratio=1.2, min_requests=1)
    state: rp.RolloutState | None = None
    weight = 0
    weights = np.zeros(T)
    shifts: list[tuple[float, int]] = []
    completed: float | None = None
    next_tick, last_tick, arr_acc = 0.0, 0.0, 0.0
    want_total = stable.live
    for t in range(T):
        for p in pools:
            p.arrive(t)
        if timer and t >= scenario.at_s and completed is None:
            k = min(int((t - scenario.at_s) // scenario.pause_s), len(scenario.steps))
            w = scenario.steps[k] if k < len(scenario.steps) else 100
            if k == len(scenario.steps):
                completed = float(t)
            if w != weight:
                weight = w
                shifts.append((float(t), w))
            if completed is None and t == scenario.at_s + k * scenario.pause_s:  # Argo scales with the weight
                canary.scale_to(rp.share(want_total, weight), t)
                stable.scale_to(rp.share(want_total, 100 - weight), t)
        if t >= next_tick:
            obs = _observation(float(t), pools, period, last_tick, arr_acc)
            for p in pools:
                p.load_acc = 0.0
            arr_acc, last_tick = 0.0, float(t)
            want_total = max(0, int(policy.decide(obs)))
            if timer:
                if completed is not None:
                    canary.scale_to(want_total, t)
                    stable.scale_to(0, t)
                else:
                    canary.scale_to(rp.share(want_total, weight), t)
                    stable.scale_to(rp.share(want_total, 100 - weight) if weight < 100 else 0, t)
            elif t < scenario.at_s:
                stable.scale_to(want_total, t)
            else:
                if state is None:
                    state = rp.start(spec, now=float(t), live_revisions=["stable"], known_revisions=["canary"],
                                     running=None)
                decision, state = rp.advance(state, rp.RolloutObservation(
                    now=float(t), demand_replicas=want_total, lead_s=lead, canary_ready=len(canary.ready_starts)))
                if decision.weight != weight:
                    shifts.append((float(t), decision.weight))
                weight = decision.weight
                if decision.action is rp.RolloutAction.COMPLETE and completed is None:
                    completed = float(t)
                canary.scale_to(decision.canary_replicas, t)
                stable.scale_to(decision.stable_replicas, t)
            next_tick = t + period
        c = float(work.counts[t])
        weights[t] = weight
        canary.serve(t, c * weight / 100.0)
        stable.serve(t, c - c * weight / 100.0)
        arr_acc += c
    for p in pools:
        p.close()
    return RolloutRun(f"rollout_{mode}", pools, weights, completed, tuple(shifts))


def score_rollout(run: RolloutRun, params: SimParams, window: tuple[float, float]) -> dict[str, Any]:
    """Cold-start hits (waits over `params.wait_threshold_s`) in the shift window and overall, and GPU-hours."""
    lo, hi = window
    hits = total = hits_w = total_w = 0.0
    for p in run.pools:
        wait, weight = p.waits()
        sec = np.tile(np.arange(p.T), wait.size // p.T)
        hit = wait > params.wait_threshold_s
        inside = (sec >= lo) & (sec < hi)
        hits += float(weight[hit].sum())
        total += float(weight.sum())
        hits_w += float(weight[hit & inside].sum())
        total_w += float(weight[inside].sum())
    gpu_s = sum(p.gpu_s for p in run.pools)
    live = run.pools[0].live_s + run.pools[1].live_s
    return {
        "cold_start_share": hits_w / total_w if total_w else 0.0,  # during the shift
        "waited_during_shift": round(hits_w, 1),
        "requests_during_shift": round(total_w, 1),
        "cold_start_share_all": hits / total if total else 0.0,
        "gpu_hours": gpu_s / 3600.0,
        "gpu_hours_during_shift": float(live[int(lo):int(hi)].sum()) / 3600.0,
        "cold_starts": int(sum(p.starts for p in run.pools)),
        "completed_at_s": run.completed_at,
        "shifts": [[t, w] for t, w in run.shifts],
    }


def rollout_rows(work: Workload, params: SimParams, scenario: RolloutScenario, *,
                 planner_settings: Any = None, reactive_gpu_hours: float | None = None) -> dict[str, dict[str, Any]]:
    """The backtest rows `rollout_prewarm` and `rollout_timer`, scored over one shift window.

    The window runs from the rollout's start to the later of the two completions (or the
    trace's end), so both are scored on the same requests."""
    runs = {name: replay_rollout(work, params, scenario, name.removeprefix("rollout_"), planner_settings)
            for name in (*ROWS, ABLATION)}
    T = float(work.counts.size)
    end = max((r.completed_at if r.completed_at is not None else T) for r in runs.values())
    window = (scenario.at_s, min(T, end + 1))
    rows = {name: score_rollout(run, params, window) | {"shift_window_s": [window[0], window[1]]}
            for name, run in runs.items()}
    timer = rows["rollout_timer"]
    for row in rows.values():
        row["gpu_hours_vs_reactive"] = row["gpu_hours"] / reactive_gpu_hours if reactive_gpu_hours else None
        row["gpu_hours_vs_rollout_timer"] = row["gpu_hours"] / timer["gpu_hours"] if timer["gpu_hours"] else None
        row["cold_start_share_vs_rollout_timer"] = (row["cold_start_share"] / timer["cold_start_share"]
                                                    if timer["cold_start_share"] else None)
    return rows


def add_rollout_rows(out: dict[str, Any], params: SimParams, at_s: float, steps: str, pause_s: float,
                     planner_settings: Any = None) -> None:
    """Add the rollout rows to a `run_backtest` result (its `work` replayed again, same seed)."""
    try:
        parsed = tuple(int(x) for x in steps.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--rollout-steps {steps!r}: comma-separated whole percents, e.g. 5,25,50,100") from None
    try:
        scenario = RolloutScenario(at_s=at_s, steps=parsed, pause_s=pause_s)
    except rp.InvalidRollout as exc:
        raise ValueError(f"--rollout-steps: {exc}") from None
    result = out["result"]
    reactive = result["policies"].get("reactive", {}).get("gpu_hours")
    rows = rollout_rows(out["work"], params, scenario, planner_settings=planner_settings, reactive_gpu_hours=reactive)
    result["policies"].update(rows)
    result["params"]["rollout"] = {"at_s": at_s, "steps": list(parsed), "pause_s": pause_s,
                                   "engine": "fluid, one queue per revision"}


def print_rollout(result: dict[str, Any]) -> None:
    """The rollout rows as text: waits during the shift and GPU-hours, each against the timer-driven shift."""
    ro = result["params"]["rollout"]
    print(f"rollout at {ro['at_s']:g} s, steps {ro['steps']}, pause {ro['pause_s']:g} s ({ro['engine']}):")
    for name in (*ROWS, ABLATION):
        r = result["policies"][name]
        vs = r["cold_start_share_vs_rollout_timer"]
        vr = r["gpu_hours_vs_reactive"]
        print(f"  {name:<16} waited during the shift {r['waited_during_shift']:>10.0f} of {r['requests_during_shift']:.0f} "
              f"({r['cold_start_share']:.3%}{'' if vs is None else f', {vs:.2f}x the timer'}); "
              f"GPU-h {r['gpu_hours']:.2f} ({r['gpu_hours_vs_rollout_timer']:.2f}x the timer"
              f"{'' if vr is None else f', {vr:.2f}x reactive'}); completed at {r['completed_at_s']}")
