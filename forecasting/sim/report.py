"""Pictures of a backtest: traffic against replicas per policy, and TTFT CDFs (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from forecasting.sim.simulate import PolicyRun, Workload


def _downsample(x: np.ndarray, points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    step = max(1, x.size // points)
    n = x.size // step
    t = np.arange(n) * step
    return t, x[: n * step].reshape(n, step).mean(axis=1)


def plot(work: Workload, runs: Mapping[str, PolicyRun], out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8))
    scale = 3600.0 if work.duration_s > 2 * 86400 else 60.0
    unit = "h" if scale == 3600.0 else "min"
    t, rate = _downsample(work.counts)
    ax1.plot(t / scale, rate, color="0.6", lw=0.8, label="arrivals (req/s)")
    ax1.set_ylabel("requests/s")
    ax1.set_xlabel(f"time ({unit})")
    axr = ax1.twinx()
    for name, run in runs.items():
        tt, live = _downsample(run.live.astype(np.float64))
        axr.plot(tt / scale, live, lw=1.0, label=name)
    axr.set_ylabel("live replicas")
    lines = ax1.get_legend_handles_labels()
    lines2 = axr.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax1.set_title(title or "traffic vs replicas")
    for name, run in runs.items():
        order = np.argsort(run.ttft)
        w = run.weight[order] if run.weight is not None else np.ones(run.ttft.size)
        cdf = np.cumsum(w) / w.sum()
        ax2.plot(run.ttft[order], cdf, lw=1.0, label=name)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT (s)")
    ax2.set_ylabel("CDF")
    ax2.axvline(1.2, color="k", ls=":", lw=0.8)
    ax2.legend(loc="lower right", fontsize=8)
    ax2.set_title("TTFT CDF (dotted: 1.2 s)")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress_bar() -> "_Progress":
    """A rich progress bar on stderr, one task per policy; a no-op when stderr is not a terminal."""
    return _Progress()


class _Progress:
    def __enter__(self) -> "_Progress":
        import sys

        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=sys.stderr)
        self._bar = Progress(TextColumn("{task.description:<10}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                             TimeElapsedColumn(), console=console, disable=not console.is_terminal, transient=False)
        self._tasks: dict[str, object] = {}
        self._bar.__enter__()
        return self

    def __call__(self, policy: str, fraction: float) -> None:
        if policy not in self._tasks:
            self._tasks[policy] = self._bar.add_task(policy, total=1.0)
        self._bar.update(self._tasks[policy], completed=fraction)  # type: ignore[arg-type]

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)


def print_table(result: Mapping[str, Any]) -> None:
    """The five-policy table, with the trace, the engine and any scaling stated."""
    from rich.console import Console
    from rich.table import Table

    params = result["params"]
    console = Console(width=140)
    console.print(f"[bold]{result['trace']}[/bold]: {params['requests']:.0f} requests over "
                  f"{params['duration_s'] / 3600:.2f} h; engine: {params['engine']}; C={params['slots']} slots, "
                  f"cold start {params['cold_start_s']:g} s; seed {params['seed']}")
    if params.get("scored_after_s"):
        console.print(f"  note: scored after {params['scored_after_s']:g} s (a warm-up excluded for every policy); "
                      "GPU-hours from the per-second replica count")
    for note in params.get("notes", []):
        console.print(f"  note: {note}")
    table = Table(show_lines=False)
    for col in ("policy", "TTFT p50 s", "p99 s", "p99.9 s", "cold-start hits", "GPU-h", "vs reactive",
                "vs oracle", "warm cost", "cold starts"):
        table.add_column(col, justify="right" if col != "policy" else "left")

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    for name, s in result["policies"].items():
        table.add_row(name, f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.3f}", f"{s['ttft_p999_s']:.3f}",
                      f"{s['cold_start_share']:.3%}", f"{s['gpu_hours']:.2f}", ratio(s.get("gpu_hours_vs_reactive")),
                      ratio(s.get("gpu_hours_vs_oracle")), f"{s['warm_cost_ratio']:.1%}", str(s["cold_starts"]))
    console.print(table)


def plot_sweep(sweep: Mapping[str, Any], out: str | Path, title: str = "") -> Path:
    """GPU-hours (vs reactive's default) against cold-start hits, one curve per policy, defaults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    by: dict[str, list[Mapping[str, Any]]] = {}
    for pt in sweep["points"]:
        by.setdefault(pt["policy"], []).append(pt)
    floor = 1e-5  # a share of 0 is drawn at this floor on the log axis
    for name, pts in by.items():
        pts = sorted(pts, key=lambda p: p["gpu_hours_vs_reactive"])
        x = [p["gpu_hours_vs_reactive"] for p in pts]
        y = [max(floor, p["cold_start_share"]) for p in pts]
        line, = ax.plot(x, y, marker="o", ms=4, lw=1.2, label=name)
        for p, xi, yi in zip(pts, x, y):
            if p["knob"]:
                ax.annotate(f"{p['value']:g}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
            if p["default"]:
                ax.plot([xi], [yi], marker="*", ms=12, color=line.get_color(), mec="k", mew=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("GPU-hours vs reactive (default)")
    ax.set_ylabel(f"cold-start hits (share of requests; 0 drawn at {floor:g})")
    knobs = ", ".join(sorted({f"{p['policy']}: {p['knob']}" for p in sweep["points"] if p["knob"]}))
    ax.set_title(title or f"{Path(str(sweep['trace'])).name}: the cost/cold-start frontier (stars: defaults)\n{knobs}",
                 fontsize=9)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
