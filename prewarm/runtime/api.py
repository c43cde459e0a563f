"""The OpenAI-compatible wire format of the model host: request parsing and response shapes.

Kept apart from the aiohttp server so that every rule about what a request may contain
lives in one place and can be read (and tested) without a server. A bad request raises
`ApiError`, which the server turns into the OpenAI error body
`{"error": {"message", "type", "param", "code"}}` with the right status — never a 500.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from prewarm.core.json_body import NestedTooDeep, load_json

MAX_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An error answered to the client: HTTP status, OpenAI error type, the offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def unavailable(message: str, retry_after: float | None, code: str) -> ApiError:
    return ApiError(503, message, type_="service_unavailable", code=code, retry_after=retry_after)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/completions request. `prompt` is text or token ids."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    stream: bool
    model: str | None
    logprobs: int | None
    echo: bool
    include_usage: bool  # stream_options.include_usage; usage always comes with non-streamed answers


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty: a JSON object is required")
    try:
        data = load_json(raw)
    except NestedTooDeep as exc:  # a bound of our own: where json.loads gives up differs between Pythons
        raise bad_request(f"request body is nested too deeply: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def encodable(text: str, param: str) -> str:
    """`text` unchanged when it is valid Unicode; a 400 when it holds a lone surrogate (`"\\ud800"`),
    which JSON can carry but UTF-8 cannot encode (the tokenizer would raise: a request fault, not a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"'{param}' is not valid Unicode: {exc.reason} at position {exc.start}", param) from None
    return text


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_completion(data: Mapping[str, Any], *, vocab_size: int, max_seq_len: int) -> CompletionRequest:
    """Validate a completions body. Sampling knobs are accepted but decoding is always greedy."""
    if "prompt" not in data:
        raise bad_request("'prompt' is required", "prompt")
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        parsed: str | tuple[int, ...] = encodable(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} in 'prompt' is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        parsed = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    else:
        raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")

    max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if max_tokens >= max_seq_len:
        raise bad_request(f"'max_tokens' ({max_tokens}) must be below the context length {max_seq_len}", "max_tokens")

    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {stream!r}", "stream")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    if model is not None:
        encodable(model, "model")

    n = data.get("n", 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported (decoding is greedy: every choice would be the same)", "n")
    best_of = data.get("best_of")
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported (decoding is greedy)", "best_of")
    for knob in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = data.get(knob)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise bad_request(f"'{knob}' must be a number, got {v!r}", knob)
    if data.get("stop") not in (None, [], ""):
        raise bad_request("'stop' sequences are not supported by this runtime", "stop")
    if data.get("suffix") not in (None, ""):
        raise bad_request("'suffix' is not supported by this runtime", "suffix")

    logprobs = data.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"'logprobs' must be an integer in 0..{MAX_LOGPROBS}, got {logprobs!r}", "logprobs")
        if stream:
            raise bad_request("'logprobs' is not supported together with 'stream'", "logprobs")
    echo = data.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise bad_request(f"'echo' must be a boolean, got {echo!r}", "echo")
    opts = data.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return CompletionRequest(
        prompt=parsed,
        max_tokens=max_tokens,
        stream=stream,
        model=model,
        logprobs=logprobs,
        echo=bool(echo),
        include_usage=bool(opts.get("include_usage", True)),
    )


def check_context(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    if prompt_tokens + max_tokens > max_seq_len:
        raise bad_request(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context length "
            f"{max_seq_len}; shorten the prompt or lower max_tokens",
            "prompt",
        )


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    cid: str,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk_body(
    cid: str, model: str, created: int, text: str, finish_reason: str | None, usage_: dict[str, int] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def finite(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None: JSON has no NaN (`json.dumps` would
    write the bare word `NaN`, which strict parsers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(data: Any) -> str:
    """Strict JSON: never NaN or Infinity."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(finite(data), allow_nan=False)


def sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else dumps(data)
    return f"data: {payload}\n\n".encode()


def parse_level(raw: str | None) -> int:
    """`?level=` of POST /sleep: 1 (offload weights to host memory) or 2 (drop them); default 1."""
    if raw in (None, ""):
        return 1
    if raw not in ("1", "2"):
        raise bad_request(f"sleep level must be 1 or 2, got {raw!r}", "level")
    return int(raw)
