"""The fleet planner: which models stay warm, where, and how warm, under one GPU budget.

One round sees every model's outlook (chance of a request in the next step, requests a
cold start would hit) and every node's GPU and host memory with what is resident there,
and decides for all models together:

- value of keeping a model on GPU for the next step = priority x P(request) x requests a
  cold start would hit; its *density* is that value per GB of GPU memory. Models are kept
  in order of density while it is at least the threshold ``lam`` and memory lasts: the
  greedy answer to "maximise expected requests spared a cold start per GPU-memory-second";
- ``lam`` is the price of GPU memory, steered by the cold-start budget (`steer`): requests of
  the models planned by their outlook that waited lower it, calm raises it, so the share of
  them that waits is the budget; memory goes where the outlook is best (a sparse model stays
  warm exactly while its own idle-time hazard pays for it, which gives it a keep-alive window
  and a pre-warm from its own distribution). Given a memory budget instead (average warm GB),
  an integral controller on ``lam`` meets that average (`_price`);
- a model with requests in flight is never evicted (one replica of it stays; its others are
  weighed like any replica, and one let go drains first);
- the replicas a model's load needs now (`FleetContext.serving`: its last bucket's rate over a
  replica's capacity, no margin) come before any model's warmth: requests arriving now wait for
  certain without them, a warm idle model's only if one comes. Placed one replica per model at
  a time, so a pool too small shares its shortfall instead of giving it all to one model; then
  the rest of a dense model's forecast (its margin and warm pool), then warmth;
- a model that leaves GPU is put to sleep where it is (weights in pinned host memory, woken in
  a fraction of a load) while that node's host memory lasts, best first, where its engine can sleep (a
  model whose engine reports no sleep mode has no asleep tier: `ModelCard.sleeps`,
  `FleetNode.no_sleep`); the rest stay in the page cache or on disk;
- placement is one pass over all models of the round: a model stays where it is resident,
  else goes where it is asleep or cached (the fastest wake), else to the best-fitting node;
  a dense model's replicas (the count planner's, `FleetContext.replicas`) go to the nodes
  with the fewest of them first, and may share a node (`FleetNode.replicas`: how many run there).

Pure: no I/O, `now` and the outlook are passed in, state is passed through.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from forecasting.calibration import budget_overspend
from forecasting.fleet.catalog import Catalog, Tier
from forecasting.planner import PlannerParams


class ActionKind(str, enum.Enum):
    """What the agents are told to do with a model on a node."""

    LOAD = "load"  # from cache or disk onto GPU
    WAKE = "wake"  # asleep -> GPU
    SLEEP = "sleep"  # GPU -> asleep (level-1: weights to host memory)
    EVICT = "evict"  # GPU or asleep -> page cache / disk


@dataclass(frozen=True)
class FleetNode:
    """A GPU node as the planner sees it: memory, and each resident model's tier and in-flight count."""

    name: str
    gpu_gb: float
    host_gb: float
    node_class: str = "default"
    resident: Mapping[str, Tier] = field(default_factory=dict)
    in_flight: Mapping[str, int] = field(default_factory=dict)
    replicas: Mapping[str, int] = field(default_factory=dict)  # replicas on GPU here, per model resident on GPU (absent: 1)
    no_sleep: frozenset[str] = frozenset()  # models whose engine reports it cannot sleep here (no asleep tier)


@dataclass(frozen=True)
class FleetParams:
    """Knobs of the fleet planner.

    ``budget_gb``: the average GPU memory warm models may hold (None: the nodes' capacity,
    with ``lam`` fixed); ``sleep_share``: share of host memory for sleeping models.
    """

    step_s: float = 60.0
    budget_gb: float | None = None
    cap_gb: float | None = None  # a hard ceiling on GPU memory per round (in-flight replicas excepted)
    lam0: float = 1e-3
    gain: float = 0.08
    sleep_share: float = 0.75
    lam_min: float = 1e-9
    lam_max: float = 1e9
    # without a memory budget the price is steered by the cold-start budget (None: held at ``lam0``): the share
    # of the outlook-planned models' requests that may wait for a load or a wake (`steer`)
    cold_start_budget: float | None = None
    price_gain: float = 1.0  # e-folds the price moves per calibration window's budget overspent (`planner.fleet_price_gain`)
    # the count planner's calibration window and budget horizon (`planner.budget_calibration_s`, `budget_horizon_s`)
    calibration_s: float = PlannerParams.budget_calibration_s
    horizon_s: float = PlannerParams.budget_horizon_s


@dataclass(frozen=True)
class FleetContext:
    """One planning round's inputs, in the catalog's model order."""

    now: float
    catalog: Catalog
    nodes: tuple[FleetNode, ...]
    rate: np.ndarray  # per model: requests' arrivals expected per warm step (the estimator's outlook)
    burst_requests: np.ndarray
    params: FleetParams
    replicas: Mapping[str, int] = field(default_factory=dict)  # dense models: replicas their forecast needs
    serving: Mapping[str, int] = field(default_factory=dict)  # ... of them, those the load now needs (no margin)
    # what the gateway counted since the last round for the models the outlook plans (no count sized for them: not
    # the dense ones, whose margin answers for their waits, nor a burst's, whose HPA-like count does):
    # (requests, requests that waited for a load, a wake or a slot, seconds counted); None: nothing new
    observed: tuple[float, float, float] | None = None


@dataclass
class FleetState:
    """What the planner carries between rounds: the memory price and the budget spent so far."""

    lam: float = 1e-3
    spent_gb_s: float = 0.0
    elapsed_s: float = 0.0
    counted_rate: float | None = None  # the outlook-planned models' requests/s over `horizon_s` (`steer`'s normaliser)
    counted_weight_s: float | None = None  # ... and the seconds of counting it rests on


@dataclass(frozen=True)
class FleetAction:
    kind: ActionKind
    model: str
    node: str
    density: float


@dataclass(frozen=True)
class FleetPlan:
    """Where every model is after the round: ``gpu[model]`` nodes (one per replica), ``asleep[model]``."""

    gpu: Mapping[str, tuple[str, ...]]
    asleep: Mapping[str, str]
    actions: tuple[FleetAction, ...]
    gpu_gb: float
    lam: float
    density: np.ndarray


def cold_requests(burst: np.ndarray, ready_s: np.ndarray, step_s: float) -> np.ndarray:
    """Requests of a burst of ``burst`` per step that arrive before a cold model is ready."""
    first = step_s / (burst + 1.0)
    return np.maximum(1.0, burst * np.minimum(1.0, (first + ready_s) / step_s))


def densities(ctx: FleetContext) -> tuple[np.ndarray, np.ndarray]:
    """Expected requests spared a cold start per GB per warm step: (on GPU rather than asleep, asleep rather than cached).

    Marginal values: GPU memory is worth what it saves over the tier the model falls back to
    (asleep, woken in a fraction of a load), host memory what sleeping saves over a load from
    the page cache. A large model that wakes slowly earns GPU memory before a small one that
    wakes in a second.
    """
    cat = ctx.catalog
    step = ctx.params.step_s
    b = ctx.burst_requests
    base = cat.priority_array * ctx.rate / cat.mem_array
    asleep = cold_requests(b, cat.ready_array(Tier.ASLEEP), step)
    cached = cold_requests(b, cat.ready_array(Tier.CACHED), step)
    return base * asleep, base * np.maximum(cached - asleep, 0.0)


def _where(nodes: Sequence[FleetNode]) -> dict[str, dict[Tier, list[str]]]:
    """model -> tier -> nodes where it is resident at that tier."""
    out: dict[str, dict[Tier, list[str]]] = {}
    for n in nodes:
        for model, t in n.resident.items():
            out.setdefault(model, {}).setdefault(t, []).append(n.name)
    return out


def plan_fleet(ctx: FleetContext, state: FleetState) -> tuple[FleetPlan, FleetState]:
    """One fleet round: every model's tier and node, within node memory and the fleet budget."""
    params = ctx.params
    cat = ctx.catalog
    cards, index, mem = cat.cards, cat.index, cat.mem_array
    dens, host_dens = densities(ctx)
    state = steer(state, params, ctx.observed, dens)
    free = {n.name: n.gpu_gb for n in ctx.nodes}
    total_gb = sum(free.values())
    host_free = {n.name: n.host_gb * params.sleep_share for n in ctx.nodes}
    no_sleep = {n.name: n.no_sleep for n in ctx.nodes}
    by_model = _where(ctx.nodes)
    on_gpu = {(m, n.name): max(1, int(n.replicas.get(m, 1))) for n in ctx.nodes for m, t in n.resident.items()
              if t is Tier.GPU}
    gpu: dict[str, list[str]] = {}
    actions: list[FleetAction] = []

    def put(i: int, node: str) -> None:
        name = cards[i].name
        free[node] -= mem[i]
        gpu.setdefault(name, []).append(node)
        tiers = by_model.get(name, {})
        if gpu[name].count(node) > on_gpu.get((name, node), 0):  # one more than runs there: woken or loaded
            woken = node in tiers.get(Tier.ASLEEP, []) and gpu[name].count(node) == 1
            actions.append(FleetAction(ActionKind.WAKE if woken else ActionKind.LOAD, name, node, float(dens[i])))

    def place(i: int) -> bool:
        """One more replica of model i: where one runs and is not yet kept, else where it sleeps or is cached,
        else on the node with the fewest of its replicas, best fit among those (a dense model's spread out)."""
        name = cards[i].name
        tiers = by_model.get(name, {})
        placed = gpu.get(name, [])
        if params.cap_gb is not None and total_gb - sum(free.values()) + mem[i] > params.cap_gb + 1e-9:
            return False
        kept = [n for n in tiers.get(Tier.GPU, []) if placed.count(n) < on_gpu.get((name, n), 0)]
        prefer = kept + [n for n in tiers.get(Tier.ASLEEP, []) + tiers.get(Tier.CACHED, []) if n not in placed]
        node = next((n for n in prefer if free[n] >= mem[i]), None)
        if node is None:
            fits = [n for n in free if free[n] >= mem[i]]
            if not fits:
                return False
            node = min(fits, key=lambda n: (placed.count(n), free[n]))  # the fewest of its replicas, then best fit
        put(i, node)
        return True

    # 1. a model with requests in flight stays, whatever its value: one replica, where the most are in flight (its
    #    others are weighed below like any replica; one let go drains its requests before it goes)
    busiest: dict[str, tuple[int, str]] = {}
    for fnode in ctx.nodes:
        for model, n in fnode.in_flight.items():
            if n > 0 and fnode.resident.get(model) == Tier.GPU and n > busiest.get(model, (0, ""))[0]:
                busiest[model] = (n, fnode.name)
    for model, (_, node) in busiest.items():
        put(index[model], node)

    def fill(wants: Mapping[str, int]) -> None:
        """Up to ``wants[model]`` replicas each while memory lasts, one more per model per pass."""
        short = {m: w for m, w in wants.items() if len(gpu.get(m, [])) < w}
        while short:
            short = {m: w for m, w in short.items() if place(index[m]) and len(gpu.get(m, [])) < w}

    # 2. the replicas the load now needs (no margin): requests arriving now wait for certain without them
    fill(ctx.serving)
    # 3. dense models: the replicas their forecast needs, while memory lasts (sized on the cold-start budget for
    #    the many requests they serve: before the warmth of a model a request may or may not come to)
    fill(ctx.replicas)
    # 4. models worth their memory at the price ``lam``, best density first, where they are if possible
    order = np.argsort(-dens, kind="stable")
    keep = order[dens[order] >= state.lam]
    for i in keep:
        if cards[i].name not in gpu:
            place(i)
    # 5. below GPU: what leaves it sleeps while host memory lasts (where it is), the best value of a wake over a
    #    load first, then the best GPU density. Host memory is a capacity, not a price: the budget is GPU memory,
    #    and a sleeping model costs the GPU only its copy out. Only a model on GPU or already asleep can sleep
    #    (a sleep is a running engine's); a model in the page cache takes no host memory from one that can
    asleep: dict[str, str] = {}
    for i in np.lexsort((-dens, -host_dens)):
        name = cards[i].name
        tiers = by_model.get(name, {})
        if name in gpu or not cards[i].sleeps:
            continue
        can = [n for n in host_free if name not in no_sleep[n]]  # nodes where its engine can sleep
        cand = [n for n in tiers.get(Tier.ASLEEP, []) + tiers.get(Tier.GPU, []) if n in can]
        host = next((n for n in cand if host_free[n] >= mem[i]), None)
        if host is None:
            continue
        host_free[host] -= mem[i]
        asleep[name] = host
    # 6. what leaves GPU or host memory: the replicas beyond those kept on each node (one put to sleep where the
    #    model sleeps and none is kept, the others evicted)
    for model, tiers in by_model.items():
        i = index[model]
        on = gpu.get(model, [])
        for node in tiers.get(Tier.GPU, []):
            surplus = on_gpu[(model, node)] - on.count(node)
            for k in range(max(0, surplus)):
                sleeps = k == 0 and node not in on and asleep.get(model) == node
                actions.append(FleetAction(ActionKind.SLEEP if sleeps else ActionKind.EVICT, model, node,
                                           float(dens[i])))
        for node in tiers.get(Tier.ASLEEP, []):
            if asleep.get(model) != node and node not in on:
                actions.append(FleetAction(ActionKind.EVICT, model, node, float(dens[i])))
    used = sum(n.gpu_gb for n in ctx.nodes) - sum(free.values())
    new_state = _price(state, params, used)
    plan = FleetPlan(gpu={k: tuple(v) for k, v in gpu.items()}, asleep=asleep, actions=tuple(actions),
                     gpu_gb=float(used), lam=state.lam, density=dens)
    return plan, new_state


def steer(state: FleetState, params: FleetParams, observed: tuple[float, float, float] | None,
          dens: np.ndarray) -> FleetState:
    """The memory price steered by the cold-start budget (without a memory budget): an integrator of the
    overspend, as the count planner's margin (`forecasting.calibration.budget_overspend`, the same measure), on
    the log of the price. Requests of the outlook-planned models that waited lower it by ``price_gain`` e-folds per
    calibration window's budget they spent (more models stay warm); calm windows raise it as much (fewer do). So
    over the budget's horizon the share of their requests that waited is the budget, whatever the step or the
    traffic, as long as the price is within the densities' range: it is kept there (from the lowest positive
    density, every model warm, to just above the highest, none kept for its outlook), so it does not wind up
    beyond what changes a decision."""
    if params.budget_gb is not None or params.cold_start_budget is None or observed is None:
        return state
    requests, waited, span_s = observed
    if not span_s > 0:
        return state
    over, rate, weight_s = budget_overspend(requests, waited, span_s, state.counted_rate, state.counted_weight_s,
                                            budget=params.cold_start_budget, calibration_s=params.calibration_s,
                                            horizon_s=params.horizon_s)
    # (the move is clipped only so that exp stays finite: 50 e-folds is wider than any densities' range)
    lam = state.lam * math.exp(-params.price_gain * float(np.clip(over, -50.0, 50.0))) if over is not None else state.lam
    positive = dens[dens > 0]
    if positive.size:
        lam = float(np.clip(lam, positive.min(), np.nextafter(positive.max(), np.inf)))
    lam = float(min(params.lam_max, max(params.lam_min, lam)))
    return replace(state, lam=lam, counted_rate=rate, counted_weight_s=weight_s)


def _price(state: FleetState, params: FleetParams, used_gb: float) -> FleetState:
    """Integral control of the memory price toward the fleet budget (average warm GB)."""
    spent = state.spent_gb_s + float(used_gb) * params.step_s
    elapsed = state.elapsed_s + params.step_s
    lam = state.lam
    if params.budget_gb is not None and params.budget_gb > 0:
        over = (spent / elapsed - params.budget_gb) / params.budget_gb
        now_over = (used_gb - params.budget_gb) / params.budget_gb
        lam = lam * math.exp(params.gain * float(np.clip(over + now_over, -3.0, 3.0)))
        lam = float(min(params.lam_max, max(params.lam_min, lam)))
    return replace(state, lam=lam, spent_gb_s=spent, elapsed_s=elapsed)
