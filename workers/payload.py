"""Validation of task payloads: ids and small scalars in, frozen requests out.

Tasks carry ids, not data, and any producer can put a message on a queue, so every task
body starts here. A malformed payload raises `InvalidPayload` naming the field; the task
wrapper refuses it without a retry (retrying cannot repair a payload). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from prewarm.core.domain import Pool, check_name, parse_replica_id
from prewarm.core.errors import InvalidPayload

_MAX_PATH = 4096
_MAX_REASON = 200


@dataclass(frozen=True)
class ReplicaRef:
    """A replica id split into its parts."""

    replica_id: str
    model: str
    revision: str
    node: str
    slot: int


@dataclass(frozen=True)
class PrewarmRequest:
    replica: ReplicaRef
    pool: Pool
    model_dir: str | None  # None: <runtime.models_dir>/<model>/<revision>, else <models_dir>/<model>


@dataclass(frozen=True)
class RetireRequest:
    replica: ReplicaRef
    reason: str


@dataclass(frozen=True)
class KeepWarmRequest:
    replica: ReplicaRef
    until: float


@dataclass(frozen=True)
class ReplicaOnlyRequest:
    replica: ReplicaRef


@dataclass(frozen=True)
class ModelRequest:
    model: str


@dataclass(frozen=True)
class PlaceElsewhereRequest:
    """A load or a wake its node's memory refused: place the model on another node."""

    replica: ReplicaRef  # the refused replica (its node is passed over)
    need_bytes: int  # the memory it needs on a GPU
    reason: str  # the refusal, naming what holds the node's memory


def _bind(task: str, args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str],
          required: int) -> dict[str, Any]:
    """Bind positional and keyword arguments to `names`, refusing unknown, duplicate or missing ones."""
    if not isinstance(kwargs, Mapping):
        raise InvalidPayload(f"{task}: keyword arguments must be an object, got {type(kwargs).__name__}")
    if len(args) > len(names):
        raise InvalidPayload(f"{task}: takes at most {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    bound: dict[str, Any] = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise InvalidPayload(f"{task}: unknown argument {key!r}; expected {', '.join(names)}")
        if key in bound:
            raise InvalidPayload(f"{task}: argument {key!r} given twice")
        bound[key] = value
    missing = [n for n in names[:required] if n not in bound]
    if missing:
        raise InvalidPayload(f"{task}: missing required argument(s) {', '.join(missing)}")
    return bound


def replica_ref(value: Any) -> ReplicaRef:
    if not isinstance(value, str):
        raise InvalidPayload(f"replica_id must be a string, got {type(value).__name__}")
    model, revision, node, slot = parse_replica_id(value)
    return ReplicaRef(value, model, revision, node, slot)


def _pool(value: Any) -> Pool:
    try:
        return Pool(value)
    except ValueError:
        raise InvalidPayload(f"pool must be one of {[p.value for p in Pool]}, got {value!r}") from None


def _model_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_PATH or "\x00" in value:
        raise InvalidPayload(f"model_dir must be a non-empty path string, got {value!r:.80}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidPayload(f"{what} must be a finite number, got {value!r}")
    return float(value)


def parse_prewarm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> PrewarmRequest:
    b = _bind("prewarm_replica", args, kwargs, ("replica_id", "pool", "model_dir"), 1)
    return PrewarmRequest(replica_ref(b["replica_id"]), _pool(b.get("pool", Pool.SERVING.value)),
                          _model_dir(b.get("model_dir")))


def parse_retire(args: Sequence[Any], kwargs: Mapping[str, Any]) -> RetireRequest:
    b = _bind("retire_replica", args, kwargs, ("replica_id", "reason"), 1)
    reason = b.get("reason", "")
    if not isinstance(reason, str) or len(reason) > _MAX_REASON:
        raise InvalidPayload(f"reason must be a string of at most {_MAX_REASON} characters")
    return RetireRequest(replica_ref(b["replica_id"]), reason)


def parse_keep_warm(args: Sequence[Any], kwargs: Mapping[str, Any]) -> KeepWarmRequest:
    b = _bind("keep_warm", args, kwargs, ("replica_id", "until"), 2)
    return KeepWarmRequest(replica_ref(b["replica_id"]), _number(b["until"], "until"))


def parse_replica_only(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ReplicaOnlyRequest:
    b = _bind(task, args, kwargs, ("replica_id",), 1)
    return ReplicaOnlyRequest(replica_ref(b["replica_id"]))


def parse_model(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ModelRequest:
    b = _bind(task, args, kwargs, ("model",), 1)
    return ModelRequest(check_name(b["model"], "model"))


def parse_place_elsewhere(args: Sequence[Any], kwargs: Mapping[str, Any]) -> PlaceElsewhereRequest:
    b = _bind("place_elsewhere", args, kwargs, ("replica_id", "need_bytes", "reason"), 2)
    need = _number(b["need_bytes"], "need_bytes")
    if need < 0:
        raise InvalidPayload(f"need_bytes must not be negative, got {need:g}")
    reason = b.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 2000:
        raise InvalidPayload("reason must be a string of at most 2000 characters")
    return PlaceElsewhereRequest(replica_ref(b["replica_id"]), int(need), reason)


def parse_nothing(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    _bind(task, args, kwargs, (), 0)


def parse_forecast(args: Sequence[Any], kwargs: Mapping[str, Any]) -> float | None:
    """`forecast_and_plan` takes nothing, or the `now` to plan at (a replay driver's clock)."""
    b = _bind("forecast_and_plan", args, kwargs, ("now",), 0)
    return _number(b["now"], "now") if "now" in b and b["now"] is not None else None


def parse_event_id(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    b = _bind(task, args, kwargs, ("event_id",), 1)
    value = b["event_id"]
    if not isinstance(value, str) or not 0 < len(value) <= 200 or any(c.isspace() for c in value):
        raise InvalidPayload(f"event_id must be a non-empty string without spaces, got {value!r:.80}")
    return value
