"""Connection-level limits of the gateway: a header-read timeout and a per-client connection cap.

aiohttp bounds an idle keep-alive connection but not one that trickles its request
headers (slowloris): 3,000 connections sending a byte now and then held the gateway's
sockets for 75 s each. Nor does it bound how many connections one address holds. Both are
decided when a connection opens, before any request exists, so they live here, around
aiohttp's own protocol, rather than in a middleware:

- a connection must deliver complete request headers within `header_timeout_s` of opening,
  and of the end of its previous answer (keep-alive), or it is closed;
- an address with `max_connections_per_client` connections open gets the next one answered
  with 429 and Retry-After (issue 20: a TCP reset told a client nothing), by a small protocol
  that reads only the request's headers, answers and closes; aiohttp never sees it;
- a declared proxy (`trusted_proxies`) is exempt: every client behind it shares its address,
  so its clients are capped per request, by their `X-Forwarded-For` address (`limits.py`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from typing import Any, Awaitable, Callable, cast

from aiohttp import web

from prewarm.policy.clients import Network, is_trusted

log = logging.getLogger("prewarm.gateway")


class ConnectionGate:
    """Counts open connections per client address and watches their header deadlines."""

    def __init__(self, header_timeout_s: float, max_per_client: int, *, trusted: tuple[Network, ...] = (),
                 retry_after_s: int = 5) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_per_client = max_per_client
        self.trusted = trusted
        self.retry_after_s = retry_after_s
        self.refusing = 0  # connections being answered 429 right now
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0
        self._timers: dict[int, asyncio.TimerHandle] = {}  # id(transport) -> its header deadline

    def admit(self, peer: str) -> bool:
        if self.max_per_client and self.open[peer] >= self.max_per_client and not is_trusted(peer, self.trusted):
            self.refused += 1
            return False
        self.open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    def arm(self, transport: asyncio.BaseTransport) -> None:
        """(Re)start the header deadline of a connection: it must send a request's headers by then."""
        self.disarm(transport)
        loop = asyncio.get_running_loop()

        def expire() -> None:
            self._timers.pop(id(transport), None)
            if not transport.is_closing():
                self.timed_out += 1
                transport.close()

        self._timers[id(transport)] = loop.call_later(self.header_timeout_s, expire)

    def disarm(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None:
            timer = self._timers.pop(id(transport), None)
            if timer is not None:
                timer.cancel()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Headers are in: stop the deadline; the answer sent, start it again for the next request."""
        transport = request.transport
        self.disarm(transport)
        try:
            return await handler(request)
        finally:
            if transport is not None and not transport.is_closing():
                self.arm(transport)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the gate."""

    def __init__(self, inner: Any, gate: ConnectionGate) -> None:
        self.inner = inner
        self.gate = gate
        self.peer: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        if not self.gate.admit(peer):
            self.refusal = _Refusal(self.gate)
            self.refusal.connection_made(transport)
            return
        self.peer = peer
        self.inner.connection_made(transport)
        self.gate.arm(transport)
        self._transport = transport

    refusal: "_Refusal | None" = None

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.inner.data_received(data)
        elif self.refusal is not None:
            self.refusal.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.peer is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is None:
            if self.refusal is not None:
                self.refusal.connection_lost(exc)
            return
        self.gate.disarm(getattr(self, "_transport", None))
        self.gate.release(self.peer)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


#: Connections answered 429 at once at most; past it a connection over the cap is closed unanswered
#: (a refusal costs a socket for up to `REFUSAL_READ_S`, and a flood must not turn that into a hold).
MAX_REFUSING = 1024
#: How long a refused connection has to send its request's headers before the 429 is sent anyway.
REFUSAL_READ_S = 2.0
#: Request headers read at most before the 429 (the rest is not needed to refuse).
REFUSAL_READ_BYTES = 16384


class _Refusal:
    """Answer a connection over the per-client cap: read its headers (so the client is reading its
    answer, not writing into a closed socket, which would reset it), send 429 and close."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.seen = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        if self.gate.refusing >= MAX_REFUSING:
            tcp.abort()
            return
        self.gate.refusing += 1
        self.transport = tcp
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_READ_S, self.answer)

    def data_received(self, data: bytes) -> None:
        if self.answered or self.transport is None:
            return
        self.seen = (self.seen + data)[-REFUSAL_READ_BYTES:]
        if b"\r\n\r\n" in self.seen or len(self.seen) >= REFUSAL_READ_BYTES:
            self.answer()

    def answer(self) -> None:
        if self.answered or self.transport is None or self.transport.is_closing():
            return
        self.answered = True
        body = (b'{"error": {"message": "too many connections from this address", '
                b'"type": "invalid_request_error", "code": "too_many_connections"}}')
        head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {self.gate.retry_after_s}\r\n"
                f"Connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        # Half-close and drain what the client still sends (closing with unread data would reset the
        # connection, and a reset can discard the answer on the client's side); close when it is done.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_READ_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.gate.refusing -= 1
            self.transport = None


async def serve(app: web.Application, host: str, port: int, gate: ConnectionGate,
                *, ready: Callable[[int], None] | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve `app` on host:port behind `gate` until `stop` is set (or SIGTERM/SIGINT without one)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    assert runner.server is not None
    server = runner.server
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Guarded(server(), gate), host, port, reuse_address=True)
    bound = listener.sockets[0].getsockname()[1] if listener.sockets else port
    if ready is not None:
        ready(bound)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
    try:
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()  # closes the connections still open, then the app's cleanup
        await listener.wait_closed()
