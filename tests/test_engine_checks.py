"""Unit tests of the pure checks of an external engine (prewarm.policy.engine_checks) and of the
engine load merge (prewarm.policy.engine_load)."""

from __future__ import annotations

import pytest

from prewarm.core.errors import InvalidPayload
from prewarm.policy.engine_checks import (
    EngineFacts, SpeedBaseline, check_engine_structure, check_speed, seeded_prompts, speed_record,
)
from prewarm.policy.engine_load import merged_inflight, model_level
from prewarm.policy.validation import CheckName, Outcome

EXPECTED = EngineFacts("chat", 512, "float32")


@pytest.mark.parametrize(
    ("observed", "outcome", "needle"),
    [
        (EngineFacts("chat", 512, "float32"), Outcome.PASSED, "as the manifest says"),
        (EngineFacts("chat", 512, "torch.float32"), Outcome.PASSED, "as the manifest says"),
        (EngineFacts("chat", 512, "bfloat16"), Outcome.FAILED, "dtype is 'bfloat16', expected 'float32'"),
        (EngineFacts("other", 512, "float32"), Outcome.FAILED, "served_name is 'other'"),
        (EngineFacts("chat", 4096, "float32"), Outcome.FAILED, "max_context is 4096"),
        (EngineFacts("chat", 512, None), Outcome.UNSUPPORTED, "does not report dtype"),
        (EngineFacts("chat", None, None), Outcome.UNSUPPORTED, "max_context, dtype"),
    ],
)
def test_structure_table(observed: EngineFacts, outcome: Outcome, needle: str) -> None:
    res = check_engine_structure(EXPECTED, observed)
    assert res.name is CheckName.STRUCTURAL and res.outcome is outcome, res.detail
    assert needle in res.detail


def test_structure_checks_only_what_is_expected() -> None:
    res = check_engine_structure(EngineFacts("chat", None, None), EngineFacts("chat", 99, None))
    assert res.outcome is Outcome.PASSED
    with pytest.raises(InvalidPayload, match="at least one"):
        check_engine_structure(EngineFacts(None, None, None), EXPECTED)


def test_speed_without_baseline_asks_to_record_positive_figures_only() -> None:
    res = check_speed([0.05, 0.02, 0.02], [0.004, 0.005], SpeedBaseline(None, None), factor=2.0)
    assert res.outcome is Outcome.NO_BASELINE
    assert speed_record(res) == pytest.approx({"ttft_s": 0.02, "decode_s_per_token": 0.0045})
    zero = check_speed([0.05, 0.02, 0.02], [0.0, 0.0], SpeedBaseline(None, None), factor=2.0)
    assert speed_record(zero) == {"ttft_s": 0.02}  # a zero decode time cannot be a baseline


@pytest.mark.parametrize(
    ("ttft", "decode", "outcome", "needle"),
    [
        ([0.05, 0.02, 0.02], [0.004, 0.005], Outcome.PASSED, "time to first token"),
        ([0.05, 0.09, 0.09], [0.004, 0.005], Outcome.FAILED, "time to first token: warm latency 90.0 ms"),
        ([0.05, 0.02, 0.02], [0.02, 0.02], Outcome.FAILED, "decode: warm latency 20.0 ms"),
    ],
)
def test_speed_against_a_baseline(ttft: list[float], decode: list[float], outcome: Outcome, needle: str) -> None:
    res = check_speed(ttft, decode, SpeedBaseline(0.02, 0.005), factor=2.0)
    assert res.name is CheckName.PERFORMANCE and res.outcome is outcome, res.detail
    assert needle in res.detail
    assert speed_record(res) == {}


def test_speed_with_one_baseline_missing_compares_the_other() -> None:
    res = check_speed([0.05, 0.09, 0.09], [0.004], SpeedBaseline(0.02, None), factor=2.0)
    assert res.outcome is Outcome.FAILED  # the known figure still fails
    ok = check_speed([0.05, 0.02, 0.02], [0.004], SpeedBaseline(0.02, None), factor=2.0)
    assert ok.outcome is Outcome.NO_BASELINE and speed_record(ok) == {"decode_s_per_token": 0.004}


def test_seeded_prompts_are_stable_and_distinct() -> None:
    a, b = seeded_prompts(0, 6), seeded_prompts(0, 6)
    assert a == b and len(set(a)) == 6
    assert seeded_prompts(1, 6) != a
    with pytest.raises(InvalidPayload):
        seeded_prompts(0, 0)


def test_merged_inflight_takes_the_larger_per_replica() -> None:
    assert merged_inflight({"a": 2, "b": 0}, {}) == {"a": 2, "b": 0}
    assert merged_inflight({"a": 2}, {"a": 1, "b": 5}) == {"a": 2, "b": 5}
    assert model_level({"a": 1, "b": 5, "c": -1}) == 6
