"""How fast a replica generates, read from one streamed completion.

Time to first token and decode time per token are both read from the same streamed request
(`"stream": true`, server-sent events): the first token is the first chunk that carries a
choice, the decode time is the time from that chunk to the last one that carries a choice,
over the tokens generated after the first. Timing a one-token request and a longer one and
taking the difference, as this project did before, subtracts two noisy wall times: on a
loaded CPU the longer request sometimes finished first, the difference read 0 and the speed
check had no baseline to compare with. Here the interval is inside one request.

Both engines stream the OpenAI completions API this way (the built-in runtime and vLLM);
`stream_options.include_usage` asks for the token count in the last chunk (vLLM sends it
only when asked; without it the chunks carrying text are counted).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import urllib3

from prewarm.core import http
from prewarm.adapters.runtimes import RuntimeRequestError, RuntimeServerError, RuntimeUnavailable


@dataclass(frozen=True)
class StreamTiming:
    ttft_s: float  # request sent -> first chunk with a choice
    decode_s_per_token: float  # first chunk -> last chunk with a choice, per token after the first (0: one token)
    tokens: int


def timing_of(sent_at: float, events: Iterable[tuple[float, Mapping[str, Any]]]) -> StreamTiming:
    """The timing of a stream from `(arrival time, chunk)` pairs (pure). Raises ValueError when no
    chunk carries a choice: nothing was generated."""
    first = last = None
    counted = 0
    usage_tokens = None
    for at, chunk in events:
        choices = chunk.get("choices") or []
        if choices:
            first = at if first is None else first
            last = at
            counted += 1 if choices[0].get("text") else 0
        usage = chunk.get("usage")
        if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
            usage_tokens = int(usage["completion_tokens"])
    if first is None or last is None:
        raise ValueError("the stream carried no generated chunk")
    tokens = usage_tokens if usage_tokens is not None else max(1, counted)
    decode = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return StreamTiming(first - sent_at, decode, tokens)


def timed_completion(base_url: str, payload: Mapping[str, Any], *, api_key: str | None,
                     timeout_s: float) -> StreamTiming:
    """POST `payload` to `base_url`/v1/completions as a stream and time it (`timing_of`).

    Raises the adapters' errors: `RuntimeUnavailable` (no answer, or 503), `RuntimeRequestError`
    (4xx), `RuntimeServerError` (another status, or a stream that is not server-sent JSON)."""
    url = base_url.rstrip("/") + "/v1/completions"
    body = json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}}).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
               **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    events: list[tuple[float, Mapping[str, Any]]] = []
    sent_at = time.perf_counter()
    try:
        resp = http.pool().request("POST", url, body=body, headers=headers, preload_content=False, redirect=False,
                                   timeout=urllib3.Timeout(connect=min(timeout_s, 5.0), read=timeout_s))
        try:
            if resp.status >= 400:
                message = resp.read().decode("utf-8", "replace")[:500]
                what = f"POST {url} (stream) -> {resp.status}: {message}"
                if resp.status == 503:
                    raise RuntimeUnavailable(what, float(resp.headers.get("Retry-After", "1") or 1))
                if resp.status < 500:
                    raise RuntimeRequestError(what, resp.status)
                raise RuntimeServerError(what, 1.0)
            for raw in resp:  # one line at a time, as it arrives
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"a chunk that is not an object: {data[:100]!r}")
                events.append((time.perf_counter(), chunk))
        finally:
            resp.release_conn()
    except urllib3.exceptions.HTTPError as exc:
        raise RuntimeUnavailable(f"POST {url} (stream): {exc}", 1.0) from exc
    except ValueError as exc:  # not JSON, or JSON that is not a chunk
        raise RuntimeServerError(f"POST {url} (stream): not a completion stream: {exc!r}", 1.0) from exc
    try:
        return timing_of(sent_at, events)
    except ValueError as exc:
        raise RuntimeServerError(f"POST {url} (stream): {exc}", 1.0) from exc
