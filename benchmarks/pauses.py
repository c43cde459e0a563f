"""The learned span of a silent fall (`planner.pause_memory`), on and off, over the clients of a per-client file.

`forecasting/pauses.py` was a split on ServeGen's two bursty clients when it was built (docs/operating.md,
"Built, off by default"), and is the default since (64 pauses; "Built since: the learned span of a silent fall
is the default"). This replays clients one by one through the
single-model engine (`forecasting.sim`, the prewarm policy alone, default charges) twice, with
`pause_memory` 0 and with `--memory`, and prints each one's cold-start share, GPU-hours and replica
starts, and the waits and GPU-hours of all of them together. Which clients is decided before any
replay: those named with `--clients`, else every client with at least `--min-requests` requests and
`--min-returns` returns to zero (a window with traffic after one without).

Usage: python benchmarks/pauses.py [CLIENT_RATES.csv] [--clients a,b] [--cold-start S] [--memory N] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, like the other benchmarks

from benchmarks.common import ROOT, parser, report
from forecasting.data.traces import RateTrace
from forecasting.fleet.traces import FleetTrace, read_client_rates
from forecasting.sim.scoring import run_backtest
from forecasting.sim.workload import SimParams

TRACE = ROOT.parent / "shared" / "traces" / "servegen_m_large_clients.csv"


def returns_to_zero(counts: np.ndarray) -> int:
    """Windows with requests that follow a window without, after the first window with requests."""
    busy = counts > 0
    first = int(np.argmax(busy)) if busy.any() else busy.size
    return int(np.sum(busy[first + 1:] & ~busy[first:-1])) if first < busy.size else 0


def chosen(trace: FleetTrace, names: list[str] | None, min_requests: float, min_returns: int) -> list[str]:
    """The clients to replay: `names` (each must be in the trace), else those the rule picks, busiest first."""
    if names:
        unknown = [n for n in names if n not in trace.names]
        if unknown:
            raise SystemExit(f"no client {unknown[0]!r} in {trace.source}")
        return names
    total = trace.counts.sum(axis=0)
    keep = [k for k in range(len(trace.names))
            if total[k] >= min_requests and returns_to_zero(trace.counts[:, k]) >= min_returns]
    return [trace.names[k] for k in sorted(keep, key=lambda k: -total[k])]


def replay(tr: RateTrace, params: SimParams, memory: int) -> dict[str, Any]:
    row = run_backtest(tr, params, ["prewarm"], policy_kwargs={"prewarm": {"pause_memory": memory}})["result"]["rows"][0]
    return {"share": row["cold_start_share"], "gpu_hours": row["gpu_hours"], "starts": row["starts"]}


def main(argv: list[str]) -> int:
    ap = parser(__doc__.strip().splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE), help="a per-client rate file")
    ap.add_argument("--clients", help="comma-separated clients (default: the rule below)")
    ap.add_argument("--min-requests", type=float, default=1e6)
    ap.add_argument("--min-returns", type=int, default=30)
    ap.add_argument("--cold-start", type=float, default=60.0)
    ap.add_argument("--memory", type=int, default=64, help="the pause memory of the run with the learned span")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, help="replay only the first S seconds of each client")
    args = ap.parse_args(argv)
    if args.memory < 1:
        ap.error("--memory must be at least 1 (0 is the run without the learned span)")
    trace = read_client_rates(args.trace)
    names = chosen(trace, args.clients.split(",") if args.clients else None, args.min_requests, args.min_returns)
    if args.quick:
        names, args.limit_s = names[:2], min(args.limit_s or 86400.0, 86400.0)
    params = SimParams(cold_start_s=args.cold_start, seed=args.seed)
    per: dict[str, dict[str, Any]] = {}
    rows: list[tuple[str, Any, str]] = []
    for name in names:
        tr = trace.client(name, args.limit_s)
        requests = float(tr.rate.sum() * tr.window_s)
        off, on = replay(tr, params, 0), replay(tr, params, args.memory)
        per[name] = {"requests": requests, "off": off, "on": on}
        rows.append((name, on["share"] / off["share"] if off["share"] else float("nan"),
                     f"share {off['share']:.4%} -> {on['share']:.4%}; GPU-h {off['gpu_hours']:,.1f} -> "
                     f"{on['gpu_hours']:,.1f}; starts {off['starts']} -> {on['starts']}"))
    waits = {k: sum(c[k]["share"] * c["requests"] for c in per.values()) for k in ("off", "on")}
    gpu = {k: sum(c[k]["gpu_hours"] for c in per.values()) for k in ("off", "on")}
    rows.append(("all: waits", waits["on"] / waits["off"] if waits["off"] else float("nan"),
                 f"{waits['off']:,.0f} -> {waits['on']:,.0f}"))
    rows.append(("all: GPU-hours", gpu["on"] / gpu["off"] if gpu["off"] else float("nan"),
                 f"{gpu['off']:,.1f} -> {gpu['on']:,.1f}"))
    report(f"learned pause span (memory {args.memory}) / off, {args.cold_start:g} s cold starts", rows,
           {"clients": per, "waits": waits, "gpu_hours": gpu, "cold_start_s": args.cold_start, "memory": args.memory,
            "seed": args.seed, "limit_s": args.limit_s}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
