"""Progressive, pipelined model loading: serve the first token before the tail is in.

`ProgressiveLoader` loads a model directory in three phases on a background thread:
EMBEDDINGS (token and position embeddings, final norm, output head), FIRST_LAYERS (the
first K blocks) and REST. Every block has its own `threading.Event`; the model's forward
pass calls `before_layer(i)`, which waits on block i's event, so a request that arrives
during loading computes block 0 while block 1 is being read (PipeSwitch-style), and its
answer is bit-identical to the fully loaded model's because it runs the same code.

Where the bytes come from:
- a valid node-local snapshot (`prewarm.runtime.snapshot`) when the store has one: tensors are
  mapped and (on CUDA) copied to the device; their crc32c checks run on a thread pool
  ahead of use, and a tensor is installed only after its own check passed; nothing
  reads model.safetensors;
- otherwise, after waiting for another replica of the node that is filling the snapshot (and
  then mapping it: `SnapshotStore.fill`), model.safetensors, through
  `prewarm.runtime.verified_read.VerifiedReader`: a reader thread reads ahead in
  `read_chunk_bytes` chunks (on CPU by mapping the file and asking the kernel to read
  ahead, on CUDA with `os.preadv` into pinned buffers) while a pool hashes the tensors
  already in, so reading tensor i+1 overlaps hashing tensor i and the
  load runs near the disk's speed; each tensor is checked against the manifest's shape,
  dtype and sha256 (`CorruptWeights` names the tensor) before it is converted to the
  runtime dtype and moved to the device (non-blocking copies on CUDA); then
  the snapshot for the next replica is written (after the model is complete, off the
  first-token path). A snapshot that fails a check mid-load is invalidated and the rest
  comes from the original, so it is never served.

`read_limit_bps` caps the read bandwidth (so a loading replica does not starve the disk
of its neighbours on a node); tests also use it to make a load slow enough to overlap.
`load_full` is the standard non-progressive path, kept for comparison. On CPU safetensors
maps the file lazily, which would move the reading into the first request (and make a
comparison of load and compute times meaningless): it touches every page of every tensor,
so "loaded" means the bytes were read, in the same form the progressive loader serves on
CPU (views of the mapped file).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from prewarm.core.domain import LoadPhase
from prewarm.runtime.manifest import WEIGHTS_FILE, CorruptWeights, Manifest, ModelError, TensorEntry, load_manifest
from prewarm.runtime.model import ModelConfig, TransformerLM, load_config, torch_dtype
from prewarm.runtime.snapshot import CorruptSnapshot, MappedSnapshot, SnapshotKey, SnapshotStore, SnapshotWriter
from prewarm.runtime.verified_read import VerifiedReader, default_verify_threads

log = logging.getLogger("prewarm.coldstart")

ProgressCallback = Callable[[float, LoadPhase], None]
PhaseCallback = Callable[[LoadPhase, float], None]

DEFAULT_CHUNK = 8 * 1024 * 1024
_SAFETENSORS_CODES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU; 'cuda' without CUDA is an error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device 'cuda' requested but torch.cuda.is_available() is False")
    return dev


def default_first_layers(n_layers: int) -> int:
    return max(1, n_layers // 4)


def coldstart_log(**fields: object) -> None:
    """One `[COLDSTART] key=value ...` line (values without spaces, floats rounded)."""
    parts = []
    for k, v in fields.items():
        if isinstance(v, float):
            v = f"{v:.4f}"
        parts.append(f"{k}={str(v).replace(' ', '_')}")
    log.info("[COLDSTART] %s", " ".join(parts))


@dataclass
class LoadStats:
    """What a load did: proof of where bytes came from, and how long each phase took."""

    source: str = ""  # "snapshot" | "original" | "snapshot+original" (a snapshot failed mid-load)
    opened: list[str] = field(default_factory=list)  # files opened for weights, in order
    bytes_from_original: int = 0
    bytes_from_snapshot: int = 0
    original_read: str = ""  # "mapped" (CPU: views of the verified file) | "pread" (CUDA: pinned staging)
    snapshot_rejected: str = ""  # why a present snapshot was not (fully) used
    snapshot_written: str = ""  # path of the snapshot this load wrote for the next replica
    fill_waited_s: float = 0.0  # waited for another replica on the node to fill the snapshot (`SnapshotStore.fill`)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    load_seconds: float = 0.0  # start to every weight on the device
    layer_waits: int = 0  # forward passes that had to wait for a block (pipelining happened)


def _partition(config: ModelConfig, first_layers: int) -> list[tuple[LoadPhase, list[tuple[int | None, list[str]]]]]:
    """Load order: (phase, [(block index or None for phase-1 tensors, tensor names)])."""
    names = [n for n, _ in config.tensor_shapes()]
    k = min(first_layers, config.n_layers)

    def block(i: int) -> tuple[int | None, list[str]]:
        return i, [n for n in names if n.startswith(f"layers.{i}.")]

    return [
        (LoadPhase.EMBEDDINGS, [(None, [n for n in names if not n.startswith("layers.")])]),
        (LoadPhase.FIRST_LAYERS, [block(i) for i in range(k)]),
        (LoadPhase.REST, [block(i) for i in range(k, config.n_layers)]),
    ]


def _check_safetensors_header(path: Path, manifest: Manifest) -> None:
    """The file's own header must agree with the manifest on every byte range."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptWeights(path.name, "file is shorter than a safetensors header")
        hlen = int.from_bytes(raw, "little")
        if hlen > 100 * 1024 * 1024:
            raise CorruptWeights(path.name, f"header length {hlen} is not plausible")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptWeights(path.name, f"safetensors header is not valid JSON: {exc}") from exc
    base = 8 + hlen
    for e in manifest.tensors:
        h = header.get(e.name)
        if not isinstance(h, dict):
            raise CorruptWeights(e.name, "missing from the safetensors header")
        begin, end = h.get("data_offsets", (None, None))
        if (base + begin, end - begin) != (e.offset, e.length):
            raise CorruptWeights(e.name, f"safetensors byte range {begin}..{end} disagrees with the manifest")
        if list(h.get("shape", [])) != list(e.shape) or _SAFETENSORS_CODES.get(str(h.get("dtype"))) != e.dtype:
            raise CorruptWeights(e.name, f"safetensors says {h.get('shape')} {h.get('dtype')}, manifest {list(e.shape)} {e.dtype}")


class ProgressiveLoader:
    """Loads one model directory into a `TransformerLM`, phase by phase, on a thread."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str | None = None,
        first_layers: int | None = None,
        snapshots: SnapshotStore | None = None,
        model_name: str | None = None,
        node: str = "",
        on_progress: ProgressCallback | None = None,
        on_phase: PhaseCallback | None = None,
        read_chunk_bytes: int = DEFAULT_CHUNK,
        read_limit_bps: float | None = None,
        verify_threads: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = load_manifest(self.model_dir)
        stored = load_config(self.model_dir)
        if stored.dtype != self.manifest.dtype:
            raise ModelError(f"config.json dtype {stored.dtype} disagrees with manifest dtype {self.manifest.dtype}")
        self.stored_config = stored
        self.config = stored.with_dtype(dtype) if dtype else stored  # runtime dtype
        self.device = resolve_device(device)
        if first_layers is not None and first_layers < 1:
            raise ValueError(f"first_layers must be >= 1, got {first_layers}")
        self.first_layers = min(first_layers or default_first_layers(stored.n_layers), stored.n_layers)
        if read_chunk_bytes <= 0:
            raise ValueError(f"read_chunk_bytes must be positive, got {read_chunk_bytes}")
        if read_limit_bps is not None and read_limit_bps <= 0:
            raise ValueError(f"read_limit_bps must be positive, got {read_limit_bps}")
        if verify_threads is not None and verify_threads < 1:
            raise ValueError(f"verify_threads must be >= 1, got {verify_threads}")
        self.read_chunk_bytes = read_chunk_bytes
        self.read_limit_bps = read_limit_bps
        self.verify_threads = verify_threads or default_verify_threads()
        self.snapshots = snapshots
        self.model_name = model_name or self.manifest.name
        self.node = node
        self.on_progress = on_progress
        self.on_phase = on_phase
        self.snapshot_key = SnapshotKey.for_manifest(self.manifest, self.config.dtype, self.model_name)
        # The module tree is built on first use: `start()` builds it on the load thread once the
        # reads are under way (building costs tens of ms, and the first one in a process imports
        # torch._dynamo for the meta-device init, seconds), so it overlaps the weights' arrival.
        self._model: TransformerLM | None = None
        self._model_lock = threading.Lock()
        self.stats = LoadStats()
        self.mapped: MappedSnapshot | None = None  # the snapshot the live weights map, if any

        self._entries = {e.name: e for e in self.manifest.tensors}
        self._check_manifest_matches_config()
        self._emb_ready = threading.Event()
        self._layer_ready = [threading.Event() for _ in range(self.config.n_layers)]
        self._done = threading.Event()  # every weight on the device (or failed)
        self._finished = threading.Event()  # thread over, snapshot written too
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._loaded_bytes = 0
        self._progress = 0.0
        self._phase = LoadPhase.NONE
        self.error: BaseException | None = None
        self._t0 = 0.0

    # -- public state --------------------------------------------------------------------
    @property
    def model(self) -> TransformerLM:
        """The model; its parameters are on the meta device until their weights are in."""
        model = self._model
        if model is None:
            with self._model_lock:
                if self._model is None:
                    self._model = TransformerLM.skeleton(self.config)
                model = self._model
        return model

    @property
    def progress(self) -> float:
        return self._progress

    @property
    def phase(self) -> LoadPhase:
        return self._phase

    @property
    def loaded(self) -> bool:
        return self._done.is_set() and self.error is None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "ProgressiveLoader":
        """Start the background load (idempotent)."""
        with self._start_lock:
            if self._thread is None:
                self._t0 = time.perf_counter()
                self._thread = threading.Thread(target=self._run, name=f"load-{self.model_name}", daemon=True)
                self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """True when every weight is loaded; raises the load's error if it failed."""
        ok = self._done.wait(timeout)
        if self.error is not None:
            raise self.error
        return ok

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to finish, including writing the snapshot."""
        return self._finished.wait(timeout)

    def wait_embeddings(self, timeout: float | None = None) -> bool:
        ok = self._emb_ready.wait(timeout)
        if self.error is not None:
            raise self.error
        return ok

    def before_layer(self, i: int) -> None:
        """The forward hook: block until layer i's weights are on the device."""
        ev = self._layer_ready[i]
        if not ev.is_set():
            self.stats.layer_waits += 1
            ev.wait()
        if self.error is not None:
            raise self.error

    # -- the load ------------------------------------------------------------------------
    def _check_manifest_matches_config(self) -> None:
        for name, shape in self.stored_config.tensor_shapes():
            e = self._entries.get(name)
            if e is None:
                raise CorruptWeights(name, "missing from the manifest")
            if tuple(e.shape) != tuple(shape):
                raise CorruptWeights(name, f"manifest shape {list(e.shape)} != config shape {list(shape)}")
            if e.dtype != self.stored_config.dtype:
                raise CorruptWeights(name, f"manifest dtype {e.dtype} != config dtype {self.stored_config.dtype}")

    def _advance(self, nbytes: int) -> None:
        self._loaded_bytes += nbytes
        total = self.manifest.total_bytes or 1
        self._progress = min(1.0, self._loaded_bytes / total)
        if self.on_progress is not None:
            try:
                self.on_progress(self._progress, self._phase)
            except Exception:  # a reporting failure must not fail the load
                log.exception("on_progress callback failed")

    def _run(self) -> None:
        try:
            self._load_all()
        except BaseException as exc:  # noqa: BLE001 - surfaced through .error and the waits
            self.error = exc
            reason = "corrupt_weights" if isinstance(exc, CorruptWeights) else type(exc).__name__
            coldstart_log(event="failed", model=self.model_name, node=self.node, phase=self._phase.value,
                          reason=reason, detail=str(exc)[:200])
            self._emb_ready.set()
            for ev in self._layer_ready:
                ev.set()
            self._done.set()
        finally:
            self._finished.set()

    def _open_snapshot(self) -> MappedSnapshot | None:
        if self.snapshots is None:
            return None
        try:
            snap = self.snapshots.open(self.snapshot_key, self.config)
        except CorruptSnapshot as exc:
            self.stats.snapshot_rejected = str(exc)
            self.snapshots.invalidate(self.snapshot_key, str(exc))
            return None
        if snap is not None:
            self.stats.opened.append(str(snap.path))
        return snap

    def _load_all(self) -> None:
        snap = self._open_snapshot()
        if snap is not None or self.snapshots is None:
            self._load_from(snap)
            return
        # No snapshot: fill it, unless another replica on the node is filling it; then wait for it and map it,
        # building the module tree meanwhile (seconds for a process's first, off the path once the snapshot is in).
        with self.snapshots.fill(self.snapshot_key) as fill:
            if fill.contended:
                self.model  # noqa: B018 - built now, while waiting
                fill.wait(self.snapshots.fill_wait_s)
                self.stats.fill_waited_s = fill.waited_s
                snap = self._open_snapshot()
                if snap is not None:
                    fill.release()
            self._load_from(snap)

    def _load_from(self, snap: MappedSnapshot | None) -> None:
        """Load every weight from `snap` (else the original, then write the snapshot)."""
        plan = _partition(self.config, self.first_layers)
        order = [n for _, groups in plan for _, names in groups for n in names]
        pool = ThreadPoolExecutor(max_workers=self.verify_threads, thread_name_prefix="verify")
        # The snapshot's per-tensor checks run ahead of use, in parallel; each tensor waits for its own.
        checks: dict[str, Future[None]] = {n: pool.submit(snap.verify, n) for n in order} if snap is not None else {}
        reader: VerifiedReader | None = None
        fd: int | None = None
        used_original = False
        done = 0  # tensors installed, in `order`
        try:
            if snap is None:
                fd = self._open_original()
                reader = self._reader(fd, pool, [self._entries[n] for n in order])
            model = self.model  # built while the first reads and checks are in flight
            for phase, groups in plan:
                self._phase = phase
                t = time.perf_counter()
                for block, names in groups:
                    for name in names:
                        e = self._entries[name]
                        tensor: torch.Tensor | None = None
                        if snap is not None:
                            try:
                                tensor = self._from_snapshot(snap, name, checks.pop(name))
                            except CorruptSnapshot as exc:
                                self.stats.snapshot_rejected = str(exc)
                                assert self.snapshots is not None
                                self.snapshots.invalidate(self.snapshot_key, str(exc))
                                snap.release()
                                snap = None
                                for f in checks.values():
                                    f.cancel()
                                checks.clear()
                        if tensor is None:
                            if reader is None:
                                fd = self._open_original()
                                reader = self._reader(fd, pool, [self._entries[n] for n in order[done:]])
                            tensor = self._from_original(reader, e)
                            used_original = True
                        model.set_tensor(name, tensor)
                        done += 1
                        self._advance(e.length)
                    self._sync_device()
                    # A block becomes usable the moment its last tensor is in, not at the phase end.
                    (self._emb_ready if block is None else self._layer_ready[block]).set()
                secs = time.perf_counter() - t
                self.stats.phase_seconds[phase.value] = secs
                coldstart_log(event="phase", model=self.model_name, node=self.node, phase=phase.value,
                              seconds=secs, progress=self._progress, source="original" if used_original else "snapshot")
                if self.on_phase is not None:
                    try:
                        self.on_phase(phase, secs)
                    except Exception:
                        log.exception("on_phase callback failed")
        finally:
            for f in checks.values():
                f.cancel()
            if reader is not None:
                reader.close()
            pool.shutdown(wait=True, cancel_futures=True)
            if fd is not None:
                os.close(fd)
        self.stats.source = ("snapshot+original" if snap is None and self.stats.bytes_from_snapshot else
                             "original" if used_original else "snapshot")
        self.mapped = snap
        self.stats.load_seconds = time.perf_counter() - self._t0
        gbps = self.manifest.total_bytes / max(self.stats.load_seconds, 1e-9) / 1e9
        coldstart_log(event="loaded", model=self.model_name, node=self.node, seconds=self.stats.load_seconds,
                      source=self.stats.source, bytes=self.manifest.total_bytes, gbps=gbps,
                      fill_waited_s=self.stats.fill_waited_s)
        self._progress = 1.0
        self._phase = LoadPhase.DONE
        self._done.set()
        if used_original and self.snapshots is not None:
            self._write_snapshot()

    def _open_original(self) -> int:
        path = self.model_dir / self.manifest.file
        _check_safetensors_header(path, self.manifest)
        size = path.stat().st_size
        if size != self.manifest.file_bytes:
            raise CorruptWeights(WEIGHTS_FILE, f"file is {size} bytes, manifest says {self.manifest.file_bytes} (truncated?)")
        self.stats.opened.append(str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
        except OSError:
            pass
        return fd

    def _reader(self, fd: int, pool: ThreadPoolExecutor, entries: list[TensorEntry]) -> VerifiedReader:
        mapped = self.device.type == "cpu"
        self.stats.original_read = "mapped" if mapped else "pread"
        return VerifiedReader(fd, entries, pool, chunk_bytes=self.read_chunk_bytes, mapped=mapped,
                              pin_memory=self.device.type == "cuda", read_limit_bps=self.read_limit_bps).start()

    def _from_original(self, reader: VerifiedReader, e: TensorEntry) -> torch.Tensor:
        buf = reader.take(e.name)  # read and sha256-verified, or CorruptWeights
        self.stats.bytes_from_original += e.length
        t = buf.view(torch_dtype(e.dtype)).view(e.shape)
        if self.device.type == "cuda":
            t = t.to(self.device, non_blocking=True)  # from a pinned buffer
        return t.to(self.config.torch_dtype) if t.dtype != self.config.torch_dtype else t

    def _from_snapshot(self, snap: MappedSnapshot, name: str, check: Future[None]) -> torch.Tensor:
        check.result()  # its crc32c, or CorruptSnapshot
        t = snap.tensor(name, verify=False)
        self.stats.bytes_from_snapshot += t.numel() * t.element_size()
        if self.device.type == "cuda":
            t = t.to(self.device, non_blocking=False)
        return t

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _write_snapshot(self) -> None:
        assert self.snapshots is not None
        t = time.perf_counter()
        writer: SnapshotWriter | None = None
        try:
            writer = self.snapshots.writer(self.snapshot_key, self.config)
            if writer is None:
                return
            params = dict(self.model.named_parameters())
            for name, _ in self.config.tensor_shapes():
                writer.write(name, params[name])
            path = writer.commit()
            writer = None
            if path is not None:
                self.stats.snapshot_written = str(path)
                coldstart_log(event="snapshot_written", model=self.model_name, node=self.node,
                              seconds=time.perf_counter() - t, path=path)
        except Exception as exc:  # the model is loaded; a failed snapshot only costs the next replica
            log.warning("snapshot for %s not written: %s", self.model_name, exc)
            if writer is not None:
                writer.abort()

    def release(self) -> None:
        """Drop the shared lock on the mapped snapshot (call when the weights are dropped)."""
        if self.mapped is not None:
            self.mapped.release()
            self.mapped = None


def load_full(model_dir: str | Path, device: str | torch.device = "auto", dtype: str | None = None) -> TransformerLM:
    """The standard path: every tensor onto the device with safetensors, then build the model."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    cfg = load_config(d)
    if dtype:
        cfg = cfg.with_dtype(dtype)
    dev = resolve_device(device)
    tensors = load_file(str(d / WEIGHTS_FILE), device=str(dev))
    model = TransformerLM.skeleton(cfg)
    for name, shape in cfg.tensor_shapes():
        t = tensors.pop(name, None)
        if t is None:
            raise CorruptWeights(name, "missing from model.safetensors")
        if tuple(t.shape) != tuple(shape):
            raise CorruptWeights(name, f"shape {list(t.shape)} != config shape {list(shape)}")
        t = t.to(cfg.torch_dtype)
        if t.device.type == "cpu":
            _fault_in(t)
        model.set_tensor(name, t)
    return model


def _fault_in(t: torch.Tensor) -> None:
    """Read one byte of every page under a CPU tensor, so a lazily mapped tensor is really in memory."""
    if t.numel() == 0:
        return
    u = t.detach().reshape(-1).view(torch.uint8)
    int(u[:: mmap.PAGESIZE].sum()) + int(u[-1])
