"""The live nodes the planner may place replicas on, read from what agents publish (`keys.node_info`).

The choice of a node is the planner's one placement rule (`forecasting.placement.place`),
applied here to slots (`pick_slots`); `live_nodes` is the one read behind it. A chosen slot is
reserved for its replica (`reserve_slots`, `keys.slot_claim`) until the agent's prewarm of it
ends (`release_slot`), so choosers running at once (two scale events of one plan, a scale from zero)
never send two replicas to one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

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


def reserve_slots(ctx: WorkerContext, n: int, replica_of: Callable[[str, int], str], *,
                  nodes: Callable[[], list[NodeSlots]] | None = None, wanted: Sequence[str] = (),
                  model_key: str = "", snapshots: Mapping[str, frozenset[str]] | None = None) -> list[tuple[str, int]]:
    """Up to `n` (node, slot) pairs chosen as `pick_slots` chooses among `nodes()` (default: `live_nodes`), each
    reserved for its replica (`replica_of(node, slot)`) by SET NX on its `keys.slot_claim`. A slot another
    chooser reserved first is passed over and the rest chosen again on a fresh read, where that reservation
    shows as used. The agent's prewarm of the replica releases the claim when it ends (`release_slot`: registered,
    the registry holds the slot; failed before, the slot is free again); a claim whose prewarm never runs
    lapses after the broker's visibility timeout, when an unacknowledged prewarm would have been delivered
    again. A dry run (`planner.dry_run`) reserves nothing: it returns what would be chosen."""
    read = nodes if nodes is not None else (lambda: live_nodes(ctx))
    if ctx.settings.planner.dry_run:
        return pick_slots(read(), n, wanted=wanted, model_key=model_key, snapshots=snapshots)
    ttl = max(1, int(ctx.settings.agent.effective_visibility_timeout_s))
    got: list[tuple[str, int]] = []
    for _ in range(n + 8):  # a lost claim is a reservation the next read sees: each round makes progress
        if len(got) >= n:
            break
        picks = pick_slots(read(), n - len(got), wanted=wanted[len(got):], model_key=model_key, snapshots=snapshots)
        if not picks:
            break
        for node, slot in picks:
            if not ctx.client.set(keys.slot_claim(node, slot), replica_of(node, slot), nx=True, ex=ttl):
                break
            got.append((node, slot))
    return got


#: Delete a slot's claim only while it names the given replica (another replica's later claim stays).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def release_slot(ctx: WorkerContext, node: str, slot: int, replica: str) -> None:
    """The slot's reservation for `replica` ends: its prewarm registered it (the registry holds the slot now) or
    ended before."""
    ctx.client.eval(_RELEASE, 1, keys.slot_claim(node, slot), replica)


def live_nodes(ctx: WorkerContext) -> list[NodeSlots]:
    """The nodes a live agent publishes, each with the slots its live replicas and the pending reservations use."""
    out = []
    for node in sorted(ctx.client.smembers(keys.NODES) | _published_nodes(ctx)):
        info: Mapping[str, str] = ctx.client.hgetall(keys.node_info(node))
        if not info or info.get("ready") != "1":
            continue  # no live agent publishes this node
        slots = int(info.get("replica_slots", "1"))
        used = frozenset(r.slot for r in ctx.registry.live_on_node(node)) | _claimed(ctx, node, slots)
        out.append(NodeSlots(node, slots, used))
    return out


def _claimed(ctx: WorkerContext, node: str, slots: int) -> frozenset[int]:
    """The slots of `node` reserved for a replica its agent has not registered yet."""
    if slots <= 0:
        return frozenset()
    held = ctx.client.mget([keys.slot_claim(node, s) for s in range(slots)])
    return frozenset(s for s, rid in enumerate(held) if rid is not None)


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
