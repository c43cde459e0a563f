"""Unit tests of prewarm.policy.reference: probes observed vs a reference, within a tolerance."""

from __future__ import annotations

import json
import math

import pytest

from prewarm.core.errors import InvalidPayload
from prewarm.policy.reference import (
    Probe, Step, build_reference, compare_probes, probes_from_json, probes_to_json, tolerance_for,
)
from prewarm.policy.validation import CheckName, Outcome


def probe(prompt: str, *steps: tuple[str, dict[str, float]]) -> Probe:
    return Probe(prompt, tuple(Step(t, top) for t, top in steps))


A = probe("p0", ("a", {"a": -0.1, "b": -2.5, "c": -3.0}), ("x", {"x": -0.5, "y": -1.2, "z": -4.0}))
B = probe("p1", ("k", {"k": -0.05, "l": -3.1, "m": -3.2}))
REF = (A, B)


def shifted(p: Probe, delta: float) -> Probe:
    return Probe(p.prompt, tuple(Step(s.token, {t: v + delta for t, v in s.top.items()}) for s in p.steps))


@pytest.mark.parametrize(
    ("observed", "outcome", "needle"),
    [
        ((A, B), Outcome.PASSED, "2 probes agree"),
        ((shifted(A, 0.009), B), Outcome.PASSED, "2 probes agree"),
        ((shifted(A, 0.05), B), Outcome.FAILED, "|diff|"),
        ((A,), Outcome.FAILED, "'p1' was not observed"),
        ((probe("p0", ("b", {"b": -0.1, "a": -2.5})), B), Outcome.FAILED, "token 'b', reference 'a'"),
        ((probe("p0", ("a", {"a": math.nan, "b": -2.5})), B), Outcome.FAILED, "non-finite"),
        ((probe("p0", ("a", {"a": -0.1, "b": -2.5, "c": -3.0})), B), Outcome.FAILED, "1 tokens, reference 2"),
        # "b" is in the reference's top-3 at -2.5 but missing from the observed top whose cut-off is -3.5
        ((probe("p0", ("a", {"a": -0.1, "c": -3.0, "q": -3.5}), ("x", {"x": -0.5, "y": -1.2, "z": -4.0})), B),
         Outcome.FAILED, "'b' (logprob -2.5) is missing from the observed top"),
    ],
)
def test_compare_table(observed: tuple[Probe, ...], outcome: Outcome, needle: str) -> None:
    res = compare_probes(observed, REF, tolerance=0.01)
    assert res.name is CheckName.NUMERIC
    assert res.outcome is outcome, res.detail
    assert needle in res.detail


def test_token_just_out_of_top_k_is_not_a_mismatch() -> None:
    # "c" (-3.0 in the reference) fell out of the observed top-3 in favour of "d" at -2.995: a rank swap at the edge
    obs = probe("p0", ("a", {"a": -0.1, "b": -2.5, "d": -2.995}), ("x", {"x": -0.5, "y": -1.2, "z": -4.0}))
    res = compare_probes((obs, B), REF, tolerance=0.01)
    assert res.passed, res.detail


def test_near_tie_divergence_passes_and_stops_the_prompt() -> None:
    ref = probe("t", ("a", {"a": -0.690, "b": -0.695}), ("q", {"q": -0.1}))
    obs = probe("t", ("b", {"b": -0.692, "a": -0.693}), ("r", {"r": -9.0}))
    res = compare_probes([obs], [ref], tolerance=0.01)
    assert res.passed, res.detail
    assert res.measured["near_ties"] == {"t": 0}
    far = probe("t", ("a", {"a": -0.1, "b": -3.0}), ("q", {"q": -0.1}))
    assert compare_probes([obs], [far], tolerance=0.01).outcome is Outcome.FAILED


def test_no_reference_is_no_baseline_and_asks_to_record() -> None:
    res = compare_probes(REF, None, tolerance=0.01)
    assert res.outcome is Outcome.NO_BASELINE
    assert res.measured["record_reference"] is True
    # even with nothing to compare with, broken numbers fail
    bad = compare_probes([probe("p0", ("a", {"a": math.inf}))], None, tolerance=0.01)
    assert bad.outcome is Outcome.FAILED


def test_given_check_name_for_other_callers() -> None:
    assert compare_probes(REF, REF, tolerance=0.1, name=CheckName.PERFORMANCE).name is CheckName.PERFORMANCE


@pytest.mark.parametrize("tol", [0.0, -1.0, math.nan, math.inf])
def test_bad_tolerance_is_named(tol: float) -> None:
    with pytest.raises(InvalidPayload, match="tolerance"):
        compare_probes(REF, REF, tolerance=tol)


def test_empty_observation_fails_and_repeats_are_rejected() -> None:
    assert compare_probes([], REF, tolerance=0.1).outcome is Outcome.FAILED
    with pytest.raises(InvalidPayload, match="repeat"):
        compare_probes([A, A], REF, tolerance=0.1)


def test_build_reference_is_robust_to_one_bad_sample() -> None:
    bad_a = probe("p0", ("z", {"z": -0.2, "a": -4.0}), ("x", {"x": -0.5}))
    samples = [[shifted(A, 0.004), B], [bad_a, B], [shifted(A, -0.002), B]]
    ref = build_reference(samples, tolerance=0.01)
    assert ref.samples == 3
    assert ref.outliers == (1,)
    p0 = next(p for p in ref.probes if p.prompt == "p0")
    assert p0.tokens == ("a", "x")
    assert p0.steps[0].top["a"] == pytest.approx(-0.099)  # the median of the two that agree: -0.096 and -0.102
    assert compare_probes([A, B], ref.probes, tolerance=0.01).passed


def test_build_reference_single_sample_is_itself() -> None:
    ref = build_reference([REF], tolerance=0.01)
    assert ref.outliers == ()
    assert ref.probes == REF


def test_build_reference_rejects_mismatched_prompts() -> None:
    with pytest.raises(InvalidPayload, match="sample 1"):
        build_reference([[A, B], [A]], tolerance=0.01)
    with pytest.raises(InvalidPayload, match="at least one"):
        build_reference([], tolerance=0.01)


def test_json_round_trip_keeps_non_finite_as_null() -> None:
    p = probe("p", ("a", {"a": -0.1, "b": -math.inf}))
    text = json.dumps(probes_to_json([p]))
    assert "null" in text
    back = probes_from_json(json.loads(text))
    assert back[0].steps[0].top["a"] == -0.1 and math.isnan(back[0].steps[0].top["b"])
    with pytest.raises(InvalidPayload, match="malformed"):
        probes_from_json([{"prompt": "p"}])
    with pytest.raises(InvalidPayload, match="list"):
        probes_from_json({"prompt": "p"})


def test_tolerance_for_dtype_any_spelling() -> None:
    table = {"float32": 0.02, "bf16": 0.15}
    assert tolerance_for("torch.float32", table) == 0.02
    assert tolerance_for("BF16", table) == 0.15
    with pytest.raises(InvalidPayload, match="float16"):
        tolerance_for("half", table)
