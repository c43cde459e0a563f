"""What a replay charges that the live path pays, in one place for both replays.

`forecasting.sim` replays one model's replicas (request by request, or a per-second fluid
queue) and `forecasting.fleet.simulate` a pool of models step by step; both take these
defaults and the snapshot rule from here, so that a charge cannot differ between them by
accident, and read the loads they charged as the registry reads its own
(`prewarm.policy.load_times`). Why each value: docs/simulator.md.

The snapshot rule (prewarm's runtime, `SnapshotStore.fill`): replicas of one model started
on a node do not each read the weights from the origin. The first fills the node's
snapshot (its weight transfer, `LOAD_SHARE` of its load); the others wait for the fill and
then copy from the snapshot, all at once. A node whose snapshot is already filled (its
weights in the page cache) serves a copy at once.

Pure (no I/O).
"""

from __future__ import annotations

import math

import numpy as np

#: seconds from a decision (or a cold model's first request) to its load starting: the live event dispatch beat
#: (`workers.schedule.EVENT_DISPATCH_S`, 2 s) plus the Celery queue and the agent's task start
ACTUATION_S = 2.5
#: a request that waited longer than this for capacity (a load, a wake or a slot) is a cold-start hit, as the
#: gateway's `waited` counter counts it (`prewarm.core.settings: wait_threshold_s`)
WAIT_THRESHOLD_S = 0.5
#: loads spread: each one's time is its expected time times a lognormal draw of mean 1 and this coefficient of
#: variation (image cache, disk, node load); a constant flatters a planner told its p95
COLD_START_CV = 0.3
#: the share of a load that is its weight transfer (what fills a node's snapshot); the rest, process start,
#: warmup and validation, is each replica's own
LOAD_SHARE = 0.5


def spread(rng: np.random.Generator, cv: float, size: int) -> np.ndarray:
    """`size` lognormal factors of mean 1 and coefficient of variation `cv` (ones where `cv` is 0, no draw)."""
    if cv <= 0:
        return np.ones(size)
    sigma = math.sqrt(math.log(1 + cv**2))
    return rng.lognormal(-sigma**2 / 2, sigma, size)


def copies_ready_s(fill_starts_s: np.ndarray | float, fill_load_s: np.ndarray | float, copy_s: np.ndarray | float,
                   filled: np.ndarray | bool, load_share: float = LOAD_SHARE) -> np.ndarray:
    """When the replicas beyond a model's first, started with it, are ready (seconds, as `fill_starts_s`).

    `fill_starts_s`: when the first replica's load starts; `fill_load_s`: that load (it fills the node's
    snapshot with its transfer, `load_share` of it, unless `filled`: the snapshot is there already);
    `copy_s`: a load from the snapshot. A copy starts when the fill ends, at once where the node is filled.
    """
    starts = np.asarray(fill_starts_s, dtype=np.float64)
    fill = np.where(filled, 0.0, load_share * np.asarray(fill_load_s, dtype=np.float64))
    return starts + fill + np.asarray(copy_s, dtype=np.float64)

