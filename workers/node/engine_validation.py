"""Validation of an external engine's replica (vLLM): the three checks, and what they record.

The built-in runtime lists its tensors and logits; an external engine answers over its
OpenAI API only. So here the three checks are:
- structural: served model name, max context and dtype against the manifest and settings
  (`prewarm.policy.engine_checks.check_engine_structure`);
- numeric: greedy tokens and top logprobs of the seeded probe prompts against the
  revision's reference (`prewarm.policy.reference.compare_probes`), within the tolerance of
  the checkpoint's dtype; with no reference yet, the probes become a sample of it;
- performance: time to first token (the warmup requests) and decode time per token (the
  probes) against the revision's baseline on this node class (`check_speed`).

`engine_report` measures and judges; `record_engine` (called only for a replica that
passed) records its speed figures (the baseline is their median over the first
`engine.reference_replicas` replicas) and its reference sample, and builds the reference
once `engine.reference_replicas` samples are in: samples that disagree with it are the
outliers, which the caller fails (the one being validated included).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from prewarm.adapters.vllm import ProbeRun
from prewarm.policy.engine_checks import EngineFacts, check_engine_structure, check_speed, seeded_prompts, speed_record
from prewarm.policy.reference import Probe, build_reference, compare_probes, tolerance_for
from prewarm.policy.validation import Outcome, ValidationReport
from prewarm.registry.references import ReferenceStore
from workers.context import WorkerContext

log = logging.getLogger("prewarm.agent.engine")


class EngineServer(Protocol):
    """A server that answers probes and reports its facts: `VllmAdapter`, or the agent's `VllmClient`."""

    def probes(self, prompts: Sequence[str], *, tokens: int, logprobs: int) -> ProbeRun: ...
    def facts(self) -> EngineFacts: ...


@dataclass(frozen=True)
class EngineVerdict:
    report: ValidationReport
    probes: tuple[Probe, ...]
    tolerance: float


def engine_report(ctx: WorkerContext, server: EngineServer, *, model: str, revision: str, node_class: str,
                  expected: EngineFacts, ttft_latencies_s: Sequence[float]) -> EngineVerdict:
    ecfg = ctx.settings.engine
    adapter = server
    prompts = seeded_prompts(ecfg.probe_seed, ecfg.probe_prompts)
    t0 = time.monotonic()
    run = adapter.probes(prompts, tokens=ecfg.probe_tokens, logprobs=ecfg.probe_logprobs)
    probes = run.probes
    probed = time.monotonic() - t0
    facts = adapter.facts()  # the dtype from the server's start-up line, or its /server_info (asked since /health)
    log.info("%s@%s: warmup %.3fs (%d requests), probes %.3fs (%d prompts, /metrics before and after each), "
             "facts %.3fs", model, revision, sum(ttft_latencies_s), len(ttft_latencies_s), probed, len(prompts),
             time.monotonic() - t0)
    structural = check_engine_structure(expected, facts)
    tol = tolerance_for(expected.dtype or facts.dtype or "float32", ecfg.logprob_tolerance)
    store = ReferenceStore(ctx.client)
    numeric = compare_probes(probes, store.reference(model, revision), tolerance=tol)
    decode = run.decode_s_per_token
    speed = check_speed(ttft_latencies_s, decode, store.speed_baseline(model, node_class, revision),
                        factor=ecfg.speed_factor)
    report = ValidationReport((structural, numeric, speed), allow_unsupported=False)
    return EngineVerdict(report, probes, tol)


def record_engine(ctx: WorkerContext, rid: str, *, model: str, revision: str, node_class: str,
                  verdict: EngineVerdict) -> tuple[str, ...]:
    """Record what a passing replica measured; returns the replicas the new reference names as outliers."""
    store = ReferenceStore(ctx.client)
    speed = verdict.report.checks[2]
    figures = speed_record(speed)
    if figures:
        need = ctx.settings.engine.reference_replicas
        stored = store.record_speed_sample(model, node_class, revision, figures, samples=need)
        log.info("replica %s: speed sample towards the baseline of %s@%s on %s (median of the first %d): %s", rid,
                 model, revision, node_class, need, stored)
    numeric = verdict.report.checks[1]
    if numeric.outcome is not Outcome.NO_BASELINE:
        return ()
    samples = store.add_sample(model, revision, rid, verdict.probes)
    need = ctx.settings.engine.reference_replicas
    if len(samples) < need:
        log.info("replica %s: reference sample %d of %d for %s@%s", rid, len(samples), need, model, revision)
        return ()
    ids = list(samples)
    built = build_reference([samples[r] for r in ids], tolerance=verdict.tolerance)
    store.set_reference_if_absent(model, revision, built.probes)
    outliers = tuple(ids[i] for i in built.outliers)
    log.info("replica %s built the reference of %s@%s from %d replicas; outliers: %s", rid, model, revision,
             len(ids), ", ".join(outliers) or "none")
    return outliers
