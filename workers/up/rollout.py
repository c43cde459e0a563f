"""`prewarm up --rollout good|corrupt`: a canary rollout of a second revision in the middle of the replay.

The second revision is built beside the first in the models directory: `good` has the same
numbers under a new revision (a re-release), `corrupt` the same files with bytes of its
weights damaged on disk (what a bad copy or a failing disk leaves). Halfway through the
replay the rollout is started exactly as `prewarm rollout start` does (`RolloutStore.update`
with `prewarm.policy.rollout.start`); from then on the planner worker carries it out and the
gateway splits traffic by the weights it writes. Nothing here steers it: this module only
starts it and watches.

What the report gets (`report.json` → `rollout`): the outcome (`completed` or `rolled_back`,
or the phase it was still in when the replay ended), the requests that waited for a replica
during the shift (the gateway's own `gateway_cold_start_wait_seconds` over 0.5 s, between
the rollout's start and its end) and the user-visible errors in that window (non-2xx
answers and failed connections of the replay), the per-revision traffic the gateway counted,
the replicas of each revision and how the canary's ended, and the rollout's history.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis
from prometheus_client.parser import text_string_to_metric_families

from prewarm.core.domain import ReplicaState
from prewarm.policy import rollout as rp
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.rollouts import RolloutStore
from prewarm.runtime.manifest import load_manifest
from prewarm.runtime.model import make_model
from workers.node.memory import models_on_disk
from workers.up.traffic import TrafficStats

KINDS = ("good", "corrupt")
DEMO_SPEED_RATIO = 5.0  # = the demo's PREWARM_WARMUP_LATENCY_FACTOR (workers/up/run.py)
#: A request that waited longer than this for a replica (not for its tokens) waited for a cold start.
WAIT_THRESHOLD_S = 0.5


def build_canary(models_dir: Path, model: str, stable: str, kind: str, *, size: str, seed: int) -> str:
    """The second revision's directory beside the stable one; returns its revision name."""
    if kind not in KINDS:
        raise ValueError(f"--rollout must be one of {', '.join(KINDS)}, got {kind!r}")
    src = models_dir / model / stable
    m = load_manifest(src)
    revision = f"{stable[:8]}-{kind}"
    out = models_dir / model / revision
    if not out.exists():
        building = models_dir / model / f"_building-{revision}"
        make_model(building, size, seed=seed, name=model, revision=revision, dtype=m.dtype)  # type: ignore[arg-type]
        if kind == "corrupt":
            damage(building)
        building.rename(out)
    return revision


def damage(model_dir: Path) -> None:
    """Overwrite bytes in the middle of the weights file, leaving the manifest as it was."""
    m = load_manifest(model_dir)
    path = model_dir / m.file
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * min(4096, size // 4))


def _gateway_counts(url: str) -> dict[str, float]:
    """The gateway's cold-start-wait histogram (total, over the threshold) and per-revision requests."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {"waits": 0.0, "waited": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "gateway_cold_start_wait_seconds_count":
                out["waits"] += s.value
                out["waited"] += s.value
            elif s.name == "gateway_cold_start_wait_seconds_bucket" and s.labels.get("le") == str(WAIT_THRESHOLD_S):
                out["waited"] -= s.value
            elif s.name == "gateway_revision_requests_total":
                key = f"rev:{s.labels['revision']}:{s.labels['code']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def _errors(stats: TrafficStats) -> int:
    return sum(n for s, n in stats.statuses.items() if not 200 <= s < 300) + sum(stats.errors.values())


@dataclass
class RolloutWatch:
    """Starts the rollout at `at_s` into the replay, then samples it once a second."""

    kind: str
    model: str
    stable: str
    canary: str
    client: "redis.Redis[str]"
    registry: ReplicaRegistry
    models_dir: Path
    pause_s: float
    steps: tuple[int, ...] = (25, 50, 100)
    started_at: float | None = None
    ended_at: float | None = None
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    errors_before: int = 0
    errors_after: int = 0
    phase: str = "not started"
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, weight, canary, stable ready)

    def start(self, gateway_url: str, stats: TrafficStats, now: float) -> rp.RolloutState:
        # the speed and live-latency ratios are the demo's warm-latency factor (run.py: on a shared CPU
        # latency varies far more than on a dedicated GPU; production default 1.2)
        spec = rp.RolloutSpec(model=self.model, stable=self.stable, canary=self.canary, steps=self.steps,
                              pause_s=self.pause_s, logprob_tolerance=0.05, speed_ratio=DEMO_SPEED_RATIO,
                              error_rate_margin=0.01, latency_ratio=DEMO_SPEED_RATIO, min_requests=20)
        known = sorted(k.partition("@")[2] for k in models_on_disk(self.models_dir) if k.startswith(f"{self.model}@"))
        state = RolloutStore(self.client).update(self.model, lambda running: rp.start(
            spec, now=now, live_revisions=[self.stable], known_revisions=known, running=running))
        self.before = _gateway_counts(gateway_url)
        self.errors_before = _errors(stats)
        self.started_at = now
        return state

    async def watch(self, gateway_url: str, stats: TrafficStats, at_s: float, t0: float,
                    done: Callable[[], bool]) -> None:
        """Start at `at_s` after `t0` (monotonic), sample until the rollout ends or `done()`."""
        while time.monotonic() - t0 < at_s:
            if done():
                return
            await asyncio.sleep(0.5)
        self.start(gateway_url, stats, time.time())
        while not done():
            state = RolloutStore(self.client).get(self.model)
            if state is not None:
                self.phase = state.phase.value
                reps = self.registry.replicas_of(self.model)
                ready = {rev: sum(r.revision == rev and r.state is ReplicaState.READY for r in reps)
                         for rev in (self.canary, self.stable)}
                self.samples.append((time.time(), state.weight, ready[self.canary], ready[self.stable]))
                if state.phase in rp.TERMINAL:
                    break
            await asyncio.sleep(1.0)
        await asyncio.sleep(2.0)  # the answers of the last requests routed in the window
        self.ended_at = time.time()
        self.after = _gateway_counts(gateway_url)
        self.errors_after = _errors(stats)

    def result(self) -> dict[str, Any]:
        state = RolloutStore(self.client).get(self.model)
        reps = self.registry.replicas_of(self.model)
        per_rev: dict[str, dict[str, int]] = {}
        for r in reps:
            if r.revision in (self.canary, self.stable):
                per_rev.setdefault(r.revision, {}).setdefault(r.state.value, 0)
                per_rev[r.revision][r.state.value] += 1
        traffic: dict[str, dict[str, float]] = {}
        for key, v in self.after.items():
            if key.startswith("rev:"):
                _, rev, code = key.split(":", 2)
                traffic.setdefault(rev, {})[code] = v - self.before.get(key, 0.0)
        validation = [{"replica": r.id, "state": r.state.value, "reason": r.reason}
                      for r in reps if r.revision == self.canary]
        outcome = {"completed": "completed", "rolled_back": "rolled_back"}.get(state.phase.value if state else "",
                                                                              state.phase.value if state else "not started")
        return {
            "kind": self.kind, "stable": self.stable, "canary": self.canary, "steps": list(self.steps),
            "pause_s": self.pause_s, "outcome": outcome, "reason": state.reason if state else "",
            "waited_during_shift": int(round(self.after.get("waited", 0.0) - self.before.get("waited", 0.0))),
            "requests_during_shift": int(round(self.after.get("waits", 0.0) - self.before.get("waits", 0.0))),
            "errors_during_shift": self.errors_after - self.errors_before,
            "shift_window_s": [self.started_at, self.ended_at],
            "traffic_by_revision": traffic, "replicas_by_revision": per_rev, "canary_validation": validation,
            "history": [list(h) for h in state.history] if state else [],
            "weight_samples": [list(s) for s in self.samples[-400:]],
        }


def rollout_watch(run: Any, stable: str) -> RolloutWatch:
    """The watch of an `UpRun` (`workers.up.run`): the canary built, the pause scaled to the replay."""
    models_dir = Path(run.settings.runtime.models_dir)
    kind = str(run.opts.rollout)
    canary = build_canary(models_dir, "demo", stable, kind, size=run.opts.model_size, seed=run.opts.seed)
    # each step must outlast a cold start and a few planner ticks (5 s in the demo), and the whole
    # rollout fit in the second half of the replay
    replay_s = run.opts.duration_s if run.opts.trace else run.opts.days * run.opts.day_s
    pause = max(10.0, replay_s / 24)
    return RolloutWatch(kind=kind, model="demo", stable=stable, canary=canary, client=run.client,
                        registry=run.registry, models_dir=models_dir, pause_s=pause)
