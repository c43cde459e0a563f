"""Proof before traffic: a canary replica must answer like the stable revision before it is ready.

The validation every replica passes (structure, finite logits, speed against its own
revision's baseline) does not catch a canary whose weights are wrong but bounded (a
corrupted file, a wrong export). While a rollout of the model to this revision runs, bring-up
adds two things:

- the speed check is made against the *stable* revision's recorded baseline on this node
  class, within the rollout's `speed_ratio` (1.2x, the seed's rule, by default), not against a
  baseline the canary would record for itself;
- the seeded warmup prompts are sent greedily, with top logprobs, to this replica and to a
  ready replica of the stable revision, and `prewarm.policy.reference.compare_probes`
  compares them within the rollout's `logprob_tolerance` (a new quantisation may move
  logprobs a little; a corrupted file moves them a lot).

A failed comparison fails the replica's validation (`ValidationFailed`), which the planner's
rollout tick sees as a failed canary replica and rolls back. No ready stable replica to
compare with is a temporary condition: the task is retried.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any, ClassVar, Sequence

from prewarm.core.errors import TemporaryError
from prewarm.core.domain import ReplicaState
from prewarm.policy import rollout as rp
from prewarm.policy.reference import Probe, Step, compare_probes
from prewarm.policy.validation import CheckName, CheckResult
from prewarm.policy.warmup import WarmupPlan, generate_requests
from prewarm.registry.rollouts import RolloutStore
from workers.context import WorkerContext

#: Generated positions compared per prompt, and the top-k logprobs at each: enough to see a
#: corrupted layer (it changes the first token's distribution) at a few forward passes each.
PROBE_TOKENS = 4
PROBE_TOP_K = 5


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


def fetch_probes(endpoint: str, prompts: Sequence[str], *, served_model: str, token: str | None,
                 timeout_s: float) -> tuple[Probe, ...]:
    """Each prompt's greedy answer with top logprobs, from one replica's OpenAI-compatible server."""
    out = []
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    for prompt in prompts:
        body = json.dumps({"model": served_model, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0,
                           "logprobs": PROBE_TOP_K}).encode()
        req = urllib.request.Request(f"{endpoint}/v1/completions", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                data = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise TemporaryError(f"probe of {endpoint} failed: {exc}") from exc
        out.append(probe_from_completion(prompt, data))
    return tuple(out)


def compare_with_stable(ctx: WorkerContext, *, model: str, revision: str, served_model: str,
                        endpoint: str) -> CheckResult | None:
    """The canary's probes against a ready stable replica's (None: no rollout to this revision runs)."""
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
    timeout = ctx.settings.gateway.upstream_timeout_s
    observed = fetch_probes(endpoint, prompts, served_model=served_model, token=token, timeout_s=timeout)
    reference = fetch_probes(stable[0].endpoint, prompts, served_model=served_model, token=token, timeout_s=timeout)
    result = compare_probes(observed, reference, tolerance=spec.logprob_tolerance, name=CheckName.NUMERIC)
    return CheckResult(result.name, result.outcome, f"against {spec.stable} ({stable[0].id}): {result.detail}",
                       result.measured)
