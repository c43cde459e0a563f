"""THE placement rule, shared by the planner's step (`forecasting.planner`) and the live demand path
(`workers.planning.nodes`): where each new replica of a model goes. Pure: the node views are passed in."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from prewarm.core.domain import NodeView, ScaleEvent, ScaleEventKind

__all__ = ["place", "place_events"]


def place(nodes: Iterable[NodeView], model_key: str, n: int, used: dict[str, int] | None = None) -> tuple[str, ...]:
    """THE placement rule: a node for each of `n` replicas, snapshot holders first, then the least
    loaded (live replicas over slots), then by name; `used` counts what earlier picks took."""
    used = {} if used is None else used
    pool = list(nodes)
    chosen: list[str] = []
    for _ in range(n):
        best: tuple[tuple[int, float, str], NodeView] | None = None
        for node in pool:
            taken = used.get(node.name, 0)
            if not node.ready or node.free_slots - taken <= 0:
                continue
            key = (0 if model_key in node.snapshots else 1, (node.replicas + taken) / max(1, node.replica_slots), node.name)
            if best is None or key < best[0]:
                best = (key, node)
        if best is None:
            break
        used[best[1].name] = used.get(best[1].name, 0) + 1
        chosen.append(best[1].name)
    return tuple(chosen)


def place_events(nodes: Sequence[NodeView], model_key: str,
                 events: Sequence[ScaleEvent]) -> tuple[list[ScaleEvent], list[tuple[ScaleEvent, str]]]:
    """A step's events with its scale-ups placed (`place`, one rule for all of them, in order): the events kept
    (a scale-up with the nodes found for it) and what no ready node had room for, with why."""
    used: dict[str, int] = {}
    out: list[ScaleEvent] = []
    dropped: list[tuple[ScaleEvent, str]] = []
    for ev in events:
        if ev.kind is not ScaleEventKind.SCALE_UP:
            out.append(ev)
            continue
        chosen = place(nodes, model_key, ev.replicas, used)
        if len(chosen) < ev.replicas:
            missing = ev.replicas - len(chosen)
            why = f"placement: no ready node with room for {missing} of {ev.replicas}"
            dropped.append((replace(ev, replicas=missing), why))
        if chosen:
            out.append(replace(ev, replicas=len(chosen), nodes=chosen))
    return out, dropped
