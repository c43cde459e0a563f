"""Which revision of a model takes a request: the weighted split of a rollout (pure).

A model may have several live revisions, each with a traffic weight (a canary rollout
writes them, `prewarm.registry.rollouts`). The gateway asks this module for a revision
before it asks `prewarm.policy.routing` for a replica of that revision. Rules:

1. a request that names a revision (`X-Prewarm-Revision`, for testing) gets that revision,
   weight or not; a name that is neither weighted nor live is refused (the caller answers 404);
2. no weights recorded: every live revision is eligible (no rollout, nothing to split);
3. weights recorded: a revision is drawn by weight among those with a ready replica. A
   weighted revision with nothing ready gets no traffic (its share goes to the others), so
   no request ever waits for a canary that is still loading; a revision with no weight gets
   nothing, however ready;
4. nothing weighted is ready: the heaviest weighted revision, so the caller holds the request
   or answers 503 for it (and records demand) exactly as for a model with nothing ready;
5. sticky: with a route key (`X-Prewarm-Route-Key`) the draw is a hash of the key, not a
   random number. The weights are ordered canary first, so a key whose hash falls under the
   canary's share stays on the canary while the share grows (5 -> 25 -> 50 -> 100).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence


class RevisionChoiceKind(str, Enum):
    ANY = "any"  # no weights recorded: route among every revision
    WEIGHTED = "weighted"  # drawn by weight among the ready weighted revisions
    STICKY = "sticky"  # drawn by the hash of the caller's route key
    PINNED = "pinned"  # named by the request
    NOT_READY = "not_ready"  # nothing weighted is ready: the heaviest, for the caller to hold or refuse
    UNKNOWN = "unknown"  # the named revision is neither weighted nor live


@dataclass(frozen=True)
class RevisionChoice:
    kind: RevisionChoiceKind
    revision: str | None  # None: every revision (ANY) or none (UNKNOWN)
    reason: str


def key_draw(key: str) -> float:
    """A stable number in [0, 1) for a route key: the same key draws the same revision."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def choose_revision(
    weights: Sequence[tuple[str, float]],
    ready: Iterable[str],
    *,
    draw: float,
    pinned: str | None = None,
    route_key: str | None = None,
    live: Iterable[str] = (),
) -> RevisionChoice:
    """Pick the revision for one request.

    `weights`: (revision, weight) pairs, canary first (the order sticky keys rely on);
    `ready`: revisions with at least one routable replica; `live`: every revision with a
    registered replica (a pinned name must be one of these or weighted); `draw`: a uniform
    number in [0, 1) the caller supplies (random per request), used unless `route_key` is set.
    """
    ready_set = set(ready)
    if pinned is not None:
        known = {r for r, _ in weights} | ready_set | set(live)
        if pinned not in known:
            return RevisionChoice(RevisionChoiceKind.UNKNOWN, None,
                                  f"revision {pinned!r} is not live; live: {', '.join(sorted(known)) or 'none'}")
        return RevisionChoice(RevisionChoiceKind.PINNED, pinned, "named by the request")
    if not weights:
        return RevisionChoice(RevisionChoiceKind.ANY, None, "no revision weights recorded")
    eligible = [(r, w) for r, w in weights if w > 0 and r in ready_set]
    total = sum(w for _, w in eligible)
    if not eligible or total <= 0:
        heaviest = max(weights, key=lambda rw: rw[1])[0]
        return RevisionChoice(RevisionChoiceKind.NOT_READY, heaviest, "no weighted revision has a ready replica")
    u = key_draw(route_key) if route_key is not None else draw
    if not 0.0 <= u < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {u!r}")
    kind = RevisionChoiceKind.STICKY if route_key is not None else RevisionChoiceKind.WEIGHTED
    acc = 0.0
    for rev, w in eligible:
        acc += w / total
        if u < acc:
            return RevisionChoice(kind, rev, f"weight {w:g} of {total:g}")
    rev, w = eligible[-1]  # rounding: u just under 1
    return RevisionChoice(kind, rev, f"weight {w:g} of {total:g}")
