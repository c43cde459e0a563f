"""Real HTTP servers for tests: an aiohttp app served from a background thread on a free port,
and a small OpenAI-compatible upstream whose behaviour a test can switch (answer, stream,
fail with 500, close the connection mid-stream). The upstream stands for a model replica;
it is a real server over real sockets, not a mock of prewarm code."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from prewarm.registry.embedded import free_port


class AppThread:
    """Serve an aiohttp Application in its own thread and event loop."""

    def __init__(self, app: web.Application, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._runner = web.AppRunner(self.app, access_log=None)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def start(self) -> "AppThread":
        self._thread.start()
        self._started.wait(10)
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "AppThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Upstream:
    """An OpenAI-compatible upstream; `mode` is one of ok, fail, bad_request, close_mid_stream, close_mid_body."""

    name: str
    mode: str = "ok"
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0  # between two stream chunks
    chunks: int = 3
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # the client's (address, port) of each request: its connection
    api_key: str | None = None  # like vLLM's --api-key: any other bearer token is answered 401

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.headers.append(dict(request.headers))
            return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer to a wrong key
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "bad_request":
            return web.json_response({"error": {"message": "bad prompt", "type": "invalid_request_error"}}, status=400)
        if self.mode == "close_mid_body":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Content-Length": "1000"})
            await resp.prepare(request)
            await resp.write(b'{"partial": ')
            assert request.transport is not None
            request.transport.close()
            return resp
        if body.get("stream"):
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                if i and self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if self.mode == "close_mid_stream" and i == 1:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {"id": "c", "object": "text_completion", "model": body.get("model"), "served_by": self.name,
             "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}]}
        )
