"""Frozen domain types shared by every stage: models, replicas, scale events, nodes.

They carry no I/O. The replica state machine lives here so that the registry (which
enforces it atomically in Redis) and the pure policies agree on one table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any, Mapping

from prewarm.core.errors import InvalidPayload

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
#: `<Secret name>/<key in the Secret>`: a Kubernetes Secret's name (DNS subdomain) and one of its data keys.
_KEY_REF = re.compile(r"^[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/[-._A-Za-z0-9]{1,253}$")


class ReplicaState(str, Enum):
    PENDING = "pending"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    ASLEEP = "asleep"  # engine level-1 sleep: weights in host memory, GPU freed; not routable until woken
    RETIRED = "retired"
    FAILED = "failed"


class Pool(str, Enum):
    SERVING = "serving"
    WARM = "warm"


class LoadPhase(str, Enum):
    """Progressive loading phases, in order."""

    NONE = "none"
    EMBEDDINGS = "embeddings"  # phase 1: embeddings, positions, final norm, output head
    FIRST_LAYERS = "first_layers"  # phase 2: the first K transformer layers
    REST = "rest"  # phase 3: the remaining layers, in the background
    DONE = "done"


#: Every legal transition. `failed` is reachable from any live state.
TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.PENDING: frozenset({ReplicaState.LOADING, ReplicaState.FAILED, ReplicaState.RETIRED}),
    ReplicaState.LOADING: frozenset({ReplicaState.WARMING, ReplicaState.FAILED}),
    ReplicaState.WARMING: frozenset({ReplicaState.READY, ReplicaState.FAILED}),
    ReplicaState.READY: frozenset({ReplicaState.DRAINING, ReplicaState.FAILED}),
    ReplicaState.DRAINING: frozenset({ReplicaState.RETIRED, ReplicaState.ASLEEP, ReplicaState.FAILED}),
    # Woken straight to ready: level-1 sleep gives back the same validated bytes.
    ReplicaState.ASLEEP: frozenset({ReplicaState.READY, ReplicaState.RETIRED, ReplicaState.FAILED}),
    ReplicaState.RETIRED: frozenset(),
    ReplicaState.FAILED: frozenset(),
}

#: States a replica never leaves: nothing routes to it and no task works on it any more.
TERMINAL_STATES: frozenset[ReplicaState] = frozenset({ReplicaState.FAILED, ReplicaState.RETIRED})
#: Every other state: the replica holds (or is about to hold) a slot (an asleep one holds host memory).
LIVE_STATES: frozenset[ReplicaState] = frozenset(ReplicaState) - TERMINAL_STATES


def check_name(value: str, what: str) -> str:
    """Validate a model, revision or node name; they become parts of Redis keys and ids."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidPayload(
            f"{what} must be 1-128 characters of letters, digits, '.', '_', ':' or '-', got {value!r}"
        )
    return value


def check_key_ref(value: str, what: str = "API key reference") -> str:
    """Validate a reference to an upstream's API key: `<Secret name>/<key>` ('' names the runtimes' own
    key, `runtime.api_key`). The registry stores the reference, never the key; the gateway reads the key
    from the file of that name under `gateway.upstream_keys_dir`, so a reference must not leave it."""
    if value == "":
        return value
    if not isinstance(value, str) or not _KEY_REF.match(value) or value.split("/", 1)[1] in (".", ".."):
        raise InvalidPayload(f"{what} must look like <secret name>/<key> (a lower-case DNS name, then the key's "
                             f"letters, digits, '.', '_' or '-'), got {value!r}")
    return value


def replica_id(model: str, revision: str, node: str, slot: int) -> str:
    """The deterministic id `model@revision/node/slot`: a redelivered task finds its work done."""
    check_name(model, "model")
    check_name(revision, "revision")
    check_name(node, "node")
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        raise InvalidPayload(f"slot must be a non-negative integer, got {slot!r}")
    return f"{model}@{revision}/{node}/{slot}"


def parse_replica_id(rid: object) -> tuple[str, str, str, int]:
    """Split `model@revision/node/slot` (any payload value); raises InvalidPayload naming what is wrong."""
    if not isinstance(rid, str):
        raise InvalidPayload(f"replica_id must be a string, got {type(rid).__name__}")
    head, sep, rest = rid.partition("@")
    parts = rest.split("/") if sep else []
    if len(parts) != 3 or not parts[2].isdigit():
        raise InvalidPayload(f"replica_id must look like model@revision/node/slot, got {rid!r}")
    model, revision, node, slot = head, parts[0], parts[1], int(parts[2])
    if replica_id(model, revision, node, slot) != rid:  # "０" or "007" would name slot 0 or 7 under a second id
        raise InvalidPayload(f"replica_id slot must be written in plain ASCII digits without leading zeros, got {rid!r}")
    return model, revision, node, slot


@dataclass(frozen=True)
class ModelSpec:
    """A model at a revision, and what one replica of it serves."""

    name: str
    revision: str
    capacity_rps: float = 4.0  # sustained requests/s one replica serves within the SLA
    slots: int = 8  # concurrent requests one replica holds

    def __post_init__(self) -> None:
        check_name(self.name, "model")
        check_name(self.revision, "revision")
        if self.capacity_rps <= 0:
            raise InvalidPayload(f"capacity_rps must be > 0, got {self.capacity_rps}")
        if self.slots <= 0:
            raise InvalidPayload(f"slots must be > 0, got {self.slots}")

    @property
    def key(self) -> str:
        return f"{self.name}@{self.revision}"


@dataclass(frozen=True)
class Replica:
    """One model replica on one node, as the registry knows it."""

    model: str
    revision: str
    node: str
    slot: int
    endpoint: str = ""  # base URL of the runtime, e.g. http://10.0.0.5:8001
    pool: Pool = Pool.SERVING
    state: ReplicaState = ReplicaState.PENDING
    progress: float = 0.0  # bytes loaded / total, 0..1
    phase: LoadPhase = LoadPhase.NONE
    created_at: float = 0.0
    updated_at: float = 0.0
    heartbeat_at: float = 0.0
    reason: str = ""  # why it failed or was retired
    auth_ref: str = ""  # which API key the gateway sends it (`check_key_ref`); '': the runtimes' own key

    def __post_init__(self) -> None:
        replica_id(self.model, self.revision, self.node, self.slot)
        check_key_ref(self.auth_ref, f"auth_ref of replica {self.model}@{self.revision}/{self.node}/{self.slot}")
        if not 0.0 <= self.progress <= 1.0:
            raise InvalidPayload(f"progress must be within 0..1, got {self.progress}")

    @cached_property
    def id(self) -> str:  # cached: the gateway's routing reads it ~20 times per request
        return replica_id(self.model, self.revision, self.node, self.slot)

    def with_(self, **changes: Any) -> "Replica":
        return replace(self, **changes)

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for a Redis hash."""
        return {
            "id": self.id,
            "model": self.model,
            "revision": self.revision,
            "node": self.node,
            "slot": str(self.slot),
            "endpoint": self.endpoint,
            "pool": self.pool.value,
            "state": self.state.value,
            "progress": repr(float(self.progress)),
            "phase": self.phase.value,
            "created_at": repr(float(self.created_at)),
            "updated_at": repr(float(self.updated_at)),
            "heartbeat_at": repr(float(self.heartbeat_at)),
            "reason": self.reason,
            "auth_ref": self.auth_ref,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> "Replica":
        try:
            return cls(
                model=fields["model"],
                revision=fields["revision"],
                node=fields["node"],
                slot=int(fields["slot"]),
                endpoint=fields.get("endpoint", ""),
                pool=Pool(fields.get("pool", "serving")),
                state=ReplicaState(fields["state"]),
                progress=float(fields.get("progress", 0.0)),
                phase=LoadPhase(fields.get("phase", "none")),
                created_at=float(fields.get("created_at", 0.0)),
                updated_at=float(fields.get("updated_at", 0.0)),
                heartbeat_at=float(fields.get("heartbeat_at", 0.0)),
                reason=fields.get("reason", ""),
                auth_ref=fields.get("auth_ref", ""),
            )
        except (KeyError, ValueError) as exc:
            raise InvalidPayload(f"replica record is malformed: {exc}") from exc


class ScaleEventKind(str, Enum):
    SCALE_UP = "scale_up"  # start (prewarm) replicas before a rise
    SCALE_DOWN = "scale_down"  # drain and retire replicas after a fall
    HOLD = "hold"  # keep replicas through a dip and keep them warm (dynamic warmup trigger)
    PARK = "park"  # drain and put to level-1 sleep instead of retiring: needed again within the park horizon


@dataclass(frozen=True)
class ScaleEvent:
    """A decision of the planner; the workers only carry it out."""

    event_id: str  # deterministic: a re-plan of the same decision yields the same id
    kind: ScaleEventKind
    model: str
    revision: str
    at: float  # epoch seconds when it must be carried out
    replicas: int  # how many replicas this event adds, removes or holds
    pool: Pool = Pool.SERVING
    nodes: tuple[str, ...] = ()  # placement, when decided
    reason: str = ""

    def to_payload(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "kind": self.kind.value,
            "model": self.model,
            "revision": self.revision,
            "at": self.at,
            "replicas": self.replicas,
            "pool": self.pool.value,
            "nodes": list(self.nodes),
            "reason": self.reason,
        }

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> "ScaleEvent":
        if not isinstance(data, Mapping):
            raise InvalidPayload(f"scale event must be an object, got {type(data).__name__}")
        try:
            return cls(
                event_id=str(data["event_id"]),
                kind=ScaleEventKind(data["kind"]),
                model=check_name(data["model"], "model"),
                revision=check_name(data["revision"], "revision"),
                at=float(data["at"]),
                replicas=int(data["replicas"]),
                pool=Pool(data.get("pool", "serving")),
                nodes=tuple(check_name(n, "node") for n in data.get("nodes", ())),
                reason=str(data.get("reason", "")),
            )
        except KeyError as exc:
            raise InvalidPayload(f"scale event is missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(f"scale event has a bad field: {exc}") from exc


@dataclass(frozen=True)
class NodeView:
    """A GPU node as the planner sees it for placement."""

    name: str
    gpus: int = 1  # allocatable accelerators (nvidia.com/gpu)
    replica_slots: int = 1  # how many replicas fit on the node
    replicas: int = 0  # replicas currently live on the node
    snapshots: frozenset[str] = field(default_factory=frozenset)  # model keys with a node-local snapshot
    model_type: str = ""  # the node's `model.type` label
    ready: bool = True

    @property
    def free_slots(self) -> int:
        return max(0, self.replica_slots - self.replicas)
