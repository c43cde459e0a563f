"""Time to first token of a new replica: naive torch.load vs safetensors vs progressive vs snapshot.

Every path is timed from "replica asked to start" to "first token returned" on the same
random-weight model (written to a temporary directory and deleted afterwards) with the
same prompt, so the first-token compute (a prefill of a few hundred tokens) is real work
that pipelining can overlap with the weights' arrival. Before each cold path the page
cache of the files it reads is dropped (`posix_fadvise(POSIX_FADV_DONTNEED)`, and
/proc/sys/vm/drop_caches when writable); the output says which method worked.

Figures that depend on the machine are reported as ratios against baselines measured in
the same run (torch.load, the full safetensors path, a plain sequential read).

    python benchmarks/loader.py            # 512 MB model
    python benchmarks/loader.py --quick    # 96 MB model, under a minute
    python benchmarks/loader.py --json     # ... and one JSON object as the last line
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prewarm.loader import ProgressiveLoader, load_full, resolve_device  # noqa: E402
from prewarm.model import TransformerLM, greedy, load_config, load_manifest, make_model  # noqa: E402
from prewarm.snapshot import SnapshotStore  # noqa: E402


def drop_cache(paths: list[Path]) -> str:
    """Evict the files from the page cache; returns the method that was used."""
    method = "posix_fadvise(DONTNEED)"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd) if os.access(p, os.W_OK) else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        method += " + /proc/sys/vm/drop_caches"
    except OSError:
        pass
    return method


def raw_read(path: Path, chunk: int = 8 << 20) -> float:
    buf = bytearray(chunk)
    view = memoryview(buf)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t


def first_token(model: TransformerLM, prompt: list[int], device: torch.device, hook: Any = None) -> int:
    tok = next(greedy(model, prompt, 1, device, hook))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tok


def run(size: str, prompt_tokens: int, device_name: str, workdir: Path | None, snapdir: Path | None) -> dict[str, Any]:
    device = resolve_device(device_name)
    tmp = Path(tempfile.mkdtemp(prefix="prewarm-bench-", dir=workdir))
    shm = Path(tempfile.mkdtemp(prefix="prewarm-snap-", dir=snapdir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)))
    try:
        t = time.perf_counter()
        mdir = make_model(tmp / "model", size, seed=1, name="bench")
        make_s = time.perf_counter() - t
        cfg = load_config(mdir)
        manifest = load_manifest(mdir)
        weights = mdir / "model.safetensors"
        pt = tmp / "model.pt"
        torch.save(load_full(mdir, "cpu").state_dict(), pt)
        prompt = [(i * 7919 + 13) % 256 for i in range(min(prompt_tokens, cfg.max_seq_len - 1))]
        out: dict[str, Any] = {
            "model_bytes": manifest.total_bytes,
            "model": f"d_model={cfg.d_model} n_layers={cfg.n_layers} d_ff={cfg.d_ff} vocab={cfg.vocab_size} {cfg.dtype}",
            "prompt_tokens": len(prompt),
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "make_model_s": make_s,
        }
        reads: dict[str, str] = {}

        # 1. naive: torch.load a .pt checkpoint, load_state_dict into a freshly built model, move, answer.
        out["cache_drop"] = drop_cache([pt, weights])
        t0 = time.perf_counter()
        model = TransformerLM(cfg)
        model.load_state_dict(torch.load(pt, map_location="cpu", weights_only=True))
        model.to(device).eval()
        ref = first_token(model, prompt, device)
        out["ttft_torch_load_s"] = time.perf_counter() - t0
        reads["ttft_torch_load_s"] = f"{pt.name} (torch.load, cold), model built with default init"
        del model

        # 2. standard safetensors: every tensor onto the device, then answer.
        drop_cache([weights])
        t0 = time.perf_counter()
        model = load_full(mdir, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        tok = first_token(model, prompt, device)
        t2 = time.perf_counter()
        assert tok == ref, "safetensors path answered differently from torch.load"
        out["ttft_full_s"], out["load_s"], out["compute_s"] = t2 - t0, t1 - t0, t2 - t1
        reads["ttft_full_s"] = f"{weights.name} (safetensors.load_file, cold)"
        del model

        # 3. progressive, pipelined, cold from the original (no snapshot store).
        drop_cache([weights])
        t0 = time.perf_counter()
        loader = ProgressiveLoader(mdir, device=device).start()
        loader.wait_embeddings()
        tok = first_token(loader.model, prompt, device, loader.before_layer)
        out["ttft_progressive_s"] = time.perf_counter() - t0
        assert tok == ref, "progressive path answered differently"
        loader.wait()
        out["progressive_layer_waits"] = loader.stats.layer_waits
        reads["ttft_progressive_s"] = f"{weights.name} (progressive, cold, sha256-verified, no snapshot)"
        del loader

        # 4. loader bandwidth and the first replica of a node: original -> device, snapshot written.
        store = SnapshotStore(shm, 64 << 30)
        drop_cache([weights])
        t0 = time.perf_counter()
        first = ProgressiveLoader(mdir, device=device, snapshots=store).start()
        first.wait()
        first_load_s = time.perf_counter() - t0
        first.join()
        out["first_replica_load_s"] = first_load_s
        out["snapshot_write_s"] = time.perf_counter() - t0 - first_load_s
        reads["first_replica_load_s"] = f"{weights.name} (progressive, cold) -> writes {Path(first.stats.snapshot_written).name}"
        out["load_gbps"] = manifest.total_bytes / first_load_s / 1e9
        del first

        drop_cache([weights])
        raw_s = raw_read(weights)
        out["raw_read_gbps"] = weights.stat().st_size / raw_s / 1e9
        reads["raw_read_gbps"] = f"{weights.name} (plain sequential read, cold)"
        out["bandwidth_ratio"] = out["load_gbps"] / out["raw_read_gbps"]

        # 5. a second replica on the node: maps the snapshot (tmpfs: no page cache to drop).
        t0 = time.perf_counter()
        second = ProgressiveLoader(mdir, device=device, snapshots=store).start()
        second.wait()
        out["snapshot_load_s"] = time.perf_counter() - t0
        assert second.stats.source == "snapshot" and second.stats.bytes_from_original == 0
        reads["snapshot_load_s"] = f"{Path(second.stats.opened[0])} (mmap + crc32c, zero-copy on CPU)"
        tok = first_token(second.model, prompt, device)
        assert tok == ref, "snapshot path answered differently"
        second.release()
        del second

        # Above 1.0 means the machine was noisier during one path than another (shared CPU).
        out["overlap_efficiency"] = (out["ttft_full_s"] - out["ttft_progressive_s"]) / min(out["load_s"], out["compute_s"])
        out["vs_torch_load_ratio"] = out["ttft_progressive_s"] / out["ttft_torch_load_s"]
        out["snapshot_load_ratio"] = out["snapshot_load_s"] / first_load_s
        out["reads"] = reads
        out["targets"] = {"overlap_efficiency": ">= 0.8", "vs_torch_load_ratio": "<= 0.5",
                          "bandwidth_ratio": ">= 0.8", "snapshot_load_ratio": "<= 0.4"}
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def table(r: dict[str, Any]) -> str:
    rows = [
        ("ttft_torch_load_s", "s"), ("ttft_full_s", "s"), ("ttft_progressive_s", "s"),
        ("load_s", "s"), ("compute_s", "s"), ("overlap_efficiency", "x"), ("vs_torch_load_ratio", "x"),
        ("first_replica_load_s", "s"), ("snapshot_write_s", "s"), ("load_gbps", "GB/s"), ("raw_read_gbps", "GB/s"),
        ("bandwidth_ratio", "x"), ("snapshot_load_s", "s"), ("snapshot_load_ratio", "x"),
    ]
    lines = [
        f"model: {r['model']}, {r['model_bytes'] / 2**20:.0f} MiB; prompt {r['prompt_tokens']} tokens; "
        f"device {r['device']}, {r['torch_threads']} torch threads",
        f"page cache dropped before each cold path with: {r['cache_drop']}",
        "",
        f"{'figure':<22} {'value':>10}  {'target':<7} read from",
    ]
    for key, unit in rows:
        v = r[key]
        lines.append(f"{key:<22} {v:>10.3f}  {r['targets'].get(key, ''):<7} {r['reads'].get(key, unit)}")
    lines.append(f"(progressive first request waited on {r['progressive_layer_waits']} layers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="96 MB model (under a minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--size", help="model size (default 512MB, 96MB with --quick)")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="prefill length of the first request")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's); 1 is steadier on a busy shared CPU")
    ap.add_argument("--workdir", type=Path, help="where to write the model (default: the temp dir)")
    ap.add_argument("--snapshot-dir", type=Path, help="where the node snapshot goes (default: /dev/shm)")
    args = ap.parse_args(argv)
    size = args.size or ("96MB" if args.quick else "512MB")
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(size, args.prompt_tokens, args.device, args.workdir, args.snapshot_dir)
    print(table(r))
    if args.json:
        print(json.dumps(r, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
