"""Connection-level limits of the gateway: a header-read timeout and a per-client connection cap.

aiohttp bounds an idle keep-alive connection but not one that trickles its request
headers (slowloris): 3,000 connections sending a byte now and then held the gateway's
sockets for 75 s each. Nor does it bound how many connections one address holds. Both are
decided when a connection opens, before any request exists, so they live here, around
aiohttp's own protocol, rather than in a middleware:

- a connection must deliver complete request headers within `header_timeout_s` of opening,
  and of the end of its previous answer (keep-alive), or it is closed;
- an address with `max_connections_per_client` connections open gets the next one closed
  at once (behind a proxy every client shares the proxy's address: raise it there).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from typing import Any, Awaitable, Callable

from aiohttp import web

log = logging.getLogger("prewarm.gateway")


class ConnectionGate:
    """Counts open connections per client address and watches their header deadlines."""

    def __init__(self, header_timeout_s: float, max_per_client: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_per_client = max_per_client
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0
        self._timers: dict[int, asyncio.TimerHandle] = {}  # id(transport) -> its header deadline

    def admit(self, peer: str) -> bool:
        if self.max_per_client and self.open[peer] >= self.max_per_client:
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
            transport.close()
            return
        self.peer = peer
        self.inner.connection_made(transport)
        self.gate.arm(transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.peer is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is None:
            return
        self.gate.disarm(getattr(self, "_transport", None))
        self.gate.release(self.peer)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


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
