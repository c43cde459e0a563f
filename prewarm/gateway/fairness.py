"""Fair turns at a model's replicas: requests beyond their concurrency wait here, one client at a time.

Issue 20: admission (`prewarm.policy.admission`) bounds how much work is queued and shares
it between clients, but a request sent on to a replica waits there in arrival order: behind
a greedy client's admitted requests, a 4-token request still waited for all of them. So
the gateway sends a model at most the concurrency its ready replicas serve at once
(`replica_concurrency` each) and keeps the rest here, one queue per client, served round
robin when a request finishes: a client with one request waits for one turn, however many
another client has waiting. A client that goes away leaves its place (its wait is cancelled).

Turns are not preempted, so a client holding every turn with long requests would still make a
newcomer wait for one of them to finish (the benchmark's well-behaved client waited a whole
500-token request each time): one client holds at most `capacity - 1` turns, so a turn is
always free for someone else (a lone client uses all but one; with a capacity of 1, all).
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator


@dataclass
class _Turns:
    inflight: int = 0
    held: dict[str, int] = field(default_factory=dict)  # turns held per client
    waiting: dict[str, deque["asyncio.Future[None]"]] = field(default_factory=dict)
    order: deque[str] = field(default_factory=deque)  # clients with requests waiting, next first


class FairTurns:
    """Per-model turns at the replicas, round robin between clients."""

    def __init__(self) -> None:
        self.models: dict[str, _Turns] = {}

    def waiting(self, model: str) -> int:
        t = self.models.get(model)
        return sum(len(q) for q in t.waiting.values()) if t else 0

    @asynccontextmanager
    async def turn(self, model: str, client: str, capacity: int | None) -> AsyncIterator[None]:
        """Hold a turn for the duration of the block; `capacity` None: no replica ready, no turns kept."""
        if capacity is None:
            yield
            return
        t = self.models.setdefault(model, _Turns())
        if t.inflight < capacity and not t.order and self._may_hold(t, client, capacity):
            t.inflight += 1
            t.held[client] = t.held.get(client, 0) + 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            t.waiting.setdefault(client, deque()).append(fut)
            if client not in t.order:
                t.order.append(client)
            self._dispatch(t, capacity)  # a turn free for this client (others wait at their limit) is its now
            try:
                await fut  # the slot was taken for us by _dispatch
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # granted just as the client went away: hand it on
                    self._done(t, client, capacity)
                raise
        try:
            yield
        finally:
            self._done(t, client, capacity)

    @staticmethod
    def _may_hold(t: _Turns, client: str, capacity: int) -> bool:
        return capacity == 1 or t.held.get(client, 0) < capacity - 1

    def _done(self, t: _Turns, client: str, capacity: int) -> None:
        t.inflight -= 1
        t.held[client] -= 1
        if t.held[client] <= 0:
            del t.held[client]
        self._dispatch(t, capacity)

    def _dispatch(self, t: _Turns, capacity: int) -> None:
        """Free turns to waiting clients, round robin, skipping a client at its limit of turns."""
        skipped = 0
        while t.inflight < capacity and t.order and skipped < len(t.order):
            client = t.order.popleft()
            if not self._may_hold(t, client, capacity):
                t.order.append(client)  # its turn comes when one of its own is done
                skipped += 1
                continue
            skipped = 0
            queue = t.waiting[client]
            fut = queue.popleft()
            if queue:
                t.order.append(client)  # its next request waits for the other clients' turns
            else:
                del t.waiting[client]
            if fut.done():  # cancelled while waiting
                continue
            t.inflight += 1
            t.held[client] = t.held.get(client, 0) + 1
            fut.set_result(None)
