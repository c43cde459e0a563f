"""The model catalog: what the fleet planner must know of each model to trade warmth for memory.

Per model: the GPU memory one replica holds, what one replica serves (req/s), a priority
(the weight of its requests) and its TTFT objective, and the measured time to ready from
each tier of warmth on each node class. The live system fills ``ready_s`` from the
registry's recorded load and wake times (`with_measured`); a backtest without measurements
uses `default_catalog`, whose times follow the footprint (bytes over a tier's bandwidth
plus a fixed start-up), so that the same planner code runs in both.
"""

from __future__ import annotations

import enum
import json
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np


class Tier(str, enum.Enum):
    """How warm a model is on a node, warmest first."""

    GPU = "gpu"  # loaded, validated, ready: serves at once
    ASLEEP = "asleep"  # engine level-1 sleep: weights in host memory, GPU freed; wakes in a fraction of a load
    CACHED = "cached"  # weights in the node's snapshot / page cache: a load without disk reads
    DISK = "disk"  # on disk only: a full load


#: Time to ready per tier when nothing is measured: fixed start-up (s) and bandwidth (GB/s).
#: Bandwidths are `benchmarks/tiers.py` on an H200 node with the real engine (bf16, 8 and
#: 30 GB): wake from level-1 sleep 53 GB/s (0.16 s for 8 GB), load from the page cache
#: 4.7 GB/s, from disk 1.6-1.75 GB/s; the start-ups add a runtime process's start (the
#: interpreter, torch, the CUDA context) to a load, and a little bookkeeping to a wake.
DEFAULT_STARTUP_S: Mapping[Tier, float] = {Tier.GPU: 0.0, Tier.ASLEEP: 0.1, Tier.CACHED: 4.0, Tier.DISK: 6.0}
DEFAULT_GBPS: Mapping[Tier, float] = {Tier.GPU: float("inf"), Tier.ASLEEP: 50.0, Tier.CACHED: 4.7, Tier.DISK: 1.6}
#: Footprints (GB) a default catalog draws from (one replica of 1.5B … 70B-class fp16 models).
DEFAULT_SIZES_GB: tuple[float, ...] = (4.0, 8.0, 16.0, 16.0, 30.0, 30.0, 66.0, 140.0)


def default_ready_s(mem_gb: float) -> dict[Tier, float]:
    """Seconds to ready from each tier for a model of ``mem_gb`` when nothing is measured."""
    return {t: DEFAULT_STARTUP_S[t] + mem_gb / DEFAULT_GBPS[t] for t in Tier}


def measured_ready_s(base: Mapping[Tier, float], load_p95_s: float | None,
                     tier_p95_s: Mapping[Tier, float]) -> dict[Tier, float]:
    """The times to ready a round plans a model with, from what was measured: `base` (the footprint's defaults
    live; the replayed catalog's times in a backtest); a load's p95 (the registry's `load_time_p95`) as the time
    from the page cache and at least from disk; each tier's measured p95 (the agents' per-tier records, the
    slowest class) over those. The live round's catalog (`workers.planning.fleet.fleet_catalog`) and the pool
    replay's planner (`forecasting.fleet.policies.FleetPlanner`) both build it here."""
    ready = dict(base)
    if load_p95_s is not None:
        ready[Tier.CACHED] = load_p95_s
        ready[Tier.DISK] = max(ready[Tier.DISK], load_p95_s)
    ready.update(tier_p95_s)
    return ready


@dataclass(frozen=True)
class ModelCard:
    """One model of the fleet. ``ready_s[node_class][tier]``: measured seconds to ready."""

    name: str
    mem_gb: float
    capacity_rps: float = 10.0
    priority: float = 1.0
    ttft_slo_s: float = 1.2
    ttft_warm_s: float = 0.25
    ready_s: Mapping[str, Mapping[Tier, float]] = field(default_factory=dict)
    # False where the model's engine reports it cannot sleep on any node it may use (vLLM off CUDA,
    # `prewarm.policy.sleep_tier`): the asleep tier is absent, a "wake" costs a load from the cache
    sleeps: bool = True

    def __post_init__(self) -> None:
        if not self.mem_gb > 0:
            raise ValueError(f"{self.name}: mem_gb must be positive")
        if not self.capacity_rps > 0 or not self.priority > 0:
            raise ValueError(f"{self.name}: capacity_rps and priority must be positive")

    def time_to_ready(self, tier: Tier, node_class: str = "default") -> float:
        """Measured seconds to ready from ``tier`` on ``node_class`` (else any class, else the default);
        from ``asleep`` where the model cannot sleep, its time from the cache (the tier it falls back to)."""
        if tier == Tier.GPU:
            return 0.0
        if tier == Tier.ASLEEP and not self.sleeps:
            tier = Tier.CACHED
        for cls in (node_class, "default", *self.ready_s):
            got = self.ready_s.get(cls, {}).get(tier)
            if got is not None:
                return float(got)
        return default_ready_s(self.mem_gb)[tier]


@dataclass(frozen=True)
class Catalog:
    """Every model's card, by name, in a fixed order (the fleet's column order)."""

    cards: tuple[ModelCard, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.cards]
        if len(set(names)) != len(names):
            raise ValueError("duplicate model names in the catalog")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cards)

    def card(self, name: str) -> ModelCard:
        return self.cards[self.index[name]]

    def __len__(self) -> int:
        return len(self.cards)

    @cached_property
    def index(self) -> dict[str, int]:
        return {c.name: i for i, c in enumerate(self.cards)}

    @cached_property
    def mem_array(self) -> np.ndarray:
        return np.array([c.mem_gb for c in self.cards], dtype=np.float64)

    @cached_property
    def capacity_array(self) -> np.ndarray:
        return np.array([c.capacity_rps for c in self.cards], dtype=np.float64)

    @cached_property
    def priority_array(self) -> np.ndarray:
        return np.array([c.priority for c in self.cards], dtype=np.float64)

    def ready_array(self, tier: Tier, node_class: str = "default") -> np.ndarray:
        """Seconds to ready from ``tier`` for every model (cached per tier and class)."""
        key = (tier, node_class)
        cache: dict[tuple[Tier, str], np.ndarray] = self.__dict__.setdefault("_ready_cache", {})
        if key not in cache:
            cache[key] = np.array([c.time_to_ready(tier, node_class) for c in self.cards], dtype=np.float64)
        return cache[key]

    def total_gb(self) -> float:
        return float(sum(c.mem_gb for c in self.cards))

    def with_measured(self, name: str, node_class: str, tier: Tier, seconds: float) -> "Catalog":
        """A catalog where ``name``'s time to ready from ``tier`` on ``node_class`` is ``seconds``."""
        out = []
        for c in self.cards:
            if c.name == name:
                per = {k: dict(v) for k, v in c.ready_s.items()}
                per.setdefault(node_class, {})[tier] = float(seconds)
                c = replace(c, ready_s=per)
            out.append(c)
        return Catalog(tuple(out))


def default_catalog(names: Sequence[str], sizes_gb: Sequence[float] = DEFAULT_SIZES_GB,
                    priorities: Mapping[str, float] | None = None) -> Catalog:
    """Cards for ``names`` with footprints drawn from ``sizes_gb`` by a stable hash of the name.

    The hash (crc32) makes a model's size independent of its traffic and the same in every
    run and on every machine.
    """
    pri = priorities or {}
    cards = []
    for n in names:
        mem = float(sizes_gb[zlib.crc32(n.encode()) % len(sizes_gb)])
        cards.append(ModelCard(name=n, mem_gb=mem, priority=float(pri.get(n, 1.0)),
                               ready_s={"default": default_ready_s(mem)}))
    return Catalog(tuple(cards))


def load_catalog(path: str | Path, names: Iterable[str] = ()) -> Catalog:
    """A JSON catalog: ``{"models": [{"name", "mem_gb", "capacity_rps"?, "priority"?, "ready_s"?}]}``.

    Models of ``names`` the file does not list get default cards.
    """
    data = json.loads(Path(path).read_text())
    cards: dict[str, ModelCard] = {}
    for item in data.get("models", []):
        ready = {cls: {Tier(t): float(s) for t, s in per.items()} for cls, per in item.get("ready_s", {}).items()}
        mem = float(item["mem_gb"])
        cards[item["name"]] = ModelCard(
            name=str(item["name"]), mem_gb=mem, capacity_rps=float(item.get("capacity_rps", 10.0)),
            priority=float(item.get("priority", 1.0)), ttft_slo_s=float(item.get("ttft_slo_s", 1.2)),
            ready_s=ready or {"default": default_ready_s(mem)})
    missing = [n for n in names if n not in cards]
    extra = default_catalog(missing).cards if missing else ()
    order = list(names) or list(cards)
    by_name = {**cards, **{c.name: c for c in extra}}
    return Catalog(tuple(by_name[n] for n in order))
