"""Proof before traffic: a canary replica must answer like the stable revision before it is ready.

The validation every replica passes (structure, finite logits, speed against its own
revision's baseline) does not catch a canary whose weights are wrong but bounded (a
corrupted file, a wrong export). While a rollout of the model to this revision runs, bring-up
adds two things:

- the warm-latency check is made against the *stable* revision's recorded baseline on this
  node class, within the rollout's `speed_ratio` (1.2x, the seed's rule, by default), not
  against a baseline the canary would record for itself (`speed_rule`);
- the seeded warmup prompts are sent greedily, with top logprobs, to this replica and to a
  ready replica of the stable revision, and `prewarm.policy.reference.compare_probes`
  compares them within the rollout's `logprob_tolerance` (a new quantisation may move
  logprobs a little; a corrupted file moves them a lot);
- each prompt is also timed on both, one replica then the other, so both see the same load:
  time to first token and decode time per token of a `SPEED_TOKENS` request, as the engine
  timed it (`prewarm.adapters.engine_timing`: a client's wall clock is noise on a loaded
  node). The canary's medians must be within `speed_ratio` of the stable replica's measured
  in the same minute (`prewarm.policy.engine_checks.check_speed`): a slower export is caught
  even where no baseline was recorded on this node class. Both engines export these timers;
  a server that does not is an error that names the metrics it lacks.

The same proof runs for both engines (the built-in runtime and vLLM): both answer the
OpenAI completions API with logprobs. A failed comparison fails the replica's validation
(`ValidationFailed`), which the planner's rollout tick sees as a failed canary replica and
rolls back. No ready stable replica to compare with is a temporary condition: the task is
retried.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from prewarm.adapters.runtimes import OpenAICompatibleAdapter
from prewarm.core.errors import TemporaryError
from prewarm.core.domain import ReplicaState
from prewarm.policy import rollout as rp
from prewarm.policy.engine_checks import SpeedBaseline, check_speed
from prewarm.policy.reference import Probe, Step, compare_probes
from prewarm.policy.validation import CheckName, CheckResult, Outcome
from prewarm.policy.warmup import WarmupPlan, generate_requests
from prewarm.registry.rollouts import RolloutStore
from workers.context import WorkerContext

#: Generated positions compared per prompt, and the top-k logprobs at each: enough to see a
#: corrupted layer (it changes the first token's distribution) at a few forward passes each.
PROBE_TOKENS = 4
PROBE_TOP_K = 5
#: Tokens of the request that times decoding: enough that the decode time outweighs one request's overhead.
SPEED_TOKENS = 16


class NoStableToCompare(TemporaryError):
    """No ready replica of the stable revision answers yet: retry the canary's validation later."""

    reason: ClassVar[str] = "no_stable_reference"


def rollout_for(ctx: WorkerContext, model: str, revision: str) -> rp.RolloutSpec | None:
    """The spec of the running (or paused) rollout of `model` whose canary is `revision`, else None."""
    state = RolloutStore(ctx.client).get(model)
    if state is None or state.phase in rp.TERMINAL or state.spec.canary != revision:
        return None
    return state.spec


def speed_rule(ctx: WorkerContext, model: str, revision: str) -> tuple[str, float]:
    """The revision whose warm-latency baseline a replica of `revision` is held to, and the factor:
    a rollout's canary, to the stable revision's within the rollout's `speed_ratio`."""
    spec = rollout_for(ctx, model, revision)
    if spec is None:
        return revision, ctx.settings.warmup.latency_factor
    return spec.stable, spec.speed_ratio


def probe_from_completion(prompt: str, data: Any) -> Probe:
    """An OpenAI completion answer with `logprobs` as a `Probe` (a missing logprob reads as NaN: it fails)."""
    try:
        lp = data["choices"][0]["logprobs"] or {}
        tokens = lp.get("tokens") or []
        tops = lp.get("top_logprobs") or [{} for _ in tokens]
        steps = tuple(Step(str(tok), {str(t): float(v) if v is not None else math.nan for t, v in (top or {}).items()})
                      for tok, top in zip(tokens, tops))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise TemporaryError(f"the completion answer carries no usable logprobs: {exc!r}") from exc
    return Probe(prompt, steps)


@dataclass(frozen=True)
class TimedProbe:
    """One prompt on one replica: its greedy answer with logprobs, and how fast it was made."""

    probe: Probe
    ttft_s: float | None  # as the engine timed it (None: it timed no request)
    decode_s_per_token: float | None  # first to last token, per token after the first


@dataclass(frozen=True)
class CanaryProof:
    """The canary against a ready stable replica: numerics and speed."""

    numeric: CheckResult
    speed: CheckResult

    @property
    def checks(self) -> tuple[CheckResult, CheckResult]:
        return self.numeric, self.speed

    @property
    def problems(self) -> str:
        return "; ".join(f"canary {c.name.value} check {c.detail}" for c in self.checks if c.outcome is Outcome.FAILED)


def _complete(endpoint: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float) -> tuple[Any, float]:
    req = urllib.request.Request(f"{endpoint}/v1/completions", data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TemporaryError(f"probe of {endpoint} failed: {exc}") from exc
    return data, time.perf_counter() - t0


def timed_probe(endpoint: str, prompt: str, *, served_model: str, token: str | None, timeout_s: float) -> TimedProbe:
    """`prompt` on one replica's OpenAI-compatible server: greedy tokens with top logprobs, then a
    SPEED_TOKENS continuation, timed by the engine itself (`prewarm.adapters.engine_timing`)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    greedy = {"model": served_model, "prompt": prompt, "temperature": 0}
    data, _ = _complete(endpoint, {**greedy, "max_tokens": PROBE_TOKENS, "logprobs": PROBE_TOP_K}, headers, timeout_s)
    server = OpenAICompatibleAdapter(endpoint, token=token, timeout_s=timeout_s)  # the key on every route, /metrics too
    before = server.engine_timers()
    # ignore_eos/min_tokens: vLLM's way to generate exactly max_tokens (the built-in runtime ignores them)
    _complete(endpoint, {**greedy, "max_tokens": SPEED_TOKENS, "min_tokens": SPEED_TOKENS, "ignore_eos": True},
              headers, timeout_s)
    ttft, decode = server.engine_timers().since(before)
    return TimedProbe(probe_from_completion(prompt, data), ttft, decode)


def _timed(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _baseline(values: Sequence[float | None]) -> float | None:
    """The stable replica's median, None when it is not a usable baseline (nothing timed, or 0)."""
    timed = _timed(values)
    m = statistics.median(timed) if timed else 0.0
    return m if m > 0 and math.isfinite(m) else None


def compare_with_stable(ctx: WorkerContext, *, model: str, revision: str, served_model: str,
                        endpoint: str) -> CanaryProof | None:
    """The canary's probes and speed against a ready stable replica's (None: no rollout to this revision runs)."""
    spec = rollout_for(ctx, model, revision)
    if spec is None:
        return None
    stable = sorted((r for r in ctx.registry.replicas_of(model)
                     if r.revision == spec.stable and r.state is ReplicaState.READY and r.endpoint),
                    key=lambda r: r.id)
    if not stable:
        raise NoStableToCompare(f"no ready replica of {model}@{spec.stable} to compare the canary {revision} with")
    wcfg = ctx.settings.warmup
    plan = WarmupPlan.from_settings(served_model, wcfg)
    prompts = [r.prompt for r in generate_requests(plan, secret=wcfg.require_secret(), now=ctx.clock())]
    key = ctx.settings.runtime.api_key
    token = key.get_secret_value() if key is not None else None

    def probe(where: str, prompt: str) -> TimedProbe:
        return timed_probe(where, prompt, served_model=served_model, token=token,
                           timeout_s=ctx.settings.gateway.upstream_timeout_s)

    canary: list[TimedProbe] = []
    reference: list[TimedProbe] = []
    for prompt in prompts:  # one replica then the other, prompt by prompt: both see the same load
        canary.append(probe(endpoint, prompt))
        reference.append(probe(stable[0].endpoint, prompt))
    against = f"against {spec.stable} ({stable[0].id})"
    numeric = compare_probes([t.probe for t in canary], [t.probe for t in reference], tolerance=spec.logprob_tolerance,
                             name=CheckName.NUMERIC)
    measured_now = SpeedBaseline(_baseline([t.ttft_s for t in reference]),
                                 _baseline([t.decode_s_per_token for t in reference]))
    speed = check_speed(_timed([t.ttft_s for t in canary]), _timed([t.decode_s_per_token for t in canary]),
                        measured_now, factor=spec.speed_ratio)
    return CanaryProof(CheckResult(numeric.name, numeric.outcome, f"{against}: {numeric.detail}", numeric.measured),
                       CheckResult(speed.name, speed.outcome, f"{against}, measured side by side: {speed.detail}",
                                   speed.measured))
