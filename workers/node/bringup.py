"""Prewarming one replica: a state machine that resumes from the registry's state.

`pending → loading → warming → ready`, one step after the other, each step starting from
what the registry says was already done. A task that is delivered again (its worker was
killed, a visibility timeout passed) therefore finds the work done, or takes over a load
whose owner is dead (the replica lock expired) and continues where it stopped, reusing
the runtime process it finds on the slot. The runtime does the heavy work in its own
process; this module only drives it through its adapter and records what happened:
progress into the registry, phase durations and the cold start into metrics and a
`[COLDSTART]` log line, the warm-latency baseline of the first validated replica.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from prewarm.core.domain import TERMINAL_STATES, LoadPhase, Replica, ReplicaState
from prewarm.core.errors import InvalidPayload, PermanentError, TemporaryError, WeightsError
from prewarm.runtime.manifest import MANIFEST_FILE, load_manifest
from prewarm.policy.validation import ValidationReport, tensor_specs, validate
from prewarm.policy.warmup import WarmupPlan, generate_requests
from workers.context import WorkerContext
from workers.node.supervision import HostedRuntime, RuntimeExited
from workers.node.lock import ReplicaLock
from workers.payload import PrewarmRequest
from workers.node.runtime_client import RuntimeClient, make_client

log = logging.getLogger("prewarm.agent.pipeline")


class ValidationFailed(PermanentError):
    """The warm replica failed a validation check; not retried (it would fail again)."""

    reason = "validation_failed"

    def __init__(self, rid: str, report: ValidationReport) -> None:
        super().__init__(f"replica {rid} failed validation: {report.reason}")
        self.report = report


class DeadlineExceeded(TemporaryError):
    """The task ran out of its time limit; a retry resumes from the registry's state."""

    reason = "timeout"


class LockLost(TemporaryError):
    """Another task took the replica over; this one stops touching it."""


class PrewarmOutcome(str, Enum):
    READY = "ready"  # this task made the replica ready
    ALREADY_READY = "already_ready"  # a previous delivery did: nothing to do
    SKIPPED = "skipped"  # the replica is draining: a prewarm must not resurrect it


@dataclass(frozen=True)
class PrewarmResult:
    replica_id: str
    outcome: PrewarmOutcome
    cold_start_s: float | None = None


def resolve_model_dir(ctx: WorkerContext, model: str, revision: str, given: str | None) -> Path:
    """Where the weights are: the payload's path, else <models_dir>/<model>/<revision>, else <models_dir>/<model>."""
    root = Path(ctx.settings.runtime.models_dir)
    candidates = [Path(given)] if given else [root / model / revision, root / model]
    for cand in candidates:
        if (cand / MANIFEST_FILE).is_file():
            return cand.resolve()
    raise PermanentError(f"no model directory with a {MANIFEST_FILE} for {model}@{revision}: looked at "
                         + ", ".join(str(c) for c in candidates))


class PrewarmJob:
    """One delivery of `prewarm_replica`: acquire the replica, then step it to ready."""

    def __init__(self, ctx: WorkerContext, req: PrewarmRequest, *, owner: str, deadline: float) -> None:
        self.ctx = ctx
        self.req = req
        self.rid = req.replica.replica_id
        self.owner = owner
        self.deadline = deadline  # time.monotonic() value
        self.poll_s = 0.05

    # --- helpers ----------------------------------------------------------------------
    def _check(self, lock: ReplicaLock, hosted: HostedRuntime | None = None) -> None:
        if lock.lost.is_set():
            raise LockLost(f"replica {self.rid} was taken over by another task")
        if time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"prewarm of {self.rid} ran past agent.task_time_limit_s "
                                   f"({self.ctx.settings.agent.task_time_limit_s}s)", retry_after=1.0)
        if hosted is not None and hosted.exit_code() is not None:
            raise RuntimeExited(f"runtime of {self.rid} exited with status {hosted.exit_code()}: "
                                f"{self.ctx.host.log_tail(hosted.slot)}")

    def _transition(self, to: ReplicaState, expected: ReplicaState, reason: str = "") -> Replica:
        rec = self.ctx.registry.transition(self.rid, to, now=self.ctx.clock(), expected=expected, reason=reason)
        self.ctx.host.update(rec)
        return rec

    def _ready_and_hosted(self) -> bool:
        rec = self.ctx.registry.get(self.rid)
        hosted = self.ctx.host.get(self.rid)
        return rec is not None and rec.state is ReplicaState.READY and hosted is not None \
            and hosted.exit_code() is None

    # --- the job ----------------------------------------------------------------------
    def run(self) -> PrewarmResult:
        ref = self.req.replica
        if ref.node != self.ctx.node:
            raise InvalidPayload(f"replica {self.rid} belongs to node {ref.node!r}, "
                                 f"but this agent serves node {self.ctx.node!r}")
        if ref.slot >= self.ctx.settings.agent.replica_slots:
            raise InvalidPayload(f"replica {self.rid}: slot {ref.slot} is outside this node's "
                                 f"{self.ctx.settings.agent.replica_slots} replica slots")
        model_dir = resolve_model_dir(self.ctx, ref.model, ref.revision, self.req.model_dir)
        lock = ReplicaLock(self.ctx.client, self.rid, self.owner, self.ctx.settings.agent.lock_ttl_s)
        if not lock.acquire(deadline=self.deadline, stop_waiting=self._ready_and_hosted):
            return PrewarmResult(self.rid, PrewarmOutcome.ALREADY_READY)
        with lock:
            return self._run_locked(lock, model_dir)

    def _run_locked(self, lock: ReplicaLock, model_dir: Path) -> PrewarmResult:
        ctx, ref = self.ctx, self.req.replica
        rec = ctx.registry.get(self.rid)
        if rec is not None and rec.state is ReplicaState.READY:
            hosted = ctx.host.get(self.rid)
            if hosted is not None and hosted.exit_code() is None:
                log.info("replica %s is already ready: nothing to do", self.rid)
                return PrewarmResult(self.rid, PrewarmOutcome.ALREADY_READY)
            rec = ctx.registry.transition(self.rid, ReplicaState.FAILED, now=ctx.clock(),
                                          reason="ready in the registry but its runtime is gone")
        if rec is not None and rec.state is ReplicaState.DRAINING:
            log.info("replica %s is draining: not prewarming it again", self.rid)
            return PrewarmResult(self.rid, PrewarmOutcome.SKIPPED)
        if rec is None or rec.state in TERMINAL_STATES:
            now = ctx.clock()
            fresh = Replica(model=ref.model, revision=ref.revision, node=ref.node, slot=ref.slot,
                            endpoint=ctx.host.endpoint_of(ref.slot), pool=self.req.pool,
                            state=ReplicaState.PENDING, created_at=now, updated_at=now, heartbeat_at=now)
            created = ctx.registry.register(fresh, now=now)
            rec = ctx.registry.get(self.rid)
            if rec is None:
                raise TemporaryError(f"replica {self.rid} vanished right after registration", 1.0)
            log.info("replica %s registered %s (state %s)", self.rid, "new" if created else "existing", rec.state.value)
        else:
            log.info("replica %s resumes from state %s", self.rid, rec.state.value)

        # Loading starts with the runtime process itself (interpreter, torch, CUDA context).
        if rec.state is ReplicaState.PENDING:
            rec = self._transition(ReplicaState.LOADING, ReplicaState.PENDING)
        hosted = ctx.host.ensure(rec, str(model_dir), now=ctx.clock())
        if rec.endpoint != hosted.endpoint:
            ctx.registry.set_endpoint(self.rid, hosted.endpoint, now=ctx.clock())
        ctx.host.wait_healthy(hosted, deadline=self.deadline, check=lambda: self._check(lock))
        client = make_client(ctx.settings, hosted.endpoint)

        if rec.state is ReplicaState.LOADING:
            self._load(lock, hosted, client)
            rec = self._transition(ReplicaState.WARMING, ReplicaState.LOADING)
        if rec.state is ReplicaState.WARMING:
            report = self._warm_and_validate(lock, hosted, client, model_dir)
            self._check(lock, hosted)
            if not client.mark_ready(report):
                raise TemporaryError(f"runtime of {self.rid} did not report ready after validation", 1.0)
            rec = self._transition(ReplicaState.READY, ReplicaState.WARMING)
            cold = max(0.0, ctx.clock() - rec.created_at)
            ctx.metrics.cold_start.labels(ref.model, ref.node).observe(cold)
            ctx.registry.record_load_time(ref.model, cold)
            log.info("[COLDSTART] replica=%s model=%s node=%s state=ready cold_start_s=%.3f endpoint=%s",
                     self.rid, ref.model, ref.node, cold, hosted.endpoint)
            return PrewarmResult(self.rid, PrewarmOutcome.READY, cold)
        raise PermanentError(f"replica {self.rid} is in state {rec.state.value}, which a prewarm cannot continue")

    def _load(self, lock: ReplicaLock, hosted: HostedRuntime, client: RuntimeClient) -> None:
        ctx, ref = self.ctx, self.req.replica
        client.load()
        last: tuple[float, LoadPhase] | None = None
        while True:
            self._check(lock, hosted)
            status = client.load_status()
            if status.error:
                kind = WeightsError if status.error_kind == WeightsError.reason else PermanentError
                raise kind(f"runtime of {self.rid} failed to load: {status.error}")
            if (status.progress, status.phase) != last:
                ctx.registry.set_progress(self.rid, min(1.0, max(0.0, status.progress)), status.phase,
                                          now=ctx.clock())
                last = (status.progress, status.phase)
            if status.loaded:
                break
            time.sleep(self.poll_s)
        phases = client.phase_durations()
        for phase, seconds in phases.items():
            ctx.metrics.loading_phase_duration.labels(ref.model, phase, ref.node).observe(seconds)
        log.info("[COLDSTART] replica=%s model=%s node=%s state=loaded load_s=%.3f %s", self.rid, ref.model,
                 ref.node, sum(phases.values()), " ".join(f"{k}_s={v:.3f}" for k, v in phases.items()))

    def _warm_and_validate(self, lock: ReplicaLock, hosted: HostedRuntime, client: RuntimeClient,
                           model_dir: Path) -> ValidationReport:
        ctx, ref = self.ctx, self.req.replica
        wcfg = ctx.settings.warmup
        plan = WarmupPlan.from_settings(ref.model, wcfg)
        requests = generate_requests(plan, secret=wcfg.require_secret(), now=ctx.clock())
        latencies = client.warmup(requests)
        ctx.metrics.warmup_requests.labels(ref.model, "prewarm").inc(len(requests))
        self._check(lock, hosted)
        probe = client.validation_inputs()
        manifest = load_manifest(model_dir)
        baseline = ctx.registry.baseline(ref.model, ctx.settings.agent.node_class)
        report = validate(
            expected=tensor_specs(manifest.tensors),
            live=probe.tensors,
            logits=probe.logits,
            latencies_s=latencies,
            baseline_s=baseline,
            mean_bound=wcfg.logits_mean_bound,
            latency_factor=wcfg.latency_factor,
        )
        for check in report.checks:
            ctx.metrics.validation_results.labels(ref.model, check.name.value, check.outcome.value).inc()
        if not report.passed:
            raise ValidationFailed(self.rid, report)
        if report.record_baseline is not None:
            recorded = ctx.registry.set_baseline_if_absent(ref.model, ctx.settings.agent.node_class,
                                                           report.record_baseline)
            log.info("replica %s recorded the warm-latency baseline of %s on %s: %.4fs", self.rid, ref.model,
                     ctx.settings.agent.node_class, recorded)
        return report


def owner_token(task_id: str) -> str:
    """Who holds a replica lock: host, pid and task id (shown when another task waits for it)."""
    return f"{os.uname().nodename}:{os.getpid()}:{task_id}"


__all__ = ["PrewarmJob", "PrewarmOutcome", "PrewarmResult", "ValidationFailed", "owner_token", "resolve_model_dir"]
