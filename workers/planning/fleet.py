"""The fleet round, live: every planned model at once, within one GPU-memory ceiling.

With `planner.fleet_budget_gb` set (the ceiling on GPU memory a round places), `forecast_and_plan`
runs this instead of planning each model alone; within it the memory price is steered by the
cold-start budget (`planner.cold_start_budget`), on the requests of the models it plans by their
outlook that waited for capacity as the gateway counted them (`keys.waited`):
1. history: each model's complete buckets from the gateway's counters (`load_redis`),
   aligned into one ``counts[bucket, model]`` matrix;
2. catalog: each model's footprint (`planner.model_memory_gb`) and priority, with the
   registry's measured load time p95 as its time to ready from the node's cache, and no asleep
   tier where its engine reports no sleep mode (the agents' `sleep_mode`, `prewarm.policy.sleep_tier`);
3. nodes: what agents publish (`keys.node_info`: `gpu_memory_gb`, `host_memory_gb`) and
   which models are live on each (the registry); a model with a request in the last complete
   bucket or in the one still being counted (`counting_now`) counts as in flight there, so the
   planner never evicts it;
4. plan: the pure `forecasting.fleet.round.fleet_round`: one shared arrival estimator for
   every model, the dense models (`dense_models`) sized by the count planner's `step` on the
   inputs `plan_model` builds for a model planned alone (`workers.planning.forecast.inputs`:
   fine counters, live replicas, measured cold start; its state in `keys.planner_state`,
   saved by the round that acts), and the fleet planner for every model's tier and node;
5. act, with `kubernetes.enabled`: each model's count goes to its Deployment's one owner
   (`publish_cluster_target`: KEDA, the HPA's metric or the scale subresource), the pods
   parked asleep included where they can sleep, and no agent gets a task (the pod warmer
   sleeps and wakes the pods); without Kubernetes, a LOAD becomes `prewarm_replica` on the
   chosen node's queue, a WAKE `wake_replica` of the replica asleep there (else a load), a
   SLEEP `sleep_replica` (engine level-1 sleep: weights to host memory), an EVICT
   `evict_replica` (the weights stay in the node's snapshot: the cached tier); sleep and
   evict wait for requests in flight (`workers.node.tiers`). The plan is written to `keys.FLEET_PLAN` for the live view.
The memory price is carried in `keys.FLEET_STATE`; the arrival estimator in this process (a
restarted planner rebuilds it from a day of history).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
from celery import Celery

from forecasting.data.history import MGET_CHUNK, counter_resolution, load_redis, rate_series
from forecasting.data.traces import HistoryError
from forecasting.fleet.catalog import Catalog, ModelCard, Tier, default_catalog, default_ready_s, measured_ready_s
from forecasting.fleet.planner import ActionKind, FleetNode, FleetParams, FleetState
from forecasting.fleet.round import RoundParams, RoundResult, RoundState, dense_models, fleet_round, held_models, \
    price_settings, round_settings
from forecasting.planner import PlannerParams
from prewarm.core import keys
from prewarm.core.domain import LIVE_STATES, ModelSpec, Pool, Replica, ReplicaState, replica_id
from prewarm.policy.sleep_tier import FIELD as SLEEP_FIELD, can_sleep, parse_report, tier_absent
from workers import names
from workers.context import WorkerContext
from workers.planning.forecast import ModelPlan, inputs, load_planner_state, planned_models, publish_cluster_target, \
    save_planner_state
from workers.planning.kubernetes import owns_replicas
from workers.planning.nodes import live_nodes, measured_ready_p95, reserve_slots, sleep_reports

log = logging.getLogger("prewarm.planner.fleet")

#: How much history a fleet round reads per model (its estimator needs gaps, not weeks).
FLEET_HISTORY_S = 86_400
_STATE = RoundState()


def fleet_catalog(ctx: WorkerContext, models: list[str]) -> Catalog:
    """Cards from the settings (footprint, priority, capacity) and the registry's measured load times.

    Agents record their per-tier times (wakes, loads) under their own `agent.node_class`, which the
    live nodes publish: each class's figures go under that class, and the pool-wide figure the round
    plans with ("default") is the slowest class measured (a p95 the model meets on any node). A model
    whose engine reports no sleep mode on every live node that reports on it has no asleep tier."""
    p = ctx.settings.planner
    reports = list(sleep_reports(ctx).values())
    defaults = {c.name: c for c in default_catalog(models).cards}
    cards = []
    for name in models:
        mem = float(p.model_memory_gb.get(name, defaults[name].mem_gb))
        per_class: dict[str, dict[Tier, float]] = {}
        slowest: dict[Tier, float] = {}
        for tier in (Tier.ASLEEP, Tier.CACHED, Tier.DISK):  # what agents measured per tier (wakes, loads)
            got = measured_ready_p95(ctx, name, tier.value)
            for cls, v in got.items():
                per_class.setdefault(cls, {})[tier] = v
            if got:
                slowest[tier] = max(got.values())
        ready = measured_ready_s(default_ready_s(mem), ctx.registry.load_time_p95(name), slowest)
        cards.append(ModelCard(name=name, mem_gb=mem, capacity_rps=p.capacity_rps,
                               priority=float(p.model_priority.get(name, 1.0)),
                               ready_s={**per_class, "default": ready}, sleeps=not tier_absent(reports, name)))
    return Catalog(tuple(cards))


def _nodes(ctx: WorkerContext, catalog: Catalog, busy: set[str]) -> tuple[FleetNode, ...]:
    out = []
    biggest = max((c.mem_gb for c in catalog.cards), default=1.0)
    for ns in live_nodes(ctx):
        info = ctx.client.hgetall(keys.node_info(ns.node))
        gpu = float(info.get("gpu_memory_gb") or 0.0) or ns.slots * biggest  # a slots-only node: a slot per model
        host = float(info.get("host_memory_gb") or 0.0)
        resident: dict[str, Tier] = {}
        replicas: dict[str, int] = {}  # replicas on GPU per model (a dense model may run several here)
        for r in ctx.registry.live_on_node(ns.node):
            if r.model in catalog.index and r.state in LIVE_STATES:
                tier = Tier.ASLEEP if r.state is ReplicaState.ASLEEP else Tier.GPU
                if tier is Tier.GPU:
                    replicas[r.model] = replicas.get(r.model, 0) + 1
                if resident.get(r.model) is not Tier.GPU:
                    resident[r.model] = tier
        for snap in (s for s in info.get("snapshots", "").split(",") if s):
            resident.setdefault(snap.partition("@")[0], Tier.CACHED)
        resident = {m: t for m, t in resident.items() if m in catalog.index}
        report = parse_report(info.get(SLEEP_FIELD))
        out.append(FleetNode(name=ns.node, gpu_gb=gpu, host_gb=host, node_class=info.get("node_class", "default"),
                             resident=resident, replicas=replicas, in_flight={m: 1 for m, t in resident.items()
                                                                             if t is Tier.GPU and m in busy},
                             no_sleep=frozenset(m for m in catalog.names if can_sleep(report, m) is False)))
    return tuple(out)


def _history(ctx: WorkerContext, model: str, *, start: float, end: float, bucket: float) -> pd.Series:
    """Requests/s per complete bucket of ``model`` in [start, end) from the gateway's counters (empty if none)."""
    resolution = counter_resolution(bucket)
    first = ctx.client.hget(keys.REQUESTS_FIRST, model)  # before it the gateway counted nothing
    if first is not None:
        start = max(start, math.floor(float(first) / bucket) * bucket)
    if start >= end:
        return pd.Series(dtype=float)
    try:
        frame = load_redis(ctx.client, model, resolution_s=resolution, start=start, end=end)
    except HistoryError as exc:
        log.info("no request history for %s yet: %s", model, exc)
        return pd.Series(dtype=float)
    return rate_series(frame, model, bucket_s=int(bucket)) if not frame.empty else pd.Series(dtype=float)


def counting_now(ctx: WorkerContext, models: list[str], *, start: float, now: float, bucket: float) -> set[str]:
    """The models with requests since ``start`` (the bucket still being counted, up to ``now``): counted (the
    gateway counts a request when it is answered) or in flight (its in-flight peak of the fine buckets, from the
    one before ``now`` at least, which a request held for a load raises at the next flush, within a second).
    In flight now, as the replay's step with requests keeps its model on GPU. Read with the last complete bucket
    only, a sparse model loaded on demand for a burst that began after that bucket was evicted by the next round
    mid-burst (the live demo evicted one 2 s after it turned ready, its burst's requests still held) and loaded
    again for the rest of its burst."""
    fine = keys.FINE_RESOLUTION_S
    # from the fine bucket before `now` at least: just after a boundary the new bucket has had no flush yet
    first_fine = math.floor(min(start, now - fine) / fine) * fine
    asked: list[tuple[str, str]] = [(m, keys.inflight_peak(m, fine, int(t))) for m in models
                                    for t in np.arange(first_fine, now, fine)]
    try:
        res = counter_resolution(bucket)
        asked += [(m, keys.requests(m, res, int(t))) for m in models
                  for t in np.arange(math.floor(start / res) * res, now, res)]
    except HistoryError:
        pass
    if not asked:
        return set()
    values = ctx.client.mget([key for _, key in asked])
    return {m for (m, _), value in zip(asked, values) if float(value or 0) > 0}


def _waited(ctx: WorkerContext, models: list[str], grid: np.ndarray, bucket: float,
            since: float | None) -> np.ndarray | None:
    """Requests that waited for capacity per bucket of ``grid`` (bucket starts) and model, as the gateway counted
    them (`keys.waited`, at its fine resolution), for the buckets from ``since`` (the last round's end; the round
    reads no other): one MGET of those keys alone. None with no last round, or a bucket the fine counters do not
    divide."""
    fine = keys.FINE_RESOLUTION_S
    if since is None or not len(grid) or bucket % fine:
        return None
    out = np.zeros((grid.size, len(models)))
    first = int(np.searchsorted(grid, since))
    starts = [int(b) for b in grid[first:]]
    per = int(bucket // fine)
    names_ = [keys.waited(m, fine, b + k * fine) for m in models for b in starts for k in range(per)]
    values = []
    for lo in range(0, len(names_), MGET_CHUNK):
        values += ctx.client.mget(names_[lo:lo + MGET_CHUNK])
    got = np.array([_count(v) for v in values]).reshape(len(models), len(starts), per).sum(axis=2)
    out[first:] = got.T
    return out


def _count(value: Any) -> float:
    """A counter's value; an unreadable one counts as 0, as the history readers count it."""
    try:
        return max(0.0, float(value or 0))
    except (TypeError, ValueError):
        return 0.0


def load_state(ctx: WorkerContext) -> FleetState:
    raw = ctx.client.hgetall(keys.FLEET_STATE)
    try:
        state = FleetState(lam=float(raw["lam"]), spent_gb_s=float(raw["spent_gb_s"]),
                           elapsed_s=float(raw["elapsed_s"]))
    except (KeyError, ValueError):
        return FleetState()
    try:  # the cold-start budget's normaliser (absent in a state an older planner wrote)
        return replace(state, counted_rate=float(raw["counted_rate"]), counted_weight_s=float(raw["counted_weight_s"]))
    except (KeyError, ValueError):
        return state


def save_state(ctx: WorkerContext, state: FleetState) -> None:
    values = {"lam": state.lam, "spent_gb_s": state.spent_gb_s, "elapsed_s": state.elapsed_s,
              "counted_rate": state.counted_rate, "counted_weight_s": state.counted_weight_s}
    # as plain floats: numpy's repr ("np.float64(1200.0)") did not read back, and every round started afresh
    ctx.client.hset(keys.FLEET_STATE, mapping={k: repr(float(v)) for k, v in values.items() if v is not None})


@dataclass(frozen=True)
class FleetDecision:
    """A fleet round's decision, before anything is done with it: the planned models (sorted), their specs and
    catalog, and the round's result (the plan: every model's tier and nodes, and the actions to get there)."""

    names: tuple[str, ...]
    specs: dict[str, ModelSpec]
    catalog: Catalog
    result: RoundResult

    def view(self) -> dict[str, dict[str, Any]]:
        """Per model: its tier (gpu, asleep, cold), nodes, replicas, density, outlook rate, footprint."""
        plan, out = self.result.plan, {}
        for j, name in enumerate(self.names):
            tier = "gpu" if name in plan.gpu else "asleep" if name in plan.asleep else "cold"
            out[name] = {"tier": tier, "nodes": list(plan.gpu.get(name, ())) or ([plan.asleep[name]] if name in
                                                                                 plan.asleep else []),
                         "density": float(plan.density[j]), "rate": float(self.result.rate[j]),
                         "replicas": len(plan.gpu.get(name, ())), "dense": name in self.result.dense,
                         "mem_gb": self.catalog.cards[j].mem_gb}
        return out


def fleet_decide(ctx: WorkerContext, *, now: float, state: RoundState) -> tuple[FleetDecision | None, RoundState]:
    """The fleet round's decision for every planned model, read-only: history, catalog and nodes from Redis,
    the pure `fleet_round`; nothing written or sent (None: no model planned). `prewarm plan --dry-run`
    prints it; `fleet_and_plan` acts on it."""
    p = ctx.settings.planner
    specs = {s.name: s for s in planned_models(ctx)}
    if not specs:
        return None, state
    names_ = sorted(specs)
    bucket = float(p.bucket_s)
    n = max(2, int(min(p.history_s, FLEET_HISTORY_S) // bucket))
    end = math.floor(now / bucket) * bucket
    grid = end - bucket * np.arange(n, 0, -1, dtype=float)
    counts = np.zeros((n, len(names_)))
    for j, name in enumerate(names_):
        y = _history(ctx, name, start=float(grid[0]), end=end, bucket=bucket)
        if len(y):
            pos = np.searchsorted(grid, y.index.to_numpy(dtype=float))
            ok = (pos < n) & (grid[np.minimum(pos, n - 1)] == y.index.to_numpy(dtype=float))
            counts[pos[ok], j] = y.to_numpy(dtype=float)[ok] * bucket
    catalog = fleet_catalog(ctx, names_)
    busy = {names_[j] for j in np.flatnonzero(counts[-1] > 0)} | counting_now(ctx, names_, start=end, now=now,
                                                                                bucket=bucket)
    nodes = _nodes(ctx, catalog, busy)
    # the memory budget is the round's ceiling; the price within it is steered by the cold-start budget, on the
    # requests that waited as the gateway counted them since the last round (`forecasting.fleet.planner.steer`)
    fleet = FleetParams(step_s=max(bucket, p.interval_s), cap_gb=p.fleet_budget_gb, **price_settings(p))
    waited = _waited(ctx, names_, grid, bucket, since=state.seen_to)
    params = RoundParams(bucket_s=bucket, fleet=fleet, **round_settings(p))  # what the replays run with too
    planner = PlannerParams.from_settings(p)
    dense = {}
    saved = {name: load_planner_state(ctx, name) for name in state.dense if name in specs}  # sized last round
    holding = held_models(tuple(saved), saved, planner, now)  # ... and its planner holds a fall
    for name in dense_models(counts, catalog, params, holding):  # sized by the count planner, as if planned alone
        planner_state = saved[name] if name in saved else load_planner_state(ctx, name)
        try:
            dense[name] = (inputs(ctx, specs[name], planner_state, planner, now=now), planner_state)
        except (HistoryError, ValueError) as exc:  # its counters unreadable: planned by its outlook this round
            log.error("fleet: %s not sized by the count planner this round: %s", name, exc)
    result, state = fleet_round(counts, catalog, nodes, now=now, params=params,
                                state=replace(state, planner=load_state(ctx)), dense=dense, waited=waited)
    return FleetDecision(tuple(names_), specs, catalog, result), state


def _reserve_on(ctx: WorkerContext, node: str, model: str, revision: str) -> int | None:
    """A free slot of `node` reserved for the model's replica there (`reserve_slots`); None: none is free."""
    got = reserve_slots(ctx, 1, lambda n, s: replica_id(model, revision, n, s),
                        nodes=lambda: [ns for ns in live_nodes(ctx) if ns.node == node])
    return got[0][1] if got else None


def fleet_and_plan(ctx: WorkerContext, app: Celery, *, now: float) -> list[ModelPlan]:
    """One fleet round over every planned model; returns one `ModelPlan` per model."""
    global _STATE
    p = ctx.settings.planner
    decision, _STATE = fleet_decide(ctx, now=now, state=_STATE)
    if decision is None:
        return []
    names_, specs, result = list(decision.names), decision.specs, decision.result
    plan = result.plan
    for name, planner_state in result.states.items():  # the dense models' count planner, as `plan_model` saves it
        save_planner_state(ctx, name, planner_state)
    save_state(ctx, _STATE.planner)
    sent: dict[str, list[str]] = {m: [] for m in names_}
    used_slots = {ns.node: set(ns.used) for ns in live_nodes(ctx)}
    slots = {ns.node: ns.slots for ns in live_nodes(ctx)}
    cluster = owns_replicas(ctx.settings.kubernetes)  # the pods are Kubernetes' to start: no agent task then
    taken: set[str] = set()  # replicas an action of this round already has: each action moves one
    on_node: dict[str, list[Replica]] = {}  # one registry read per node acted on
    for action in () if cluster else plan.actions:
        spec = specs[action.model]
        if action.node not in on_node:
            on_node[action.node] = list(ctx.registry.live_on_node(action.node))
        here = [r for r in on_node[action.node] if r.model == action.model and r.id not in taken]
        asleep_here = [r.id for r in here if r.state is ReplicaState.ASLEEP]
        if action.kind is ActionKind.WAKE and asleep_here:  # a sleeping replica there: wake it, no load
            if p.dry_run:
                log.info("dry run: would wake %s", asleep_here[0])
            else:
                app.send_task(names.WAKE, args=[asleep_here[0]])
            taken.add(asleep_here[0])
            sent[action.model].append(asleep_here[0])
        elif action.kind in (ActionKind.LOAD, ActionKind.WAKE):
            free = [s for s in range(slots.get(action.node, 0)) if s not in used_slots.get(action.node, set())]
            if free and not p.dry_run:  # the slot reserved for its replica, as the executor's are
                slot = _reserve_on(ctx, action.node, spec.name, spec.revision)
                free = [] if slot is None else [slot]
            if not free:
                log.warning("fleet: no free slot on %s for %s", action.node, action.model)
                continue
            used_slots[action.node].add(free[0])
            rid = replica_id(spec.name, spec.revision, action.node, free[0])
            if p.dry_run:
                log.info("dry run: would prewarm %s (%s)", rid, action.kind.value)
            else:
                app.send_task(names.PREWARM, args=[rid, Pool.SERVING.value, None])
            sent[action.model].append(rid)
        else:
            # SLEEP: drain and sleep (weights to host memory); EVICT: drain and retire (the snapshot keeps
            # the weights). Both wait for requests in flight to finish (workers.node.tiers).
            # One ready replica per action (the surplus on GPU; one still loading is left to the next round);
            # an eviction from a node where the model only sleeps clears what sleeps there.
            task = names.SLEEP if action.kind is ActionKind.SLEEP else names.EVICT
            ready = [r for r in here if r.state is ReplicaState.READY]
            only_asleep = task == names.EVICT and bool(here) and all(r.state is ReplicaState.ASLEEP for r in here)
            for r in ready[:1] or (here if only_asleep else []):
                taken.add(r.id)
                why = f"fleet: {action.kind.value} (density {action.density:.3g} below the memory price)"[:200]
                if p.dry_run:
                    log.info("dry run: would %s %s", action.kind.value, r.id)
                else:
                    app.send_task(task, args=[r.id] if task == names.SLEEP else [r.id, why])
    view = decision.view()
    ctx.client.set(keys.FLEET_PLAN, json.dumps({"at": now, "lam": plan.lam, "gpu_gb": plan.gpu_gb,
                                                "budget_gb": p.fleet_budget_gb,
                                                "models": view}))
    out = []
    for name in names_:
        status = f"fleet: {view[name]['tier']}" + (" (dry run)" if p.dry_run else "")
        ctx.client.hset(keys.last_forecast(name), mapping={"status": status, "at": repr(now),
                                                            "need_now": str(view[name]["replicas"])})
        if cluster:  # every model's count reaches its Deployment's one owner, as a single model's does
            publish_cluster_target(ctx, name, view[name]["replicas"], int(name in plan.asleep), now=now,
                                   revision=specs[name].revision)
        out.append(ModelPlan(name, status, (), tuple(sent[name]), 0, view[name]["replicas"]))
    log.info("fleet round: %d models, %.4g GB on GPU (budget %.4g), %d asleep, %d action(s), %d dense",
             len(names_), plan.gpu_gb, p.fleet_budget_gb, len(plan.asleep), len(plan.actions), len(result.dense))
    return out
