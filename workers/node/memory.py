"""GPU and host memory accounting of one node agent, and what its node view reports per tier.

An agent hosts several models at once; what limits it is GPU memory, not a count of
replicas. Every hosted replica books its footprint (the manifest's bytes, or the
catalog's `planner.model_memory_gb` when larger, or what the runtime measured on CUDA
once loaded) against the node's budget (`agent.gpu_memory_gb`; 0 leaves GPU memory
unaccounted, slots only). A replica put to sleep moves its booking to host memory
(`agent.host_memory_gb`, the pinned copy of its weights), a woken one moves it back, a
stopped one releases it. Host memory also holds the node's snapshot store (weights kept
for the `cached` tier: `runtime.snapshot_dir`, /dev/shm by default, so RAM): its files count
against `agent.host_memory_gb` beside the asleep replicas, read from the store at each check.
A load, a sleep or a wake that would not fit is refused with `InsufficientMemory`, naming
what holds the memory (replicas and snapshots), instead of an out-of-memory crash in the
runtime or the kernel's OOM killer on the host. The ledger lives in the agent process (one per node), under one lock, so
concurrent tasks of the threads pool cannot both take the last gigabytes.

Tiers, warmest first (`forecasting.fleet.catalog.Tier`): `gpu` (hosted and awake),
`asleep` (hosted, weights in host memory), `cached` (a node snapshot holds the weights),
`disk` (only the model directory).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from prewarm.core.errors import PermanentError
from prewarm.core.settings import Settings
from prewarm.runtime.manifest import MANIFEST_FILE, load_manifest

GB = 1e9
GPU, ASLEEP, CACHED, DISK = "gpu", "asleep", "cached", "disk"
TIER_ORDER = (GPU, ASLEEP, CACHED, DISK)


class InsufficientMemory(PermanentError):
    """The node's memory budget cannot take this replica now; nothing was started."""

    reason = "insufficient_memory"

    def __init__(self, message: str, nbytes: int = 0) -> None:
        super().__init__(message)
        self.nbytes = nbytes  # what the refused replica needs (another node must have this much free)


@dataclass(frozen=True)
class Booking:
    rid: str
    model: str
    nbytes: int
    tier: str  # GPU or ASLEEP


def _budget(gb: float) -> int | None:
    return int(gb * GB) if gb > 0 else None


class MemoryLedger:
    """What each hosted replica holds of the node's GPU and host memory (thread-safe)."""

    def __init__(self, gpu_budget_gb: float, host_budget_gb: float, node: str = "",
                 snapshot_dir: str | Path | None = None) -> None:
        self.gpu_budget = _budget(gpu_budget_gb)
        self.host_budget = _budget(host_budget_gb)
        self.node = node
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir else None
        self._lock = threading.Lock()
        self._book: dict[str, Booking] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> "MemoryLedger":
        a = settings.agent
        return cls(a.gpu_memory_gb, a.host_memory_gb, a.node, settings.runtime.snapshot_dir)

    # --- reading ------------------------------------------------------------------------
    def bookings(self) -> list[Booking]:
        with self._lock:
            return list(self._book.values())

    def get(self, rid: str) -> Booking | None:
        with self._lock:
            return self._book.get(rid)

    def snapshots(self) -> dict[str, int]:
        """The snapshot store's files (name -> bytes): weights the node keeps in host memory."""
        return snapshot_files(self.snapshot_dir) if self.snapshot_dir is not None else {}

    def _used(self, tier: str, without: str = "") -> int:
        booked = sum(b.nbytes for b in self._book.values() if b.tier == tier and b.rid != without)
        return booked + (sum(self.snapshots().values()) if tier == ASLEEP else 0)

    def used(self, tier: str) -> int:
        with self._lock:
            return self._used(tier)

    def free(self, tier: str) -> int | None:
        """Bytes left under the tier's budget; None when that memory is not accounted."""
        budget = self.gpu_budget if tier == GPU else self.host_budget
        return None if budget is None else budget - self.used(tier)

    def _describe(self, tier: str) -> str:
        held = [(b.rid, b.nbytes) for b in self._book.values() if b.tier == tier]
        if tier == ASLEEP:
            held += [(f"snapshot {name}", n) for name, n in self.snapshots().items()]
        return ", ".join(f"{what} {n / GB:.3g} GB" for what, n in sorted(held, key=lambda h: -h[1])) or "nothing"

    def _fits(self, rid: str, model: str, nbytes: int, tier: str, what: str) -> None:
        budget = self.gpu_budget if tier == GPU else self.host_budget
        if budget is None:
            return
        used = self._used(tier, without=rid)
        if used + nbytes > budget:
            where = "GPU" if tier == GPU else "host"
            msg = (f"{what} {rid}: {model} needs {nbytes / GB:.3g} GB of {where} memory, but node {self.node} has "
                   f"{max(0, budget - used) / GB:.3g} of {budget / GB:.3g} GB free (held by {self._describe(tier)})")
            raise InsufficientMemory(msg, nbytes)

    # --- changing -----------------------------------------------------------------------
    def book_gpu(self, rid: str, model: str, nbytes: int, *, what: str = "load of") -> None:
        """Book `nbytes` of GPU memory for `rid` (again: keeps the larger figure); raises when it does not fit."""
        with self._lock:
            cur = self._book.get(rid)
            if cur is not None and cur.tier == GPU and cur.nbytes >= nbytes:
                return
            self._fits(rid, model, nbytes, GPU, what)
            self._book[rid] = Booking(rid, model, int(nbytes), GPU)

    def book(self, rid: str, model: str, nbytes: int, tier: str) -> None:
        """Record a booking without checking the budget (an adopted runtime already holds its memory)."""
        with self._lock:
            self._book[rid] = Booking(rid, model, int(nbytes), tier)

    def check(self, rid: str, tier: str, *, what: str) -> None:
        """Raise `InsufficientMemory` if moving `rid`'s booking to `tier` would not fit (changes nothing)."""
        with self._lock:
            cur = self._book.get(rid)
            if cur is not None and cur.tier != tier:
                self._fits(rid, cur.model, cur.nbytes, tier, what)

    def move(self, rid: str, tier: str, *, what: str, force: bool = False) -> None:
        """Move a booking between GPU and host memory; raises when the destination is full (unless `force`:
        the move already happened in the runtime, the books follow it)."""
        with self._lock:
            cur = self._book.get(rid)
            if cur is None or cur.tier == tier:
                return
            if not force:
                self._fits(rid, cur.model, cur.nbytes, tier, what)
            self._book[rid] = Booking(rid, cur.model, cur.nbytes, tier)

    def measured(self, rid: str, nbytes: int) -> None:
        """The runtime measured what it holds on the GPU: book that when it is more than the estimate."""
        with self._lock:
            cur = self._book.get(rid)
            if cur is not None and nbytes > cur.nbytes:
                self._book[rid] = Booking(rid, cur.model, int(nbytes), cur.tier)

    def release(self, rid: str) -> None:
        with self._lock:
            self._book.pop(rid, None)


def footprint_bytes(settings: Settings, model: str, model_dir: str | Path) -> int:
    """What one replica of `model` holds on the GPU: its manifest's bytes, or the catalog's figure if larger."""
    manifest = load_manifest(model_dir).total_bytes
    catalog = float(settings.planner.model_memory_gb.get(model, 0.0)) * GB
    return int(max(manifest, catalog))


# --- the node view's residency --------------------------------------------------------------
def _safe(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)  # how `prewarm.runtime.snapshot` names a snapshot file


def models_on_disk(models_dir: str | Path) -> set[str]:
    """`model@revision` of every model directory under `models_dir` (<model>/<revision>/ or <model>/)."""
    root = Path(models_dir)
    out: set[str] = set()
    if not root.is_dir():
        return out
    for manifest in list(root.glob(f"*/{MANIFEST_FILE}")) + list(root.glob(f"*/*/{MANIFEST_FILE}")):
        try:
            m = load_manifest(manifest.parent)
        except Exception:  # noqa: BLE001 - an unreadable directory is not a model on disk
            continue
        model = manifest.parent.name if manifest.parent.parent == root else manifest.parent.parent.name
        out.add(f"{model}@{m.revision}")
    return out


def snapshot_files(snapshot_dir: str | Path) -> dict[str, int]:
    """Every weight snapshot in the store (file name -> bytes); a file removed meanwhile is skipped."""
    d = Path(snapshot_dir)
    out: dict[str, int] = {}
    if not d.is_dir():
        return out
    for f in d.glob("*.snap"):
        try:
            out[f.name] = f.stat().st_size
        except OSError:
            continue
    return out


def in_snapshot(snapshot_dir: str | Path, key: str) -> bool:
    """Whether the node's snapshot store holds weights of `model@revision` (any dtype)."""
    d = Path(snapshot_dir)
    return d.is_dir() and any(d.glob(f"{_safe(key)}.*.snap"))


def residency(hosted: Mapping[str, str], known: Iterable[str], snapshot_dir: str | Path) -> dict[str, str]:
    """`model@revision` -> its warmest tier here. `hosted`: model@revision -> GPU or ASLEEP of a hosted replica."""
    out: dict[str, str] = {}
    for key in set(known) | set(hosted):
        tier = hosted.get(key) or (CACHED if in_snapshot(snapshot_dir, key) else DISK)
        out[key] = tier
    return out


def warmest(tiers: Iterable[str]) -> str:
    ranks = [TIER_ORDER.index(t) for t in tiers if t in TIER_ORDER]
    return TIER_ORDER[min(ranks)] if ranks else DISK


__all__ = ["ASLEEP", "CACHED", "DISK", "GB", "GPU", "Booking", "InsufficientMemory", "MemoryLedger",
           "footprint_bytes", "in_snapshot", "models_on_disk", "residency", "snapshot_files", "warmest"]
