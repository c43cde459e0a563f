"""The completions role of the model host: admission, one-shot and streamed generation.

Admission refuses (503 + Retry-After) while the host sleeps, failed to load, or serves
weights it no longer trusts, and waits up to `load_wait_s` for phase 1 of a load; a request
then computes pipelined while the tail of the weights loads. Generation runs in the
host's thread pool; a stream hands each token to the event loop through a queue, and a
client that goes away stops the generation at the next token. Requests with a valid,
fresh warmup signature count as warmup; the rest (forged or replayed ones included) as
user traffic.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Iterable, Iterator

from aiohttp import web

from prewarm.core.domain import LoadPhase
from prewarm.core.signing import HEADER, is_valid_warmup
from prewarm.runtime import api
from prewarm.runtime import probe
from prewarm.runtime.hostcore import HostCore, _json

log = logging.getLogger("prewarm.runtime")


class CompletionHandlers(HostCore):
    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        kind = self._kind(request, raw)
        code = 500
        try:
            response = await self._complete(request, raw)
            code = response.status
            return response
        except api.ApiError as exc:
            code = exc.status
            raise
        finally:
            self.metrics.runtime_requests.labels(self.model_name, kind, str(code)).inc()

    def _kind(self, request: web.Request, raw: bytes) -> str:
        if request.headers.get(HEADER) is None:
            self.state.counts["user"] += 1
            return "user"
        if is_valid_warmup(self.warmup_secret, request.headers, request.method, request.path, raw, time.time(),
                           self.nonces):
            self.state.counts["warmup"] += 1
            return "warmup"
        self.state.counts["forged_warmup"] += 1
        self.state.counts["user"] += 1
        return "user"

    async def _complete(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        cfg = self.engine.config
        req = api.parse_completion(api.parse_json_object(raw), vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len)
        if req.model is not None and req.model != self.model_name:
            raise api.ApiError(404, f"model {req.model!r} is not served here; this runtime serves {self.model_name!r}",
                               param="model", code="model_not_found")
        ids = list(req.prompt) if isinstance(req.prompt, tuple) else list(self.engine.encode(req.prompt))
        if not ids:
            raise api.bad_request("'prompt' encodes to no tokens", "prompt")
        api.check_context(len(ids), req.max_tokens, cfg.max_seq_len)
        await self._admit()
        admitted = time.perf_counter()
        self.state.inflight += 1
        self._idle.clear()
        try:
            if req.stream:
                return await self._stream(request, req, ids, admitted)
            return await self._complete_once(req, ids, admitted)
        finally:
            self.state.inflight -= 1
            if self.state.inflight == 0:
                self._idle.set()

    async def _admit(self) -> None:
        """Refuse (503) while sleeping or failed; wait up to load_wait_s for phase 1."""
        if self.engine.error is not None:
            raise api.ApiError(503, f"the model failed to load: {self.engine.error}",
                               type_="service_unavailable", code="load_failed")
        if self.state.pausing or self.engine.is_sleeping:
            raise api.unavailable("the model is sleeping; POST /wake_up first", 1, "sleeping")
        fault = self.weights_fault()
        if fault is not None:  # refused before any work: the gateway sends the request elsewhere
            raise api.unavailable(f"this replica's weights are no longer trusted: {fault}", 5, "weights_changed")
        deadline = time.monotonic() + self.load_wait_s
        while not self.servable:
            if time.monotonic() >= deadline:
                if self._phase() is LoadPhase.NONE and not self._loading_started():
                    raise api.unavailable("the model is not loaded; POST /load to start loading", 2, "not_loaded")
                raise api.unavailable(f"the model is loading (phase {self._phase().value}, "
                                      f"{self.engine.progress:.0%}); retry shortly", 1, "loading")
            await asyncio.sleep(0.01)

    def _timed(self, tokens: Iterable[int], admitted: float) -> Iterator[int]:
        """`tokens` as they come, timed: the first token's delay after admission and the time per token after
        it go to the host's histograms (`runtime_time_to_first_token_seconds`, `..._per_output_token_...`),
        the figures the speed checks read from the engine rather than from a client's wall clock."""
        first = last = 0.0
        made = 0
        try:
            for tok in tokens:
                last = time.perf_counter()
                first = first or last
                made += 1
                yield tok
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:  # the engine holds its generation lock until its iterator is closed
                close()
            if made:
                self.metrics.runtime_ttft.labels(self.model_name).observe(first - admitted)
            if made > 1:
                self.metrics.runtime_tpot.labels(self.model_name).observe((last - first) / (made - 1))

    async def _complete_once(self, req: api.CompletionRequest, ids: list[int], admitted: float) -> web.Response:
        def work() -> tuple[list[int], dict[str, Any] | None]:
            out = list(self._timed(self.engine.generate(ids, req.max_tokens), admitted))
            lp = probe.logprobs(self.engine, ids, out, req.logprobs) if req.logprobs is not None else None
            return out, lp

        out, logprobs = await self._run(work)
        text = self.engine.decode(out)
        if req.echo:
            text = self.engine.decode(ids) + text
        finish = "length" if len(out) >= req.max_tokens else "stop"
        return _json(
            api.completion_body(api.completion_id(), self.model_name, text, finish, len(ids), len(out), logprobs)
        )

    async def _stream(self, request: web.Request, req: api.CompletionRequest, ids: list[int],
                      admitted: float) -> web.StreamResponse:
        """SSE chunks as tokens come. One executor job runs the whole generation (the engine
        holds its generation lock for the iterator's life, so stepping it from several jobs
        could starve the holder) and hands each token to the event loop through a queue."""
        cid, created = api.completion_id(), int(time.time())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def produce() -> None:
            it = self._timed(self.engine.generate(ids, req.max_tokens), admitted)
            try:
                for tok in it:
                    loop.call_soon_threadsafe(queue.put_nowait, ("token", tok))
                    if cancel.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop, raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

        job = self._run(produce)
        try:
            kind, item = await queue.get()
            if kind == "error":  # before the first token: still a JSON error (503 when sleeping, ...)
                raise item
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            out: list[int] = []
            sent = ""
            try:
                if req.echo:
                    await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, self.engine.decode(ids), None)))
                while kind != "end":
                    if kind == "error":
                        log.error("generation failed mid-stream: %r", item)
                        break
                    out.append(int(item))
                    text = self.engine.decode(out)
                    if not text.endswith("\ufffd") and len(text) > len(sent):  # hold back a partial UTF-8 sequence
                        await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, text[len(sent):], None)))
                        sent = text
                    kind, item = await queue.get()
                tail = self.engine.decode(out)[len(sent):]
                finish = "length" if len(out) >= req.max_tokens else "stop"
                usage = api.usage(len(ids), len(out)) if req.include_usage else None
                await resp.write(api.sse(api.chunk_body(cid, self.model_name, created, tail, finish, usage)))
                await resp.write(api.sse("[DONE]"))
                await resp.write_eof()
            except ConnectionResetError:  # the client went away ("stop generating"): not an error here either
                log.info("client of %s went away mid-stream after %d token(s)", self.model_name, len(out))
            return resp
        finally:
            cancel.set()  # a client that went away stops the generation at the next token
            await job
