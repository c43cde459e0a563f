"""Score every policy on one trace: TTFT percentiles, cold-start hits, GPU-hours, ratios.

`run_backtest` replays the same `Workload` (same seeded arrivals) through each policy and
reduces each `PolicyRun` to the figures `prewarm backtest` prints. Pure computation; the
CLI does the printing and `forecasting.sim.report` the plotting.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from forecasting.curves import at_equal_share, sweep_summary  # noqa: F401  (re-exported)
from forecasting.curves import foresight, weighted_quantile
from forecasting.budget import warm_cost
from forecasting.parallel import check_jobs, run_all
from forecasting.planner import PlannerParams
from forecasting.sim.policies import KNOWN, POLICIES, Prewarm, make_policy
from forecasting.sim.simulate import PolicyRun, SimParams, Workload, build_workload, replay


def score(run: PolicyRun, work: Workload, params: SimParams, after_s: float = 0.0) -> dict[str, float | int]:
    """The figures of one run; with `after_s`, only requests arriving (and GPU time) after it."""
    if after_s > 0:
        run, work = _after(run, work, after_s)
    w = run.weight
    total = float(w.sum()) if w is not None else float(run.wait.size)
    hits = float(w[run.wait > params.wait_threshold_s].sum()) if w is not None else float(
        (run.wait > params.wait_threshold_s).sum())
    live = run.live.astype(np.float64)
    need = work.need[: live.size].astype(np.float64)
    return {
        "ttft_p50_s": weighted_quantile(run.ttft, w, 0.5),
        "ttft_p99_s": weighted_quantile(run.ttft, w, 0.99),
        "ttft_p999_s": weighted_quantile(run.ttft, w, 0.999),
        "cold_start_share": hits / total if total else 0.0,
        "gpu_hours": run.gpu_s / 3600.0,
        "warm_cost_ratio": warm_cost(live, need),
        "cold_starts": int(run.starts),
    }


def _after(run: PolicyRun, work: Workload, after_s: float) -> tuple[PolicyRun, Workload]:
    """The run and workload restricted to time >= after_s (a warm-up excluded for every policy)."""
    from dataclasses import replace

    cut = int(after_s)
    if cut >= run.live.size:
        raise ValueError(f"--score-after {after_s:g} s is beyond the trace ({run.live.size} s)")
    if run.weight is None:
        assert work.arrivals is not None
        keep = work.arrivals >= after_s
        weight = None
    else:
        seconds = work.counts.size
        parts = run.wait.size // seconds
        keep = np.tile(np.arange(seconds) >= cut, parts)
        weight = run.weight[keep]
    live = run.live[cut:]
    sub = replace(run, ttft=run.ttft[keep], wait=run.wait[keep], weight=weight, live=live,
                  gpu_s=float(live.sum()))  # GPU time from the per-second replica count
    return sub, replace(work, need=work.need[cut:])


def _policy_run(shared: tuple[Workload, SimParams, Mapping[str, Mapping[str, Any]], float], name: str,
                progress: Callable[[str, float], None] | None = None) -> tuple[PolicyRun, dict[str, Any]]:
    """One policy's replay and its scores (`forecasting.parallel.run_all`'s function: module-level)."""
    import time

    work, params, policy_kwargs, score_after_s = shared
    t0 = time.perf_counter()
    cb = (lambda f, n=name: progress(n, f)) if progress is not None else None
    policy = make_policy(name, **policy_kwargs.get(name, {}))
    run = replay(work, policy, params, cb)
    scores: dict[str, Any] = score(run, work, params, score_after_s) | {"replay_s": round(time.perf_counter() - t0, 3)}
    if isinstance(policy, Prewarm):
        scores |= {"planner_modes": dict(policy.modes), "cold_start_budget": policy.params.cold_start_budget,
                   "margin_final": policy.state.margin}
    return run, scores


def run_backtest(trace: Any, params: SimParams, policies: Sequence[str] = POLICIES,
                 progress: Callable[[str, float], None] | None = None,
                 policy_kwargs: dict[str, dict[str, Any]] | None = None, score_after_s: float = 0.0,
                 jobs: int = 1) -> dict[str, Any]:
    """Replay `trace` under each policy; the JSON-ready result `prewarm backtest` prints. The policies replay in up
    to ``jobs`` processes (`forecasting.parallel`: the same figures as in one); ``progress`` follows each replay (one
    job) or is told each as it ends (several)."""
    check_jobs(jobs)
    unknown = [p for p in policies if p not in KNOWN]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(KNOWN)}")
    work = build_workload(trace, params)
    shared = (work, params, policy_kwargs or {}, score_after_s)
    if jobs > 1:
        done = run_all(_policy_run, shared, list(policies), jobs,
                       done=None if progress is None else lambda name: progress(name, 1.0))
    else:
        done = [_policy_run(shared, name, progress) for name in policies]
    runs: dict[str, PolicyRun] = {name: run for name, (run, _) in zip(policies, done)}
    scores: dict[str, dict[str, Any]] = {name: s for name, (_, s) in zip(policies, done)}
    for name, s in scores.items():
        for ref in ("reactive", "oracle"):
            base = scores.get(ref, {}).get("gpu_hours")
            s[f"gpu_hours_vs_{ref}"] = s["gpu_hours"] / base if base else None
    rows = []
    for name, s in scores.items():
        knob, value = default_knob(name)
        r = row(name, s, knob, s.get("cold_start_budget", value) if knob == "cold_start_budget" else value, True)
        r["gpu_hours_vs_reactive"] = s["gpu_hours_vs_reactive"]
        rows.append(r)
    out = {
        "trace": work.source,
        "params": asdict(params) | {
            "engine": "fluid (per-second aggregate)" if work.aggregated else "exact (every request)",
            "duration_s": work.duration_s,
            "scored_after_s": score_after_s,
            "requests": work.n_requests,
            "mean_service_s": round(work.mean_service_s, 4),
            "notes": list(work.notes),
        },
        "policies": scores,
        "rows": rows,
    }
    return {"result": out, "runs": runs, "work": work}


#: Each policy's knob for `prewarm backtest --sweep`: (keyword, values, the default value).
#: prewarm's is its cold-start budget (the share of requests that may wait for capacity, which its margin
#: calibrates on; the default is the planner setting's); reactive_sized's its square-root staffing margin
#: (the planner's queue_beta: 1.5). The baselines' curves reach far past their defaults (reactive's target 0.2,
#: reactive_sized's beta 9-16): at a 60 s cold start their defaults wait 10-100x prewarm's share, and a curve that
#: stops short of prewarm's share leaves the equal-share reading blank (m-large, 2 days: reactive_sized reaches
#: 0.11% only at beta 12, reactive 0.11% only at target 0.5).
SWEEP_KNOBS: dict[str, tuple[str, tuple[float, ...], float]] = {
    "reactive": ("target", (0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9), 0.7),
    "reactive_sized": ("queue_beta", (0.5, 1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 12.0, 16.0), 1.5),
    "fixed_pool": ("percent", (5.0, 10.0, 25.0, 50.0), 10.0),
    "keepalive": ("fixed_keepalive_s", (600.0, 1800.0, 3600.0, 14400.0), 14400.0),
    "prewarm": ("cold_start_budget", (0.00003, 0.0001, 0.0003, 0.001, 0.003), PlannerParams().cold_start_budget),
    "prewarm_fixed_margin": ("margin", (1.5, 3.0, 6.0, 9.0, 12.0, 16.0), PlannerParams().margin_initial),
}


def row(policy: str, s: Mapping[str, Any], knob: str, value: float, default: bool) -> dict[str, Any]:
    """One row of the output contract: {policy, knob, value, default, gpu_hours, gpu_hours_vs_reactive,
    cold_start_share, ttft_p99_s, starts} (gpu_hours_vs_reactive filled in once reactive's default is known);
    a policy swept over its cold-start budget also carries `cold_start_budget` (the budget in force)."""
    extra = {"cold_start_budget": value} if knob == "cold_start_budget" else {}
    return extra | {"policy": policy, "knob": knob, "value": value, "default": default, "gpu_hours": s["gpu_hours"],
            "gpu_hours_vs_reactive": None, "cold_start_share": s["cold_start_share"], "ttft_p99_s": s["ttft_p99_s"],
            "starts": int(s["cold_starts"])}


def default_knob(policy: str, knobs: Mapping[str, tuple[str, tuple[float, ...], float]] | None = None) -> tuple[str, float]:
    """The policy's knob and its default value ("" and nan for a policy without one, the oracle)."""
    knob, _, default = (SWEEP_KNOBS if knobs is None else knobs).get(policy, ("", (), float("nan")))
    return knob, default


def _sweep_point(shared: tuple[Workload, SimParams, Mapping[str, Mapping[str, Any]]],
                 setting: tuple[str, str, float, bool], progress: Callable[[str, float], None] | None = None
                 ) -> dict[str, Any]:
    """One policy at one knob value, scored (`forecasting.parallel.run_all`'s function: module-level)."""
    work, params, policy_kwargs = shared
    name, knob, v, _ = setting
    kw = dict(policy_kwargs.get(name, {}))
    if knob:
        kw[knob] = v
    cb = (lambda f, n=f"{name} {knob}={v:g}": progress(n, f)) if progress is not None else None
    return score(replay(work, make_policy(name, **kw), params, cb), work, params)


def run_sweep(trace: Any, params: SimParams, policies: Sequence[str] = POLICIES,
              knobs: dict[str, tuple[str, tuple[float, ...], float]] | None = None,
              policy_kwargs: dict[str, dict[str, Any]] | None = None,
              progress: Callable[[str, float], None] | None = None, jobs: int = 1) -> dict[str, Any]:
    """Each policy over its knob on one workload: GPU-hours and cold-start hits per setting.

    Returns `{"trace", "reactive_gpu_hours", "rows", "points", "at_equal_cold_start_share", "foresight"}`:
    `points` holds every setting ({policy, knob, value, default, gpu_hours, gpu_hours_vs_reactive,
    cold_start_share, ttft_p99_s, starts}), `rows` the defaults, `at_equal_cold_start_share`
    each policy's GPU-hours vs reactive on its curve at prewarm's default cold-start share, and
    `foresight` the oracle's against `reactive_sized`'s there (`forecasting.curves.foresight`).
    The oracle is one point. The settings replay in up to ``jobs`` processes (`forecasting.parallel`: the same
    figures as in one); ``progress`` follows each replay (one job) or is told each as it ends (several).
    """
    check_jobs(jobs)
    knobs = SWEEP_KNOBS if knobs is None else knobs
    work = build_workload(trace, params)
    settings: list[tuple[str, str, float, bool]] = []  # (policy, knob, value, default)
    for name in policies:
        knob, values, default = knobs.get(name, ("", (float("nan"),), float("nan")))
        settings += [(name, knob, v, bool(v == default or not knob)) for v in values]
    shared = (work, params, policy_kwargs or {})
    if jobs > 1:
        scores = run_all(_sweep_point, shared, settings, jobs,
                         done=None if progress is None else lambda s: progress(f"{s[0]} {s[1]}={s[2]:g}", 1.0))
    else:
        scores = [_sweep_point(shared, s, progress) for s in settings]
    base_gpu: float | None = None
    points: list[dict[str, Any]] = []
    for (name, knob, v, default), s in zip(settings, scores):
        if name == "reactive" and default:
            base_gpu = s["gpu_hours"]
        points.append(row(name, s, knob, v, default))
    if base_gpu is None:
        base_gpu = score(replay(work, make_policy("reactive"), params), work, params)["gpu_hours"]
    for pt in points:
        pt["gpu_hours_vs_reactive"] = pt["gpu_hours"] / base_gpu if base_gpu else None
    summary = sweep_summary(points)
    return {"trace": work.source, "params": asdict(params) | {"engine": "fluid" if work.aggregated else "exact"},
            "reactive_gpu_hours": base_gpu, "rows": [p for p in points if p["default"]],
            "points": points, "at_equal_cold_start_share": summary, "foresight": foresight(points, summary)}
