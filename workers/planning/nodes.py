"""The live nodes the planner may place replicas on, read from what agents publish (`keys.node_info`).

The choice of a node is the planner's one placement rule (`forecasting.placement.place`),
applied here to slots (`pick_slots`); `live_nodes` is the one read behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from forecasting.placement import place
from prewarm.core import keys
from prewarm.core.domain import NodeView
from prewarm.policy.sleep_tier import FIELD as SLEEP_FIELD, parse_report
from workers.context import WorkerContext


@dataclass(frozen=True)
class NodeSlots:
    node: str
    slots: int
    used: frozenset[int]

    @property
    def free(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.used]


def pick_slots(nodes: Iterable[NodeSlots], n: int, *, wanted: Sequence[str] = (), model_key: str = "",
               snapshots: Mapping[str, frozenset[str]] | None = None) -> list[tuple[str, int]]:
    """`n` (node, lowest free slot) pairs: the planner's placement (`wanted`) first where it still
    fits, then `forecasting.placement.place` (snapshot holders, then the least loaded, then by name)."""
    table = {ns.node: ns for ns in nodes}
    snaps = snapshots or {}
    chosen: list[tuple[str, int]] = []
    for i in range(n):
        if i < len(wanted) and wanted[i] in table and table[wanted[i]].free:
            node = wanted[i]
        else:
            views = [NodeView(name=ns.node, replica_slots=ns.slots, replicas=len(ns.used),
                              snapshots=snaps.get(ns.node, frozenset())) for ns in table.values()]
            got = place(views, model_key, 1)
            if not got:
                break
            node = got[0]
        ns = table[node]
        slot = ns.free[0]
        table[node] = NodeSlots(node, ns.slots, ns.used | {slot})
        chosen.append((node, slot))
    return chosen


def choose_placement(nodes: Iterable[NodeSlots]) -> tuple[str, int] | None:
    """One replica's (node, slot) by the same rule; None when every node is full."""
    got = pick_slots(nodes, 1)
    return got[0] if got else None


def live_nodes(ctx: WorkerContext) -> list[NodeSlots]:
    out = []
    for node in sorted(ctx.client.smembers(keys.NODES) | _published_nodes(ctx)):
        info: Mapping[str, str] = ctx.client.hgetall(keys.node_info(node))
        if not info or info.get("ready") != "1":
            continue  # no live agent publishes this node
        used = frozenset(r.slot for r in ctx.registry.live_on_node(node))
        out.append(NodeSlots(node, int(info.get("replica_slots", "1")), used))
    return out


def sleep_reports(ctx: WorkerContext, nodes: Iterable[str] | None = None) -> dict[str, dict[str, bool]]:
    """Node -> what its agent's engines report of sleep mode per model (`prewarm.policy.sleep_tier`), for
    `nodes` (default: the live ones)."""
    names = [ns.node for ns in live_nodes(ctx)] if nodes is None else list(nodes)
    return {n: parse_report(ctx.client.hget(keys.node_info(n), SLEEP_FIELD)) for n in names}


def node_classes(ctx: WorkerContext) -> list[str]:
    """The node classes of the live nodes (and this process's own `agent.node_class`): the classes agents
    record their measured times under (`registry.record_ready_time`)."""
    return sorted({ctx.client.hget(keys.node_info(ns.node), "node_class") or ctx.settings.agent.node_class
                   for ns in live_nodes(ctx)} | {ctx.settings.agent.node_class})


def measured_ready_p95(ctx: WorkerContext, model: str, tier: str) -> dict[str, float]:
    """Node class -> the measured p95 time to ready of `model` from `tier` there, for the classes measured."""
    return {cls: v for cls in node_classes(ctx) if (v := ctx.registry.ready_time_p95(model, tier, cls)) is not None}


def _published_nodes(ctx: WorkerContext) -> set[str]:
    prefix = keys.node_info("")
    return {k[len(prefix):] for k in ctx.client.scan_iter(match=prefix + "*", count=200)}
