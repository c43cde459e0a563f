"""A minimal OpenAI-shaped upstream for measuring the gateway's own overhead.

It answers every completion at once with a fixed body, so whatever time a request
spends beyond the direct call is the gateway's. Run: `python echo_upstream.py PORT`.
"""

from __future__ import annotations

import sys

from aiohttp import web

BODY = b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}]}'


async def complete(_request: web.Request) -> web.Response:
    await _request.read()
    return web.Response(body=BODY, content_type="application/json")


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/healthz", lambda _r: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
