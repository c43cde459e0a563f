"""Request bodies parsed as JSON with one nesting bound, the same on every Python.

`json.loads` refuses deep nesting only where the interpreter's recursion guard trips, and
that point moves between builds: measured here, CPython 3.11.7 raised RecursionError on
arrays nested 5,000 deep, 3.12.1 parsed 1,000 and refused 5,000, and 3.12.3 (the GPU
machine's) and 3.13.0 parsed 5,000. So the same body got a 400 on one host and a 200 on
another, and anything that re-encodes or walks the parsed value recursively inherits the
difference. `MAX_DEPTH` is far beyond any completion or chat body (a tool's JSON schema
nests about ten deep) and far below every interpreter's guard.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128  # containers inside containers; the outermost object is depth 1


class NestedTooDeep(ValueError):
    """The body is valid JSON but nests containers deeper than the bound."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"JSON nested deeper than {max_depth} levels")


def load_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(raw)`, raising `NestedTooDeep` for nesting beyond `max_depth`.

    Other errors are `json.loads`'s own (`json.JSONDecodeError`, `UnicodeDecodeError`).
    The walk runs only when the body holds more opening brackets than the bound (a C-speed
    count), so an ordinary body pays one `count` per bracket kind."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise NestedTooDeep(max_depth) from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and deeper_than(data, max_depth):
        raise NestedTooDeep(max_depth)
    return data


def deeper_than(value: Any, max_depth: int) -> bool:
    """Whether lists and dicts nest more than `max_depth` deep in `value` (iterative: no recursion)."""
    if not isinstance(value, (dict, list)):
        return False  # a scalar holds no container
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
