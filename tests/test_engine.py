"""The Engine facade: pipelined generation, structure, sleep/wake levels, thread use."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from prewarm.core.domain import LoadPhase
from prewarm.runtime.engine import Engine, EngineNotLoaded, EngineSleeping
from prewarm.runtime.loader import load_full
from prewarm.runtime.model import CorruptWeights, ModelConfig, greedy, last_logits, make_model
from prewarm.runtime.snapshot import SnapshotStore

CPU = torch.device("cpu")
PROMPT = "An engine answers while its weights are still arriving."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=8, n_heads=4, d_ff=256, max_seq_len=256)
    return make_model(tmp_path_factory.mktemp("engine") / "m", cfg, seed=5, name="eng")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[int], torch.Tensor]:
    full = load_full(model_dir, "cpu")
    ids = list(PROMPT.encode())
    return list(greedy(full, ids, 8, CPU)), last_logits(full, ids, CPU)


def test_generate_during_loading_equals_the_full_model(model_dir: Path, reference: tuple[list[int], torch.Tensor]) -> None:
    progress: list[float] = []
    phases: list[LoadPhase] = []
    # CPU explicitly: the reference is computed on CPU, and "auto" is CUDA where a GPU is present
    # (tests/test_gpu.py runs the same comparison on CUDA).
    eng = Engine(model_dir, device="cpu", read_limit_bps=12e6, read_chunk_bytes=64 * 1024,
                 on_progress=lambda p, ph: progress.append(p), on_phase=lambda ph, s: phases.append(ph))
    assert eng.device == CPU and eng.phase is LoadPhase.NONE and not eng.loaded and not eng.load_started
    with pytest.raises(EngineNotLoaded):
        next(eng.generate(PROMPT, 1))
    eng.start_load()
    eng.start_load()
    tokens = list(eng.generate(PROMPT, 8))  # starts right away: the prefill waits per layer
    assert eng.loader.stats.layer_waits >= 1
    assert tokens == reference[0]
    assert eng.wait_loaded(30) and eng.loaded and eng.progress == 1.0 and eng.phase is LoadPhase.DONE
    assert progress == sorted(progress) and progress[-1] == pytest.approx(1.0)
    assert phases == [LoadPhase.EMBEDDINGS, LoadPhase.FIRST_LAYERS, LoadPhase.REST]
    assert torch.equal(eng.logits(PROMPT), reference[1])
    assert eng.decode(eng.encode("héllo")) == "héllo"
    assert eng.error is None and eng.fragmentation() == 0.0


def test_tensors_match_the_manifest(model_dir: Path) -> None:
    eng = Engine(model_dir, device="cpu")
    assert eng.tensors() == {}  # nothing loaded yet
    eng.start_load()
    eng.wait_loaded(30)
    assert eng.tensors() == eng.manifest.shapes()
    assert len(eng.tensors()) == len(eng.manifest.tensors)


def test_sleep_levels_and_wake_give_the_same_answers(
    model_dir: Path, reference: tuple[list[int], torch.Tensor], tmp_path: Path
) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    eng = Engine(model_dir, device="cpu", snapshots=store, model_name="eng", node="n1")
    eng.start_load()
    eng.wait_loaded(30)
    eng.wait_snapshot(30)
    assert eng.loader.stats.source == "original" and eng.loader.stats.snapshot_written

    eng.sleep(1)
    assert eng.is_sleeping and eng.sleep_level == 1
    with pytest.raises(EngineSleeping):
        list(eng.generate(PROMPT, 2))
    eng.wake_up()
    assert not eng.is_sleeping
    assert list(eng.generate(PROMPT, 8)) == reference[0]

    eng.sleep(2)
    assert eng.is_sleeping and eng.tensors() == {} and not eng.loaded
    with pytest.raises(EngineSleeping):
        eng.logits(PROMPT)
    eng.wake_up(timeout=30)
    assert not eng.is_sleeping and eng.loaded
    assert eng.loader.stats.source == "snapshot"  # level 2 reloads from the node snapshot
    assert list(eng.generate(PROMPT, 8)) == reference[0]
    assert torch.equal(eng.logits(PROMPT), reference[1])
    with pytest.raises(ValueError):
        eng.sleep(3)
    eng.close()


def test_calls_from_executor_threads_are_serialised(model_dir: Path, reference: tuple[list[int], torch.Tensor]) -> None:
    eng = Engine(model_dir, device="cpu")
    eng.start_load()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: list(eng.generate(PROMPT, 8)), range(4)))
    assert results == [reference[0]] * 4
    # An abandoned iterator releases the generation lock when closed.
    it = eng.generate(PROMPT, 8)
    next(it)
    it.close()
    assert list(eng.generate(PROMPT, 8)) == reference[0]


def test_bad_prompts_are_refused_at_once(model_dir: Path) -> None:
    eng = Engine(model_dir, device="cpu")
    with pytest.raises(ValueError, match="empty"):
        eng.generate("", 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([1, 2, 10_000], 3)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate("hi", -1)


def test_a_failed_load_is_reported(model_dir: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-10, 2)
        tail = f.read(10)
        f.seek(-10, 2)
        f.write(bytes(b ^ 0xFF for b in tail))  # the last tensor: layers.7.mlp.fc2.bias
    eng = Engine(bad, device="cpu")
    eng.start_load()
    with pytest.raises(CorruptWeights, match=r"layers\.7\.mlp\.fc2\.bias"):
        eng.wait_loaded(30)
    assert eng.error is not None and not eng.loaded
