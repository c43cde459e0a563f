"""`benchmarks/loader.py` runs end to end on a small model and reports every figure it promises.

Nothing here asserts a speed (the figures are ratios for the benchmark's reader): only that each
path ran, read from where it says, and that the ratios are computed from the medians reported.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("ttft_torch_load_s", "ttft_full_s", "ttft_progressive_s", "load_s", "compute_s", "overlap_efficiency",
        "pipelining_efficiency", "vs_torch_load_ratio", "load_gbps", "raw_read_gbps", "bandwidth_ratio",
        "first_replica_load_s", "snapshot_write_s", "snapshot_load_s", "snapshot_load_ratio",
        "snapshot_load_after_drop_s", "snapshot_load_after_drop_ratio", "burst_first_ready_at_once_s",
        "burst_first_ready_fill_s", "burst_first_ready_ratio", "burst_last_ready_at_once_s", "burst_last_ready_fill_s",
        "burst_last_ready_ratio")


@pytest.mark.timeout(300)
def test_loader_benchmark_reports_every_figure(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader.py"), "--size", "8MB", "--repeat", "2",
         "--prompt-tokens", "16", "--burst", "2", "--json", "--files-only", "--workdir", str(tmp_path), "--snapshot-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        if key.endswith("_efficiency") and r[key] is None:  # too little to hide for the run-to-run spread: says so
            assert r["reads"][key].startswith("not measurable"), r["reads"][key]
            continue
        assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
    assert r["snapshot_load_ratio"] == pytest.approx(r["snapshot_load_s"] / r["first_replica_load_s"])
    assert r["snapshot_load_after_drop_ratio"] == pytest.approx(r["snapshot_load_after_drop_s"] / r["first_replica_load_s"])
    assert r["vs_torch_load_ratio"] == pytest.approx(r["ttft_progressive_s"] / r["ttft_torch_load_s"])
    assert len(r["samples"]["snapshot_load_s"]) == len(r["samples"]["first_replica_load_s"]) == 2
    # the burst: two replica processes, twice each way; each run's times sorted (first ready, last ready)
    for mode in ("at_once", "fill"):
        runs = r["samples"][f"burst_{mode}_ready_s"]
        assert len(runs) == 2 and all(len(run) == 2 and run == sorted(run) for run in runs)
        assert r[f"burst_first_ready_{mode}_s"] == pytest.approx(sum(run[0] for run in runs) / 2)
    assert r["burst_replicas"] == 2
    assert r["burst_first_ready_ratio"] == pytest.approx(r["burst_first_ready_fill_s"] / r["burst_first_ready_at_once_s"])
    assert "crc32c" in r["reads"]["snapshot_load_s"] and "sha256" in r["reads"]["ttft_progressive_s"]
    assert "drop_caches" not in r["cache_drop"]  # --files-only: the rest of the machine's page cache is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the benchmark left files behind"
    for key in ("ttft_progressive_s", "snapshot_load_ratio", "bandwidth_ratio"):
        assert key in proc.stdout.split("{", 1)[0]  # the table, before the JSON line
