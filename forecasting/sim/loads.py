"""Replica loads on nodes: what a cold start costs when several happen at once, and what the planner learns of it.

A backtest that gives every start its full, constant cold start flatters a policy that starts
many replicas (churn) and a planner handed the replica model's exact p95. This module charges
what a node pays instead, the same way for every policy and both engines of
`forecasting.sim.simulate`:

- each cold start is drawn (`SimParams.cold_starts_s`, measured, else a lognormal of
  `cold_start_cv`), and split into a weight transfer (`load_share` of it) and the rest
  (process start, warmup, validation);
- replicas sit on nodes of `gpus_per_node` GPUs, packed (the lowest node with a free GPU),
  and a node's transfers use its one load bandwidth (`node_loads`): "ordered", one after
  another in the order they began, as prewarm's runtime does (one replica fills the node's
  snapshot while the others wait for it), or "shared", all at once (processor sharing: with
  k transfers on the node each progresses at 1/k speed). Either way a burst of starts on a
  node ends later than one start would; ordered, its first replica is ready as soon as one;
- ordered, with `snapshot_ratio` set, the snapshot is credited: a node's first completed
  transfer fills it, and from then every transfer on the node (those queued behind the fill,
  and any later one) copies from it at once, in `snapshot_ratio` of its transfer time;
- a load cancelled half-way has still held its GPU and bandwidth until then;
- the starts that completed are the planner's only knowledge of cold starts: the p95 of the
  last `LOADTIMES_KEEP` of them, as the live registry's `load_time_p95` computes it.

Pure (numpy, seeded by the caller's generator).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

import numpy as np

from forecasting.sim.workload import SimParams
from prewarm.core.keys import LOADTIMES_KEEP
from prewarm.policy.load_times import load_time_p95

_EPS = 1e-9


def cold_sampler(params: SimParams, rng: np.random.Generator) -> Callable[[], float]:
    """One cold start per call: a measured one (seeded, with replacement), else the lognormal (or the constant)."""
    if params.cold_starts_s:
        measured = np.asarray(params.cold_starts_s, dtype=np.float64)
        return lambda: float(measured[rng.integers(measured.size)])
    if params.cold_start_cv <= 0:
        return lambda: params.cold_start_s
    sigma = math.sqrt(math.log(1 + params.cold_start_cv**2))
    mu = math.log(params.cold_start_s) - sigma**2 / 2
    return lambda: float(rng.lognormal(mu, sigma))


def cold_start_p95(params: SimParams) -> float:
    """The cold-start p95 of the replica model itself (what `planner_cold_start="exact"` hands the planner)."""
    if params.cold_starts_s:
        measured = load_time_p95(params.cold_starts_s)
        assert measured is not None
        return measured
    if params.cold_start_cv <= 0:
        return params.cold_start_s
    sigma = math.sqrt(math.log(1 + params.cold_start_cv**2))
    mu = math.log(params.cold_start_s) - sigma**2 / 2
    return float(math.exp(mu + 1.6448536269514722 * sigma))


class LoadBank:
    """Which node each replica holds a GPU on, and the loads in progress (see the module docstring).

    Ordered: a queue of transfers per node, its head's real end in `_nodes`.
    Processor sharing per node with a virtual clock: a node's clock runs at 1/k of real time
    while k transfers run on it, so a transfer of W seconds (at full bandwidth) that began at
    node clock v ends when the clock reaches v + W, whatever the sharing meanwhile. Transfers
    wait in a heap per node by that finish, each node's next real finish in one heap (stale
    entries skipped by version), the unshared rest in another by its real end: an event costs
    O(log n), so thousands of concurrent loads on hundreds of nodes replay fast.
    """

    def __init__(self, params: SimParams, rng: np.random.Generator) -> None:
        self._cold = cold_sampler(params, rng)
        self._gpn = params.gpus_per_node
        self._ordered = params.node_loads == "ordered"
        self._ratio = params.snapshot_ratio  # ordered: a filled node's transfers take this share (None: uncredited)
        self._filled: set[int] = set()  # nodes whose snapshot a completed transfer filled
        self._queue: dict[int, deque[tuple[int, float]]] = {}  # ordered: node -> (rid, transfer s), head transferring
        self._share = params.load_share
        self._used: list[int] = []  # replicas holding a GPU per node
        self._free: list[int] = []  # heap of nodes with a free GPU (lowest first; stale entries skipped)
        self._node_of: dict[int, int] = {}
        self._started: dict[int, float] = {}  # loads in progress: rid -> load start
        self._rest_of: dict[int, float] = {}  # rid -> its unshared rest (s), while it transfers
        self._clock: dict[int, tuple[float, float]] = {}  # node -> (virtual clock, at real time)
        self._k: dict[int, int] = {}  # node -> transfers running on it
        self._xfer: dict[int, list[tuple[float, int]]] = {}  # node -> heap of (virtual finish, rid)
        self._ver: dict[int, int] = {}  # node -> version of its entry in _nodes
        self._nodes: list[tuple[float, int, int]] = []  # heap of (real time of the node's next transfer end, node, ver)
        self._rest: list[tuple[float, int]] = []  # heap of (real end, rid) of loads past their transfer
        self._seen: deque[float] = deque(maxlen=LOADTIMES_KEEP)
        self._p95: float | None = None
        self.starts = 0

    # -- placement ---------------------------------------------------------------------------------------------
    def place(self, rid: int) -> int:
        """Give replica `rid` a GPU: the lowest node with one free (a new node when none)."""
        while self._free and self._used[self._free[0]] >= self._gpn:
            heapq.heappop(self._free)  # stale: filled since
        if self._free:
            node = self._free[0]
        else:
            node = len(self._used)
            self._used.append(0)
            heapq.heappush(self._free, node)
        self._used[node] += 1
        self._node_of[rid] = node
        return node

    def release(self, rid: int, now: float) -> None:
        """Replica `rid` gives its GPU back (retired); a load still in progress is cancelled at `now`."""
        if self._started.pop(rid, None) is not None and rid in self._rest_of:
            node = self._node_of[rid]
            del self._rest_of[rid]  # its heap entry is skipped from now on
            if self._ordered:
                queue = self._queue[node]
                head = queue[0][0] == rid
                queue.remove(next(e for e in queue if e[0] == rid))
                if head:
                    self._start_head(node, now)
            else:
                self._sync(node, now)
                self._k[node] -= 1
                self._touch(node, now)
        node_ = self._node_of.pop(rid, None)
        if node_ is not None:
            if self._used[node_] == self._gpn:
                heapq.heappush(self._free, node_)
            self._used[node_] -= 1

    # -- loads -------------------------------------------------------------------------------------------------
    def begin(self, rid: int, now: float) -> None:
        """Start loading replica `rid` at `now` (placing it first if it has no GPU yet)."""
        node = self._node_of.get(rid)
        if node is None:
            node = self.place(rid)
        c = self._cold()
        transfer, rest = self._share * c, (1.0 - self._share) * c
        self._started[rid] = now
        self.starts += 1
        if transfer <= _EPS:
            heapq.heappush(self._rest, (now + rest, rid))
            return
        if self._ratio is not None and node in self._filled:  # mapped from the node's snapshot, alongside any other
            heapq.heappush(self._rest, (now + self._ratio * transfer + rest, rid))
            return
        self._rest_of[rid] = rest
        if self._ordered:
            queue = self._queue.setdefault(node, deque())
            queue.append((rid, transfer))
            if len(queue) == 1:
                self._start_head(node, now)
            return
        clock = self._sync(node, now)
        self._k[node] = self._k.get(node, 0) + 1
        heapq.heappush(self._xfer.setdefault(node, []), (clock + transfer, rid))
        self._touch(node, now)

    @property
    def loading(self) -> int:
        return len(self._started)

    def next_time(self) -> float:
        """The next moment a load finishes or a transfer ends (inf: none in progress); step to it with `pop_ready`."""
        while self._rest and self._rest[0][1] not in self._started:
            heapq.heappop(self._rest)  # cancelled
        while self._nodes and self._nodes[0][2] != self._ver.get(self._nodes[0][1]):
            heapq.heappop(self._nodes)  # stale
        a = self._rest[0][0] if self._rest else math.inf
        b = self._nodes[0][0] if self._nodes else math.inf
        return a if a < b else b

    def pop_ready(self, now: float) -> list[tuple[int, float]]:
        """Step to `now` (never past `next_time()`) and return the loads finished by then: (rid, ready time)."""
        while self._nodes and self._nodes[0][0] <= now + _EPS:
            end, node, ver = heapq.heappop(self._nodes)
            if ver != self._ver.get(node):
                continue
            if self._ordered:  # the head's transfer is over: its rest starts, and the next transfer
                queue = self._queue[node]
                rid, _ = queue.popleft()
                heapq.heappush(self._rest, (end + self._rest_of.pop(rid), rid))
                if self._ratio is not None:  # it filled the snapshot: the queued ones copy from it, all at once
                    self._filled.add(node)
                    while queue:
                        waiter, transfer = queue.popleft()
                        heapq.heappush(self._rest, (end + self._ratio * transfer + self._rest_of.pop(waiter), waiter))
                self._start_head(node, end)
                continue
            clock = self._sync(node, now)
            heap = self._xfer[node]
            while heap and heap[0][0] <= clock + _EPS:
                _, rid = heapq.heappop(heap)
                rest = self._rest_of.pop(rid, None)
                if rest is None:
                    continue  # cancelled
                self._k[node] -= 1
                heapq.heappush(self._rest, (now + rest, rid))
            self._touch(node, now)
        done: list[tuple[int, float]] = []
        while self._rest and self._rest[0][0] <= now + _EPS:
            _, rid = heapq.heappop(self._rest)
            started = self._started.pop(rid, None)
            if started is None:
                continue  # cancelled
            self._seen.append(now - started)
            done.append((rid, now))
        if done:
            self._p95 = load_time_p95(self._seen)
        return done

    def observed_p95(self) -> float | None:
        """The p95 of the last `LOADTIMES_KEEP` completed cold starts (None before the first)."""
        return self._p95

    def _start_head(self, node: int, now: float) -> None:
        """Ordered: the node's next transfer (if any) starts at `now`; (re)schedule its end."""
        ver = self._ver.get(node, 0) + 1
        self._ver[node] = ver
        queue = self._queue[node]
        if queue:
            heapq.heappush(self._nodes, (now + queue[0][1], node, ver))

    def _sync(self, node: int, now: float) -> float:
        """The node's virtual clock brought to real time `now` (at its sharing since the last change)."""
        clock, at = self._clock.get(node, (0.0, now))
        k = self._k.get(node, 0)
        if k > 0:
            clock += (now - at) / k
        self._clock[node] = (clock, now)
        return clock

    def _touch(self, node: int, now: float) -> None:
        """Its sharing or its transfers changed at `now`: (re)schedule the node's next transfer end."""
        ver = self._ver.get(node, 0) + 1
        self._ver[node] = ver
        heap = self._xfer.get(node, [])
        while heap and heap[0][1] not in self._rest_of:
            heapq.heappop(heap)  # cancelled
        k = self._k.get(node, 0)
        if heap and k > 0:
            clock, _ = self._clock[node]
            heapq.heappush(self._nodes, (now + (heap[0][0] - clock) * k, node, ver))
