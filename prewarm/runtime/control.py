"""The control role of the model host: load (idempotent), load status, sleep and wake.

Sleep level 1 moves the weights to host memory and keeps the validation (the same bytes
come back); level 2 drops them, so after waking the host must be validated again. A sleep
first drains the requests in flight (refusing new ones) for up to `drain_timeout_s`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from prewarm.runtime import api
from prewarm.runtime.hostcore import HostCore, _json


class ControlHandlers(HostCore):
    async def load(self, request: web.Request) -> web.Response:
        async with self._control_lock:
            if self.engine.is_sleeping:
                raise api.ApiError(409, "the model is sleeping: POST /wake_up instead of /load", code="sleeping")
            self.engine.start_load()  # idempotent: a second call while loading or loaded does nothing
        return _json(self._load_body(), status=202 if not self.engine.loaded else 200)

    async def load_status(self, request: web.Request) -> web.Response:
        return _json(self._load_body())

    async def sleep(self, request: web.Request) -> web.Response:
        level = api.parse_level(request.query.get("level"))
        async with self._control_lock:
            if not self.engine.loaded:
                raise api.ApiError(409, "the model is not loaded yet; it cannot sleep", code="not_loaded")
            if not self.engine.is_sleeping:
                self.state.pausing = True
                try:
                    try:
                        await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
                    except asyncio.TimeoutError:
                        raise api.unavailable(
                            f"{self.state.inflight} request(s) still in flight after {self.drain_timeout_s}s; "
                            "sleep not entered", 1, "busy") from None
                    await self._run(self.engine.sleep, level)
                finally:
                    self.state.pausing = False
                if level == 2:
                    self.state.validated = False  # the weights are gone: what comes back must be validated again
        return _json({"is_sleeping": bool(self.engine.is_sleeping), "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        async with self._control_lock:
            if self.engine.is_sleeping:
                await self._run(self.engine.wake_up)
            if self.self_validate and not self.state.validated:
                self.validate_itself()  # level 2 dropped the weights: what comes back is checked again
        return _json({"is_sleeping": bool(self.engine.is_sleeping), **self._load_body()})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": bool(self.engine.is_sleeping)})
