"""What `prewarm up` replays: its options, the workload (synthetic or from a trace) and the timeline it samples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from forecasting.data.synthetic import SyntheticWorkload
from forecasting.data.traces import RateTrace, RequestTrace, load_trace


@dataclass(frozen=True)
class UpOptions:
    out_dir: Path
    trace: str | None = None
    duration_s: float = 360.0  # a trace is compressed into this long a replay
    max_rps: float = 6.0  # a trace's mean rate is thinned to this (2 CPU cores serve the demo)
    model_size: str = "tiny"
    days: int = 3  # synthetic workload
    day_s: float = 120.0
    seed: int = 0
    flower: bool = True
    # > 0 with a trace: its first history_s seconds are not replayed but counted into the gateway's counters at
    # their (past) times before the stack starts, as a gateway that had been running would have; the next
    # `duration_s` seconds are replayed uncompressed. The planner then starts with days of history: its daily
    # profile and phase calibration run from its first step (the closed-loop equivalence test uses this)
    history_s: float = 0.0
    # how long each history request is counted in flight (its answer time; the replay's own are measured)
    history_service_s: float = 0.1
    rollout: str | None = None  # "good" | "corrupt": a rollout of a second revision midway (workers/up/rollout.py)
    engine: str = "builtin"  # "vllm": the agents run a real vLLM per replica (workers/up/vllm.py)


@dataclass
class Timeline:
    """One sample a second: what the registry and the replay looked like."""

    t: list[float] = field(default_factory=list)
    serving: list[int] = field(default_factory=list)
    loading: list[int] = field(default_factory=list)
    warm: list[int] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Workload:
    arrivals: np.ndarray  # replay offsets, seconds
    description: str
    batch_cron: str | None = None
    batch_len_s: float = 0.0
    day_s: float | None = None
    history: np.ndarray = field(default_factory=lambda: np.empty(0))  # offsets (< 0) of the counted, unreplayed past


def synthetic(opts: UpOptions, start_epoch: float) -> tuple[Workload, float]:
    """The synthetic workload, its batch job aligned with a cron time; returns it and the start time."""
    period_min = max(1, int(round(opts.day_s / 60)))
    day_s = period_min * 60.0
    # The batch job runs at `*/period * * * *`; pick the day phase so that it falls on a cron time.
    boundary = math.ceil(start_epoch / day_s) * day_s
    batch_at = ((boundary - start_epoch) % day_s) / day_s
    if not 0.45 <= batch_at <= 0.85:
        shift = ((batch_at - 0.6) % 1.0) * day_s  # start later so the job lands at 60% of a day
        start_epoch += shift
        batch_at = ((boundary - start_epoch) % day_s) / day_s
    w = SyntheticWorkload(days=opts.days, day_s=day_s, batch_at=batch_at, seed=opts.seed, night_rps=0.3, peak_rps=4.0,
                          batch_rps=4.0, burst_rps=4.0, generated_tokens=8)
    wl = Workload(w.trace().t, w.describe() + " (SYNTHETIC)", f"*/{period_min} * * * *", w.batch_len * day_s, day_s)
    return wl, start_epoch


def from_trace(opts: UpOptions) -> Workload:
    trace = load_trace(opts.trace or "")
    rng = np.random.default_rng(opts.seed)
    if opts.history_s > 0:
        return _with_history(trace, opts, rng)
    if isinstance(trace, RequestTrace):
        t = trace.t - trace.t[0]
        span = float(t[-1]) if t.size else 0.0
    else:
        assert isinstance(trace, RateTrace)
        counts = rng.poisson(trace.rate * trace.window_s)
        t = np.sort(np.concatenate([s + rng.uniform(0, trace.window_s, n) for s, n in zip(trace.window_start_s, counts)]))
        span = trace.span_s
    time_scale = max(1.0, span / opts.duration_s)
    t = t / time_scale
    mean = t.size / max(1.0, opts.duration_s)
    keep = 1.0 if mean <= opts.max_rps else opts.max_rps / mean
    if keep < 1.0:
        t = t[rng.uniform(size=t.size) < keep]
    desc = f"{trace.source}: time compressed x{time_scale:.1f}, rate scaled x{keep * time_scale:.3g} ({t.size} requests)"
    return Workload(t, desc)


def _with_history(trace: RequestTrace | RateTrace, opts: UpOptions, rng: np.random.Generator) -> Workload:
    """The trace uncompressed: [0, history_s) counted as history, [history_s, + duration_s) replayed."""
    if not isinstance(trace, RequestTrace):
        raise ValueError("--history needs a request-level trace (one timestamp per request), not a rate series")
    t = trace.t - trace.t[0]
    end = opts.history_s + opts.duration_s
    if t.size == 0 or float(t[-1]) < opts.history_s:
        raise ValueError(f"the trace spans {float(t[-1]) if t.size else 0.0:.0f} s: nothing after --history "
                         f"{opts.history_s:.0f} s to replay")
    t = t[t < end] - opts.history_s
    window = t[t >= 0]
    mean = window.size / max(1.0, opts.duration_s)
    keep = 1.0 if mean <= opts.max_rps else opts.max_rps / mean
    if keep < 1.0:
        t = t[rng.uniform(size=t.size) < keep]
    desc = (f"{trace.source}: {opts.history_s:.0f} s of history counted, then {opts.duration_s:.0f} s replayed "
            f"uncompressed, rate scaled x{keep:.3g} ({int((t >= 0).sum())} requests replayed)")
    return Workload(t[t >= 0], desc, history=t[t < 0])
