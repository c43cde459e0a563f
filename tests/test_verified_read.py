"""The verified reader: every tensor's sha256 is checked before it is handed out, in both
read modes (mapped on CPU, pread into staging buffers on CUDA), and closing it never hangs."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch

from prewarm.runtime.manifest import CorruptWeights, Manifest
from prewarm.runtime.model import ModelConfig, load_manifest, make_model
from prewarm.runtime.verified_read import VerifiedReader

CFG = ModelConfig(vocab_size=512, d_model=64, n_layers=3, n_heads=2, d_ff=128, max_seq_len=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vr") / "m", CFG, seed=3, name="vr")


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    p = ThreadPoolExecutor(max_workers=2)
    yield p
    p.shutdown(wait=True, cancel_futures=True)


def _expected(model_dir: Path, m: Manifest) -> dict[str, bytes]:
    raw = (model_dir / m.file).read_bytes()
    return {e.name: raw[e.offset : e.offset + e.length] for e in m.tensors}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x80]))


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_reads_every_tensor_byte_exact_in_order(model_dir: Path, pool: ThreadPoolExecutor, mapped: bool, chunk: int) -> None:
    m = load_manifest(model_dir)
    want = _expected(model_dir, m)
    fd = os.open(model_dir / m.file, os.O_RDONLY)
    # A read-ahead window smaller than one tensor still makes progress, one tensor at a time.
    reader = VerifiedReader(fd, m.tensors, pool, chunk_bytes=chunk, mapped=mapped, ahead_bytes=1024).start()
    try:
        for e in m.tensors:
            buf = reader.take(e.name)
            assert buf.dtype == torch.uint8 and buf.numel() == e.length
            assert bytes(buf.numpy()) == want[e.name]
        assert reader.bytes_read == m.total_bytes
    finally:
        reader.close()
        os.close(fd)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
def test_a_flipped_bit_is_refused_naming_the_tensor(model_dir: Path, tmp_path: Path, pool: ThreadPoolExecutor,
                                                     mapped: bool) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    m = load_manifest(bad)
    target = m.entry("layers.1.mlp.fc2.weight")
    _flip(bad / m.file, target.offset + target.length - 1)  # the very last byte
    fd = os.open(bad / m.file, os.O_RDONLY)
    reader = VerifiedReader(fd, m.tensors, pool, chunk_bytes=8192, mapped=mapped).start()
    try:
        for e in m.tensors:
            if e.name == target.name:
                with pytest.raises(CorruptWeights, match=r"layers\.1\.mlp\.fc2\.weight.*sha256"):
                    reader.take(e.name)
                break
            reader.take(e.name)  # the tensors before it are intact and served
    finally:
        reader.close()
        os.close(fd)


def test_a_short_file_is_refused_in_pread_mode(model_dir: Path, tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    bad = tmp_path / "short"
    shutil.copytree(model_dir, bad)
    m = load_manifest(bad)
    last = m.tensors[-1]
    os.truncate(bad / m.file, last.offset + last.length // 2)
    fd = os.open(bad / m.file, os.O_RDONLY)
    reader = VerifiedReader(fd, m.tensors, pool, chunk_bytes=1 << 20).start()
    try:
        for e in m.tensors[:-1]:
            reader.take(e.name)
        with pytest.raises(CorruptWeights, match="ends inside"):
            reader.take(last.name)
    finally:
        reader.close()
        os.close(fd)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
def test_close_mid_read_ends_the_reader_and_every_hash(model_dir: Path, mapped: bool) -> None:
    m = load_manifest(model_dir)
    pool = ThreadPoolExecutor(max_workers=2)
    fd = os.open(model_dir / m.file, os.O_RDONLY)
    # 200 KB/s: the whole model would take many seconds; close after the first tensor.
    reader = VerifiedReader(fd, m.tensors, pool, chunk_bytes=4096, mapped=mapped, read_limit_bps=200e3).start()
    reader.take(m.tensors[0].name)
    done = threading.Event()

    def close() -> None:
        reader.close()
        pool.shutdown(wait=True, cancel_futures=True)
        done.set()

    threading.Thread(target=close, daemon=True).start()
    assert done.wait(10), "close() hung"
    os.close(fd)
    assert reader.bytes_read < m.total_bytes
