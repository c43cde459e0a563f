"""The one warm-cost definition (`forecasting.budget.warm_cost`), tested once: the planner, the
`warmup_cost_ratio` gauge, `prewarm up` and the simulator's scoring all call it."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting.budget import warm_cost


@pytest.mark.parametrize(("live", "need", "ratio"), [(0, 0, 0.0), (4, 4, 0.0), (5, 4, 0.2), (3, 5, 0.0), (10, 7, 0.3)])
def test_warm_cost_of_one_moment(live: int, need: int, ratio: float) -> None:
    assert warm_cost(live, need) == pytest.approx(ratio)


def test_warm_cost_is_the_share_of_replica_time_above_need() -> None:
    live = np.array([2, 2, 4, 4, 0])
    need = np.array([1, 2, 5, 2, 0])
    # above need: 1 + 0 + 0 + 2 + 0 = 3 replica-seconds of 12
    assert warm_cost(live, need) == pytest.approx(3 / 12)
