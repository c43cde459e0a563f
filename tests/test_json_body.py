"""The JSON nesting bound of request bodies (prewarm/core/json_body.py): one answer on every Python."""

from __future__ import annotations

import json

import pytest

from prewarm.core.json_body import MAX_DEPTH, NestedTooDeep, deeper_than, load_json


def nested(depth: int) -> bytes:
    """A list nested `depth` deep: `[[...]]` with `depth` pairs of brackets."""
    return b"[" * depth + b"]" * depth


def test_nesting_up_to_the_bound_parses_and_one_more_level_is_refused() -> None:
    assert load_json(nested(MAX_DEPTH)) is not None
    with pytest.raises(NestedTooDeep, match=f"deeper than {MAX_DEPTH} levels"):
        load_json(nested(MAX_DEPTH + 1))
    with pytest.raises(NestedTooDeep):
        load_json(b'{"model": "m", "x": ' + nested(MAX_DEPTH) + b"}")


def test_nesting_past_the_interpreters_recursion_guard_is_the_same_refusal() -> None:
    with pytest.raises(NestedTooDeep):
        load_json(nested(1_000_000))  # json.loads raises RecursionError here on every CPython


def test_brackets_inside_strings_are_not_nesting() -> None:
    body = json.dumps({"model": "m", "prompt": "[{" * (4 * MAX_DEPTH)}).encode()
    assert load_json(body)["prompt"].startswith("[{")


def test_invalid_json_keeps_the_parsers_own_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        load_json(b'{"model": ')
    assert not issubclass(json.JSONDecodeError, NestedTooDeep)


def test_depth_counts_dicts_and_lists_alike() -> None:
    value = {"a": [{"b": [1]}]}  # four containers deep
    assert not deeper_than(value, 4) and deeper_than(value, 3)
    assert not deeper_than("a scalar", 0) and deeper_than([], 0)
