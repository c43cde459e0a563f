"""The node snapshot store: layout, atomic commit, corruption detection, LRU eviction."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from prewarm.runtime.model import ModelConfig
from prewarm.runtime.snapshot import ALIGN, MAGIC, CorruptSnapshot, FillLock, SnapshotKey, SnapshotStore

CFG = ModelConfig.for_size("tiny")


def _key(rev: str = "r1", dtype: str = "float32") -> SnapshotKey:
    return SnapshotKey("tiny", rev, dtype, (rev * 64)[:64])


def _tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(cfg.torch_dtype) for n, s in cfg.tensor_shapes()}


def _write(store: SnapshotStore, key: SnapshotKey, cfg: ModelConfig = CFG, seed: int = 0) -> Path:
    w = store.writer(key, cfg)
    assert w is not None
    for name, t in _tensors(cfg, seed).items():
        w.write(name, t)
    path = w.commit()
    assert path is not None
    return path


def test_round_trip_maps_page_aligned_tensors(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key())
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    snap = store.open(_key(), CFG)
    assert snap is not None
    want = _tensors(CFG)
    for name, spec in snap.tensors.items():
        assert spec.offset % ALIGN == 0
        got = snap.tensor(name)
        assert torch.equal(got, want[name])
    snap.release()


def test_bfloat16_snapshot_keeps_the_runtime_dtype(tmp_path: Path) -> None:
    cfg = CFG.with_dtype("bfloat16")
    store = SnapshotStore(tmp_path, 1 << 30)
    _write(store, _key(dtype="bfloat16"), cfg)
    snap = store.open(_key(dtype="bfloat16"), cfg)
    assert snap is not None and snap.tensor("tok_emb.weight").dtype == torch.bfloat16
    # A float32 replica of the same weights has a different key: it does not see this one.
    assert store.open(_key(dtype="float32"), CFG) is None


def test_an_uncommitted_snapshot_is_never_visible(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    w = store.writer(_key(), CFG)
    assert w is not None
    w.write("tok_emb.weight", _tensors(CFG)["tok_emb.weight"])
    assert store.open(_key(), CFG) is None and store.entries() == []
    with pytest.raises(ValueError, match="missing tensors"):
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_temp_files_of_dead_writers_are_cleaned(tmp_path: Path) -> None:
    stale = tmp_path / f".{_key().filename}.tmp.999999999.1"
    stale.write_bytes(b"half")
    mine = tmp_path / f".{_key().filename}.tmp.{os.getpid()}.2"
    mine.write_bytes(b"in progress")
    SnapshotStore(tmp_path, 1 << 30)
    assert not stale.exists() and mine.exists()


def test_flipped_bytes_fail_the_tensor_check(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key())
    snap = store.open(_key(), CFG)
    assert snap is not None
    spec = snap.tensors["layers.1.mlp.fc1.weight"]
    snap.release()
    with open(path, "r+b") as f:
        f.seek(spec.offset + 1000)
        b = f.read(1)
        f.seek(spec.offset + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    snap = store.open(_key(), CFG)
    assert snap is not None
    snap.tensor("layers.0.mlp.fc1.weight")  # untouched tensors pass
    with pytest.raises(CorruptSnapshot, match="layers.1.mlp.fc1.weight"):
        snap.tensor("layers.1.mlp.fc1.weight")


def test_truncated_and_bad_header_are_detected(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key())
    size = path.stat().st_size
    os.truncate(path, size - 5000)
    with pytest.raises(CorruptSnapshot, match="truncated"):
        store.open(_key(), CFG)
    path = _write(store, _key())
    raw = bytearray(path.read_bytes())
    raw[len(MAGIC) + 8 + 2] ^= 0x55  # inside the JSON header
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshot):
        store.open(_key(), CFG)
    path.write_bytes(b"not a snapshot at all")
    with pytest.raises(CorruptSnapshot, match="magic"):
        store.open(_key(), CFG)


def test_header_for_other_weights_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key("r1"))
    os.replace(path, store.path(_key("r2")))  # a file under the wrong name
    with pytest.raises(CorruptSnapshot, match="key"):
        store.open(_key("r2"), CFG)


def test_lru_eviction_under_max_bytes_skips_snapshots_in_use(tmp_path: Path) -> None:
    one = _write(SnapshotStore(tmp_path / "probe", 1 << 30), _key("p")).stat().st_size
    store = SnapshotStore(tmp_path / "s", int(one * 2.5))  # room for two
    a = _write(store, _key("a"))
    b = _write(store, _key("b"))
    os.utime(a, (1000, 1000))
    os.utime(b, (2000, 2000))
    held = store.open(_key("a"), CFG)  # a is now the most recently used, and in use
    assert held is not None
    c = _write(store, _key("c"))  # must evict b (least recently used, not in use)
    assert a.exists() and c.exists() and not b.exists()
    assert store.evicted == [b]
    assert store.total_bytes() <= store.max_bytes
    # Everything else is in use: a new snapshot does not fit, and nothing in use is evicted.
    held_c = store.open(_key("c"), CFG)
    assert held_c is not None
    w = store.writer(_key("d"), CFG)
    assert w is not None
    for name, t in _tensors(CFG).items():
        w.write(name, t)
    assert w.commit() is None
    assert a.exists() and c.exists() and not store.path(_key("d")).exists()
    held.release()
    d = _write(store, _key("d"))  # a was released: it is now evictable
    assert d.exists() and not a.exists() and c.exists()
    held_c.release()


def test_a_snapshot_larger_than_the_store_is_not_written(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1024)
    assert store.writer(_key(), CFG) is None


def test_header_lists_every_tensor(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key())
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 8], "little")
    header = json.loads(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + hlen])
    assert [t["name"] for t in header["tensors"]] == [n for n, _ in CFG.tensor_shapes()]
    assert header["file_bytes"] == len(raw)


def test_a_mapped_snapshot_notices_an_in_place_rewrite_but_not_another_replica_opening_it(tmp_path: Path) -> None:
    """Issue 13: snapshots are only ever renamed into place; a rewrite in place is caught by identity."""
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key("a"))
    held = store.open(_key("a"), CFG)
    assert held is not None and held.changed() is None
    other = store.open(_key("a"), CFG)  # another replica maps it: the LRU touch is not a change
    assert other is not None and held.changed() is None
    with open(path, "r+b") as f:
        f.seek(ALIGN)
        f.write(b"\xff" * 64)
    assert "modified in place" in (held.changed() or "")
    held.release()
    other.release()


def test_a_rewrite_in_place_that_restores_the_mtime_is_still_caught(tmp_path: Path) -> None:
    """Issue 20 (minor): same size, mtime put back with utime: the old (size, mtime) identity saw nothing,
    and the replica answered 200 with NaN logprobs. The ctime moves on every write and every utime."""
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key("a"))
    held = store.open(_key("a"), CFG)
    assert held is not None and held.changed() is None
    before = os.stat(path)
    time.sleep(0.01)  # a later clock reading than the ctime the snapshot has (coarse ctime granularity)
    with open(path, "r+b") as f:
        f.seek(ALIGN)
        f.write(b"\xff" * 64)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # the forgery holds
    assert "modified in place" in (held.changed() or "")
    held.release()


def test_the_last_use_lives_in_a_sidecar_and_leaves_the_snapshot_untouched(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, 1 << 30)
    path = _write(store, _key("a"))
    before = os.stat(path)
    held = store.open(_key("a"), CFG)
    assert held is not None
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)
    used = path.with_name(path.name + ".used")
    assert used.exists() and store.entries()[0].last_used >= used.stat().st_mtime
    held.release()
    store.invalidate(_key("a"), "test")
    assert not path.exists() and not used.exists()


def test_the_fill_lock_is_one_holder_per_key_waits_at_most_its_bound_and_dies_with_its_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    store = SnapshotStore(tmp_path, 1 << 30, fill_wait_s=0.2)
    first = store.fill(_key())
    assert first.acquired and not first.contended and first.wait(0.0)
    other = store.fill(_key("r2"))  # another key: its own lock
    assert other.acquired
    second = store.fill(_key())
    assert not second.acquired and second.contended
    t0 = time.monotonic()
    assert not second.wait(store.fill_wait_s) and 0.2 <= time.monotonic() - t0 < 2 and second.waited_s >= 0.2
    first.release()
    assert second.wait(store.fill_wait_s) and second.contended  # the filler is done: the waiter holds it now
    second.release()
    with store.fill(_key()) as again:
        assert again.acquired
    assert not again.acquired  # released on leaving the block
    # The snapshot store's listing and its clean-up leave lock files alone (they are not snapshots).
    assert store.entries() == [] and first.path.exists()
    # A holder that dies drops the lock (the kernel releases a dead process's flock).
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"), str(first.path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        waiter = FillLock(first.path)
        assert not waiter.acquired
    finally:
        holder.kill()
        holder.wait()
    assert waiter.wait(5.0)
    waiter.release()
    with pytest.raises(ValueError, match="fill_wait_s"):
        SnapshotStore(tmp_path, 1 << 30, fill_wait_s=-1)
    # no lock file to be had (its directory gone, or read-only): neither held nor waited for, the load goes on
    gone = FillLock(tmp_path / "gone" / ".x.snap.fill")
    assert not gone.acquired and not gone.contended and not gone.wait(5.0) and gone.waited_s < 1
