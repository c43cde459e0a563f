"""Numeric validation of any engine against a reference: probes observed vs probes recorded.

"Finite logits with a sane mean" (validation.check_numeric) passes a replica whose weights
are wrong but bounded: a corrupted copy, a wrong revision, a broken kernel. What catches
those is agreement with a known-good answer. A probe is one seeded prompt run greedily:
the tokens chosen and, at each position, the top log-probabilities the engine reported.
The reference of a revision is built from the probes of its first validated replicas by a
robust statistic (the most common token sequence per prompt, the median of each logprob
over the replicas that agree), so one bad early replica does not become the truth when
several are recorded; the ones that disagree are named as outliers.

Comparing probes within a tolerance (per dtype, or given) answers the existing
`CheckResult` of `prewarm.policy.validation`. Nothing here knows which engine produced the
probes: the same comparison serves a vLLM replica against its revision's reference and a
canary revision against the stable one.

Rules of the comparison, per prompt of the reference:
- the observed probe must exist, and every logprob it reports must be finite;
- at each position the greedy tokens must agree; they may differ only at a near tie (the
  reference ranks the observed token within `tolerance` of its own choice), after which
  the continuations legitimately differ and the prompt's comparison stops there;
- every token both sides list in their top-k agrees within `tolerance`; a token only one
  side lists must lie within `tolerance` of the other side's cut-off (it fell just out).

No I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from prewarm.core.errors import InvalidPayload
from prewarm.policy.validation import CheckName, CheckResult, Outcome, normalise_dtype


@dataclass(frozen=True)
class Step:
    """One generated position: the token chosen and the top-k {token: logprob} reported there."""

    token: str
    top: Mapping[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "top": {t: _json_num(v) for t, v in self.top.items()}}


@dataclass(frozen=True)
class Probe:
    """The greedy answer of an engine to one seeded prompt, identified by `prompt`."""

    prompt: str
    steps: tuple[Step, ...]

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(s.token for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Probe":
        try:
            steps = tuple(
                Step(str(s["token"]), {str(t): _from_json_num(v) for t, v in dict(s["top"]).items()})
                for s in data["steps"]
            )
            return cls(str(data["prompt"]), steps)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidPayload(f"probe is malformed: {exc!r}") from exc


def _json_num(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN; a non-finite logprob travels as null


def _from_json_num(v: Any) -> float:
    return math.nan if v is None else float(v)


def probes_to_json(probes: Sequence[Probe]) -> list[dict[str, Any]]:
    return [p.to_dict() for p in probes]


def probes_from_json(data: Any) -> tuple[Probe, ...]:
    if not isinstance(data, list):
        raise InvalidPayload(f"probes must be a list, got {type(data).__name__}")
    return tuple(Probe.from_dict(d) for d in data)


def tolerance_for(dtype: object, table: Mapping[str, float]) -> float:
    """The logprob tolerance for a dtype (any spelling), from a table keyed by normalised dtype."""
    name = normalise_dtype(dtype)
    norm = {normalise_dtype(k): float(v) for k, v in table.items()}
    if name not in norm:
        raise InvalidPayload(f"no logprob tolerance for dtype {name!r}; known: {sorted(norm)}")
    tol = norm[name]
    if not (math.isfinite(tol) and tol > 0):
        raise InvalidPayload(f"logprob tolerance for {name!r} must be a positive number, got {tol!r}")
    return tol


@dataclass(frozen=True)
class _PromptVerdict:
    compared: int  # positions whose logprobs were compared
    max_diff: float
    diverged_at: int | None  # near tie: position where the continuations split
    problem: str | None


def _compare_top(obs: Mapping[str, float], ref: Mapping[str, float], tol: float) -> tuple[float, str | None]:
    """Max |diff| over the tokens both list, and the first violation (or None)."""
    worst = 0.0
    for tok in obs.keys() & ref.keys():
        d = abs(obs[tok] - ref[tok])
        worst = max(worst, d)
        if d > tol:
            return worst, f"logprob of {tok!r} is {obs[tok]:.4g}, reference {ref[tok]:.4g} (|diff| {d:.3g} > {tol:g})"
    for only, other, side in ((ref.keys() - obs.keys(), obs, "observed"), (obs.keys() - ref.keys(), ref, "reference")):
        if not only or not other:
            continue
        cutoff = min(other.values())
        src = ref if side == "observed" else obs
        for tok in only:
            if src[tok] > cutoff + tol:
                return worst, (f"{tok!r} (logprob {src[tok]:.4g}) is missing from the {side} top-{len(other)} "
                               f"whose lowest is {cutoff:.4g}")
    return worst, None


def _compare_prompt(obs: Probe, ref: Probe, tol: float) -> _PromptVerdict:
    worst = 0.0
    for i, r in enumerate(ref.steps):
        if i >= len(obs.steps):
            return _PromptVerdict(i, worst, None, f"{len(obs.steps)} tokens, reference {len(ref.steps)}")
        o = obs.steps[i]
        bad = [t for t, v in o.top.items() if not math.isfinite(v)]
        if bad:
            return _PromptVerdict(i, worst, None, f"position {i}: non-finite logprob for {bad[0]!r}")
        if o.token != r.token:
            chosen = r.top.get(r.token)
            alt = r.top.get(o.token)
            if chosen is not None and alt is not None and chosen - alt <= tol:
                return _PromptVerdict(i, worst, i, None)  # a near tie: both choices are right
            gap = "not in its top" if alt is None or chosen is None else f"logprob gap {chosen - alt:.3g} > {tol:g}"
            return _PromptVerdict(i, worst, None, f"position {i}: token {o.token!r}, reference {r.token!r} ({gap})")
        d, problem = _compare_top(o.top, r.top, tol)
        worst = max(worst, d)
        if problem:
            return _PromptVerdict(i, worst, None, f"position {i}: {problem}")
    return _PromptVerdict(len(ref.steps), worst, None, None)


def compare_probes(
    observed: Sequence[Probe], reference: Sequence[Probe] | None, *, tolerance: float,
    name: CheckName = CheckName.NUMERIC,
) -> CheckResult:
    """Observed probes against reference probes, logprobs within `tolerance`.

    `reference is None` (nothing recorded yet): NO_BASELINE, and `measured["record_reference"]`
    says these probes are to be recorded. Every observed logprob must be finite either way.
    """
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise InvalidPayload(f"logprob tolerance must be a positive number, got {tolerance!r}")
    if not observed:
        return CheckResult(name, Outcome.FAILED, "no probes were observed", {"prompts": 0})
    by_prompt = {p.prompt: p for p in observed}
    if len(by_prompt) != len(observed):
        raise InvalidPayload("observed probes repeat a prompt")
    for p in observed:
        if not p.steps:
            return CheckResult(name, Outcome.FAILED, f"probe {p.prompt!r} produced no tokens", {"prompts": len(observed)})
        for i, s in enumerate(p.steps):
            if any(not math.isfinite(v) for v in s.top.values()):
                return CheckResult(name, Outcome.FAILED, f"probe {p.prompt!r} position {i}: non-finite logprob",
                                   {"prompts": len(observed)})
    if reference is None:
        return CheckResult(
            name, Outcome.NO_BASELINE,
            f"no reference yet: these {len(observed)} probes are recorded toward it",
            {"prompts": len(observed), "tolerance": tolerance, "record_reference": True},
        )
    if not reference:
        raise InvalidPayload("the reference holds no probes")
    compared = 0
    worst = 0.0
    diverged: dict[str, int] = {}
    problems: list[str] = []
    for ref in reference:
        obs = by_prompt.get(ref.prompt)
        if obs is None:
            problems.append(f"probe {ref.prompt!r} was not observed")
            continue
        v = _compare_prompt(obs, ref, tolerance)
        compared += v.compared
        worst = max(worst, v.max_diff)
        if v.diverged_at is not None:
            diverged[ref.prompt] = v.diverged_at
        if v.problem:
            problems.append(f"probe {ref.prompt!r} {v.problem}")
    measured: dict[str, Any] = {
        "prompts": len(reference), "positions_compared": compared, "max_abs_diff": worst,
        "tolerance": tolerance, "near_ties": diverged, "mismatched": len(problems),
    }
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Outcome.FAILED, f"disagrees with the reference: {problems[0]}{more}", measured)
    return CheckResult(
        name, Outcome.PASSED,
        f"{len(reference)} probes agree with the reference: {compared} positions, "
        f"max |logprob diff| {worst:.3g} <= {tolerance:g}", measured,
    )


@dataclass(frozen=True)
class Reference:
    """The reference built from several replicas' probes, and which samples disagreed with it."""

    probes: tuple[Probe, ...]
    samples: int
    outliers: tuple[int, ...]  # indices of the samples that fail compare_probes against `probes`


def build_reference(samples: Sequence[Sequence[Probe]], *, tolerance: float) -> Reference:
    """The robust reference of several replicas' probes of the same prompts.

    Per prompt: the most common greedy token sequence (ties: the first sample's), and at each
    position, for each token listed by at least half the agreeing samples, the median logprob.
    """
    if not samples:
        raise InvalidPayload("a reference needs at least one sample")
    prompts = [p.prompt for p in samples[0]]
    for i, s in enumerate(samples):
        if sorted(p.prompt for p in s) != sorted(prompts):
            raise InvalidPayload(f"sample {i} probes other prompts than sample 0")
    out: list[Probe] = []
    for prompt in prompts:
        probes = [next(p for p in s if p.prompt == prompt) for s in samples]
        seqs = Counter(p.tokens for p in probes)
        best = max(seqs.values())
        mode = next(p.tokens for p in probes if seqs[p.tokens] == best)
        agree = [p for p in probes if p.tokens == mode]
        steps = []
        for pos, tok in enumerate(mode):
            tops = [p.steps[pos].top for p in agree]
            names = Counter(t for top in tops for t in top)
            need = math.ceil(len(tops) / 2)
            steps.append(Step(tok, {t: statistics.median(top[t] for top in tops if t in top)
                                    for t, n in names.items() if n >= need}))
        out.append(Probe(prompt, tuple(steps)))
    ref = tuple(out)
    outliers = tuple(i for i, s in enumerate(samples) if not compare_probes(s, ref, tolerance=tolerance).passed)
    return Reference(ref, len(samples), outliers)
