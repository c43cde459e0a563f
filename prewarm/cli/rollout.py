"""`prewarm rollout`: start, inspect, pause, resume and abort a canary rollout of a model.

The command only writes the rollout's state in Redis (`prewarm.registry.rollouts`); the
planner worker carries it out on its ticks (`workers/planning/rollout.py`): it warms and
validates the canary's replicas for each step before shifting weight to them. Bad input
(an unknown revision, steps out of order, a second rollout while one runs) ends the
command with exit code 2 and a message naming what is wrong, and changes nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from prewarm.core.settings import Settings

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration_s(text: str) -> float:
    """`90`, `90s`, `10m`, `1.5h` -> seconds; argparse reports a ValueError as a bad value."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 10m, 1h)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def steps_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: steps are comma-separated whole percents, e.g. 5,25,50,100") \
            from None


def add_parser(sub: Any) -> None:
    """Register `rollout` on the CLI's subparsers."""
    p = sub.add_parser("rollout", help="canary rollouts: warm and validate a new revision before shifting traffic to it")
    actions = p.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    q = actions.add_parser("start", help="start rolling MODEL out to a new revision")
    q.add_argument("model")
    q.add_argument("--revision", required=True, help="the new (canary) revision")
    q.add_argument("--from", dest="stable", help="the stable revision (default: the live one with most ready replicas)")
    q.add_argument("--steps", type=steps_arg, default=(5, 25, 50, 100),
                   help="canary weights in percent, strictly increasing, ending at 100 (default 5,25,50,100)")
    q.add_argument("--pause", type=duration_s, default=None, help="how long each step runs (default: rollout.pause_s)")
    q.add_argument("--tolerance", type=float, default=None,
                   help="max top-logprob difference from the stable revision's answers (default: rollout.logprob_tolerance)")
    q.add_argument("--json", action="store_true")
    for name, text in (("status", "show the rollout of MODEL (every rollout without MODEL)"),
                       ("pause", "hold the rollout of MODEL at its current weights"),
                       ("resume", "resume a paused rollout (its step's pause restarts)"),
                       ("abort", "roll back: weight to the stable revision, canary replicas retired")):
        q = actions.add_parser(name, help=text)
        q.add_argument("model", nargs="?" if name == "status" else None)
        q.add_argument("--json", action="store_true")
        if name in ("pause", "abort"):
            q.add_argument("--reason", default=None)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from prewarm.core.errors import InvalidPayload, SettingsError
    from prewarm.core.domain import LIVE_STATES
    from prewarm.policy import rollout as policy
    from prewarm.registry.connection import sync_client
    from prewarm.registry.replicas import ReplicaRegistry
    from prewarm.registry.rollouts import RolloutStore

    if not settings.redis.url:
        raise SettingsError("PREWARM_REDIS_URL is not set: a rollout lives in the shared Redis the planner reads")
    client = sync_client(settings.redis)
    store = RolloutStore(client)
    now = time.time()
    cmd = args.rollout_command
    try:
        if cmd == "status":
            models = [args.model] if args.model else store.models()
            states = [(m, store.get(m)) for m in models]
            if args.model and states[0][1] is None:
                raise policy.InvalidRollout(f"no rollout of {args.model} was ever started")
            for m, st in states:
                if st is not None:
                    _print(st, store.weights(m), args.json)
            return 0
        if cmd == "start":
            reps = ReplicaRegistry(client, settings.registry).replicas_of(args.model)
            live = [r for r in reps if r.state in LIVE_STATES]
            ready_by_rev: dict[str, int] = {}
            for r in live:
                ready_by_rev[r.revision] = ready_by_rev.get(r.revision, 0) + (r.state.value == "ready")
            stable = args.stable or max(sorted(ready_by_rev), key=lambda rev: ready_by_rev[rev], default="")
            if not stable:
                raise policy.InvalidRollout(f"{args.model} has no live replica: nothing to roll out from")
            cfg = settings.rollout
            spec = policy.RolloutSpec(
                model=args.model, stable=stable, canary=args.revision, steps=tuple(args.steps),
                pause_s=args.pause if args.pause is not None else cfg.pause_s,
                logprob_tolerance=args.tolerance if args.tolerance is not None else cfg.logprob_tolerance,
                speed_ratio=cfg.speed_ratio, error_rate_margin=cfg.error_rate_margin, latency_ratio=cfg.latency_ratio,
                min_requests=cfg.min_requests)
            known = sorted(store.known_revisions(args.model) | {r.revision for r in reps})
            state = store.update(args.model, lambda running: policy.start(
                spec, now=now, live_revisions=sorted(ready_by_rev), known_revisions=known, running=running))
        else:
            change = {
                "pause": lambda st: policy.pause(st, now=now, **({"reason": args.reason} if args.reason else {})),
                "resume": lambda st: policy.resume(st, now=now),
                "abort": lambda st: policy.abort(st, now=now, **({"reason": args.reason} if args.reason else {})),
            }[cmd]

            def apply(st: policy.RolloutState | None) -> policy.RolloutState:
                if st is None:
                    raise policy.InvalidRollout(f"no rollout of {args.model} was ever started")
                return change(st)

            state = store.update(args.model, apply)
    except InvalidPayload as exc:  # InvalidRollout, or a bad model or revision name
        print(f"prewarm rollout {cmd}: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    _print(state, policy.weights(state), args.json)
    return 0


def _print(state: Any, weights: list[tuple[str, float]], as_json: bool) -> None:
    spec = state.spec
    if as_json:
        print(json.dumps({"model": spec.model, "stable": spec.stable, "canary": spec.canary, "steps": list(spec.steps),
                          "pause_s": spec.pause_s, "phase": state.phase.value, "weight": state.weight,
                          "step": state.step, "reason": state.reason, "weights": weights, "settled": state.settled,
                          "history": [list(h) for h in state.history]}))
        return
    split = ", ".join(f"{r} {w:g}%" for r, w in weights) or "any ready revision (split cleared)"
    print(f"{spec.model}: {spec.stable} -> {spec.canary} {state.phase.value} at {state.weight}% "
          f"(steps {','.join(map(str, spec.steps))}, pause {spec.pause_s:g} s); traffic: {split}"
          + (f"; reason: {state.reason}" if state.reason else ""))
