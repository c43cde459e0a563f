"""The fleet backtest's table and its curve: cold-start share against warm GPU-memory-time.

Each policy trades memory for cold starts through one knob (keep-alive seconds, the
histogram's tail percentile, the planner's budget); the curve of every knob value shows
which policy buys fewer cold starts for the same memory, which a single row cannot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

_COLUMNS = (("policy", "policy", "{}"), ("cold %", "cold_share", "{:.4%}"), ("full-load %", "full_load_share", "{:.4%}"),
            ("slot waits", "capacity_waited", "{:,.0f}"),
            ("TTFT p99 s", "ttft_p99_s", "{:.2f}"), ("TTFT p99.9 s", "ttft_p999_s", "{:.2f}"),
            ("warm GB·h", "warm_gb_h", "{:,.0f}"), ("wasted GB·h", "wasted_gb_h", "{:,.0f}"),
            ("avg warm GB", "avg_warm_gb", "{:,.0f}"), ("loads", "loads", "{:,}"), ("wakes", "wakes", "{:,}"),
            ("sleeps", "sleeps", "{:,}"), ("starts", "starts", "{:,}"))


def table_lines(result: Mapping[str, Any], markdown: bool = False) -> list[str]:
    """The result's rows as text (or a Markdown table)."""
    rows = [[fmt.format(r.get(key, float("nan"))) for _, key, fmt in _COLUMNS] for r in result["rows"]]
    head = [h for h, _, _ in _COLUMNS]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return out
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return out


def print_fleet(result: Mapping[str, Any]) -> None:
    f = result["fleet"]
    print(f"fleet backtest: {result['trace']} ({result['kind']}): {result['models']} models, "
          f"{result['steps']} steps of {result['step_s']:.0f} s, {result['requests']:,.0f} requests")
    print(f"fleet: {f['nodes']} nodes x {f['node_gpu_gb']:.0f} GB GPU = {f['gpu_capacity_gb']:,.0f} GB "
          f"(all models: {f['all_models_gb']:,.0f} GB), {f['node_host_gb']:.0f} GB host each; "
          f"scored after {result['score_after_s'] / 3600:.0f} h")
    for line in table_lines(result):
        print(line)
    t = result.get("target") or {}
    if t:
        print(f"target: fleet planner at cold-start budget {t['cold_start_budget']:.2%}: cold {t['fleet_cold_share']:.4%} vs "
              f"hybrid histogram {t['hybrid_cold_share']:.4%} (ratio {t['cold_ratio']:.2f}) at "
              f"{t['fleet_warm_gb_h']:,.0f} vs {t['hybrid_warm_gb_h']:,.0f} GB·h: {'met' if t['met'] else 'NOT met'}")
    eq = result.get("at_equal") or {}
    if eq.get("warm_gb_h") is not None:
        print(f"on each policy's curve at the planner's point ({eq['cold_share']:.4%} cold, {eq['warm_gb_h']:,.0f} GB·h):")
        for name, cold in eq["cold_share_at_equal_warm_gb_h"].items():
            gbh = eq["warm_gb_h_at_equal_cold_share"].get(name)
            print(f"  {name:<24} cold at equal GB·h: {'outside its curve' if cold is None else f'{cold:.4%}'}; "
                  f"GB·h at equal cold: {'outside its curve' if gbh is None else f'{gbh:,.0f}'}")


def plot_curves(result: Mapping[str, Any], out: str | Path, title: str = "") -> Path:
    """Cold-start share against warm GPU-memory-time, one line per policy across its knob."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    names = list(dict.fromkeys([*result.get("curves", {}), *(r["policy"] for r in result["rows"])]))
    color = {n: f"C{i}" for i, n in enumerate(names)}
    floor = 1e-7
    for name, points in result.get("curves", {}).items():
        pts = sorted(points, key=lambda r: r["warm_gb_h"])
        ax.plot([p["warm_gb_h"] for p in pts], [max(p["cold_share"], floor) for p in pts], marker="o", ms=3,
                lw=1.2, color=color[name], label=f"{name} (curve)")
    for r in result["rows"]:
        zero = r["cold_share"] <= 0
        ax.scatter([r["warm_gb_h"]], [max(r["cold_share"], floor)], marker="*", s=110, zorder=5,
                   color=color[r["policy"]], label=f"{r['policy']}{' (0 cold, drawn at 1e-7)' if zero else ''}")
    ax.set_yscale("log")
    ax.set_xlabel("warm GPU memory-time (GB·h)")
    ax.set_ylabel("share of requests hitting a cold model")
    first = Path(str(result["trace"]).split(",")[0])
    source = first.name if "," not in str(result["trace"]) else f"{first.parent.name}/ ({result['kind']})"
    ax.set_title(title or f"{source}, {result['models']} models: cold starts vs warm GPU memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
