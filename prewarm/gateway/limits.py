"""Per-request limits of the gateway: body and write deadlines, client identity, fair admission.

Issue 20 found four ways one client could shut others out; `guard.py` handles what is
decided when a connection opens, this module what is decided per request:

- a request body must arrive within `body_timeout_s` of its headers (256 bodies trickled a
  byte at a time held their connections for a minute): 408 and the connection closed;
- a write to a client that reads nothing may block for `write_timeout_s`, then the client
  is cut and its replica slot freed (128 unread streams held every slot for 35 s and more);
- behind a declared proxy (`trusted_proxies`) a client is its `X-Forwarded-For` address,
  and its requests in flight are capped at `max_connections_per_client` (the connection
  cap cannot tell the proxy's clients apart): 429 with Retry-After past it;
- admission by expected wait with fair shares (`prewarm.policy.admission`), over the
  tokens each client has in flight per model and the model's measured drain rate.

The decisions are the pure policies'; this module only keeps the counts and the clocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from prewarm.core.settings import GatewaySettings
from prewarm.policy.admission import AdmissionDecision, admit, request_cost
from prewarm.policy.clients import client_address, client_key, is_trusted, networks

log = logging.getLogger("prewarm.gateway")

#: Busy seconds after which a model's drain measurement is halved: recent load outweighs old load.
RATE_WINDOW_S = 60.0
#: Busy seconds measured before the measured drain rate replaces the assumed one.
RATE_MIN_BUSY_S = 1.0


class BodyTimeout(Exception):
    """The request body did not arrive within the body deadline."""


class ClientStalled(Exception):
    """The client read nothing of its answer within the write deadline."""


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole request body, or `BodyTimeout` when it takes longer than `timeout_s` (slow-body abuse)."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:.0f}s") from None


async def write(resp: web.StreamResponse, chunk: bytes, timeout_s: float) -> None:
    """Write to a client; `ClientStalled` when the client's socket stays full for `timeout_s`."""
    try:
        await asyncio.wait_for(resp.write(chunk), timeout_s)
    except asyncio.TimeoutError:
        raise ClientStalled(f"the client read nothing for {timeout_s:.0f}s") from None


@dataclass
class _ModelQueue:
    queued: dict[str, float] = field(default_factory=dict)  # client -> tokens in flight
    serving: int = 0  # admitted requests that reached a replica and are not answered yet
    # The drain rate's clock runs only while a replica serves the model: a request held for a cold
    # start drains nothing, and counting its wait as busy time measured a rate near zero after every
    # load, so the next requests were refused for a queue that was about to drain.
    busy_since: float | None = None
    busy_s: float = 0.0
    done_tokens: float = 0.0

    def total(self) -> float:
        return sum(self.queued.values())


@dataclass
class Ticket:
    """One admitted request: its place in the model's queue until `release`."""

    model: str
    client: str
    address: str | None  # set when capped per request (behind a trusted proxy)
    cost: float
    decision: AdmissionDecision
    serving: bool = False  # it reached a replica (`Limits.serving`)
    released: bool = False


#: The authenticated client's name (`client_auth.ClientKeys`), when the gateway asks for keys.
CLIENT_NAME_KEY: "web.RequestKey[str]" = web.RequestKey("prewarm_client", str)

#: Where the gateway keeps a user request's ticket while it is routed.
TICKET_KEY: "web.RequestKey[Ticket]" = web.RequestKey("prewarm_ticket", Ticket)


class Limits:
    """The gateway's per-request limits and the per-model queues admission reads."""

    def __init__(self, cfg: GatewaySettings) -> None:
        self.cfg = cfg
        self.trusted = networks(cfg.trusted_proxies)
        self.queues: dict[str, _ModelQueue] = {}
        self.requests_per_address: Counter[str] = Counter()

    # --- who the client is -------------------------------------------------------------------
    def peer(self, request: web.Request) -> str:
        return request.remote or "?"

    def address(self, request: web.Request) -> str:
        return client_address(self.peer(request), request.headers.get("X-Forwarded-For"), self.trusted)

    def client(self, request: web.Request) -> str:
        name = request.get(CLIENT_NAME_KEY)
        if name is not None:  # authenticated: one share per named client, from any address
            return "client:" + name
        return client_key(request.headers.get("Authorization"), self.address(request))

    # --- the drain rate ------------------------------------------------------------------------
    def rate(self, model: str, now: float | None = None) -> float:
        """Tokens per busy second the model drained lately; the assumed rate until measured."""
        q = self.queues.get(model)
        if q is None:
            return self.cfg.assumed_tokens_per_s
        busy = q.busy_s + (((now or time.monotonic()) - q.busy_since) if q.busy_since is not None else 0.0)
        if busy < RATE_MIN_BUSY_S or q.done_tokens <= 0:
            return self.cfg.assumed_tokens_per_s
        return q.done_tokens / busy

    def drain_s(self, model: str) -> int:
        """Whole seconds until the model's queue has drained (the Retry-After of a full replica)."""
        q = self.queues.get(model)
        total = q.total() if q else 0.0
        return max(1, int(-(-total // self.rate(model))))

    # --- admission -----------------------------------------------------------------------------
    def admit(self, request: web.Request, model: str, payload: dict[str, object]) -> Ticket | web.Response:
        """Admit a user request into the model's queue (a `Ticket`), or the 429 that refuses it."""
        now = time.monotonic()
        address: str | None = None
        if self.cfg.max_connections_per_client and is_trusted(self.peer(request), self.trusted):
            address = self.address(request)
            if self.requests_per_address[address] >= self.cfg.max_connections_per_client:
                return _too_many(f"client {address} has {self.cfg.max_connections_per_client} requests in flight",
                                 "client_limit", self.cfg.retry_after_s)
        client = self.client(request)
        q = self.queues.setdefault(model, _ModelQueue())
        cost = request_cost(payload)
        decision = admit(cost, client, q.queued, rate=self.rate(model, now), max_wait_s=self.cfg.max_queue_wait_s)
        if not decision.admitted:
            log.info("admission refused for %s: %s", model, decision.reason)
            return _too_many(f"the queue for {model!r} is full for this client: {decision.reason}; retry in "
                             f"{decision.retry_after_s}s", "over_fair_share", decision.retry_after_s)
        if address is not None:
            self.requests_per_address[address] += 1
        q.queued[client] = q.queued.get(client, 0.0) + cost
        return Ticket(model, client, address, cost, decision)

    def serving(self, ticket: Ticket) -> None:
        """The request reached a replica: the model drains from now while anything is being served."""
        if ticket.serving or ticket.released:
            return
        ticket.serving = True
        q = self.queues[ticket.model]
        q.serving += 1
        if q.busy_since is None:
            q.busy_since = time.monotonic()

    def release(self, ticket: Ticket, status: int | None) -> None:
        """The request is answered (`status`, None when it never got one): its tokens leave the queue."""
        if ticket.released:
            return
        ticket.released = True
        now = time.monotonic()
        if ticket.address is not None:
            self.requests_per_address[ticket.address] -= 1
            if self.requests_per_address[ticket.address] <= 0:
                del self.requests_per_address[ticket.address]
        q = self.queues[ticket.model]
        q.queued[ticket.client] -= ticket.cost
        if q.queued[ticket.client] <= 1e-9:
            del q.queued[ticket.client]
        if not ticket.serving:  # refused or held past the hold timeout: no replica's time to count
            return
        q.serving -= 1
        if status == 200:
            q.done_tokens += ticket.cost
        if q.busy_since is not None:  # fold the busy time so far in; busy on while a replica serves
            q.busy_s += now - q.busy_since
            q.busy_since = now if q.serving else None
        if q.busy_s > RATE_WINDOW_S:  # halve both: the rate stays, old load weighs less
            q.busy_s /= 2
            q.done_tokens /= 2


def _too_many(message: str, code: str, retry_after_s: int) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=429, headers={"Retry-After": str(max(1, retry_after_s))})
