"""Node-local weight snapshots: the first replica pays for reading, the next ones map.

A snapshot is one file per (model, revision, runtime dtype, manifest checksum) under a
node-local directory (tmpfs such as /dev/shm, or a hostPath). Layout:

    b"PWSNAP2\\n" | u64 little-endian header length | JSON header | padding | tensor data

Every tensor starts at a 4096-aligned offset and is stored already in the runtime dtype,
so a later replica builds its tensors with `torch.frombuffer` over a private (copy-on-write)
mmap: no read, no conversion, and on tmpfs the pages are shared between replicas. The
header lists each tensor's shape, dtype, offset, length and crc32c, and the file size.

Safety: a snapshot is written under a hidden temporary name and renamed into place only
when complete, so a partial one is never visible, and a file is never rewritten in place
(invalidating unlinks it; a rebuild is a new file). A replica keeps the descriptor of the
file it maps and `MappedSnapshot.changed()` compares its identity (inode, size, mtime and
ctime) with the one checked: a snapshot modified in place behind its back takes the
replica out of service instead of serving garbage. The ctime is what a rewrite cannot forge
cheaply (issue 20): a writer can put the mtime back with `utime`, but the kernel sets the
ctime to the present on every write and every `utime` alike, and nothing but a clock change
sets it back. So prewarm itself never touches a committed snapshot's inode: its last use
(for LRU) goes to a sidecar file `<snapshot>.used`. Opening checks the magic, the header,
the file size (truncation) and that the tensor list matches the manifest; each tensor's
crc32c is checked before it is used (`verify`, which the loader runs on a thread pool
ahead of use). crc32c, not zlib's crc32: with the CPU's crc32 instruction it runs at
memory speed (~8 GB/s against ~1.6), which is what makes mapping a snapshot near-free
while every byte is still checked. Anything wrong raises `CorruptSnapshot`; the loader
then invalidates the file, finishes from the original checkpoint and rebuilds it.

The directory is bounded by `max_bytes` with least-recently-used eviction (a snapshot's
last use is its sidecar's modification time; the snapshot's own times are left as written). A replica holds a shared `flock` on the snapshot it maps for as
long as it serves from it; eviction takes an exclusive non-blocking lock first and skips
a snapshot in use, in this process or any other on the node.

One replica fills a snapshot; the others wait for it (`SnapshotStore.fill`). Replicas of
the same weights started together on a node would otherwise all read the original at
once, sharing the disk's bandwidth, so the first of them was ready no sooner than the last
and none of them used the snapshot the first one writes. The first takes an exclusive
`flock` on the key's fill lock (`.<snapshot>.fill`) for its read and the snapshot's write;
the next ones wait for it (at most `fill_wait_s`), then find the snapshot and map it. The
kernel drops the lock of a replica that dies, and a wait that runs out reads the original
as before, so a stuck first replica delays the others by at most `fill_wait_s`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import mmap
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

from prewarm.core.errors import PermanentError
from prewarm.runtime.manifest import Manifest
from prewarm.runtime.model import ModelConfig, torch_dtype

log = logging.getLogger(__name__)

MAGIC = b"PWSNAP2\n"  # version 2: crc32c checksums (version 1 files fail the magic check and are rebuilt)
ALIGN = 4096
SUFFIX = ".snap"
FILL_SUFFIX = ".fill"  # `.<snapshot>.fill`: the lock one replica holds while it fills the snapshot
USED_SUFFIX = ".used"  # sidecar whose mtime is the snapshot's last use (the snapshot's inode is never touched)
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)\.\d+$")


class CorruptSnapshot(PermanentError):
    """A snapshot file failed a check; it must be rebuilt, never served."""


def _used(path: Path) -> Path:
    return path.with_name(path.name + USED_SUFFIX)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SnapshotKey:
    """What a snapshot holds: these weights (by manifest checksum) in this dtype."""

    model: str
    revision: str
    dtype: str
    checksum: str

    @classmethod
    def for_manifest(cls, manifest: Manifest, dtype: str, model_name: str | None = None) -> "SnapshotKey":
        return cls(model_name or manifest.name, manifest.revision, dtype, manifest.checksum)

    @property
    def filename(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.model}@{self.revision}")
        return f"{safe}.{self.dtype}.{self.checksum[:16]}{SUFFIX}"

    def as_dict(self) -> dict[str, str]:
        return {"model": self.model, "revision": self.revision, "dtype": self.dtype, "checksum": self.checksum}


@dataclass(frozen=True)
class SnapshotTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    length: int


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    bytes: int
    last_used: float


def layout(config: ModelConfig, key: SnapshotKey) -> tuple[list[SnapshotTensor], int]:
    """Tensor placement for a runtime config (its dtype) and the file size.

    The header size is computed from a header with fixed-width placeholder checksums, so
    the real header (written last) has exactly the same length.
    """
    dt = config.dtype
    esize = torch.empty((), dtype=torch_dtype(dt)).element_size()
    specs = [(n, s, math.prod(s) * esize) for n, s in config.tensor_shapes()]
    # The header's size depends on the offsets' digits, which depend on the header: iterate.
    data_start = ALIGN
    while True:
        tensors, pos = [], data_start
        for name, shape, length in specs:
            tensors.append(SnapshotTensor(name, tuple(shape), dt, pos, length))
            pos = _align(pos + length)
        header = _header_bytes(key, tensors, ["00000000"] * len(tensors), pos)
        need = _align(len(MAGIC) + 8 + len(header))
        if need <= data_start:
            return tensors, pos
        data_start = need


def _header_bytes(key: SnapshotKey, tensors: list[SnapshotTensor], crcs: list[str], file_bytes: int) -> bytes:
    data: dict[str, Any] = {
        "key": key.as_dict(),
        "file_bytes": file_bytes,
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset, "length": t.length, "crc32c": c}
            for t, c in zip(tensors, crcs)
        ],
    }
    return json.dumps(data, separators=(",", ":")).encode()


class MappedSnapshot:
    """An open, header-checked snapshot; `tensor(name)` maps one tensor, `verify(name)` checks it.

    Holds a shared flock until `release()`; the tensors it handed out stay valid after
    release (the mapping lives as long as they do), but the file may then be evicted.
    """

    def __init__(self, path: Path, key: SnapshotKey, config: ModelConfig) -> None:
        self.path = path
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            self._check_and_map(key, config)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
        """(device, inode, size, mtime, ctime): a write changes both times; restoring the mtime
        with utime changes the ctime again. Nothing of prewarm's touches a committed snapshot."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def changed(self) -> str | None:
        """Why the mapped file is no longer what was checked, or None. Snapshots are only ever
        written new and renamed into place, so the inode a replica maps never changes — unless
        something rewrites it in place, and then the private mapping's clean pages show the new
        bytes: garbage weights answering 200. A cheap fstat of the held descriptor tells."""
        if self._fd < 0:
            return None
        try:
            now = self._identity(os.fstat(self._fd))
        except OSError as exc:
            return f"{self.path.name}: cannot stat the mapped file: {exc}"
        if now != self.identity:
            return f"{self.path.name}: the mapped snapshot was modified in place (size/mtime/ctime changed)"
        return None

    def _check_and_map(self, key: SnapshotKey, config: ModelConfig) -> None:
        self.identity = self._identity(os.fstat(self._fd))
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, len(MAGIC) + 8, 0)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise CorruptSnapshot(f"{self.path.name}: bad magic (not a snapshot or truncated)")
        hlen = int.from_bytes(head[len(MAGIC):], "little")
        if hlen <= 0 or len(MAGIC) + 8 + hlen > min(size, 64 * 1024 * 1024):
            raise CorruptSnapshot(f"{self.path.name}: header length {hlen} does not fit the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, hlen, len(MAGIC) + 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptSnapshot(f"{self.path.name}: header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict) or header.get("key") != key.as_dict():
            raise CorruptSnapshot(f"{self.path.name}: header key does not match {key}")
        if header.get("file_bytes") != size:
            raise CorruptSnapshot(f"{self.path.name}: file is {size} bytes, header says {header.get('file_bytes')} (truncated?)")
        expected, _ = layout(config, key)
        try:
            got = [SnapshotTensor(t["name"], tuple(t["shape"]), t["dtype"], t["offset"], t["length"]) for t in header["tensors"]]
            self._crc = {t["name"]: int(t["crc32c"], 16) for t in header["tensors"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptSnapshot(f"{self.path.name}: malformed tensor index: {exc!r}") from exc
        if got != expected:
            raise CorruptSnapshot(f"{self.path.name}: tensor index does not match the model's layout")
        self.tensors = {t.name: t for t in got}
        # Map through a separate open file: mmap keeps a dup of the descriptor it is given,
        # and a dup of the locked one would hold the flock for as long as the mapping lives.
        map_fd = os.open(self.path, os.O_RDONLY)
        try:
            if os.fstat(map_fd).st_ino != os.fstat(self._fd).st_ino:
                raise CorruptSnapshot(f"{self.path.name}: replaced while being opened")
            self._mm = mmap.mmap(map_fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(map_fd)

    def verify(self, name: str) -> None:
        """Raise CorruptSnapshot unless the tensor's bytes match its crc32c (thread-safe)."""
        t = self.tensors[name]
        if crc32c.crc32c(memoryview(self._mm)[t.offset : t.offset + t.length]) != self._crc[name]:
            raise CorruptSnapshot(f"{self.path.name}: tensor {name!r} fails its crc32c check")

    def tensor(self, name: str, verify: bool = True) -> torch.Tensor:
        """The tensor over the mapping (zero-copy); crc32c-checked first unless `verify` is False."""
        t = self.tensors[name]
        if verify:
            self.verify(name)
        flat = torch.frombuffer(self._mm, dtype=torch_dtype(t.dtype), count=t.length // torch_dtype(t.dtype).itemsize,
                                offset=t.offset)
        return flat.view(t.shape)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the shared flock
            self._fd = -1

    def __del__(self) -> None:
        self.release()


class SnapshotWriter:
    """Writes one snapshot under a temporary name; `commit()` makes it visible atomically."""

    def __init__(self, store: "SnapshotStore", key: SnapshotKey, config: ModelConfig) -> None:
        self.store, self.key = store, key
        self.tensors, self.file_bytes = layout(config, key)
        self._index = {t.name: i for i, t in enumerate(self.tensors)}
        self._crcs = ["" for _ in self.tensors]
        self.path = store.directory / key.filename
        self.tmp = store.directory / f".{key.filename}.tmp.{os.getpid()}.{time.monotonic_ns()}"
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(self._fd, self.file_bytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i = self._index[name]
        spec = self.tensors[i]
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if tuple(t.shape) != spec.shape or t.dtype != torch_dtype(spec.dtype):
            raise ValueError(f"snapshot tensor {name}: got {tuple(t.shape)} {t.dtype}, expected {spec.shape} {spec.dtype}")
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().data
        done = 0
        while done < len(raw):
            done += os.pwrite(self._fd, raw[done:], spec.offset + done)
        self._crcs[i] = f"{crc32c.crc32c(raw):08x}"

    def commit(self) -> Path | None:
        """Header, fsync, rename into place; None (and nothing visible) when it cannot fit."""
        missing = [t.name for t, c in zip(self.tensors, self._crcs) if not c]
        if missing:
            self.abort()
            raise ValueError(f"snapshot is missing tensors: {missing[:3]}")
        header = _header_bytes(self.key, self.tensors, self._crcs, self.file_bytes)
        os.pwrite(self._fd, MAGIC + len(header).to_bytes(8, "little") + header, 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if not self.store.make_room(self.file_bytes, exclude=self.path):
            self.abort()
            return None
        os.replace(self.tmp, self.path)
        self.store._fsync_dir()
        log.info("snapshot written: %s (%d bytes)", self.path, self.file_bytes)
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)


class FillLock:
    """An exclusive flock on a snapshot's fill lock file: tried once when made, `wait` for it within a bound."""

    POLL_S = 0.02  # flock has no timeout: a non-blocking try this often until the wait runs out

    def __init__(self, path: Path) -> None:
        self.path = path
        self.waited_s = 0.0
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a directory gone or read-only: load as if alone (the snapshot is only a cache)
            log.warning("snapshot fill lock %s not available (%s): loading without it", path.name, exc)
            self._fd = -1
            self.acquired = self.contended = False
            return
        self.acquired = self._try()
        self.contended = not self.acquired  # another replica held it when first asked

    def _try(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def wait(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the lock (at once if held already); whether it is held."""
        t0 = time.monotonic()
        while not self.acquired and self._fd >= 0:
            self.acquired = self._try()
            if self.acquired or time.monotonic() - t0 >= wait_s:
                break
            time.sleep(self.POLL_S)
        self.waited_s += time.monotonic() - t0
        return self.acquired

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1
            self.acquired = False

    def __enter__(self) -> "FillLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class SnapshotStore:
    """A bounded directory of snapshots with LRU eviction that never evicts one in use."""

    def __init__(self, directory: str | Path, max_bytes: int, fill_wait_s: float = 0.0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if fill_wait_s < 0:
            raise ValueError(f"fill_wait_s must be >= 0, got {fill_wait_s}")
        self.fill_wait_s = float(fill_wait_s)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self.evicted: list[Path] = []  # what this store object evicted, oldest first
        self._clean_stale_temps()

    def path(self, key: SnapshotKey) -> Path:
        return self.directory / key.filename

    def exists(self, key: SnapshotKey) -> bool:
        return self.path(key).is_file()

    def open(self, key: SnapshotKey, config: ModelConfig) -> MappedSnapshot | None:
        """Map the snapshot for `key`; None when absent. A bad one raises CorruptSnapshot."""
        path = self.path(key)
        try:
            snap = MappedSnapshot(path, key, config)
        except FileNotFoundError:
            return None
        try:  # last use, for LRU, in the sidecar: the snapshot's own times are the mapped file's identity
            _used(path).touch()
        except OSError as exc:
            log.warning("could not record the use of %s: %s", path.name, exc)
        return snap

    def fill(self, key: SnapshotKey) -> FillLock:
        """The key's fill lock, tried once (see the module docstring). Hold it (`with`) while reading the
        original and writing the snapshot; when `contended`, `wait(fill_wait_s)` for the replica filling it,
        then map its snapshot (a wait that runs out: read the original anyway)."""
        return FillLock(self.directory / f".{key.filename}{FILL_SUFFIX}")

    def writer(self, key: SnapshotKey, config: ModelConfig) -> SnapshotWriter | None:
        """A writer, or None when the snapshot can never fit under max_bytes."""
        w_bytes = layout(config, key)[1]
        if w_bytes > self.max_bytes:
            log.warning("snapshot of %s needs %d bytes, more than max_bytes %d: not written", key.model, w_bytes, self.max_bytes)
            return None
        return SnapshotWriter(self, key, config)

    def invalidate(self, key: SnapshotKey, reason: str) -> None:
        log.warning("snapshot %s invalidated: %s", self.path(key).name, reason)
        self.path(key).unlink(missing_ok=True)
        _used(self.path(key)).unlink(missing_ok=True)

    def entries(self) -> list[SnapshotInfo]:
        out = []
        for p in self.directory.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            try:
                used = _used(p).stat().st_mtime
            except FileNotFoundError:
                used = 0.0
            out.append(SnapshotInfo(p, st.st_size, max(st.st_atime, st.st_mtime, used)))
        return sorted(out, key=lambda e: e.last_used)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def make_room(self, need: int, exclude: Path | None = None) -> bool:
        """Evict least-recently-used snapshots not in use until `need` more bytes fit."""
        with self._lock:
            entries = [e for e in self.entries() if e.path != exclude]
            used = sum(e.bytes for e in entries)
            for e in entries:
                if used + need <= self.max_bytes:
                    break
                if self._evict_if_unused(e.path):
                    used -= e.bytes
            ok = used + need <= self.max_bytes
            if not ok:
                log.warning("snapshot store %s: %d bytes in use, cannot fit %d more under %d",
                            self.directory, used, need, self.max_bytes)
            return ok

    def _evict_if_unused(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a replica maps it
            path.unlink(missing_ok=True)
            _used(path).unlink(missing_ok=True)
            self.evicted.append(path)
            log.info("snapshot evicted (least recently used): %s", path.name)
            return True
        finally:
            os.close(fd)

    def _clean_stale_temps(self) -> None:
        """Remove temporary files left by writers that died mid-write."""
        for p in self.directory.iterdir():
            if p.name.endswith(SUFFIX + USED_SUFFIX) and not p.with_name(p.name[: -len(USED_SUFFIX)]).exists():
                p.unlink(missing_ok=True)  # the sidecar of a snapshot removed by hand
                continue
            m = _TMP.match(p.name)
            if not m:
                continue
            pid = int(m.group("pid"))
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                pass
            if not alive:
                p.unlink(missing_ok=True)

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
