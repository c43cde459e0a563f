"""The pure rollout policies: the weighted revision split and the rollout state machine (no I/O)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from prewarm.policy.revisions import RevisionChoiceKind, choose_revision, key_draw
from prewarm.policy.rollout import (
    InvalidRollout,
    RevisionStats,
    RolloutAction,
    RolloutObservation,
    RolloutPhase,
    RolloutSpec,
    RolloutState,
    abort,
    advance,
    pause,
    resume,
    settle,
    start,
    weights,
)


def spec(**kw: object) -> RolloutSpec:
    base: dict[str, object] = dict(model="m", stable="r1", canary="r2", steps=(5, 25, 50, 100), pause_s=60.0,
                                   logprob_tolerance=0.05, speed_ratio=1.2, error_rate_margin=0.02, latency_ratio=1.2,
                                   min_requests=20)
    base.update(kw)
    return RolloutSpec(**base)  # type: ignore[arg-type]


def begin(**kw: object) -> RolloutState:
    return start(spec(**kw), now=0.0, live_revisions=["r1"], known_revisions=["r1", "r2"], running=None)


# --- the weighted split ----------------------------------------------------------------------


@pytest.mark.parametrize("weights_, ready, kw, kind, rev", [
    ([], ["r1", "r2"], {}, RevisionChoiceKind.ANY, None),
    ([("r2", 0.0), ("r1", 100.0)], ["r1", "r2"], {}, RevisionChoiceKind.WEIGHTED, "r1"),  # weight 0: nothing
    ([("r2", 50.0), ("r1", 50.0)], ["r1"], {}, RevisionChoiceKind.WEIGHTED, "r1"),  # canary not ready: no traffic
    ([("r2", 100.0), ("r1", 0.0)], ["r1"], {}, RevisionChoiceKind.NOT_READY, "r2"),  # hold for the only weighted one
    ([("r2", 5.0), ("r1", 95.0)], ["r1", "r2"], {"pinned": "r2"}, RevisionChoiceKind.PINNED, "r2"),
    ([("r2", 5.0), ("r1", 95.0)], ["r1", "r2"], {"pinned": "r9"}, RevisionChoiceKind.UNKNOWN, None),
    ([], ["r1"], {"pinned": "r1"}, RevisionChoiceKind.PINNED, "r1"),
])
def test_choose_revision_rules(weights_: list[tuple[str, float]], ready: list[str], kw: dict[str, str],
                               kind: RevisionChoiceKind, rev: str | None) -> None:
    c = choose_revision(weights_, ready, draw=0.5, **kw)
    assert (c.kind, c.revision) == (kind, rev)


def test_unknown_pinned_revision_names_the_live_ones() -> None:
    c = choose_revision([("r2", 5.0), ("r1", 95.0)], ["r1"], draw=0.0, pinned="nope")
    assert "nope" in c.reason and "r1" in c.reason and "r2" in c.reason


def test_weighted_split_follows_the_weights() -> None:
    rng = random.Random(1)
    n = 20_000
    got = sum(choose_revision([("r2", 25.0), ("r1", 75.0)], ["r1", "r2"], draw=rng.random()).revision == "r2"
              for _ in range(n))
    assert abs(got / n - 0.25) < 0.02


def test_sticky_keys_stay_on_the_canary_as_its_share_grows() -> None:
    keys = [f"client-{i}" for i in range(2000)]
    on_canary: set[str] = set()
    for w in (5.0, 25.0, 50.0, 100.0):
        now = {k for k in keys
               if choose_revision([("r2", w), ("r1", 100 - w)], ["r1", "r2"], draw=0.99, route_key=k).revision == "r2"}
        assert on_canary <= now  # nobody moves back to the stable revision
        assert abs(len(now) / len(keys) - w / 100) < 0.04
        on_canary = now
    assert key_draw("a") == key_draw("a") and 0 <= key_draw("b") < 1


def test_draw_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="draw"):
        choose_revision([("r2", 5.0), ("r1", 95.0)], ["r1", "r2"], draw=1.0)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, live, known, match", [
    ({"steps": (25, 5, 100)}, ["r1"], ["r1", "r2"], "out of order"),
    ({"steps": (5, 5, 100)}, ["r1"], ["r1", "r2"], "out of order"),
    ({"steps": (5, 50)}, ["r1"], ["r1", "r2"], "not 100"),
    ({"steps": (0, 100)}, ["r1"], ["r1", "r2"], "outside"),
    ({"steps": ()}, ["r1"], ["r1", "r2"], "empty"),
    ({"canary": "r3"}, ["r1"], ["r1", "r2"], "unknown revision 'r3'"),
    ({"stable": "r0"}, ["r1"], ["r1", "r2"], "no live revision 'r0'"),
    ({"canary": "r1"}, ["r1"], ["r1", "r2"], "already the stable"),
    ({"pause_s": 0.0}, ["r1"], ["r1", "r2"], "--pause"),
    ({"speed_ratio": 0.9}, ["r1"], ["r1", "r2"], "speed_ratio"),
])
def test_bad_rollouts_are_refused_with_a_clear_error(kw: dict[str, object], live: list[str], known: list[str],
                                                     match: str) -> None:
    with pytest.raises(InvalidRollout, match=match):
        start(spec(**kw), now=0.0, live_revisions=live, known_revisions=known, running=None)


def test_a_second_rollout_while_one_runs_is_refused() -> None:
    running = begin()
    with pytest.raises(InvalidRollout, match="is running"):
        start(spec(canary="r3"), now=1.0, live_revisions=["r1"], known_revisions=["r2", "r3"], running=running)
    done = abort(running, now=2.0)
    assert start(spec(canary="r3"), now=3.0, live_revisions=["r1"], known_revisions=["r3"], running=done).phase \
        is RolloutPhase.RUNNING


# --- the state machine ------------------------------------------------------------------------


def obs(now: float, ready: int, demand: int = 20, lead: float = 30.0, **kw: object) -> RolloutObservation:
    return RolloutObservation(now=now, demand_replicas=demand, lead_s=lead, canary_ready=ready, **kw)  # type: ignore[arg-type]


def test_each_shift_waits_for_the_canary_capacity_and_the_pause() -> None:
    s = begin()
    d, s = advance(s, obs(0.0, 0))
    assert (d.action, d.weight, d.canary_replicas, d.stable_replicas) == (RolloutAction.PREPARE, 0, 1, 20)
    d, s = advance(s, obs(10.0, 1))  # the one canary replica for 5% of 20 is ready: shift
    assert (d.action, d.weight) == (RolloutAction.SHIFT, 5)
    assert d.stable_replicas == 20  # the stable is not shrunk in the same tick as the shift
    d, s = advance(s, obs(15.0, 1))
    assert (d.action, d.stable_replicas) == (RolloutAction.HOLD, 19)
    d, s = advance(s, obs(20.0, 1))  # 25% is due at 70; its lead (30 s) starts at 40
    assert (d.action, d.canary_replicas) == (RolloutAction.HOLD, 1)
    d, s = advance(s, obs(45.0, 1))
    assert (d.action, d.weight, d.canary_replicas, d.stable_replicas) == (RolloutAction.PREPARE, 5, 5, 19)
    d, s = advance(s, obs(70.0, 4))  # due, but only 4 of 5 ready: no shift on the timer alone
    assert (d.action, d.weight) == (RolloutAction.PREPARE, 5) and "4/5" in d.reason
    d, s = advance(s, obs(75.0, 5))
    assert (d.action, d.weight) == (RolloutAction.SHIFT, 25)
    for w in (50, 100):
        d, s = advance(s, obs(s.due_at(), 20))
        assert d.action is RolloutAction.HOLD  # the shrink tick
        d, s = advance(s, obs(s.due_at(), 20))
        assert (d.action, d.weight) == (RolloutAction.SHIFT, w)
    d, s = advance(s, obs(s.due_at() - 1, 20))
    assert d.stable_replicas == 0 and d.action is RolloutAction.HOLD
    d, s = advance(s, obs(s.due_at(), 20))
    assert d.action is RolloutAction.COMPLETE and s.phase is RolloutPhase.COMPLETED
    assert weights(s) == [("r2", 100.0)]


def test_a_finished_rollout_clears_its_split_once_the_retired_revision_is_gone() -> None:
    """After completion (or a rollback) no weights are left behind: a revision deployed later
    without a rollout is routed again (no weights = any ready revision). Not while a replica of
    the retired revision is still live: the final split keeps traffic off it until it is gone."""
    running = begin()
    _, running = advance(running, obs(0.0, 1))
    assert settle(running, retired_live=0, now=1.0) == running  # running: nothing to settle
    completed = replace(running, phase=RolloutPhase.COMPLETED, weight=100)
    rolled_back = abort(running, now=2.0)
    for s, final in ((completed, [("r2", 100.0)]), (rolled_back, [("r2", 0.0), ("r1", 100.0)])):
        held = settle(s, retired_live=1, now=3.0)
        assert held == s and weights(held) == final
        done = settle(s, retired_live=0, now=4.0)
        assert done.settled and weights(done) == [] and "settled" in done.history[-1][1]
        assert settle(done, retired_live=0, now=5.0) == done
        assert RolloutState.from_json(done.to_json()) == done
        assert choose_revision(weights(done), ["r1", "r3"], draw=0.5).kind is RevisionChoiceKind.ANY


def test_a_failed_canary_replica_rolls_back_with_its_reason() -> None:
    s = begin()
    d, s = advance(s, obs(0.0, 0, canary_failed=("m@r2/n/0: logits differ from r1 by 3.1 > 0.05",)))
    assert d.action is RolloutAction.ROLLBACK and d.weight == 0 and d.canary_replicas == 0
    assert s.phase is RolloutPhase.ROLLED_BACK and "logits differ" in s.reason
    assert weights(s) == [("r2", 0.0), ("r1", 100.0)]
    d2, s2 = advance(s, obs(5.0, 0))
    assert d2.action is RolloutAction.WAIT and s2 == s


def test_live_errors_during_a_pause_roll_back_but_few_requests_do_not() -> None:
    s = begin()
    _, s = advance(s, obs(0.0, 1))  # shifted to 5%
    bad = RevisionStats(requests=10, errors=5, latency_s=1.0)
    good = RevisionStats(requests=200, errors=0, latency_s=20.0)
    d, s = advance(s, obs(5.0, 1, canary_stats=bad, stable_stats=good))
    assert d.action is RolloutAction.HOLD  # 10 < min_requests: no verdict yet
    d, s = advance(s, obs(9.0, 1, canary_stats=RevisionStats(40, 4, 4.0), stable_stats=good))
    assert d.action is RolloutAction.ROLLBACK and "error rate" in s.reason
    s = begin()
    _, s = advance(s, obs(0.0, 1))
    d, s = advance(s, obs(5.0, 1, canary_stats=RevisionStats(40, 0, 40 * 0.2), stable_stats=good))
    assert d.action is RolloutAction.ROLLBACK and "latency" in s.reason


def test_pause_resume_abort_and_state_round_trip() -> None:
    s = begin()
    _, s = advance(s, obs(0.0, 1))
    p = pause(s, now=10.0)
    d, p2 = advance(p, obs(500.0, 20))
    assert d.action is RolloutAction.WAIT and d.weight == 5 and p2 == p
    with pytest.raises(InvalidRollout, match="not running"):
        pause(p, now=11.0)
    r = resume(p, now=100.0)
    assert r.phase is RolloutPhase.RUNNING and r.due_at() == 160.0  # the pause restarts
    assert RolloutState.from_json(r.to_json()) == r
    a = abort(r, now=120.0)
    assert a.phase is RolloutPhase.ROLLED_BACK and a.weight == 0
    with pytest.raises(InvalidRollout, match="nothing to abort"):
        abort(a, now=121.0)


def test_a_dip_in_demand_never_cancels_canary_replicas_already_asked_for() -> None:
    s = begin()
    _, s = advance(s, obs(0.0, 1))  # 5%
    _, s = advance(s, obs(5.0, 1))  # shrink tick
    d, s = advance(s, obs(45.0, 1, demand=20))
    assert (d.action, d.canary_replicas) == (RolloutAction.PREPARE, 5)
    d, s = advance(s, obs(50.0, 2, demand=8))  # the forecast dipped: 25% of 8 is 2, but 5 are loading
    assert d.canary_replicas == 5
    d, s = advance(s, obs(50.0, 2, demand=8, lead=1.0))  # and the lead moved: still 5
    assert d.canary_replicas == 5
