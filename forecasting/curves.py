"""Claims at equal cost or equal cold starts: a policy's curve over its knob, read at another policy's point.

Also the TTFT quantiles both replays report (`weighted_quantile`: a request cohort counted by its size).

A policy scored at one setting wins or loses by its default; over its knob it is a curve of
cold-start share against cost (GPU-hours, warm GB·h). These helpers read a curve at the
anchor's (prewarm's, the fleet planner's) default point, so "prewarm saves X% at the same
cold starts" is read on each baseline's own curve. Shared by the single-model sweep
(`forecasting.sim.scoring`) and the fleet backtest (`forecasting.fleet.backtest`), which do
not import each other. Pure numpy.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def at_equal_share(points: Sequence[Mapping[str, Any]], share: float, x: str = "cold_start_share",
                   y: str = "gpu_hours_vs_reactive") -> float | None:
    """A curve's `y` interpolated (linearly, points ordered by `x`) at `x == share`; None outside its range.

    A curve that is not monotone in `x` is read through its lower envelope: at each point's x the
    least y of any setting whose x is no larger (it meets that share too)."""
    pts = sorted((float(p[x]), float(p[y])) for p in points if p.get(y) is not None and p.get(x) is not None)
    if not pts or not pts[0][0] <= share <= pts[-1][0]:
        return None
    xs = np.asarray([p[0] for p in pts])
    ys = np.minimum.accumulate(np.asarray([p[1] for p in pts]))  # the best y at this x or below
    return float(np.interp(share, xs, ys))


def sweep_summary(points: Sequence[Mapping[str, Any]], anchor: str = "prewarm", x: str = "cold_start_share",
                  y: str = "gpu_hours_vs_reactive") -> dict[str, Any]:
    """`at_equal_cold_start_share`: each policy's `y` on its curve at the anchor's default `x` (null outside its range)."""
    base = next((p for p in points if p["policy"] == anchor and p["default"]), None)
    out: dict[str, Any] = {"anchor": anchor, x: None if base is None else base[x], "policies": {}}
    if base is None:
        return out
    by: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        by.setdefault(str(p["policy"]), []).append(p)
    for name, pts in by.items():
        out["policies"][name] = base[y] if name == anchor else at_equal_share(pts, float(base[x]), x, y)
    return out


def foresight(points: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], anchor: str = "prewarm",
              ablation: str = "reactive_sized", oracle: str = "oracle",
              y: str = "gpu_hours_vs_reactive") -> dict[str, Any] | None:
    """What perfect foresight would save against the forecast-free ablation at the anchor's share, and how much of
    it the anchor saves: the oracle's `y` (its default point; it knows the need and waits for (almost) no load, so it is
    the reference a forecast is read against, not a proof of the least cost at a share) over the ablation's `y`
    on its curve at the anchor's share (`summary`, `sweep_summary`'s), the anchor's over the same, and the share
    of the oracle's saving the anchor gets. None when a reading is missing (the ablation's curve does not reach
    the anchor's share, or a policy was not replayed)."""
    o = next((p for p in points if p["policy"] == oracle and p["default"]), None)
    at = summary.get("policies", {})
    base, mine = at.get(ablation), at.get(anchor)
    if o is None or o.get(y) is None or not base or mine is None:
        return None
    saved = base - float(o[y])
    return {"oracle": float(o[y]), "oracle_cold_start_share": o.get("cold_start_share"),
            f"oracle_vs_{ablation}": float(o[y]) / base, f"{anchor}_vs_{ablation}": mine / base,
            "captured": (base - mine) / saved if saved > 0 else None}


def weighted_quantile(values: np.ndarray, weights: np.ndarray | None, q: float) -> float:
    """The q-quantile of values (each counted `weight` times; None: once each); nan when there is no weight."""
    if values.size == 0:
        return float("nan")
    if weights is None:
        return float(np.quantile(values, q))
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    if cum[-1] <= 0:
        return float("nan")
    i = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(values[order][min(i, values.size - 1)])
