"""A canary rollout as a pure state machine: warm the next step's capacity, prove it, shift, or roll back.

Argo Rollouts, Flagger and KServe shift a canary's weight on a timer and watch metrics;
the replicas for a step load while that step's traffic arrives. Here each step's canary
capacity is brought up a lead before the step is due, and the shift waits for it:

- `start` checks the request (revisions, steps strictly increasing in (0, 100], ending at
  100, a positive pause) and returns the first state, nothing shifted yet;
- `advance(state, obs)` is called on every planner tick with what the registry and the
  gateway saw (`RolloutObservation`, `now` inside). It answers one `RolloutDecision`:
  how many canary and stable replicas to keep, and the canary's weight (percent). The
  shift to step k happens once its pause has run (`pause_s` after the previous shift) AND
  the canary has the replicas for step k's share of the forecast demand ready; those are
  asked for `lead_s` before the step is due. The stable revision is shrunk to its new
  share one tick after the shift (once the gateway has read the new weights).
- a canary replica that failed (validation against the stable revision's answers, speed,
  corrupt weights), or a canary whose live error rate or latency during a pause is worse
  than the stable revision's by more than the rollout allows, rolls back: weight 0, no
  canary replica, the reason kept in the state;
- `pause`, `resume` and `abort` are operator actions: a paused rollout keeps its weights
  and replicas; an aborted one rolls back.

Every judgement threshold is a field of the spec (set per rollout, defaults from settings).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, Sequence

from prewarm.core.domain import check_name
from prewarm.core.errors import InvalidPayload


class RolloutPhase(str, Enum):
    RUNNING = "running"  # working towards the next step
    PAUSED = "paused"  # held by the operator: weights and replicas as they are
    COMPLETED = "completed"  # 100% on the canary, the stable revision retired
    ROLLED_BACK = "rolled_back"  # weight back on the stable revision, canary retired (failure or abort)


TERMINAL = (RolloutPhase.COMPLETED, RolloutPhase.ROLLED_BACK)


class RolloutAction(str, Enum):
    PREPARE = "prepare"  # bring canary replicas up for the next step (its share, a lead ahead)
    SHIFT = "shift"  # move the canary's weight to the next step
    HOLD = "hold"  # keep weights; the pause runs
    COMPLETE = "complete"  # the last step's pause ran clean: the canary is the new stable
    ROLLBACK = "rollback"  # weight to stable, canary retired
    WAIT = "wait"  # paused or finished: nothing to do


class InvalidRollout(InvalidPayload):
    """A rollout request that cannot run (unknown revision, steps out of order, one already running)."""

    reason: ClassVar[str] = "invalid_rollout"


@dataclass(frozen=True)
class RolloutSpec:
    model: str
    stable: str  # the revision serving now
    canary: str  # the new revision
    steps: tuple[int, ...]  # canary weight (percent) of each step, strictly increasing, the last 100
    pause_s: float  # how long each step runs before the next (and the live comparison window)
    logprob_tolerance: float  # max |top-logprob difference| vs the stable revision's answers to seeded prompts
    speed_ratio: float  # canary TTFT and decode time within this multiple of the stable baseline
    error_rate_margin: float  # canary live error rate may exceed the stable one's by this much (absolute)
    latency_ratio: float  # canary mean live latency within this multiple of the stable one's
    min_requests: int  # live comparison only once the canary served this many requests in the window

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"steps": list(self.steps)}


@dataclass(frozen=True)
class RolloutState:
    spec: RolloutSpec
    phase: RolloutPhase
    started_at: float
    weight: int = 0  # the canary's current weight (percent)
    step: int = -1  # index of the step live now (-1: none yet)
    shifted_at: float | None = None  # when the current step's weight was written
    shrunk: bool = True  # the stable revision has been shrunk to the current step's share
    reason: str = ""  # why it ended (rollback) or why it is paused
    canary_asked: int = 0  # canary replicas asked for so far: never shrunk while running (a load cut short is waste)
    updated_at: float = 0.0
    history: tuple[tuple[float, str], ...] = field(default=())  # (time, what happened), oldest first
    settled: bool = False  # finished and the revision it retired has no live replica: the split is cleared

    def to_json(self) -> str:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        d["phase"] = self.phase.value
        d["history"] = [list(h) for h in self.history]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RolloutState":
        d = json.loads(text)
        spec = d.pop("spec")
        spec["steps"] = tuple(int(s) for s in spec["steps"])
        d["phase"] = RolloutPhase(d["phase"])
        d["history"] = tuple((float(t), str(w)) for t, w in d.get("history", []))
        return cls(spec=RolloutSpec(**spec), **d)

    @property
    def next_step(self) -> int | None:
        nxt = self.step + 1
        return nxt if nxt < len(self.spec.steps) else None

    def due_at(self) -> float:
        """When the next step may shift: at once for the first, a pause after the last shift otherwise."""
        if self.shifted_at is None:
            return self.started_at
        return self.shifted_at + self.spec.pause_s


@dataclass(frozen=True)
class RevisionStats:
    """What the gateway saw of one revision over the last pause window."""

    requests: int = 0
    errors: int = 0  # answers with a 5xx status, or none
    latency_s: float = 0.0  # summed request durations

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class RolloutObservation:
    now: float
    demand_replicas: int  # the planner's replica target for the whole model (its forecast at the lead)
    lead_s: float  # the planner's lead: how long before it is needed a replica must be started
    canary_ready: int  # canary replicas validated and ready
    canary_failed: tuple[str, ...] = ()  # why canary replicas failed since the rollout started (one line each)
    canary_stats: RevisionStats = RevisionStats()
    stable_stats: RevisionStats = RevisionStats()


@dataclass(frozen=True)
class RolloutDecision:
    action: RolloutAction
    weight: int  # the canary's weight (percent) to route with
    canary_replicas: int  # canary replicas to keep (ready or coming up)
    stable_replicas: int  # stable replicas to keep
    reason: str


def share(demand: int, weight: int) -> int:
    """Replicas for `weight` percent of `demand` replicas: rounded up, at least one for any traffic."""
    if weight <= 0:
        return 0
    return max(1, math.ceil(round(demand * weight / 100.0, 9)))


def check_steps(steps: Sequence[int]) -> tuple[int, ...]:
    """Steps strictly increasing in (0, 100], the last 100; a clear error naming what is wrong."""
    out = tuple(steps)
    if not out:
        raise InvalidRollout("--steps is empty; give canary weights in percent, e.g. 5,25,50,100")
    for s in out:
        if not 0 < s <= 100:
            raise InvalidRollout(f"step {s} is outside (0, 100]: steps are canary weights in percent")
    for a, b in zip(out, out[1:]):
        if b <= a:
            raise InvalidRollout(f"steps out of order: {b} follows {a}; each step must raise the canary's weight")
    if out[-1] != 100:
        raise InvalidRollout(f"the last step is {out[-1]}, not 100: a rollout ends with all traffic on the canary")
    return out


def start(spec: RolloutSpec, *, now: float, live_revisions: Sequence[str], known_revisions: Sequence[str],
          running: "RolloutState | None") -> RolloutState:
    """The first state of a rollout, or InvalidRollout naming what is wrong (nothing is changed then)."""
    check_name(spec.model, "model")
    check_name(spec.canary, "revision")
    if running is not None and running.phase not in TERMINAL:
        raise InvalidRollout(f"a rollout of {spec.model} to {running.spec.canary} is {running.phase.value}; "
                             "abort it or let it finish first")
    if spec.stable not in live_revisions:
        raise InvalidRollout(f"{spec.model} has no live revision {spec.stable!r} to roll out from; "
                             f"live: {', '.join(live_revisions) or 'none'}")
    if spec.canary == spec.stable:
        raise InvalidRollout(f"revision {spec.canary!r} is already the stable revision of {spec.model}")
    if spec.canary not in known_revisions:
        raise InvalidRollout(f"unknown revision {spec.canary!r} of {spec.model}; "
                             f"known: {', '.join(sorted(known_revisions)) or 'none'}")
    check_steps(spec.steps)
    if not spec.pause_s > 0:
        raise InvalidRollout(f"--pause must be positive, got {spec.pause_s:g} s")
    if not spec.logprob_tolerance > 0:
        raise InvalidRollout(f"--tolerance must be positive, got {spec.logprob_tolerance}")
    if not spec.error_rate_margin >= 0:
        raise InvalidRollout(f"error_rate_margin must be >= 0, got {spec.error_rate_margin}")
    for name in ("speed_ratio", "latency_ratio"):
        if not getattr(spec, name) >= 1:
            raise InvalidRollout(f"{name} must be >= 1, got {getattr(spec, name)}")
    return RolloutState(spec=spec, phase=RolloutPhase.RUNNING, started_at=now, updated_at=now,
                        history=((now, f"started: {spec.stable} -> {spec.canary}, steps {list(spec.steps)}"),))


def _log(state: RolloutState, now: float, what: str) -> tuple[tuple[float, str], ...]:
    return (state.history + ((now, what),))[-50:]


def pause(state: RolloutState, *, now: float, reason: str = "paused by the operator") -> RolloutState:
    if state.phase is not RolloutPhase.RUNNING:
        raise InvalidRollout(f"the rollout of {state.spec.model} is {state.phase.value}, not running: nothing to pause")
    return replace(state, phase=RolloutPhase.PAUSED, reason=reason, updated_at=now, history=_log(state, now, reason))


def resume(state: RolloutState, *, now: float) -> RolloutState:
    if state.phase is not RolloutPhase.PAUSED:
        raise InvalidRollout(f"the rollout of {state.spec.model} is {state.phase.value}, not paused: nothing to resume")
    # the pause the operator held does not count as the step's clean pause: it restarts
    shifted = now if state.shifted_at is not None else None
    return replace(state, phase=RolloutPhase.RUNNING, reason="", updated_at=now, shifted_at=shifted,
                   history=_log(state, now, "resumed"))


def abort(state: RolloutState, *, now: float, reason: str = "aborted by the operator") -> RolloutState:
    if state.phase in TERMINAL:
        raise InvalidRollout(f"the rollout of {state.spec.model} already {state.phase.value}: nothing to abort")
    return _rolled_back(state, now, reason)


def _rolled_back(state: RolloutState, now: float, reason: str) -> RolloutState:
    return replace(state, phase=RolloutPhase.ROLLED_BACK, weight=0, reason=reason, updated_at=now, shrunk=True,
                   history=_log(state, now, f"rolled back: {reason}"))


def _live_verdict(spec: RolloutSpec, obs: RolloutObservation) -> str | None:
    """Why the canary's live traffic in this pause is worse than the stable's, or None."""
    c, s = obs.canary_stats, obs.stable_stats
    if c.requests < spec.min_requests:
        return None
    if c.error_rate > s.error_rate + spec.error_rate_margin:
        return (f"canary error rate {c.error_rate:.1%} over {c.requests} requests exceeds the stable "
                f"{s.error_rate:.1%} by more than {spec.error_rate_margin:.1%}")
    if s.requests and s.mean_latency_s > 0 and c.mean_latency_s > spec.latency_ratio * s.mean_latency_s:
        return (f"canary mean latency {c.mean_latency_s:.3f} s exceeds {spec.latency_ratio:g}x the stable "
                f"{s.mean_latency_s:.3f} s")
    return None


def advance(state: RolloutState, obs: RolloutObservation) -> tuple[RolloutDecision, RolloutState]:
    """One tick of the rollout: the decision to carry out now, and the next state.

    While it runs, the canary is never asked for fewer replicas than before: a dip in the
    forecast (or a lead that moved) must not cancel the load of a replica the next step needs."""
    decision, new = _advance(state, obs)
    if new.phase in (RolloutPhase.RUNNING, RolloutPhase.PAUSED):
        keep = max(decision.canary_replicas, state.canary_asked)
        decision = replace(decision, canary_replicas=keep)
        new = replace(new, canary_asked=keep)
    return decision, new


def _advance(state: RolloutState, obs: RolloutObservation) -> tuple[RolloutDecision, RolloutState]:
    spec, now, demand = state.spec, obs.now, max(0, obs.demand_replicas)
    if state.phase is RolloutPhase.COMPLETED:
        return RolloutDecision(RolloutAction.WAIT, 100, demand, 0, "completed"), state
    if state.phase is RolloutPhase.ROLLED_BACK:
        return RolloutDecision(RolloutAction.WAIT, 0, 0, demand, state.reason), state
    kept_canary = share(demand, state.weight)
    kept_stable = share(demand, 100 - (state.weight if state.shrunk else _previous_weight(state)))
    if state.phase is RolloutPhase.PAUSED:
        return RolloutDecision(RolloutAction.WAIT, state.weight, kept_canary, kept_stable, state.reason), state

    failed = obs.canary_failed
    why = f"canary replica failed: {failed[0]}" if failed else None
    if why is None and state.shifted_at is not None and now - state.shifted_at >= 0:
        why = _live_verdict(spec, obs)
    if why is not None:
        new = _rolled_back(state, now, why)
        return RolloutDecision(RolloutAction.ROLLBACK, 0, 0, max(demand, 1), why), new

    if not state.shrunk:  # the shift was written last tick: the gateway has the new weights, shrink the old
        new = replace(state, shrunk=True, updated_at=now,
                      history=_log(state, now, f"{spec.stable} shrunk to {share(demand, 100 - state.weight)}"))
        return (RolloutDecision(RolloutAction.HOLD, state.weight, kept_canary, share(demand, 100 - state.weight),
                                f"step {state.weight}% shifted; stable shrunk to its share"), new)

    nxt = state.next_step
    if nxt is None:  # the last step (100%) is live
        if now >= state.due_at():
            new = replace(state, phase=RolloutPhase.COMPLETED, updated_at=now,
                          history=_log(state, now, f"completed: {spec.canary} serves all traffic"))
            return RolloutDecision(RolloutAction.COMPLETE, 100, demand, 0, "the last step's pause ran clean"), new
        return RolloutDecision(RolloutAction.HOLD, 100, kept_canary, 0, "last step: pause running"), state

    target_w = spec.steps[nxt]
    due = state.due_at()
    if now < due - obs.lead_s:
        return (RolloutDecision(RolloutAction.HOLD, state.weight, kept_canary, kept_stable,
                                f"step {target_w}% due in {due - now:.0f} s"), state)
    want = share(demand, target_w)
    if now >= due and obs.canary_ready >= want:
        new = replace(state, weight=target_w, step=nxt, shifted_at=now, shrunk=False, updated_at=now,
                      history=_log(state, now, f"shifted to {target_w}% with {obs.canary_ready} canary replicas ready"))
        return (RolloutDecision(RolloutAction.SHIFT, target_w, want, kept_stable,
                                f"{obs.canary_ready} canary replicas ready for {target_w}%"), new)
    why = (f"step {target_w}% due in {due - now:.0f} s" if now < due
           else f"step {target_w}% waits for capacity: {obs.canary_ready}/{want} canary replicas ready")
    return RolloutDecision(RolloutAction.PREPARE, state.weight, want, kept_stable, why), state


def _previous_weight(state: RolloutState) -> int:
    """The canary's weight before the current step (the stable keeps that share until it is shrunk)."""
    return state.spec.steps[state.step - 1] if state.step >= 1 else 0


def retired_revision(state: RolloutState) -> str | None:
    """The revision a finished rollout retires (the stable one on completion, the canary on rollback)."""
    if state.phase is RolloutPhase.COMPLETED:
        return state.spec.stable
    if state.phase is RolloutPhase.ROLLED_BACK:
        return state.spec.canary
    return None


def settle(state: RolloutState, *, retired_live: int, now: float) -> RolloutState:
    """A finished rollout, settled once the revision it retired has no live replica left.

    Settled, it splits nothing (`weights` is []): the gateway routes to any ready revision again,
    so a revision deployed later without a rollout gets traffic. Before that the final split holds,
    so a retiring replica is never routed to. Anything else is returned as it is (a rollout started
    in between, one already settled, or live replicas still retiring)."""
    if state.settled or retired_revision(state) is None or retired_live > 0:
        return state
    return replace(state, settled=True, updated_at=now,
                   history=_log(state, now, f"settled: {retired_revision(state)} retired, revision split cleared"))


def weights(state: RolloutState) -> list[tuple[str, float]]:
    """The gateway's revision weights for this state, canary first (what sticky route keys rely on);
    [] once a finished rollout is settled (no split: any ready revision)."""
    spec = state.spec
    if state.settled:
        return []
    if state.phase is RolloutPhase.COMPLETED:
        return [(spec.canary, 100.0)]
    if state.phase is RolloutPhase.ROLLED_BACK:
        return [(spec.canary, 0.0), (spec.stable, 100.0)]
    return [(spec.canary, float(state.weight)), (spec.stable, float(100 - state.weight))]
