"""Reading a checkpoint at disk speed while still checking every tensor's sha256.

sha256 runs at about 1 GB/s on one core, a cold sequential read at 1-2 GB/s: done one
after the other per tensor (read tensor i, hash it, read tensor i+1 ...) the load runs at
half the disk's speed. `VerifiedReader` splits the work into a pipeline:

- one reader thread brings the tensors in, in load order and in large chunks, never
  waiting for a hash. Two ways, chosen by the loader:
  * `mapped=True` (CPU): the file is mapped privately (copy-on-write) and each tensor is
    a view of the mapping; the reader asks the kernel to read each chunk ahead
    (`MADV_WILLNEED`, asynchronous) and the hash pulls the pages in. No copy and, above
    all, no freshly allocated memory to fault in and zero: on a virtual machine first
    touches of new anonymous memory cost about as much CPU as the sha256 itself, so a
    copying load cannot keep up with the disk on a few cores;
  * `mapped=False` (CUDA): `os.preadv` straight into each tensor's pinned staging buffer
    (the caching host allocator reuses those), from which the loader copies to the device;
- each tensor's sha256 runs on a small thread pool, chunk by chunk as its bytes arrive,
  so tensor i is hashed while tensor i+1 is read and several tensors hash at once
  (file reads and hashlib release the GIL for large buffers);
- the consumer (the loader) `take`s tensors in order; a buffer is handed out only after
  its sha256 matched the manifest, otherwise `take` raises `CorruptWeights` naming it.

Read-ahead is bounded (`ahead_bytes` not yet taken) so a slow consumer does not pin the
whole model in host memory; `read_limit_bps` caps the read bandwidth.

A mapped tensor is verified when it is handed out; like the node snapshot, the served
weights then stay a view of the file, so the original must not be rewritten in place
while a replica maps it (a new revision is a new directory; `make-model` writes once).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from prewarm.runtime.manifest import CorruptWeights, TensorEntry

DEFAULT_AHEAD = 256 * 1024 * 1024

# What a chunk queue carries: the end offset of the bytes read so far, None when the
# tensor is complete, or the exception that stopped the read.
_Chunk = int | BaseException | None


def default_verify_threads() -> int:
    """Hash threads: enough to keep up with a fast disk, without taking the whole node."""
    return max(1, min(4, os.cpu_count() or 1))


class ReadCancelled(Exception):
    """The reader was closed before this tensor was complete."""


@dataclass
class _Slot:
    entry: TensorEntry
    buf: torch.Tensor
    chunks: "queue.SimpleQueue[_Chunk]" = field(default_factory=queue.SimpleQueue)
    verified: Future[None] | None = None


def _verify(slot: _Slot) -> None:
    """Hash the tensor's bytes as the reader reports them; raise unless they match."""
    e = slot.entry
    view = slot.buf.numpy().data
    h = hashlib.sha256()
    pos = 0
    while True:
        item = slot.chunks.get()
        if item is None:
            break
        if isinstance(item, BaseException):
            raise item
        h.update(view[pos:item])
        pos = item
    if pos != e.length:
        raise CorruptWeights(e.name, f"only {pos} of {e.length} bytes were read")
    if h.hexdigest() != e.sha256:
        raise CorruptWeights(e.name, "sha256 of its bytes does not match the manifest")


class VerifiedReader:
    """Reads `entries` from `fd` on a thread; `take(name)` returns verified uint8 buffers.

    The caller owns `fd` and `pool` and must `close()` the reader before closing either.
    Tensors must be taken in the order of `entries`.
    """

    def __init__(
        self,
        fd: int,
        entries: Sequence[TensorEntry],
        pool: ThreadPoolExecutor,
        *,
        chunk_bytes: int,
        mapped: bool = False,
        pin_memory: bool = False,
        ahead_bytes: int = DEFAULT_AHEAD,
        read_limit_bps: float | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._fd = fd
        self._entries = list(entries)
        self._pool = pool
        self._chunk = chunk_bytes
        self._pin = pin_memory
        self._ahead_limit = ahead_bytes
        self._limit = read_limit_bps
        self._mm: mmap.mmap | None = None
        if mapped and self._entries:
            # PROT_WRITE on a private mapping: torch wants writable buffers; writes never reach the file.
            self._mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._cond = threading.Condition()
        self._slots: dict[str, _Slot] = {}
        self._ahead = 0  # bytes handed to the pipeline and not yet taken
        self._closed = False
        self._reader_done = False
        self._error: BaseException | None = None  # what stopped the reader between tensors
        self._thread = threading.Thread(target=self._read_all, name="weights-reader", daemon=True)
        self.bytes_read = 0

    def start(self) -> "VerifiedReader":
        self._thread.start()
        return self

    def take(self, name: str) -> torch.Tensor:
        """The tensor's bytes once read and verified; raises CorruptWeights otherwise."""
        with self._cond:
            while name not in self._slots and not self._reader_done:
                self._cond.wait()
            slot = self._slots.pop(name, None)
        if slot is None:
            if self._error is not None:
                raise self._error
            raise CorruptWeights(name, "was not read (the reader stopped before it)")
        try:
            assert slot.verified is not None
            slot.verified.result()
        finally:
            with self._cond:
                self._ahead -= slot.entry.length
                self._cond.notify_all()
        return slot.buf

    def close(self) -> None:
        """Stop reading, end the pending hashes, wait for the reader thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None:  # started
            self._thread.join()

    # -- the reader thread ---------------------------------------------------------------
    def _read_all(self) -> None:
        current: _Slot | None = None
        t0 = time.perf_counter()
        try:
            for e in self._entries:
                with self._cond:
                    while not self._closed and self._ahead > 0 and self._ahead + e.length > self._ahead_limit:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._ahead += e.length
                slot = _Slot(e, self._buffer(e))
                slot.verified = self._pool.submit(_verify, slot)
                current = slot
                with self._cond:
                    self._slots[e.name] = slot
                    self._cond.notify_all()
                self._read_into(slot, t0)
                slot.chunks.put(None)
                current = None
        except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the tensor
            if current is not None:
                current.chunks.put(exc)
            else:
                self._error = exc
        finally:
            with self._cond:
                self._reader_done = True
                self._cond.notify_all()

    def _buffer(self, e: TensorEntry) -> torch.Tensor:
        if self._mm is None or e.length == 0:
            return torch.empty(e.length, dtype=torch.uint8, pin_memory=self._pin)
        if e.offset + e.length > len(self._mm):
            raise CorruptWeights(e.name, f"byte range ends at {e.offset + e.length}, file has {len(self._mm)} bytes")
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=e.length, offset=e.offset)

    def _read_into(self, slot: _Slot, t0: float) -> None:
        e = slot.entry
        view = slot.buf.numpy().data
        pos = 0
        while pos < e.length:
            if self._closed:
                raise ReadCancelled(f"reader closed while reading {e.name}")
            n = min(self._chunk, e.length - pos)
            if self._mm is not None:
                # Asynchronous: the hash pulls the pages in. (Mapping each chunk here with
                # MADV_POPULATE_READ instead was measured slower for a cold file: it reads synchronously.)
                start = (e.offset + pos) // mmap.PAGESIZE * mmap.PAGESIZE
                self._mm.madvise(mmap.MADV_WILLNEED, start, e.offset + pos + n - start)
                got = n
            else:
                got = os.preadv(self._fd, [view[pos : pos + n]], e.offset + pos)
            if got <= 0:
                raise CorruptWeights(e.name, f"file ends inside the tensor ({pos} of {e.length} bytes read)")
            pos += got
            slot.chunks.put(pos)
            self.bytes_read += got
            if self._limit:
                delay = t0 + self.bytes_read / self._limit - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
