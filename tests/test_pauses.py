"""The interruption's span learned from a model's own pauses (`forecasting.pauses`), and the planner holding by it."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting.pauses import Pauses, hold_s, observe, return_size
from forecasting.planner import PlannerParams, PlannerState, ReplicaCounts, StepInputs, observed_from_counts, step
from prewarm.core.domain import ModelSpec

B = 10.0  # fine bucket s
MIN_S = 300.0  # a pause: at least the scale-down window without a request
LEAD_S = 25.0  # what a return that finds nothing waits: the requests of the three buckets back


def _seen(carried: Pauses, requests: list[float], start: float) -> Pauses:
    return observe(carried, np.asarray(requests, dtype=float), start, B, MIN_S, 3, LEAD_S)


def test_a_return_after_a_silence_is_remembered_with_its_length_and_the_requests_of_its_lead() -> None:
    busy = [50.0] * 6
    carried = _seen(Pauses(), busy, 0.0)
    assert carried.silent_since == 60.0 and carried.pauses == () and carried.since == 0.0
    # 40 s of silence: shorter than the scale-down window, not a pause
    carried = _seen(carried, busy + [0.0] * 4 + busy, 0.0)
    assert carried.pauses == () and carried.silent_since == 160.0
    # 20 min of silence, then a return: the requests of its lead back are counted as its buckets come in
    r = busy + [0.0] * 120 + [20.0]
    carried = _seen(carried, r, 100.0)
    (ended, length, back), = carried.pauses
    assert ended == 100.0 + 126 * B and length == ended - 160.0 and back == 20.0
    carried = _seen(carried, r + [90.0, 60.0], 100.0)
    assert carried.pauses[0][2] == 170.0 and carried.silent_since == 100.0 + 129 * B
    assert _seen(carried, r + [90.0, 60.0, 500.0], 100.0).pauses[0][2] == 170.0  # past its lead
    quiet = _seen(carried, [0.0] * 30, carried.silent_since)  # silence: no pause, no request
    assert quiet._replace(counted_to=None) == carried._replace(counted_to=None) and quiet.counted_to == 1690.0
    # the requests are counted once, whatever the windows read
    assert carried.requests == 2 * 6 * 50.0 + 20.0 + 90.0 + 60.0  # the third window re-read the second's last six
    # the last `memory` pauses are kept
    for k in range(4):
        assert carried.silent_since is not None
        carried = _seen(carried, [0.0] * 60 + [30.0 + k], carried.silent_since)
    assert len(carried.pauses) == 3 and carried.pauses[-1][2] == 33.0


def _pauses(lengths: list[float], back: float, every_s: float) -> Pauses:
    ps = tuple((every_s * (k + 1), length, back) for k, length in enumerate(lengths))
    return Pauses(ps, every_s * len(lengths) + 60.0, 0.0)


def test_the_hold_is_the_quantile_of_the_pauses_the_budget_affords() -> None:
    lengths = [600.0 * (k + 1) for k in range(20)]  # 10 min to 200 min
    now, hour = 60 * 3600.0, 3600.0
    carried = _pauses(lengths, back=1400.0, every_s=3 * 3600.0)._replace(requests=5.0 * now, counted_to=now)

    def held(budget: float, rate: float = 5.0, back: float = 1400.0, floor_s: float = hour,
             memory: int = 64) -> tuple[float, float | None]:
        ps = tuple((e, n, back) for e, n, _ in carried.pauses)
        return hold_s(carried._replace(requests=rate * now, pauses=ps), budget, memory, floor_s, 86400.0)

    # a miss costs the 1,400 requests of a lead back; a 3 h cycle at a mean of 5 req/s brings 54,000 requests
    span, alpha = held(0.005)
    assert alpha is not None and alpha == pytest.approx(0.005 * 5.0 * 3 * 3600.0 / 1400.0)
    assert span == pytest.approx(np.quantile(lengths, 1 - alpha)) and span > hour
    tighter, less = held(0.002)
    assert tighter > span and less is not None and less < alpha
    assert held(0.005, back=3800.0)[0] > span  # a longer cold start makes a miss dearer: a longer hold
    assert held(0.005, floor_s=12 * hour)[0] == 12 * hour  # never below the interruption's hold
    assert hold_s(carried, 0.005, 64, 0.0, 1800.0)[0] == 1800.0  # nor above the ceiling
    # dense traffic: so many requests between its rare pauses that a miss is affordable on every one
    assert held(0.001, rate=5000.0)[0] == hour
    assert hold_s(Pauses(), 0.001, 64, hour, 86400.0) == (hour, None)
    # a full memory reads the requests of the span its pauses came in (from the first one's start)
    assert held(0.005, memory=20)[1] == pytest.approx(alpha * (now - 10200.0) / now)
    # from fewer pauses than 1 / alpha, the quantile is read near the longest of them (on the safe side)
    assert held(0.001) == (pytest.approx(np.quantile(lengths, 1 - 0.0386), rel=0.01), pytest.approx(0.0386, abs=1e-4))


def test_a_hold_serves_the_returns_the_budget_cannot_afford_to_let_wait() -> None:
    """What a held fall keeps is read from the whole distribution of the returns: the least whose mean excess over
    the remembered returns (what they would make wait) is the budget's share of a pause cycle. Mostly small returns
    and one large one: a tight budget serves the large one, a looser one lets it wait in part, a dense model's
    budget affords every return's waits."""
    backs = [100.0] * 15 + [2000.0]
    now = 16 * 3 * 3600.0 + 60.0
    carried = Pauses(tuple((3 * 3600.0 * (k + 1), 3600.0, b) for k, b in enumerate(backs)), now, 0.0, 5.0 * now, now)
    cycle = 5.0 * now / 16

    def excess(size: float) -> float:
        return float(np.maximum(np.asarray(backs) - size, 0.0).mean())

    tight = return_size(carried, 0.0002, 64)
    assert excess(tight) == pytest.approx(0.0002 * cycle) and 1800.0 < tight < 2000.0
    loose = return_size(carried, 0.001, 64)
    assert excess(loose) == pytest.approx(0.001 * cycle) and 100.0 < loose < tight  # the median is 100
    assert return_size(carried, 0.01, 64) == 0.0  # the budget affords every return's waits: nothing is kept for them
    assert return_size(carried._replace(requests=0.0), 0.001, 64) == 100.0  # nothing counted: the median
    assert return_size(Pauses(), 0.001, 64) == 0.0


def _step(requests: np.ndarray, now: float, state: PlannerState, live: int) -> tuple[int, str]:
    busy = requests * 2.0  # each request in flight 2 s
    obs = observed_from_counts(now - requests.size * B, B, requests, np.ceil(busy / B), busy)
    decision, _ = step(StepInputs(ModelSpec("m", "r1", slots=4), now, obs, ReplicaCounts(ready=live),
                                  PlannerParams(cold_start_budget=0.001, default_cold_start_s=60.0, pause_memory=64)),
                    state)
    return decision.target, " ".join(e.reason for e in decision.events)


def test_the_planner_holds_a_long_pause_its_past_pauses_say_will_end() -> None:
    """Past the interruption's hour, a model whose pauses ran three hours keeps what its recent level (read over
    the learned span) expects while the fall stays silent, at most the live replicas; the same model with no pause
    remembered lets them go, and so does this one past its longest pause, or once a request came after the fall."""
    night = 3 * 86400.0 + 2 * 3600.0
    requests = np.concatenate([np.full(360, 100.0), np.zeros(460)])  # an hour at 10 req/s, then 77 min of nothing
    now = night + requests.size * B
    silent = now - 460 * B
    carried = _pauses([3600.0 * 3] * 16, back=700.0, every_s=4.5 * 3600.0)._replace(
        silent_since=silent, since=0.0, requests=5.0 * silent, counted_to=silent)
    state = PlannerState(margin=0.0, pauses=carried, quiet_since=silent + 300.0)  # the fall, seen when it began
    held, why = _step(requests, now, state, live=9)
    assert 1 < held < 9 and "recent level" in why and "of its pauses outlast" in why
    assert _step(requests, now, state, live=1)[0] == 1  # a hold keeps, it never loads
    released, _ = _step(requests, now, PlannerState(margin=0.0, quiet_since=silent + 300.0), live=9)
    assert released < held
    stirred = requests.copy()
    stirred[-200] = 1.0  # one request after the fall began: a new fall, judged on the hour
    assert _step(stirred, now, state, live=9)[0] < held
    later = np.concatenate([np.full(360, 100.0), np.zeros(1150)])
    assert _step(later, silent + 3 * 3600.0 + 600.0, state, live=held)[0] < held


def test_a_long_pause_holds_what_its_returns_bring_not_the_level_its_silence_thinned() -> None:
    """Three hours into a silence the level over the learned span is an eighth of the rate the model left at, and
    held alone it kept what an eighth needs; its returns came back at the rate they left (the requests of a lead
    back, remembered), so the hold keeps what the returns bring (at the budget: `return_size`), at most the live
    replicas."""
    night = 3 * 86400.0 + 2 * 3600.0
    requests = np.concatenate([np.full(360, 100.0), np.zeros(1080)])  # an hour at 10 req/s, then 3 h of nothing
    now = night + requests.size * B
    silent = now - 1080 * B
    thin = _pauses([3600.0 * 4] * 16, back=70.0, every_s=4.5 * 3600.0)  # returns that brought 1 req/s
    full = _pauses([3600.0 * 4] * 16, back=700.0, every_s=4.5 * 3600.0)  # ... and the 10 req/s they left at
    held = {}
    for name, carried in (("thin", thin), ("full", full)):
        carried = carried._replace(silent_since=silent, since=0.0, requests=0.5 * silent, counted_to=silent)
        held[name], why = _step(requests, now, PlannerState(margin=0.0, pauses=carried, quiet_since=silent + 300.0),
                                live=12)
        assert "of its pauses outlast" in why
    assert held["thin"] <= 2 and held["full"] == 5  # 10 req/s x 2 s in flight over 4 slots: 5 replicas
    carried = full._replace(silent_since=silent, since=0.0, requests=0.5 * silent, counted_to=silent)
    assert _step(requests, now, PlannerState(margin=0.0, pauses=carried, quiet_since=silent + 300.0), live=3)[0] == 3
    # a quarter of the returns came back full, the rest thin: the median return is thin, but the full ones' waits
    # are more than the budget's share of the pauses, so the hold serves them
    mixed = carried._replace(pauses=tuple((e, n, 700.0 if k % 4 == 0 else 70.0) for k, (e, n, _) in enumerate(thin.pauses)))
    assert _step(requests, now, PlannerState(margin=0.0, pauses=mixed, quiet_since=silent + 300.0), live=12)[0] == 5


def test_the_pauses_survive_the_planner_states_round_trip() -> None:
    carried = _pauses([600.0, 1200.0], back=3.0, every_s=3600.0)._replace(requests=40.0, counted_to=7200.0)
    state = PlannerState(pauses=carried)
    assert PlannerState.from_json(state.to_json()).pauses == carried
    assert PlannerState.from_json(PlannerState().to_json()).pauses == Pauses()
