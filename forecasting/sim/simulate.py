"""Trace replay: one replica model, every scaling policy, so their costs compare honestly.

A replica has C concurrent slots. A request waits (FIFO) for a free slot on a ready replica;
its time to first token (TTFT) is that wait plus a prefill (a base + context tokens ÷
prefill rate), and it holds its slot for the prefill plus generated tokens ÷ decode rate.
A new replica takes a cold start (a seeded lognormal draw, or a measured one) before it serves.
GPU time runs from the start of a replica's load to its retirement; a draining replica
takes no new request and retires when its last one finishes.

Two engines, the same model:
- `exact`: a discrete-event replay of every request (request-level traces, and rate traces
  with low rates, whose windows become seeded Poisson arrivals);
- `fluid`: for high rates (default above 50 req/s on average) arrivals are aggregated per
  second (seeded Poisson counts) and served by a per-second FIFO fluid queue whose capacity
  is ready replicas x C / mean service time; waits come from the cumulative arrival and
  departure curves. With hundreds of slots the law of large numbers makes this accurate, and
  14 days at 2,000 req/s replay in seconds. The output says when it was used.

Policies (`forecasting.sim.policies`) only choose how many replicas should be live; the engine
carries that out identically for all, `actuation_delay_s` after the decision (the live
dispatch beat, queue and agent): start replicas (their loads are charged by
`forecasting.sim.loads`: drawn cold starts, a node's load bandwidth shared by concurrent
loads), cancel loading ones first, then drain the least busy ready ones. Each decision
sees the p95 of the cold starts completed so far, as the live registry measures it.
What is charged and why: docs/simulator.md.

Workloads are built by `forecasting.sim.workload`; `forecasting.sim.scoring` runs this over policies.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from forecasting.sim.interface import Observation, Policy, PolicyEnv
from forecasting.sim.loads import LoadBank
from forecasting.sim.workload import (  # noqa: F401  (re-exported: the replay's inputs)
    AZURE_CODE_MEAN_CONTEXT,
    AZURE_CODE_MEAN_GENERATED,
    SimParams,
    Workload,
    build_workload,
)

@dataclass(frozen=True, eq=False)
class PolicyRun:
    """One policy's replay: per-request (or per-cohort) TTFTs and waits, GPU time, timeline."""

    policy: str
    ttft: np.ndarray
    wait: np.ndarray
    weight: np.ndarray | None  # fluid engine: requests per cohort; None: one per request
    gpu_s: float
    live: np.ndarray  # replicas holding a GPU (loading, ready, draining) at each second's start
    starts: int  # replicas started (cold starts paid)


@dataclass
class _Replicas:
    """Replica bookkeeping of the exact engine: states, requests in flight, GPU time (loads: `LoadBank`)."""

    bank: LoadBank
    start: list[float] = field(default_factory=list)
    state: list[int] = field(default_factory=list)  # 0 loading, 1 ready, 2 draining, 3 retired
    active: list[int] = field(default_factory=list)
    loading: list[int] = field(default_factory=list)
    serving: list[int] = field(default_factory=list)
    draining: int = 0
    gpu_s: float = 0.0

    def new(self, now: float, ready_now: bool) -> int:
        rid = len(self.start)
        self.start.append(now)
        self.active.append(0)
        if ready_now:
            self.bank.place(rid)
            self.state.append(1)
            self.serving.append(rid)
            return rid
        self.state.append(0)
        self.loading.append(rid)
        self.bank.begin(rid, now)
        return rid

    def retire(self, rid: int, now: float) -> None:
        if self.state[rid] == 2:
            self.draining -= 1
        self.state[rid] = 3
        self.gpu_s += now - self.start[rid]
        self.bank.release(rid, now)

    @property
    def live(self) -> int:
        return len(self.serving) + len(self.loading)


def placeable(want: float, params: SimParams) -> int:
    """The replicas of a policy's wish the pool can place (`SimParams.max_replicas`)."""
    n = max(0, int(want))
    return n if params.max_replicas is None else min(n, params.max_replicas)


def replay(work: Workload, policy: Policy, params: SimParams,
           progress: Callable[[float], None] | None = None) -> PolicyRun:
    """Replay the workload under one policy; `progress(fraction)` is called now and then."""
    env = PolicyEnv(work=work, params=params)
    if work.aggregated:
        return _replay_fluid(work, policy, env, params, progress)
    return _replay_exact(work, policy, env, params, progress)


def _replay_exact(work: Workload, policy: Policy, env: PolicyEnv, params: SimParams,
                  progress: Callable[[float], None] | None) -> PolicyRun:
    rng = np.random.default_rng(params.seed + 1)
    bank = LoadBank(params, rng)
    reps = _Replicas(bank=bank)
    assert work.arrivals is not None and work.prefill is not None and work.service is not None
    arr = work.arrivals.tolist()
    svc = work.service.tolist()
    n = len(arr)
    C = params.slots
    start_t = np.full(n, np.nan)
    comp: list[tuple[float, int]] = []  # (end, replica)
    acts: deque[tuple[float, int]] = deque()  # (due, live replicas wanted): decisions on their way (actuation delay)
    queue: deque[int] = deque()
    end = work.duration_s
    seconds = int(end)
    live_log_t: list[float] = [0.0]
    live_log_n: list[int] = []
    active, state, serving = reps.active, reps.state, reps.serving

    for _ in range(policy.start(env)):
        reps.new(0.0, True)
    live_log_n.append(reps.live)
    period = policy.period_s
    delay = params.actuation_delay_s
    next_tick = 0.0
    busy = 0
    area = 0.0
    last_t = 0.0
    arrivals_since = 0
    waited_since = 0  # served after waiting longer than the threshold: what the gateway counts as waited
    theta = params.wait_threshold_s
    last_tick = 0.0
    i = 0
    inf = math.inf
    report_every = max(1.0, end / 100)
    next_report = report_every

    def assign(req: int, rid: int, t: float) -> None:
        nonlocal busy, waited_since
        if t - arr[req] > theta:
            waited_since += 1
        active[rid] += 1
        busy += 1
        start_t[req] = t
        heapq.heappush(comp, (t + svc[req], rid))

    def act(want: int, t: float) -> None:
        live = reps.live
        if want > live:
            for _ in range(want - live):
                reps.new(t, False)
        elif want < live:
            remove = live - want if params.cancel_loads else min(live - want, len(serving))
            while remove and reps.loading and params.cancel_loads:
                rid = reps.loading.pop()
                reps.retire(rid, t)  # a cancelled load has held its GPU (and its share of the node) until now
                remove -= 1
            if remove:
                serving.sort(key=active.__getitem__)
                for rid in serving[:remove]:
                    if active[rid] == 0:
                        reps.retire(rid, t)
                    else:
                        state[rid] = 2
                        reps.draining += 1
                del serving[:remove]
        if want != live:
            live_log_t.append(t)
            live_log_n.append(reps.live + reps.draining)

    while True:
        ta = arr[i] if i < n else inf
        tc = comp[0][0] if comp else inf
        tr = bank.next_time()
        tx = acts[0][0] if acts else inf
        tt = next_tick if next_tick < end else inf
        t = min(ta, tc, tr, tx, tt)
        if t == inf:
            break
        area += (busy + len(queue)) * (t - last_t)
        last_t = t
        if tr == t:
            for rid, _ in bank.pop_ready(t):
                state[rid] = 1
                reps.loading.remove(rid)
                serving.append(rid)
                while queue and active[rid] < C:
                    assign(queue.popleft(), rid, t)
        elif tc == t:
            _, rid = heapq.heappop(comp)
            active[rid] -= 1
            busy -= 1
            if state[rid] == 2:
                if active[rid] == 0:
                    reps.retire(rid, t)
                    live_log_t.append(t)
                    live_log_n.append(reps.live + reps.draining)
            elif queue:
                assign(queue.popleft(), rid, t)
        elif ta == t:
            arrivals_since += 1
            best, best_a = -1, C
            for rid in serving:
                a = active[rid]
                if a < best_a:
                    best, best_a = rid, a
                    if a == 0:
                        break
            if best >= 0:
                assign(i, best, t)
            else:
                queue.append(i)
            i += 1
        elif tx == t:
            act(acts.popleft()[1], t)
        else:
            span = t - last_tick
            obs = Observation(t, len(serving), len(reps.loading), area / span if span > 0 else float(busy + len(queue)),
                              float(arrivals_since), period, bank.observed_p95(), float(waited_since))
            area, arrivals_since, waited_since, last_tick = 0.0, 0, 0, t
            want = placeable(policy.decide(obs), params)
            if delay > 0:
                acts.append((t + delay, want))
            else:
                act(want, t)
            next_tick = t + period
            if progress is not None and t >= next_report:
                progress(t / end)
                next_report += report_every
    # close the books: live replicas hold their GPU until the end (or their last request)
    for rid, st in enumerate(state):
        if st in (0, 1):
            reps.retire(rid, end)
        elif st == 2:
            reps.retire(rid, max(end, last_t))
    wait = start_t - work.arrivals
    wait = np.where(np.isnan(wait), np.maximum(end - work.arrivals, 0.0), wait)  # never served: waited to the end
    ttft = wait + work.prefill
    idx = np.searchsorted(np.asarray(live_log_t), np.arange(seconds, dtype=np.float64), side="right") - 1
    live_arr = np.asarray(live_log_n, dtype=np.int64)[idx]
    if progress is not None:
        progress(1.0)
    return PolicyRun(policy.name, ttft, wait, None, reps.gpu_s, live_arr, bank.starts)


def _replay_fluid(work: Workload, policy: Policy, env: PolicyEnv, params: SimParams,
                  progress: Callable[[float], None] | None) -> PolicyRun:
    rng = np.random.default_rng(params.seed + 1)
    bank = LoadBank(params, rng)
    S = work.mean_service_s
    C = params.slots
    per_replica = C / S  # requests/s one ready replica serves
    counts = work.counts.tolist()
    T = len(counts)
    dep = [0.0] * T
    live_arr = np.zeros(T, dtype=np.int64)
    ready: list[tuple[float, int]] = []  # (load start, replica) of each ready replica (a stack)
    loading: dict[int, float] = {}  # replica -> load start, in start order
    draining: deque[tuple[float, int]] = deque()  # (drained at, replica)
    acts: deque[tuple[float, int]] = deque()  # (due, live replicas wanted): decisions on their way
    gpu = 0.0
    next_rid = 0
    for _ in range(policy.start(env)):
        bank.place(next_rid)
        ready.append((0.0, next_rid))
        next_rid += 1
    period = policy.period_s
    delay = params.actuation_delay_s
    next_tick = 0.0
    backlog = 0.0
    load_acc = 0.0
    arr_acc = 0.0
    waited_acc = 0.0  # arrivals that wait longer than the threshold (`waited_share`): what the gateway counts
    theta = params.wait_threshold_s
    last_tick = 0.0
    report_every = max(1, T // 100)

    def act(want: int, t: float) -> None:
        nonlocal gpu, next_rid
        live = len(ready) + len(loading)
        if want > live:
            for _ in range(want - live):
                loading[next_rid] = float(t)
                bank.begin(next_rid, float(t))
                next_rid += 1
        elif want < live:
            remove = live - want if params.cancel_loads else min(live - want, len(ready))
            while remove and loading and params.cancel_loads:
                rid, s0 = loading.popitem()
                bank.release(rid, float(t))  # a cancelled load has held its GPU (and its share of the node)
                gpu += t - s0
                remove -= 1
            for _ in range(remove):
                s0, rid = ready.pop()
                gpu += t + S - s0  # drains: its in-flight requests finish first
                draining.append((t + S, rid))

    for t in range(T):
        while draining and draining[0][0] <= t:
            bank.release(draining.popleft()[1], float(t))
        while acts and acts[0][0] <= t:
            act(acts.popleft()[1], t)
        if t >= next_tick:
            span = t - last_tick
            obs = Observation(float(t), len(ready), len(loading), load_acc / span if span > 0 else backlog,
                              arr_acc, period, bank.observed_p95(), waited_acc)
            load_acc, arr_acc, waited_acc, last_tick = 0.0, 0.0, 0.0, float(t)
            want = placeable(policy.decide(obs), params)
            if delay > 0:
                acts.append((t + delay, want))
            else:
                act(want, t)
            next_tick = t + period
        partial = 0.0
        while bank.next_time() < t + 1:
            for rid, at in bank.pop_ready(bank.next_time()):
                s0 = loading.pop(rid)
                ready.append((s0, rid))
                partial -= at - t  # the part of this second it was still loading
        cap = (len(ready) + partial) * per_replica
        waited_acc += waited_share(backlog, float(counts[t]), cap, theta) * float(counts[t])
        q = backlog + counts[t]
        served = q if q < cap else cap
        backlog = q - served
        dep[t] = served
        load_acc += served * S + backlog
        arr_acc += counts[t]
        live_arr[t] = len(ready) + len(loading) + len(draining)
        if progress is not None and t % report_every == 0:
            progress(t / T)
    gpu += sum(T - s0 for s0, _ in ready) + sum(T - s0 for s0 in loading.values())
    cap = len(ready) * per_replica
    if backlog > 1e-9 and cap > 0:  # the queue left at the end drains at the last capacity
        extra = int(math.ceil(backlog / cap))
        dep.extend([cap] * (extra - 1) + [backlog - cap * (extra - 1)])
    wait, weight = _fluid_waits(work.counts, np.asarray(dep), T)
    if progress is not None:
        progress(1.0)
    return PolicyRun(policy.name, wait + work.mean_prefill_s, wait, weight, gpu, live_arr, bank.starts)


def waited_share(queued: float, arrivals: float, cap: float, theta: float) -> float:
    """The share of one second's `arrivals` (even over it) that wait longer than `theta` behind `queued` at a
    capacity of `cap` per second (the fluid queue, first come first served): the one at fraction f of the
    second finds queued + (arrivals - cap) f ahead of it, so waits that over cap. The gateway counts every
    request held longer than the threshold, so this counts the wait accrued within the second too; counting
    only the queue left at the second's end beyond cap x theta missed a fifth of the waits of a load step
    (m-large, 2 days, 8.7 s: 45,663 counted of 57,487 scored), and the budget's feedback steered to that."""
    if arrivals <= 0:
        return 0.0
    if cap <= 0:
        return 1.0
    head = queued - cap * theta  # how far the first arrival's queue is beyond what theta drains
    slope = arrivals - cap
    if slope == 0:
        return 1.0 if head > 0 else 0.0
    f = -head / slope  # where the queue ahead crosses cap x theta
    return 1.0 - min(1.0, max(0.0, f)) if slope > 0 else min(1.0, max(0.0, f))


def _fluid_waits(counts: np.ndarray, dep: np.ndarray, T: int, parts: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """FIFO waits from cumulative curves: each second's arrivals split into `parts` cohorts."""
    A = np.concatenate([[0.0], np.cumsum(counts)])
    D = np.concatenate([[0.0], np.cumsum(dep)])  # may run past T while a final backlog drains
    T = dep.size
    waits, weights = [], []
    sec = np.arange(counts.size, dtype=np.float64)
    for j in range(parts):
        f = (j + 0.5) / parts
        k = A[:-1] + counts * f  # the cohort's position in the arrival order
        arrive = sec + f
        idx = np.searchsorted(D, k - 1e-9, side="left")
        idx = np.clip(idx, 1, T)
        lo, hi = D[idx - 1], D[idx]
        width = np.where(hi > lo, hi - lo, 1.0)
        tau = (idx - 1) + np.clip((k - lo) / width, 0.0, 1.0)
        tau = np.where(k > D[-1] + 1e-9, float(T), tau)  # never served: waited to the end
        waits.append(np.maximum(tau - arrive, 0.0))
        weights.append(counts / parts)
    return np.concatenate(waits), np.concatenate(weights)
