"""Structural and speed checks of an external engine (vLLM, or any OpenAI-compatible server).

An external engine cannot list its tensors, so the built-in structural check (every
manifest tensor live with its shape) cannot run. What it can say about itself is what
serving depends on: the name it serves the model under (the gateway's `model` field must
match it), the longest context it accepts, and the dtype it computes in. Each is compared
with what the manifest and the engine settings expect; a fact the engine does not report
is named as unverified, never passed silently.

Speed of a generative server has two figures: time to first token (the warmup requests,
one token each) and the decode time per token (the probes: greedy continuations of a
fixed length). Both are compared with the baseline recorded for the revision on the node
class, like the built-in's warm latency; the first replica records it.

Also here: the seeded probe prompts, the same for every replica so their answers compare.
No I/O, no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from prewarm.core.errors import InvalidPayload
from prewarm.policy.validation import CheckName, CheckResult, Outcome, check_performance, normalise_dtype

_WORDS = (
    "river", "market", "window", "engine", "garden", "signal", "harbor", "letter", "planet", "silver",
    "forest", "bridge", "number", "winter", "circle", "pocket", "summer", "travel", "mirror", "castle",
)
_OPENERS = ("Tell me about the", "Write a line on the", "Describe a", "Why does the", "A short story of the")


def seeded_prompts(seed: int, n: int) -> list[str]:
    """`n` distinct short prompts drawn from `seed`: the same list for every replica and revision."""
    if n < 1:
        raise InvalidPayload(f"the number of probe prompts must be >= 1, got {n}")
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        p = f"{rng.choice(_OPENERS)} {rng.choice(_WORDS)} and the {rng.choice(_WORDS)}"
        if p not in out:
            out.append(p)
    return out


@dataclass(frozen=True)
class EngineFacts:
    """What an engine serves: None where it does not say."""

    served_name: str | None
    max_context: int | None
    dtype: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"served_name": self.served_name, "max_context": self.max_context, "dtype": self.dtype}


def check_engine_structure(expected: EngineFacts, observed: EngineFacts) -> CheckResult:
    """Served name, max context and dtype as expected. A fact `expected` leaves None is not checked;
    one the engine does not report is UNSUPPORTED (named), a differing one FAILED."""
    wanted = {k: v for k, v in expected.to_dict().items() if v is not None}
    if not wanted:
        raise InvalidPayload("the structural check of an engine needs at least one expected fact")
    got = observed.to_dict()
    mismatched: dict[str, list[Any]] = {}
    unreported: list[str] = []
    for key, want in wanted.items():
        have = got[key]
        if have is None:
            unreported.append(key)
        elif (normalise_dtype(have) != normalise_dtype(want)) if key == "dtype" else have != want:
            mismatched[key] = [want, have]
    measured = {"expected": wanted, "observed": got, "mismatched": mismatched, "unreported": unreported}
    if mismatched:
        text = "; ".join(f"{k} is {v[1]!r}, expected {v[0]!r}" for k, v in mismatched.items())
        return CheckResult(CheckName.STRUCTURAL, Outcome.FAILED, f"the engine serves the wrong model: {text}", measured)
    if unreported:
        return CheckResult(CheckName.STRUCTURAL, Outcome.UNSUPPORTED,
                           f"the engine does not report {', '.join(unreported)}; not verified", measured)
    return CheckResult(CheckName.STRUCTURAL, Outcome.PASSED,
                       "serves " + ", ".join(f"{k}={v!r}" for k, v in wanted.items()) + " as the manifest says", measured)


@dataclass(frozen=True)
class SpeedBaseline:
    """A revision's recorded speed on a node class; either figure may be missing."""

    ttft_s: float | None
    decode_s_per_token: float | None


def check_speed(ttft_latencies_s: Sequence[float], decode_s_per_token: Sequence[float],
                baseline: SpeedBaseline, *, factor: float) -> CheckResult:
    """Time to first token and decode time per token, each <= factor x its baseline.

    Either baseline missing: NO_BASELINE (unless the other figure fails), and
    `measured["record"]` holds the figures to record."""
    ttft = check_performance(ttft_latencies_s, baseline.ttft_s, factor=factor)
    decode = check_performance(decode_s_per_token, baseline.decode_s_per_token, factor=factor)
    measured: dict[str, Any] = {"ttft": dict(ttft.measured), "decode": dict(decode.measured), "factor": factor}
    dm = decode.measured.get("warm_latency_s")
    if isinstance(dm, float) and dm > 0:
        measured["decode_tokens_per_s"] = 1.0 / dm
    # a figure of 0 (a clock too coarse for the step) cannot be a baseline: nothing is recorded for it
    record = {k: float(c.measured["record_baseline"]) for k, c in (("ttft_s", ttft), ("decode_s_per_token", decode))
              if float(c.measured.get("record_baseline", 0.0)) > 0}
    if record:
        measured["record"] = record
    failed = [f"{k}: {c.detail}" for k, c in (("time to first token", ttft), ("decode", decode))
              if c.outcome is Outcome.FAILED]
    if failed:
        return CheckResult(CheckName.PERFORMANCE, Outcome.FAILED, "; ".join(failed), measured)
    if record:
        return CheckResult(CheckName.PERFORMANCE, Outcome.NO_BASELINE,
                           "no speed baseline yet for " + ", ".join(record) + ": this run records it", measured)
    return CheckResult(CheckName.PERFORMANCE, Outcome.PASSED,
                       f"time to first token ({ttft.detail}); decode ({decode.detail})", measured)


def speed_record(result: CheckResult) -> Mapping[str, float]:
    """The figures a speed check asks to record as the baseline (empty when it compared)."""
    rec = result.measured.get("record")
    return dict(rec) if isinstance(rec, Mapping) else {}
