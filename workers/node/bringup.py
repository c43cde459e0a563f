"""Bringing one replica up: register → load → warm → validate → ready, in one function.

`bring_up` is the one bring-up every replica goes through, whoever started its server: a
node agent (`PrewarmJob` below, for the `prewarm_replica` task), the Kubernetes pod warmer
(`workers/pods.py`, for a pod that turned Ready) and the load benchmark
(`benchmarks/load.py`). What differs between them is passed in (`BringUpSpec` and the
callbacks): how the server is reached once the replica is loading, what else stops the
work (a lost lock, a deadline, a pod gone), whether the server can list its tensors for
the structural check, and where the cold start is counted from. The outcome is typed
(`PrewarmOutcome`, `BringUpResult`); a failure is one of the typed errors below or the
adapter's, and the caller decides what it does to the replica (fail it, retry).

Every step starts from what the registry says was already done, so a task that is
delivered again finds the work done, or takes over a load whose owner is dead (the replica
lock expired) and continues where it stopped, reusing the runtime process it finds on the
slot. The runtime does the heavy work in its own process; this module only drives it and
records what happened: progress into the registry, phase durations and the cold start into
metrics and a `[COLDSTART]` log line, a sample towards the warm-latency baseline (the
median of the first validated replicas), and the cold start into the registry (`load_time_p95`: the planner's lead).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence, cast

from prewarm.adapters.runtimes import LoadStatus, ValidationInputs
from prewarm.adapters.vllm import expected_dtype, expected_max_context
from prewarm.policy.engine_checks import EngineFacts
from prewarm.registry.references import EnginePhases
from prewarm.core.domain import TERMINAL_STATES, LoadPhase, Replica, ReplicaState
from prewarm.core.errors import InvalidPayload, PermanentError, TemporaryError, WeightsError
from prewarm.runtime.manifest import MANIFEST_FILE, load_manifest
from prewarm.policy.validation import CheckName, Outcome, TensorSpec, ValidationReport, tensor_specs, validate
from prewarm.policy.warmup import WarmupPlan, WarmupRequest, generate_requests
from workers.context import WorkerContext
from workers.node.canary import compare_with_stable, speed_rule
from workers.node.memory import CACHED, DISK, in_snapshot
from workers.node.supervision import HostedRuntime, RuntimeExited
from workers.node.tiers import TierOutcome, admit_load, wake_locked
from workers.planning.nodes import release_slot
from workers.node.lock import ReplicaLock
from workers.payload import PrewarmRequest
from workers.node.engine_validation import EngineServer, engine_report, record_engine
from workers.node.engines import VLLM
from workers.node.runtime_client import RuntimeClient, client_for

log = logging.getLogger("prewarm.agent.pipeline")


class ValidationFailed(PermanentError):
    """The warm replica failed a validation check; not retried (it would fail again)."""

    reason = "validation_failed"

    def __init__(self, rid: str, report: ValidationReport, problems: str = "") -> None:
        super().__init__(f"replica {rid} failed validation: {problems or report.reason}")
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


class ServerDriver(Protocol):
    """What bring-up drives: the agent's `RuntimeClient`, or any `prewarm.adapters.runtimes` adapter."""

    def load(self) -> LoadStatus: ...
    def load_status(self) -> LoadStatus: ...
    def warmup(self, requests: Sequence[WarmupRequest]) -> list[float]: ...
    def validation_inputs(self) -> ValidationInputs: ...
    def mark_ready(self, report: ValidationReport) -> bool: ...


@dataclass(frozen=True)
class BringUpSpec:
    """What varies between bring-ups of one replica."""

    model: str  # registry name (metrics label)
    node: str  # metrics label
    node_class: str  # key of the warm-latency baseline (with the revision)
    served_model: str  # the name the server knows the model by (the warmup requests' `model`)
    expected: Mapping[str, TensorSpec] | None  # the manifest's tensors; None: the server cannot list its own
    started_at: float  # epoch s the cold start is counted from (registration, or a pod's creation)
    require_logprobs: bool = True  # without listed tensors: False accepts a numeric check "unsupported"
    load_timeout_s: float | None = None  # None: only `check` ends a load that never finishes
    label: str = ""  # extra words for the log lines (e.g. "pod=<name>")
    revision: str = ""  # the baseline is per revision: new weights, new baseline
    excluded_s: float = 0.0  # time since started_at that is not the lead (a pod's image pull, recorded apart)
    engine_expect: EngineFacts | None = None  # an external engine (vLLM): validated by workers/node/engine_validation.py


@dataclass(frozen=True)
class BringUpResult:
    replica: Replica
    outcome: PrewarmOutcome
    report: ValidationReport | None = None
    cold_start_s: float | None = None


#: Moves the replica and returns the stored record; callers map a lost race to their own error.
Transition = Callable[[ReplicaState, ReplicaState, str], Replica]


def required_problems(report: ValidationReport, spec: BringUpSpec) -> str:
    """What the report lacks. With listed tensors every check must pass. A server that cannot list them
    may leave structural unsupported, and numeric too when logprobs are not required."""
    if spec.expected is not None:
        return "" if report.passed else report.reason
    may_be_unsupported = {CheckName.STRUCTURAL} | (set() if spec.require_logprobs else {CheckName.NUMERIC})
    bad = [c for c in report.checks
           if c.outcome is Outcome.FAILED or (c.outcome is Outcome.UNSUPPORTED and c.name not in may_be_unsupported)]
    return "; ".join(f"{c.name.value}: {c.detail}" for c in bad)


def bring_up(ctx: WorkerContext, rec: Replica, spec: BringUpSpec, *, connect: Callable[[Replica], ServerDriver],
             transition: Transition, check: Callable[[], None] = lambda: None,
             after_load: Callable[[ServerDriver], None] | None = None, poll_s: float = 0.05) -> BringUpResult:
    """From the registered replica's state (pending, loading or warming) to ready.

    `connect` returns the server once the replica is loading (an agent starts or adopts its
    runtime process there); `check` raises to stop (lock lost, deadline, pod gone) and is
    called between steps and while polling. Raises `ValidationFailed` when a required check
    fails and `TemporaryError` when the server stops answering ready; the replica is left
    where it stopped, for the caller to fail or to resume."""
    rid = rec.id
    if rec.state is ReplicaState.PENDING:
        rec = transition(ReplicaState.LOADING, ReplicaState.PENDING, "")
    if rec.state not in (ReplicaState.LOADING, ReplicaState.WARMING):
        raise PermanentError(f"replica {rid} is in state {rec.state.value}, which a bring-up cannot continue")
    server = connect(rec)
    if rec.state is ReplicaState.LOADING:
        _load(ctx, rid, server, spec, check, poll_s)
        if after_load is not None:
            after_load(server)
        rec = transition(ReplicaState.WARMING, ReplicaState.LOADING, "")
    report = _warm_and_validate(ctx, rid, server, spec, check)
    check()
    if not server.mark_ready(report):
        raise TemporaryError(f"the server of {rid} did not report ready after validation", 1.0)
    check()
    cold = max(0.0, ctx.clock() - spec.started_at - spec.excluded_s)
    # the planner's lead (`load_time_p95`), per revision and node class: recorded before the replica shows ready, so
    # whoever sees it ready (the planner's next round, a test) also sees its lead
    ctx.registry.record_load_time(spec.model, cold, revision=spec.revision, node_class=spec.node_class)
    rec = transition(ReplicaState.READY, ReplicaState.WARMING, report.reason if spec.expected is None else "")
    ctx.metrics.cold_start.labels(spec.model, spec.node).observe(cold)
    log.info("[COLDSTART] replica=%s model=%s node=%s %sstate=ready cold_start_s=%.3f endpoint=%s", rid, spec.model,
             spec.node, f"{spec.label} " if spec.label else "", cold, rec.endpoint)
    return BringUpResult(rec, PrewarmOutcome.READY, report, cold)


def _load(ctx: WorkerContext, rid: str, server: ServerDriver, spec: BringUpSpec, check: Callable[[], None],
          poll_s: float) -> None:
    deadline = None if spec.load_timeout_s is None else time.monotonic() + spec.load_timeout_s
    status = server.load()
    last: tuple[float, LoadPhase] | None = None
    while True:
        check()
        if status.error:
            kind = WeightsError if status.error_kind == WeightsError.reason else PermanentError
            raise kind(f"runtime of {rid} failed to load: {status.error}")
        progress = (1.0, LoadPhase.DONE) if status.loaded else (min(1.0, max(0.0, status.progress)), status.phase)
        if progress != last:
            ctx.registry.set_progress(rid, progress[0], progress[1], now=ctx.clock())
            last = progress
        if status.loaded:
            return
        if deadline is not None and time.monotonic() > deadline:
            from prewarm.adapters.runtimes import RuntimeUnavailable

            raise RuntimeUnavailable(f"the server of {rid} did not load (pass its health check) within "
                                     f"{spec.load_timeout_s}s")
        time.sleep(poll_s)
        status = server.load_status()


def _warm_and_validate(ctx: WorkerContext, rid: str, server: ServerDriver, spec: BringUpSpec,
                       check: Callable[[], None]) -> ValidationReport:
    wcfg = ctx.settings.warmup
    plan = WarmupPlan.from_settings(spec.served_model, wcfg)
    requests = generate_requests(plan, secret=wcfg.require_secret(), now=ctx.clock())
    latencies = server.warmup(requests)
    ctx.metrics.warmup_requests.labels(spec.model, "prewarm").inc(len(requests))
    check()
    if spec.engine_expect is not None:
        return _validate_engine(ctx, rid, cast(EngineServer, server), spec, latencies)
    probe = server.validation_inputs()
    listed = spec.expected is not None
    baseline_of, factor = speed_rule(ctx, spec.model, spec.revision)  # a rollout's canary: the stable's, its ratio
    expected = spec.expected if spec.expected is not None else (probe.expected or {})
    report = validate(expected=expected, live=probe.live,
                      logits=probe.logits, latencies_s=latencies,
                      baseline_s=ctx.registry.baseline(spec.model, spec.node_class, baseline_of),
                      mean_bound=wcfg.logits_mean_bound, latency_factor=factor,
                      allow_unsupported=not listed)
    for c in report.checks:
        ctx.metrics.validation_results.labels(spec.model, c.name.value, c.outcome.value).inc()
    problems = required_problems(report, spec) or _prove_canary(ctx, rid, spec)
    if problems:
        raise ValidationFailed(rid, report, problems)
    if report.record_baseline is not None:  # no baseline yet: this replica's latency is one of its samples
        recorded = ctx.registry.record_baseline_sample(spec.model, spec.node_class, report.record_baseline,
                                                       spec.revision, samples=wcfg.baseline_samples)
        log.info("replica %s recorded a warm-latency sample of %s on %s (%.4fs); baseline %s", rid, spec.model,
                 spec.node_class, report.record_baseline,
                 "not yet made" if recorded is None else f"{recorded:.4f}s (median of {wcfg.baseline_samples})")
    return report


def _prove_canary(ctx: WorkerContext, rid: str, spec: BringUpSpec) -> str:
    """What is wrong with a rollout's canary against a ready stable replica: numerics and speed,
    side by side (`workers.node.canary`); '' when it passes or no rollout to its revision runs."""
    rec = ctx.registry.get(rid)
    if rec is None or not rec.endpoint:
        return ""
    proof = compare_with_stable(ctx, model=spec.model, revision=spec.revision, served_model=spec.served_model,
                                endpoint=rec.endpoint)
    if proof is None:
        return ""
    for c in proof.checks:
        ctx.metrics.validation_results.labels(spec.model, f"canary_{c.name.value}", c.outcome.value).inc()
        log.info("replica %s: canary %s check %s: %s", rid, c.name.value, c.outcome.value, c.detail)
    return proof.problems


def _validate_engine(ctx: WorkerContext, rid: str, server: EngineServer, spec: BringUpSpec,
                     latencies: list[float]) -> ValidationReport:
    assert spec.engine_expect is not None
    where = dict(model=spec.model, revision=spec.revision, node_class=spec.node_class)
    verdict = engine_report(ctx, server, expected=spec.engine_expect, ttft_latencies_s=latencies, **where)
    report = verdict.report
    for c in report.checks:
        ctx.metrics.validation_results.labels(spec.model, c.name.value, c.outcome.value).inc()
    problems = required_problems(report, spec) or _prove_canary(ctx, rid, spec)
    if problems:
        raise ValidationFailed(rid, report, problems)
    outliers = record_engine(ctx, rid, verdict=verdict, **where)
    for other in outliers:
        if other != rid:
            ctx.registry.transition(other, ReplicaState.FAILED, now=ctx.clock(),
                                    reason=f"disagrees with the reference of {spec.model}@{spec.revision}")
    if rid in outliers:
        raise ValidationFailed(rid, report, "numeric: disagrees with the reference its revision's replicas agree on")
    return report


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
        self._hosted: HostedRuntime | None = None  # the runtime process, once bring-up reached it
        self._server_up: tuple[float, float] | None = None  # an external engine spawned here: (spawned, healthy)

    # --- helpers ----------------------------------------------------------------------
    def _check(self, lock: ReplicaLock, hosted: HostedRuntime | None = None) -> None:
        if lock.lost.is_set():
            raise LockLost(f"replica {self.rid} was taken over by another task")
        if time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"prewarm of {self.rid} ran past agent.task_time_limit_s "
                                   f"({self.ctx.settings.agent.task_time_limit_s}s)", retry_after=1.0)
        if hosted is not None and hosted.exit_code() is not None:
            raise RuntimeExited(f"runtime of {self.rid} exited with status {hosted.exit_code()}: "
                                f"{self.ctx.runtimes.log_tail(hosted.slot)}")

    def _transition(self, to: ReplicaState, expected: ReplicaState, reason: str = "") -> Replica:
        rec = self.ctx.registry.transition(self.rid, to, now=self.ctx.clock(), expected=expected, reason=reason)
        self.ctx.runtimes.update(rec)
        return rec

    def _ready_and_hosted(self) -> bool:
        rec = self.ctx.registry.get(self.rid)
        hosted = self.ctx.runtimes.get(self.rid)
        return rec is not None and rec.state is ReplicaState.READY and hosted is not None \
            and hosted.exit_code() is None

    # --- the job ----------------------------------------------------------------------
    def run(self) -> PrewarmResult:
        ref = self.req.replica
        try:
            return self._run()
        finally:  # registered (the registry holds its slot now) or never started: the chooser's reservation ends
            release_slot(self.ctx, ref.node, ref.slot, self.rid)

    def _run(self) -> PrewarmResult:
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
            hosted = ctx.runtimes.get(self.rid)
            if hosted is not None and hosted.exit_code() is None:
                log.info("replica %s is already ready: nothing to do", self.rid)
                return PrewarmResult(self.rid, PrewarmOutcome.ALREADY_READY)
            rec = ctx.registry.transition(self.rid, ReplicaState.FAILED, now=ctx.clock(),
                                          reason="ready in the registry but its runtime is gone")
        if rec is not None and rec.state is ReplicaState.DRAINING:
            log.info("replica %s is draining: not prewarming it again", self.rid)
            return PrewarmResult(self.rid, PrewarmOutcome.SKIPPED)
        if rec is not None and rec.state is ReplicaState.ASLEEP:  # a prewarm of a sleeping replica wakes it
            outcome, seconds = wake_locked(ctx, self.rid)
            if outcome is TierOutcome.READY:
                return PrewarmResult(self.rid, PrewarmOutcome.READY, seconds)
            if outcome is TierOutcome.ALREADY:
                return PrewarmResult(self.rid, PrewarmOutcome.ALREADY_READY)
            if outcome is TierOutcome.NO_MEMORY:
                return PrewarmResult(self.rid, PrewarmOutcome.SKIPPED)
            rec = ctx.registry.get(self.rid)
        if rec is None or rec.state in TERMINAL_STATES:
            now = ctx.clock()
            fresh = Replica(model=ref.model, revision=ref.revision, node=ref.node, slot=ref.slot,
                            endpoint=ctx.runtimes.endpoint_of(ref.slot), pool=self.req.pool,
                            state=ReplicaState.PENDING, created_at=now, updated_at=now, heartbeat_at=now)
            created = ctx.registry.register(fresh, now=now)
            rec = ctx.registry.get(self.rid)
            if rec is None:
                raise TemporaryError(f"replica {self.rid} vanished right after registration", 1.0)
            log.info("replica %s registered %s (state %s)", self.rid, "new" if created else "existing", rec.state.value)
        else:
            log.info("replica %s resumes from state %s", self.rid, rec.state.value)
        if ctx.runtimes.get(self.rid) is None:  # its runtime is not up yet: book its GPU memory first
            admit_load(ctx, self.rid, ref.model, model_dir, self.deadline)
        tier = CACHED if in_snapshot(ctx.settings.runtime.snapshot_dir, f"{ref.model}@{ref.revision}") else DISK

        # Loading starts with the runtime process itself (interpreter, torch, CUDA context).
        def connect(rec: Replica) -> ServerDriver:
            fresh = ctx.runtimes.get(self.rid) is None
            hosted = ctx.runtimes.ensure(rec, str(model_dir), now=ctx.clock())
            spawned_at = ctx.clock()
            if rec.endpoint != hosted.endpoint:
                ctx.registry.set_endpoint(self.rid, hosted.endpoint, now=ctx.clock())
            ctx.runtimes.wait_healthy(hosted, deadline=self.deadline, check=lambda: self._check(lock))
            if fresh and hosted.engine == VLLM:  # the engine's own start: spawn to /health
                self._server_up = (spawned_at, ctx.clock())
            self._hosted = hosted
            return client_for(ctx.settings, hosted)

        external = ctx.settings.engine.engine_of(ref.model) == VLLM
        spec = BringUpSpec(model=ref.model, node=ref.node, node_class=ctx.settings.agent.node_class,
                           served_model=ref.model,
                           expected=None if external else tensor_specs(load_manifest(model_dir).tensors),
                           started_at=rec.created_at, revision=ref.revision,
                           engine_expect=EngineFacts(ref.model, expected_max_context(
                               model_dir, ctx.settings.engine.vllm_max_model_len), expected_dtype(model_dir))
                           if external else None)
        done = bring_up(ctx, rec, spec, connect=connect,
                        transition=lambda to, expected, reason: self._transition(to, expected, reason),
                        check=lambda: self._check(lock, self._hosted), after_load=self._record_phases,
                        poll_s=self.poll_s)
        if done.cold_start_s is not None:  # the catalog's measured time to ready from this tier
            ctx.registry.record_ready_time(ref.model, tier, ctx.settings.agent.node_class, done.cold_start_s)
        if self._server_up is not None and done.outcome is PrewarmOutcome.READY:
            self._record_engine_phases(*self._server_up)
        return PrewarmResult(self.rid, done.outcome, done.cold_start_s)

    def _record_engine_phases(self, spawned_at: float, healthy_at: float) -> None:
        """An external engine's start (spawn to /health) and what warmup and validation added (to ready)."""
        ref, cls = self.req.replica, self.ctx.settings.agent.node_class
        start, added = healthy_at - spawned_at, self.ctx.clock() - healthy_at
        phases = EnginePhases(self.ctx.client)
        phases.record(ref.model, EnginePhases.SERVER_START, cls, start)
        phases.record(ref.model, EnginePhases.WARM_VALIDATE, cls, added)
        log.info("[COLDSTART] replica=%s model=%s node=%s engine=vllm server_start_s=%.3f warm_validate_s=%.3f "
                 "ratio=%.3f", self.rid, ref.model, ref.node, start, added, added / start if start > 0 else 0.0)

    def _record_phases(self, server: ServerDriver) -> None:
        ref = self.req.replica
        if not isinstance(server, RuntimeClient):
            return
        measured = server.gpu_bytes()  # on CUDA: what the runtime's allocator holds, booked when above the estimate
        if measured is not None:
            self.ctx.runtimes.ledger.measured(self.rid, measured)
        phases = server.phase_durations()
        for phase, seconds in phases.items():
            self.ctx.metrics.loading_phase_duration.labels(ref.model, phase, ref.node).observe(seconds)
        log.info("[COLDSTART] replica=%s model=%s node=%s state=loaded load_s=%.3f %s", self.rid, ref.model,
                 ref.node, sum(phases.values()), " ".join(f"{k}_s={v:.3f}" for k, v in phases.items()))


def owner_token(task_id: str) -> str:
    """Who holds a replica lock: host, pid and task id (shown when another task waits for it)."""
    return f"{os.uname().nodename}:{os.getpid()}:{task_id}"


__all__ = ["BringUpResult", "BringUpSpec", "PrewarmJob", "PrewarmOutcome", "PrewarmResult", "ServerDriver",
           "ValidationFailed", "bring_up", "owner_token", "required_problems", "resolve_model_dir"]
