"""What a replay replays: a trace turned into arrivals, service times and the instant need.

Request-level traces keep every request (token counts give each its prefill and service
time; traces without them use configured means, the Azure code trace's by default). Rate
traces become seeded Poisson arrivals within each window. Above a mean rate (50 req/s by
default) arrivals are aggregated per second for the fluid engine of `forecasting.sim.simulate`,
and the workload's notes say so, as they state any time or rate scaling.

The instant-service need (replicas needed each second if every request started on
arrival) is computed here once: the oracle's view, and the yardstick of the warm-cost ratio.
Pure numpy, seeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from forecasting.charges import ACTUATION_S, COLD_START_CV, LOAD_SHARE, WAIT_THRESHOLD_S


#: Azure LLM code trace means (2023-11-16): used when a trace carries no token counts.
AZURE_CODE_MEAN_CONTEXT = 2048.0
AZURE_CODE_MEAN_GENERATED = 28.0
NODE_LOADS = ("ordered", "shared")  # `SimParams.node_loads`


@dataclass(frozen=True)
class SimParams:
    slots: int = 8  # concurrent requests per replica (C)
    prefill_base_s: float = 0.05
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 40.0
    cold_start_s: float = 8.7  # the median-ish scale of a cold start: the mean of its lognormal draw
    # cold starts are lognormal with this coefficient of variation (0: every start takes cold_start_s).
    # 0.3 by default: measured pod starts spread (image cache, disk, node load); a constant flatters a planner
    # that is handed its exact p95
    cold_start_cv: float = COLD_START_CV
    # measured cold starts (s), e.g. a `prewarm up` run's: when given, each start draws one of them (seeded, with
    # replacement) instead of the lognormal
    cold_starts_s: tuple[float, ...] = ()
    # what the planner is told of cold starts: "running" (the p95 of the starts it has seen so far, its default
    # before the first, as the live registry's load_time_p95), or "exact" (the distribution's own p95, the old
    # optimistic yardstick)
    planner_cold_start: str = "running"
    # seconds from a policy's decision until the replicas act on it: the live path's event dispatch beat
    # (workers.schedule.EVENT_DISPATCH_S = 2 s), the Celery queue and the agent's task start. Default: the beat
    # period plus 0.5 s; a `prewarm up` run measures it (see docs/simulator.md)
    actuation_delay_s: float = ACTUATION_S
    # churn: replicas sit on nodes of this many GPUs (packed, lowest node first), and the `load_share` of a cold
    # start that is weight transfer uses the node's load bandwidth (the rest, process start, warmup and
    # validation, is the replica's own). `node_loads` says how a node's concurrent transfers share it:
    # "ordered" (prewarm's runtime: one replica fills the node's snapshot while the others wait for it,
    # `SnapshotStore.fill`, so transfers run one after another) or "shared" (an engine that reads at once, each
    # of k transfers at 1/k speed). The snapshot's own speed-up is not credited by default: a waiting replica pays a
    # whole transfer after the one it waited for, as if it read the original
    gpus_per_node: int = 8
    node_loads: str = "ordered"
    # "ordered" only: credit the node snapshot. Once a node's first transfer has completed, its snapshot exists, and
    # every later transfer on the node (those that waited for the fill, and those started after it) copies from it,
    # at once, in this share of its transfer time (`benchmarks/loader.py`'s snapshot_load_ratio: 0.34 on an H200).
    # None: not credited (the yardsticks' default)
    snapshot_ratio: float | None = None
    # the pool's capacity in replicas (nodes x replica slots): a policy's wish beyond it is not placed, as the
    # live placement drops a scale-up no node has a slot for. None: unbounded
    max_replicas: int | None = None
    load_share: float = LOAD_SHARE
    # whether a scale-down cancels replicas still loading (first) or, as the live executor does (it retires ready
    # replicas only), lets them finish their load, to be retired by a later decision once ready
    cancel_loads: bool = True
    mean_context_tokens: float = AZURE_CODE_MEAN_CONTEXT
    mean_generated_tokens: float = AZURE_CODE_MEAN_GENERATED
    wait_threshold_s: float = WAIT_THRESHOLD_S  # a request that waited longer for capacity is a cold-start hit
    time_scale: float = 1.0  # > 1 compresses the trace in time (rates x time_scale)
    rate_scale: float = 1.0  # multiplies the request rate
    seed: int = 0
    aggregate_above_rps: float = 50.0  # mean rate above which the fluid engine is used
    target_utilization: float = 0.7  # the utilization the reactive baselines aim for

    def __post_init__(self) -> None:
        for name in ("slots", "prefill_tokens_per_s", "decode_tokens_per_s", "cold_start_s", "time_scale", "rate_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimParams.{name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"SimParams.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"SimParams.max_replicas must be >= 1 (or None: unbounded), got {self.max_replicas}")
        if self.node_loads not in NODE_LOADS:
            raise ValueError(f"SimParams.node_loads must be one of {NODE_LOADS}, got {self.node_loads!r}")
        if self.snapshot_ratio is not None and not (0 < self.snapshot_ratio <= 1 and self.node_loads == "ordered"):
            raise ValueError(f"SimParams.snapshot_ratio must be within (0, 1] with node_loads='ordered' (the fill lock; "
                             f"'shared' reads keep no snapshot), got {self.snapshot_ratio} with {self.node_loads!r}")
        if not 0 <= self.load_share <= 1:
            raise ValueError(f"SimParams.load_share must be within [0, 1], got {self.load_share}")
        if self.cold_start_cv < 0:
            raise ValueError(f"SimParams.cold_start_cv must be >= 0, got {self.cold_start_cv}")
        if self.actuation_delay_s < 0:
            raise ValueError(f"SimParams.actuation_delay_s must be >= 0, got {self.actuation_delay_s}")
        if any(not c > 0 for c in self.cold_starts_s):
            raise ValueError(f"SimParams.cold_starts_s must all be > 0, got {self.cold_starts_s}")
        if self.planner_cold_start not in ("running", "exact"):
            raise ValueError(f"SimParams.planner_cold_start must be 'running' or 'exact', got {self.planner_cold_start!r}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"SimParams.target_utilization must be within (0, 1], got {self.target_utilization}")

    def prefill_s(self, context_tokens: np.ndarray | float) -> np.ndarray | float:
        return self.prefill_base_s + np.asarray(context_tokens, dtype=np.float64) / self.prefill_tokens_per_s

    def service_s(self, context_tokens: np.ndarray | float, generated: np.ndarray | float) -> np.ndarray | float:
        return self.prefill_s(context_tokens) + np.asarray(generated, dtype=np.float64) / self.decode_tokens_per_s


@dataclass(frozen=True, eq=False)
class Workload:
    """What every policy replays: arrivals, their service, and the instant-service need."""

    source: str
    duration_s: float
    counts: np.ndarray  # arrivals per second (both engines); policies may read only the past
    need: np.ndarray  # replicas needed per second if every request were served at once (oracle's view)
    mean_prefill_s: float
    mean_service_s: float
    aggregated: bool  # True: the fluid per-second engine
    arrivals: np.ndarray | None = None  # exact engine: arrival seconds, sorted
    prefill: np.ndarray | None = None
    service: np.ndarray | None = None
    notes: tuple[str, ...] = ()
    start_epoch: float = 0.0  # epoch second of t == 0 (calendar features of the forecaster)
    peak: np.ndarray | None = None  # peak requests in flight per second if served at once (what a gateway counts)
    busy: np.ndarray | None = None  # request-seconds in flight in each second, split over the seconds (a gateway's busy time)

    @property
    def n_requests(self) -> float:
        return float(self.counts.sum())


def _instant_peak_exact(arrivals: np.ndarray, service: np.ndarray, seconds: int) -> np.ndarray:
    """Per second, the most requests in flight if every request started on arrival."""
    times = np.concatenate([arrivals, arrivals + service])
    delta = np.concatenate([np.ones(arrivals.size), -np.ones(arrivals.size)])
    order = np.lexsort((delta, times))  # ends before starts at equal times
    times, conc = times[order], np.cumsum(delta[order])
    sec = np.minimum(times.astype(np.int64), seconds - 1)
    peak = np.zeros(seconds)
    np.maximum.at(peak, sec, conc)
    # the level carried into each second from the last event before it
    last = np.full(seconds, np.nan)
    last[sec] = conc  # later events overwrite: the level at the end of each second
    carried = np.concatenate([[0.0], last[:-1]])
    idx = np.where(np.isnan(carried), 0, np.arange(seconds))
    np.maximum.accumulate(idx, out=idx)
    carried = np.nan_to_num(carried[idx])
    return np.maximum(peak, carried)


def _busy_exact(arrivals: np.ndarray, service: np.ndarray, seconds: int) -> np.ndarray:
    """Per second, the request-seconds in flight in it if every request started on arrival: each
    request's time split over the seconds it spans, as the gateway credits its busy counter (the
    integral of requests in flight), not credited at its end. Time past the end falls in the last second."""
    grid = np.arange(seconds + 1, dtype=np.float64)

    def integral(starts: np.ndarray) -> np.ndarray:  # sum over starts < x of (x - start), at each grid x
        s = np.sort(starts)
        n = np.searchsorted(s, grid, side="left")
        below = np.concatenate([[0.0], np.cumsum(s)])[n]
        return n * grid - below

    F = integral(arrivals) - integral(arrivals + service)  # request-seconds in flight before each x
    busy = np.diff(F)
    busy[-1] += float(service.sum()) - F[-1]  # what runs past the end
    return busy


def _instant_peak_fluid(counts: np.ndarray, service_s: float) -> np.ndarray:
    """Per second, in-flight requests = arrivals spread over the service time."""
    whole = int(math.floor(service_s))
    kernel = np.ones(whole + 1)
    kernel[-1] = service_s - whole
    return np.round(np.convolve(counts.astype(np.float64), kernel)[: counts.size], 9)


def build_workload(trace: object, params: SimParams) -> Workload:
    """Turn a `RequestTrace` or `RateTrace` into what the engines replay (seeded, scaled)."""
    work = _build(trace, params)
    return replace(work, start_epoch=float(getattr(trace, "start_epoch", 0.0) or 0.0))


def _build(trace: object, params: SimParams) -> Workload:
    rng = np.random.default_rng(params.seed)
    notes: list[str] = []
    if params.time_scale != 1.0:
        notes.append(f"time compressed x{params.time_scale:g} (rates x{params.time_scale:g})")
    if params.rate_scale != 1.0:
        notes.append(f"rate scaled x{params.rate_scale:g}")
    source = str(getattr(trace, "source", "trace"))
    if hasattr(trace, "t"):  # a RequestTrace
        t = np.asarray(trace.t, dtype=np.float64)
        t = (t - t[0]) / params.time_scale
        ctx = getattr(trace, "context_tokens", None)
        gen = getattr(trace, "generated_tokens", None)
        ctx = np.full(t.size, params.mean_context_tokens) if ctx is None else np.asarray(ctx, dtype=np.float64)
        gen = np.full(t.size, params.mean_generated_tokens) if gen is None else np.asarray(gen, dtype=np.float64)
        if getattr(trace, "context_tokens", None) is None:
            notes.append(f"no token counts: means {params.mean_context_tokens:g}/{params.mean_generated_tokens:g} used")
        if params.rate_scale != 1.0:
            t, ctx, gen = _rescale_requests(t, ctx, gen, params.rate_scale, rng)
        duration = float(math.ceil(t[-1] + 1e-9)) if t.size else 1.0
        prefill = np.asarray(params.prefill_s(ctx))
        service = np.asarray(params.service_s(ctx, gen))
        mean_rate = t.size / max(duration, 1.0)
        if mean_rate <= params.aggregate_above_rps:
            return _exact(source, duration, t, prefill, service, params, notes)
        notes.append(f"mean rate {mean_rate:.0f} req/s > {params.aggregate_above_rps:g}: arrivals aggregated per second (fluid engine)")
        counts = np.bincount(np.minimum(t.astype(np.int64), int(duration) - 1), minlength=int(duration)).astype(np.float64)
        return _fluid(source, duration, counts, float(prefill.mean()), float(service.mean()), params, notes)
    # a RateTrace: rate per window
    starts = np.asarray(trace.window_start_s, dtype=np.float64) / params.time_scale  # type: ignore[attr-defined]
    window = float(trace.window_s) / params.time_scale  # type: ignore[attr-defined]
    rate = np.asarray(trace.rate, dtype=np.float64) * params.time_scale * params.rate_scale  # type: ignore[attr-defined]
    duration = float(math.ceil(starts[-1] + window))
    prefill_m = float(params.prefill_s(params.mean_context_tokens))
    service_m = float(params.service_s(params.mean_context_tokens, params.mean_generated_tokens))
    notes.append(f"rate trace: seeded Poisson arrivals per window (seed {params.seed}); "
                 f"token means {params.mean_context_tokens:g}/{params.mean_generated_tokens:g}")
    mean_rate = float((rate * window).sum() / max(duration, 1.0))
    if mean_rate <= params.aggregate_above_rps:
        n = rng.poisson(rate * window)
        t = np.sort(np.repeat(starts, n) + rng.random(int(n.sum())) * window)
        return _exact(source, duration, t, np.full(t.size, prefill_m), np.full(t.size, service_m), params, notes)
    # per-second Poisson counts with the window's rate
    sec_starts = np.arange(int(duration), dtype=np.float64)
    widx = np.clip(np.searchsorted(starts, sec_starts, side="right") - 1, 0, rate.size - 1)
    counts = rng.poisson(rate[widx]).astype(np.float64)
    notes.append(f"mean rate {mean_rate:.0f} req/s > {params.aggregate_above_rps:g}: arrivals aggregated per second (fluid engine)")
    return _fluid(source, duration, counts, prefill_m, service_m, params, notes)


def _rescale_requests(t: np.ndarray, ctx: np.ndarray, gen: np.ndarray, scale: float,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin (scale < 1) or replicate with 0-1 s jitter (scale > 1) the requests, seeded."""
    copies = np.floor(scale) + (rng.random(t.size) < (scale - np.floor(scale)))
    copies = copies.astype(np.int64)
    idx = np.repeat(np.arange(t.size), copies)
    first = np.concatenate([[0], np.cumsum(copies)[:-1]])
    jitter = rng.random(idx.size)
    jitter[first[copies > 0]] = 0.0  # the original keeps its time
    nt = t[idx] + jitter
    order = np.argsort(nt, kind="stable")
    return nt[order], ctx[idx][order], gen[idx][order]


def _exact(source: str, duration: float, t: np.ndarray, prefill: np.ndarray, service: np.ndarray,
           params: SimParams, notes: list[str]) -> Workload:
    seconds = int(duration)
    counts = np.bincount(np.minimum(t.astype(np.int64), seconds - 1), minlength=seconds).astype(np.float64)
    peak = _instant_peak_exact(t, service, seconds)
    need = np.ceil(peak / params.slots).astype(np.int64)
    busy = _busy_exact(t, service, seconds)
    return Workload(source, duration, counts, need, float(prefill.mean()), float(service.mean()), False,
                    t, prefill, service, tuple(notes), peak=peak, busy=busy)


def _fluid(source: str, duration: float, counts: np.ndarray, prefill_m: float, service_m: float,
           params: SimParams, notes: list[str]) -> Workload:
    peak = _instant_peak_fluid(counts, service_m)
    need = np.ceil(peak / params.slots).astype(np.int64)
    busy = peak  # each second's arrivals spread over the service time: the request-seconds in each second
    return Workload(source, duration, counts, need, prefill_m, service_m, True, notes=tuple(notes), peak=peak,
                    busy=busy)
