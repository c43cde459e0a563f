"""Replay a fleet trace through a warmth policy and score it: cold share, TTFT, GPU memory-time.

One step at a time (the trace's step, e.g. a minute), for all models at once:

1. the policy says which models it wants on GPU and which asleep for this step; a model it
   adds is loaded from the tier it is in (asleep, page cache or disk: the catalog's time to
   ready) and is ready that many seconds into the step;
2. requests of the step arrive spread evenly over it; a model with requests and no GPU
   replica is loaded on demand (every policy does), ready one load time after its first
   request; every request that arrives before its model is ready is a *cold* request and
   waits for it;
3. GPU memory is charged for every model on GPU during the step (loading included); memory
   of a model on GPU during a step without requests is *wasted*; the fleet's GPU capacity is
   enforced by evicting the least recently used models without requests in flight;
4. evicted weights stay in the page cache (least recently used first, in the host memory
   that sleeping models leave free), else fall back to disk;
5. tiers cost what they cost live: only a model on GPU (or already asleep) can go to sleep;
   sleeping models are capped by the nodes' host memory (the least recently used beyond it
   fall to the page cache or disk); putting a model to sleep takes its copy time
   (`FleetEnv.sleep_s`), during which it still holds its GPU memory (charged), and a wake
   takes the catalog's time to ready from `asleep`.

6. a pool, not one replica per model: a warm model runs as many replicas as its sizer gives it
   (the policy's own count for the models it sizes, `FleetPolicy.replicas`: the fleet planner's
   dense models; else an HPA on the rate it saw, `forecasting.fleet.capacity.HpaCounts`), each
   charged its memory; a replica beyond the first loads from the page cache (the node-local
   snapshot), after the first has filled it where the first loads from disk (the rule the
   single-model replay charges too, `forecasting.charges`), and every replica serves
   `ModelCard.capacity_rps`. Requests that wait longer than `FleetEnv.wait_threshold_s` for a
   ready replica's slot (a per-step fluid queue, `capacity_waits`) are cold too: a request waits
   for a load whether its model had no replica or too few.
7. what it charges that the live path pays (actuation delay, the loads' spread, the snapshot
   rule, the wait threshold) is `forecasting.charges`'s, as the single-model replay's; policies
   are told each load and wake as the agents record them (`FleetPolicy.loaded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from forecasting.charges import copies_ready_s, spread
from forecasting.curves import weighted_quantile
from forecasting.fleet.capacity import HpaCounts, capacity_waits
from forecasting.fleet.catalog import Tier
from forecasting.fleet.policies import FleetEnv, FleetPolicy
from forecasting.fleet.traces import FleetTrace

_TIERS = (Tier.ASLEEP, Tier.CACHED, Tier.DISK)


@dataclass(frozen=True)
class FleetScore:
    """A policy's figures over the scored span."""

    policy: str
    knob: float | None
    hpa_target: float  # the utilisation the HPA sizing the models the policy does not size itself targets
    requests: float
    cold_requests: float
    cold_share: float
    full_load_share: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_p999_s: float
    warm_gb_h: float
    wasted_gb_h: float
    avg_warm_gb: float
    peak_warm_gb: float
    loads: int
    wakes: int
    sleeps: int = 0
    capacity_waited: float = 0.0  # requests (in cold_requests) that waited for a replica's slot, not for a load
    cold_start_budget: float | None = None  # the planner's: the share its dense models are sized on (None: a baseline)
    cold_by_model: tuple[float, ...] = ()
    warm_gb_h_by_model: tuple[float, ...] = ()

    @property
    def starts(self) -> int:
        """Replicas brought up: full loads (page cache or disk) and wakes from sleep."""
        return self.loads + self.wakes

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_by_model")} | {"starts": self.starts}


def simulate(trace: FleetTrace, policy: FleetPolicy, env: FleetEnv, *, score_after_s: float = 0.0,
             progress: Callable[[int, int], None] | None = None) -> FleetScore:
    """Replay ``trace`` through ``policy`` on ``env``; score steps starting at or after ``score_after_s``."""
    cards = env.catalog.cards
    if tuple(c.name for c in cards) != trace.names:
        raise ValueError("the catalog and the trace list different models")
    policy.reset(env)
    m, dt = trace.n_models, trace.step_s
    mem = np.array([c.mem_gb for c in cards])
    ready = np.array([[c.time_to_ready(t) for t in _TIERS] for c in cards])  # [m, 3]
    warm_ttft = np.array([c.ttft_warm_s for c in cards])
    cap_rps = env.catalog.capacity_array
    hpa_target = policy.hpa_target if policy.hpa_target is not None else env.hpa_target
    hpa = HpaCounts(cap_rps, dt, target=hpa_target, scale_down_s=env.hpa_scale_down_s)
    n_prev = np.zeros(m, dtype=np.int64)  # replicas on GPU during the last step
    backlog = np.zeros(m)  # requests still waiting for a slot at the end of the last step
    host_total = env.n_nodes * env.node_host_gb
    cap = env.gpu_capacity_gb
    gpu = np.zeros(m, dtype=bool)
    slept = np.zeros(m, dtype=bool)  # asleep during the last step (after the rules below)
    sleep_s = np.minimum(np.asarray(env.sleep_s(mem), dtype=np.float64), dt)
    ready_at = np.zeros(m)
    last_used = np.full(m, -1.0)
    off_tier = np.full(m, 2, dtype=np.int64)  # index into _TIERS for models off GPU
    was_tier = np.full(m, 2, dtype=np.int64)  # ... as it was during the last step
    first_scored = int(np.ceil(score_after_s / dt - 1e-9))
    rng = np.random.default_rng(env.seed + 1)
    req = cold = full = gb_s = waste_s = cap_waited = 0.0
    peak = 0.0
    loads = wakes = sleeps = 0
    warm_w = np.zeros(m)
    cold_m = np.zeros(m)
    gb_s_m = np.zeros(m)
    waits: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for t in range(trace.n_steps):
        start = t * dt
        want, asleep = policy.decide(t)
        want = want.copy()
        c = trace.counts[t]
        busy = c > 0
        # only a model on GPU (or already asleep) can sleep, and sleeping models fit in host memory:
        # the least recently used beyond it fall to the page cache or disk
        asleep = asleep & ~want & (gpu | slept)
        sidx = np.flatnonzero(asleep)
        sidx = sidx[np.argsort(-last_used[sidx], kind="stable")]
        asleep[sidx[np.cumsum(mem[sidx]) > host_total]] = False
        to_sleep = asleep & gpu  # the copy to host memory holds the GPU memory too while it runs
        # weights off GPU: asleep where the policy says, else page cache (LRU) within host memory, else disk
        host_left = host_total - float(mem[asleep & ~want].sum())
        off = ~want & ~asleep
        order = np.argsort(-last_used[off], kind="stable")
        idx = np.flatnonzero(off)[order]
        fits = np.cumsum(mem[idx]) <= host_left
        off_tier[:] = 2
        off_tier[idx[fits & (last_used[idx] >= 0)]] = 1
        off_tier[asleep & ~want] = 0
        newly = want & ~gpu
        # a model the policy brings back comes from where its weights were during the last step (asleep:
        # a wake; page cache; disk), not from where a model it released now would go
        off_tier[newly] = was_tier[newly]
        # on-demand loads: the first request of the step starts them
        demand = busy & ~want
        first = dt / (c + 1.0)
        from_tier = np.where(newly | demand, off_tier, -1)
        f = spread(rng, env.cold_start_cv, m)  # this step's draw of each model's first load (or wake)
        load_s = ready[np.arange(m), np.maximum(from_tier, 0)] * f
        fill_from = start + env.actuation_s + np.where(demand, first, 0.0)  # when a load decided now starts
        ready_at[newly | demand] = (fill_from + load_s)[newly | demand]
        gpu = want | busy
        n = np.where(gpu, hpa.desired(), 0)
        for i, k in policy.replicas(t).items():
            if gpu[i]:
                n[i] = max(1, int(k))
        # the fleet's GPU capacity: evict least recently used models without requests this step, then the
        # replicas beyond the first (those starting now, then the models holding the most)
        used = float((mem * n).sum())
        if used > cap:
            cand = np.flatnonzero(gpu & ~busy)
            for i in cand[np.argsort(last_used[cand], kind="stable")]:
                if used <= cap:
                    break
                gpu[i] = False
                used -= mem[i] * n[i]
                n[i] = 0
            while used > cap and (n > 1).any():  # the replicas starting now stay pending first (unschedulable pods)
                grow = np.where(n > np.maximum(n_prev, 1), n, 0)
                i = int(np.argmax(grow if grow.any() else n))
                n[i] -= 1
                used -= mem[i]
        last_used[busy] = start
        slept = asleep & ~gpu
        was_tier = np.where(gpu, 0, off_tier)  # where each model's weights are for the next step (GPU: moot)
        late = np.clip(ready_at - start, 0.0, dt)
        coldf = np.where(busy, np.minimum(1.0, late / dt), 0.0)
        cold_req = np.where(coldf > 0, np.minimum(c, np.maximum(1.0, c * coldf)), 0.0)
        # replicas beyond the first: kept from the last step (ready) and started now (from the page cache)
        kept = np.maximum(0, np.minimum(n, n_prev) - 1)
        started = np.where(gpu, np.maximum(0, n - np.maximum(n_prev, 1)), 0)
        # what the agents record: each wake and load (the first replica's from its tier, the copies from the cache)
        records = [(int(i), _TIERS[from_tier[i]], float(load_s[i])) for i in np.flatnonzero((from_tier >= 0) & gpu)]
        # a replica beyond the first copies from the node's snapshot (a load from the page cache), once the first has
        # filled it where it loads from disk now (`forecasting.charges`); each copy its own draw
        extra = np.zeros(m)  # the replicas started now: the share of the step they serve, summed
        for j in np.flatnonzero(started):
            copy_s = ready[j, 1] * spread(rng, env.cold_start_cv, int(started[j]))
            at = copies_ready_s(fill_from[j], ready[j, 2] * f[j], copy_s, from_tier[j] != 2, env.load_share)
            extra[j] = float((1.0 - np.clip(at - start, 0.0, dt) / dt).sum())
            records.extend((int(j), Tier.CACHED, float(x)) for x in at - fill_from[j])
        serving = np.where(gpu, 1.0 - late / dt + kept + extra, 0.0)
        over, over_wait, backlog = capacity_waits(backlog, c / dt, cap_rps * serving, dt, env.wait_threshold_s)
        backlog = np.where(gpu, backlog, 0.0)
        cold_all = np.where(busy, np.minimum(c, np.maximum(cold_req, over)), 0.0)
        slot_only = cold_all - cold_req  # waited for a slot, not (only) for this step's load or wake
        hpa.observe(c)
        if records:
            policy.loaded(t, records)
        policy.observe(t, c, gpu, replicas=n, waited=cold_all, queued=backlog)
        n_prev = n
        if t < first_scored:
            continue
        req += float(c.sum())
        cold += float(cold_all.sum())
        cap_waited += float(slot_only.sum())
        full += float(cold_req[from_tier >= 1].sum())
        loads += int(((from_tier >= 1) & gpu).sum()) + int(started.sum())
        wakes += int((from_tier == 0).sum())
        gb_s += used * dt + float((mem * sleep_s)[to_sleep].sum())
        sleeps += int(to_sleep.sum())
        peak = max(peak, used)
        waste_s += float((mem * n)[gpu & ~busy].sum()) * dt
        warm_w += c - cold_all
        cold_m += cold_all
        gb_s_m += mem * n * dt
        hit = np.flatnonzero(cold_req > 0)
        if hit.size:
            span = np.where(demand[hit], ready_at[hit] - start - first[hit], late[hit])
            span = np.maximum(span, 0.0)
            half = cold_req[hit] / 2.0
            waits.append(np.concatenate([0.25 * span, 0.75 * span]) + np.tile(warm_ttft[hit], 2))
            weights.append(np.concatenate([half, half]))
        slot = np.flatnonzero(slot_only > 0)
        if slot.size:
            waits.append(over_wait[slot] + warm_ttft[slot])
            weights.append(slot_only[slot])
        if progress is not None and t % 500 == 0:
            progress(t, trace.n_steps)
    w_all = np.concatenate([warm_w] + weights) if weights else warm_w
    v_all = np.concatenate([warm_ttft] + waits) if waits else warm_ttft
    span_s = max(dt, (trace.n_steps - first_scored) * dt)
    return FleetScore(
        policy=policy.name, knob=None, hpa_target=hpa_target, requests=req, cold_requests=cold,
        cold_share=cold / req if req else 0.0, full_load_share=full / req if req else 0.0,
        ttft_p50_s=weighted_quantile(v_all, w_all, 0.5), ttft_p99_s=weighted_quantile(v_all, w_all, 0.99),
        ttft_p999_s=weighted_quantile(v_all, w_all, 0.999),
        warm_gb_h=gb_s / 3600.0, wasted_gb_h=waste_s / 3600.0, avg_warm_gb=gb_s / span_s, peak_warm_gb=peak,
        loads=loads, wakes=wakes, sleeps=sleeps, capacity_waited=cap_waited, cold_by_model=tuple(cold_m.tolist()),
        warm_gb_h_by_model=tuple((gb_s_m / 3600.0).tolist()))
