"""On CUDA: what a runtime reports of its GPU memory is what the agent books, and sleep gives it back.

A real `serve-model` process on the GPU, driven through the agent's `RuntimeClient`: once
loaded, `/stats` reports what its CUDA allocator holds (at least the weights), the memory
ledger books that instead of the manifest's estimate, a level-1 sleep gives nearly all of
it back, and the wake restores it with the same answer. Marked `gpu`: skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prewarm.core.settings import RuntimeSettings, Settings
from prewarm.runtime.manifest import load_manifest
from prewarm.runtime.model import make_model
from tests.runtime_server import TOKEN, call, start_runtime, wait_loaded
from workers.node.memory import GPU, MemoryLedger
from workers.node.runtime_client import RuntimeClient

pytestmark = pytest.mark.gpu


def test_runtime_reports_its_gpu_memory_the_ledger_books_it_and_sleep_returns_it(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "m", 256 * 1024 * 1024, dtype="float16", name="m", revision="r1")
    weights = load_manifest(model_dir).total_bytes
    rt = start_runtime(model_dir, tmp_path, env={"PREWARM_RUNTIME_DEVICE": "cuda"})
    try:
        wait_loaded(rt.url, timeout=120)
        client = RuntimeClient(Settings(runtime=RuntimeSettings(token=TOKEN)), rt.url, model="m")
        body = {"model": "m", "prompt": "tiers of warmth", "max_tokens": 8}
        status, before, _ = call(f"{rt.url}/v1/completions", "POST", body)
        assert status == 200, before
        awake = client.gpu_bytes()
        assert awake is not None and awake >= weights, (awake, weights)

        ledger = MemoryLedger(gpu_budget_gb=100.0, host_budget_gb=100.0)
        ledger.book_gpu("m@r1/n/0", "m", weights)
        ledger.measured("m@r1/n/0", awake)
        assert ledger.used(GPU) == awake  # the measured footprint replaces the manifest's estimate

        assert client.sleep(1) is True
        asleep = client.gpu_bytes() or 0
        assert asleep < awake - weights // 2, (awake, asleep)  # the weights left the GPU
        assert client.wake_up() is True
        assert (client.gpu_bytes() or 0) >= weights
        status, after, _ = call(f"{rt.url}/v1/completions", "POST", body)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        rt.stop()
