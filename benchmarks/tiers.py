"""Each tier's time to ready, measured: disk, page cache (the node snapshot), level-1 sleep.

The fleet planner trades GPU memory for cold starts with the catalog's time to ready per
tier (`forecasting.fleet.catalog`). This script measures them for one model on this
machine with the real engine (`prewarm.runtime.engine.Engine`):
- disk: a load after the weight file is evicted from the page cache (posix_fadvise
  DONTNEED, no root needed);
- cached: the same load again, the weights in the page cache;
- asleep: level-1 sleep (weights to pinned host memory, GPU freed: the GPU memory held
  before and during sleep is reported) and the wake back to ready.
Each is reported next to the catalog's default for the same footprint, and the wake as a
share of the cached load (the catalog's "a fraction of a load").

Usage: python -m benchmarks.tiers [--quick] [--json] [--device auto|cuda|cpu] [--gb 2]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import parser, report
from forecasting.fleet.catalog import Tier, default_ready_s
from prewarm.runtime.engine import Engine
from prewarm.runtime.model import ModelConfig, make_model


def _evict(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _gpu_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated(device))


def _load(model_dir: Path, device: str) -> tuple[Engine, float]:
    t0 = time.perf_counter()
    engine = Engine(model_dir, device=device)
    engine.start_load()
    if not engine.wait_loaded(timeout=600):
        raise RuntimeError("the load did not finish")
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return engine, time.perf_counter() - t0


def measure(gb: float, device: str, repeats: int) -> dict[str, Any]:
    d_model, n_heads = 2048, 16
    per_layer = 12 * d_model * d_model * 2  # bf16 bytes of one layer (attention + 4x MLP)
    layers = max(1, int(gb * 1e9 / per_layer))
    cfg = ModelConfig(vocab_size=32000, d_model=d_model, n_layers=layers, n_heads=n_heads, d_ff=4 * d_model,
                      max_seq_len=512, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "m", cfg, seed=0, name="tiers")
        size_gb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 1e9
        disk, cached, sleep, wake, held, asleep_held = [], [], [], [], [], []
        for _ in range(repeats):
            _evict(Path(model_dir))
            engine, t = _load(Path(model_dir), device)
            disk.append(t)
            engine.close()
            del engine
            engine, t = _load(Path(model_dir), device)
            cached.append(t)
            held.append(_gpu_bytes(engine.device))
            t0 = time.perf_counter()
            engine.sleep(1)
            sleep.append(time.perf_counter() - t0)
            asleep_held.append(_gpu_bytes(engine.device))
            t0 = time.perf_counter()
            engine.wake_up()
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            wake.append(time.perf_counter() - t0)
            assert list(engine.generate("hello", 2)), "no token after the wake"
            dev = str(engine.device)
            engine.close()
            del engine
    best = {k: min(v) for k, v in (("disk_s", disk), ("cached_s", cached), ("sleep_s", sleep), ("wake_s", wake))}
    default = default_ready_s(size_gb)
    return {
        "device": dev, "model_gb": size_gb, "repeats": repeats, **best,
        "disk_gbps": size_gb / best["disk_s"], "cached_gbps": size_gb / best["cached_s"],
        "wake_gbps": size_gb / best["wake_s"], "wake_vs_cached_load": best["wake_s"] / best["cached_s"],
        "gpu_gb_held_ready": max(held) / 1e9, "gpu_gb_held_asleep": max(asleep_held) / 1e9,
        "catalog_default_s": {t.value: default[t] for t in (Tier.DISK, Tier.CACHED, Tier.ASLEEP)},
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--gb", type=float, default=None, help="model size (default 2 GB; --quick: 0.05 GB)")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3; --quick: 1)")
    args = p.parse_args()
    gb = args.gb if args.gb is not None else (0.05 if args.quick else 2.0)
    r = measure(gb, args.device, repeats=args.repeats or (1 if args.quick else 3))
    d = r["catalog_default_s"]
    rows: list[tuple[str, Any, str]] = [
        ("model GB", r["model_gb"], f"on {r['device']}, best of {r['repeats']}"),
        ("disk -> ready s", r["disk_s"], f"{r['disk_gbps']:.2f} GB/s; catalog default {d['disk']:.2f} s"),
        ("page cache -> ready s", r["cached_s"], f"{r['cached_gbps']:.2f} GB/s; catalog default {d['cached']:.2f} s"),
        ("asleep -> ready s (wake)", r["wake_s"], f"{r['wake_gbps']:.2f} GB/s; catalog default {d['asleep']:.2f} s"),
        ("wake / cached load", r["wake_vs_cached_load"], "the asleep tier's share of a load"),
        ("sleep s", r["sleep_s"], "level 1: weights to pinned host memory"),
        ("GPU GB held ready / asleep", f"{r['gpu_gb_held_ready']:.3f} / {r['gpu_gb_held_asleep']:.3f}",
         "level-1 sleep frees the GPU"),
    ]
    try:
        report("time to ready per tier (real engine)", rows, r, args.json)
    except ImportError:  # a bare GPU machine without rich: plain lines
        import json

        for key, value, note in rows:
            print(f"{key}: {value} ({note})")
        if args.json:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
