"""The demo's synthetic workload: seeded, shaped as described."""

from __future__ import annotations

import numpy as np

from forecasting.data.synthetic import SyntheticWorkload


def test_deterministic_and_shaped() -> None:
    w = SyntheticWorkload(days=3, day_s=200.0, seed=3)
    a, b = w.trace(), w.trace()
    assert np.array_equal(a.t, b.t)
    assert "synthetic" in a.source
    assert np.all(np.diff(a.t) >= 0) and a.t[0] >= 0 and a.t[-1] < w.duration_s
    # the expected count matches the integral of the rate curve
    grid = np.linspace(0, w.duration_s, 200_001)
    expected = np.trapezoid(w.rate(grid), grid)
    assert abs(len(a) - expected) < 5 * np.sqrt(expected)
    # nights are quieter than noon, and the batch job window is busier than just before it
    counts = np.histogram(a.t, bins=np.arange(0, w.duration_s + 1, 10.0))[0]
    assert counts[:2].mean() < counts[9:11].mean()
    s, e = w.batch_window(1)
    in_batch = ((a.t >= s) & (a.t < e)).sum() / (e - s)
    before = ((a.t >= s - (e - s)) & (a.t < s)).sum() / (e - s)
    assert in_batch > before + 0.5 * w.batch_rps
