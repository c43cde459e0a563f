"""The CUDA paths: the engine, the progressive loader, snapshots, sleep mode and a runtime process on a GPU.

Every test here is marked `gpu` and skipped (saying why) where CUDA is absent; CPU machines
run the same behaviours in test_engine.py, test_loader.py and test_runtime.py. The CPU run
of the same model is the reference each CUDA result is compared with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prewarm.core.domain import LoadPhase
from prewarm.runtime.engine import Engine
from prewarm.runtime.loader import load_full, resolve_device
from prewarm.runtime.model import ModelConfig, greedy, last_logits, make_model
from prewarm.runtime.snapshot import SnapshotStore
from tests.runtime_server import call, start_runtime, wait_loaded

pytestmark = pytest.mark.gpu

PROMPT = "A replica on a GPU answers like the one on the CPU."
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=8, n_heads=4, d_ff=512, max_seq_len=256)
    return make_model(tmp_path_factory.mktemp("gpu") / "m", cfg, seed=11, name="gpu")


@pytest.fixture(scope="module")
def cpu_logits(model_dir: Path) -> torch.Tensor:
    full = load_full(model_dir, "cpu")
    return last_logits(full, list(PROMPT.encode()), CPU)


def test_auto_resolves_to_cuda() -> None:
    assert resolve_device("auto").type == "cuda"


def test_progressive_load_on_cuda_matches_the_cpu_model(model_dir: Path, cpu_logits: torch.Tensor) -> None:
    eng = Engine(model_dir, device="auto")
    assert eng.device.type == "cuda"
    eng.start_load()
    tokens = list(eng.generate(PROMPT, 8))  # may start before the tail is in: the prefill waits per layer
    assert eng.wait_loaded(60) and eng.phase is LoadPhase.DONE and eng.error is None
    assert len(tokens) == 8
    on_gpu = {p.device.type for p in eng.loader.model.parameters()}
    assert on_gpu == {"cuda"}
    torch.testing.assert_close(eng.logits(PROMPT), cpu_logits, atol=2e-3, rtol=2e-3)
    frag = eng.fragmentation()
    assert 0.0 <= frag < 1.0
    eng.close()


def test_level1_sleep_frees_gpu_memory_and_wake_restores_the_model(model_dir: Path, cpu_logits: torch.Tensor) -> None:
    eng = Engine(model_dir, device="cuda")
    eng.start_load()
    assert eng.wait_loaded(60)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    eng.sleep(1)
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    assert asleep < loaded - eng.manifest.total_bytes // 2, (loaded, asleep)
    eng.wake_up(60)
    torch.testing.assert_close(eng.logits(PROMPT), cpu_logits, atol=2e-3, rtol=2e-3)
    eng.close()


def test_snapshot_replica_on_cuda_equals_the_first(model_dir: Path, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots", max_bytes=1 << 30)
    first = Engine(model_dir, device="cuda", snapshots=store)
    first.start_load()
    assert first.wait_loaded(60) and first.wait_snapshot(60)
    second = Engine(model_dir, device="cuda", snapshots=store)
    second.start_load()
    assert second.wait_loaded(60)
    assert second.loader.stats.source == "snapshot"
    assert torch.equal(first.logits(PROMPT), second.logits(PROMPT))
    ids = list(PROMPT.encode())
    assert list(greedy(first.loader.model, ids, 8, first.device)) == list(greedy(second.loader.model, ids, 8, second.device))
    first.close()
    second.close()


def test_runtime_process_serves_from_cuda(model_dir: Path, tmp_path: Path) -> None:
    rt = start_runtime(model_dir, tmp_path, "--model-name", "gpu", "--self-validate", env={"PREWARM_RUNTIME_DEVICE": "auto"})
    try:
        status = wait_loaded(rt.url, 120.0)
        assert str(status["device"]).startswith("cuda"), status
        code, body, _ = call(f"{rt.url}/v1/completions", "POST", {"model": "gpu", "prompt": "hello", "max_tokens": 4})
        assert code == 200, body
        assert body["choices"][0]["text"] is not None
    finally:
        rt.stop()
