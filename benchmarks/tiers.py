"""Time to ready from each tier of warmth, and what sleep gives back, on one replica's engine.

The fleet planner trades GPU memory for warmth with each model's time to ready per tier
(`forecasting.fleet.catalog`); the agents measure it live (`workers.node.tiers`). This
script measures the same transitions on one engine, in one run, so their ratios are
comparable:

- `disk`: a load of the model directory (no node snapshot yet; it writes one);
- `cached`: a new engine loading the same weights from the node snapshot;
- `asleep`: a level-1 wake (weights back from pinned host memory to the GPU);
- `sleep_s`: how long the sleep takes, and how much GPU memory the process's allocator
  holds awake and asleep (`cuda_reserved`: what the agent books for the replica).

The files were just written, so the `disk` load reads mostly from the page cache: it is a
lower bound of a real cold load (benchmarks/loader.py drops the cache for that). The
greedy answer to one prompt is checked equal before the sleep and after the wake.

    python benchmarks/tiers.py --quick          # small model, CPU or CUDA
    python benchmarks/tiers.py --size 2GB --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from prewarm.runtime.engine import Engine
from prewarm.runtime.loader import resolve_device
from prewarm.runtime.model import make_model
from prewarm.runtime.snapshot import SnapshotStore

PROMPT = "the fleet keeps each model at the right tier of warmth"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(model_dir: Path, device: str, snaps: SnapshotStore) -> tuple[Engine, float]:
    started = time.perf_counter()
    engine = Engine(model_dir, device=device, snapshots=snaps)
    engine.start_load()
    engine.wait_loaded()
    _sync(engine.device)
    seconds = time.perf_counter() - started
    engine.wait_snapshot()
    return engine, seconds


def run(size: str, device: str, dtype: str, repeat: int) -> dict[str, Any]:
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "m", size, dtype=dtype, name="m", revision="r1")  # type: ignore[arg-type]
        snaps = SnapshotStore(Path(tmp) / "snaps", 64 * 1024**3)
        engine, disk_s = _load(model_dir, str(dev), snaps)
        answer = list(engine.generate(PROMPT, 8))
        mem_awake = engine.memory()
        sleeps, wakes, same = [], [], True
        mem_asleep: dict[str, int] = {}
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.sleep(1)
            _sync(engine.device)
            sleeps.append(time.perf_counter() - t0)
            mem_asleep = engine.memory()
            t0 = time.perf_counter()
            engine.wake_up()
            _sync(engine.device)
            wakes.append(time.perf_counter() - t0)
            same = same and list(engine.generate(PROMPT, 8)) == answer
        nbytes = engine.manifest.total_bytes
        engine.close()
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        cached = []
        for _ in range(repeat):
            e2, s = _load(model_dir, str(dev), snaps)
            cached.append(s)
            e2.close()
            del e2
            gc.collect()
    wake_s, cached_s = statistics.median(wakes), statistics.median(cached)
    return {"device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "",
            "dtype": dtype, "model_bytes": nbytes, "repeat": repeat,
            "ready_s": {"disk": round(disk_s, 4), "cached": round(cached_s, 4), "asleep": round(wake_s, 4)},
            "sleep_s": round(statistics.median(sleeps), 4),
            "wake_vs_cached": round(wake_s / cached_s, 4), "wake_vs_disk": round(wake_s / disk_s, 4),
            "memory_awake": mem_awake, "memory_asleep": mem_asleep, "same_answer_after_wake": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=None, help="model size (default 1GB on CUDA, 200MB on CPU; --quick: 50MB)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    dev = resolve_device(a.device)
    size = a.size or ("50MB" if a.quick else "1GB" if dev.type == "cuda" else "200MB")
    out = run(size, a.device, "float16" if dev.type == "cuda" else "float32", 1 if a.quick else a.repeat)
    r = out["ready_s"]
    print(f"{out['device']} {out['gpu']} {out['model_bytes'] / 1e6:.0f} MB {out['dtype']}: time to ready "
          f"disk {r['disk']:.3f}s, cached {r['cached']:.3f}s, asleep {r['asleep']:.3f}s "
          f"(wake = {out['wake_vs_cached']:.1%} of a snapshot load); sleep {out['sleep_s']:.3f}s; "
          f"GPU held awake {out['memory_awake']['cuda_reserved'] / 1e6:.0f} MB, asleep "
          f"{out['memory_asleep'].get('cuda_reserved', 0) / 1e6:.0f} MB; same answer after wake: "
          f"{out['same_answer_after_wake']}")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
