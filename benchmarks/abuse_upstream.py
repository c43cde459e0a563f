"""A verbose, token-paced OpenAI-shaped upstream for the abuse benchmark (`benchmarks/abuse.py`).

Each request takes `max_tokens` x TOKEN_S, at most SLOTS at a time (like a runtime batching a
few sequences); a stream sends one padded chunk per token (a verbose model), so a client that
does not read fills its socket quickly. Run: `python abuse_upstream.py PORT`.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

TOKEN_S = 0.002
SLOTS = 4
PAD = "x" * 4096  # a verbose model: 4 KiB per token, sent as fast as it comes
STREAM_TOKEN_S = TOKEN_S / 8

_slots: asyncio.Semaphore | None = None


async def complete(request: web.Request) -> web.StreamResponse:
    global _slots
    _slots = _slots or asyncio.Semaphore(SLOTS)
    body = await request.json()
    tokens = int(body.get("max_tokens") or 16)
    async with _slots:
        if not body.get("stream"):
            await asyncio.sleep(tokens * TOKEN_S)
            return web.json_response({"id": "c", "object": "text_completion",
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(tokens):
                await resp.write(f"data: {json.dumps({'choices': [{'text': PAD}]})}\n\n".encode())
                await asyncio.sleep(STREAM_TOKEN_S)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the gateway cut the stream (its client read nothing): stop generating
            pass
        return resp


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/healthz", lambda _r: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
