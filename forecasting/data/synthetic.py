"""A synthetic workload for the demo: a daily cycle compressed into minutes, a scheduled
batch job and a burst. It is labelled synthetic wherever it is shown.

Arrivals come from a seeded inhomogeneous Poisson process (thinning) over a rate curve:
a smooth day (night trough, day peak), a batch job that adds a plateau at a fixed phase of
every day (what a cron job does), and one burst on the last day. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.data.traces import RequestTrace, TraceFormat


@dataclass(frozen=True)
class SyntheticWorkload:
    days: int = 3
    day_s: float = 180.0  # one compressed "day"
    night_rps: float = 0.5
    peak_rps: float = 6.0
    batch_at: float = 0.70  # phase of the day when the scheduled batch job starts
    batch_len: float = 0.08  # its duration, as a share of the day
    batch_rps: float = 6.0  # rate it adds
    burst_day: int = -1  # the day with an unscheduled burst (-1: the last)
    burst_at: float = 0.35
    burst_len: float = 0.04
    burst_rps: float = 6.0
    context_tokens: int = 24
    generated_tokens: int = 4
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.days * self.day_s

    def batch_window(self, day: int) -> tuple[float, float]:
        start = (day + self.batch_at) * self.day_s
        return start, start + self.batch_len * self.day_s

    def rate(self, t: np.ndarray) -> np.ndarray:
        """Request rate (req/s) at offsets `t` (seconds from the start)."""
        phase = np.mod(t, self.day_s) / self.day_s
        day = np.floor(t / self.day_s)
        daily = self.night_rps + (self.peak_rps - self.night_rps) * 0.5 * (1 - np.cos(2 * np.pi * phase))
        batch = np.where((phase >= self.batch_at) & (phase < self.batch_at + self.batch_len), self.batch_rps, 0.0)
        burst_day = self.burst_day % self.days
        burst = np.where(
            (day == burst_day) & (phase >= self.burst_at) & (phase < self.burst_at + self.burst_len), self.burst_rps, 0.0
        )
        return daily + batch + burst

    def describe(self) -> str:
        return (
            f"synthetic workload: {self.days} days of {self.day_s:.0f} s (a daily cycle compressed), "
            f"{self.night_rps:g}-{self.peak_rps:g} req/s, a batch job (+{self.batch_rps:g} req/s) at "
            f"{self.batch_at:.0%} of each day, a burst (+{self.burst_rps:g} req/s) on day {self.burst_day % self.days + 1}"
        )

    def trace(self) -> RequestTrace:
        rng = np.random.default_rng(self.seed)
        peak = self.peak_rps + self.batch_rps + self.burst_rps
        n = rng.poisson(peak * self.duration_s)
        candidates = np.sort(rng.uniform(0.0, self.duration_s, size=n))
        keep = rng.uniform(0.0, peak, size=n) < self.rate(candidates)
        t = candidates[keep]
        ctx = np.full(t.size, self.context_tokens, dtype=np.int64)
        gen = np.full(t.size, self.generated_tokens, dtype=np.int64)
        return RequestTrace(t=t, context_tokens=ctx, generated_tokens=gen, source=self.describe(),
                            start_epoch=0.0, format=TraceFormat.REQUEST_CSV)
