"""The live nodes the planner may place replicas on, read from what agents publish (`keys.node_info`).

The choice of a node is the pure `choose_placement`; `live_nodes` is the one read behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from prewarm.core import keys
from workers.context import WorkerContext


@dataclass(frozen=True)
class NodeSlots:
    node: str
    slots: int
    used: frozenset[int]

    @property
    def free(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.used]


def choose_placement(nodes: Iterable[NodeSlots]) -> tuple[str, int] | None:
    """The node with the most free slots (ties: by name) and its lowest free slot; None when all are full."""
    best = sorted((n for n in nodes if n.free), key=lambda n: (-len(n.free), n.node))
    return (best[0].node, best[0].free[0]) if best else None


def live_nodes(ctx: WorkerContext) -> list[NodeSlots]:
    out = []
    for node in sorted(ctx.client.smembers(keys.NODES) | _published_nodes(ctx)):
        info: Mapping[str, str] = ctx.client.hgetall(keys.node_info(node))
        if not info or info.get("ready") != "1":
            continue  # no live agent publishes this node
        used = frozenset(r.slot for r in ctx.registry.live_on_node(node))
        out.append(NodeSlots(node, int(info.get("replica_slots", "1")), used))
    return out


def _published_nodes(ctx: WorkerContext) -> set[str]:
    prefix = keys.node_info("")
    return {k[len(prefix):] for k in ctx.client.scan_iter(match=prefix + "*", count=200)}
