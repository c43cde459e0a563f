"""`timing_of`: what a streamed completion's chunks say about the replica's speed (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from prewarm.adapters.stream_timing import timing_of


def chunk(text: str, finish: str | None = None, usage: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"choices": [{"text": text, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = {"completion_tokens": usage}
    return body


def test_decode_runs_from_the_first_chunk_to_the_last_over_the_tokens_after_the_first() -> None:
    events = [(10.2, chunk("a")), (10.3, chunk("b")), (10.4, chunk("c")), (10.6, chunk("d", "length")),
              (10.9, {"choices": [], "usage": {"completion_tokens": 5}})]  # vLLM's usage chunk: no choice
    t = timing_of(10.0, events)
    assert t.tokens == 5 and t.ttft_s == pytest.approx(0.2)
    assert t.decode_s_per_token == pytest.approx(0.4 / 4)  # the usage chunk's arrival is not a token


def test_without_usage_the_chunks_with_text_are_counted() -> None:
    t = timing_of(0.0, [(0.1, chunk("a")), (0.2, chunk("b")), (0.4, chunk("", "length"))])
    assert t.tokens == 2 and t.decode_s_per_token == pytest.approx(0.3)


def test_one_token_has_no_decode_time_and_no_chunk_is_an_error() -> None:
    assert timing_of(0.0, [(0.5, chunk("a", "length", usage=1))]).decode_s_per_token == 0.0
    with pytest.raises(ValueError, match="no generated chunk"):
        timing_of(0.0, [(0.5, {"choices": [], "usage": {"completion_tokens": 0}})])
