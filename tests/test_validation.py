"""Validation rules: each check passing and failing, and the combined report."""

from __future__ import annotations

import math

import pytest

from prewarm.core.errors import InvalidPayload
from prewarm.policy.validation import (
    CheckName,
    LogitStats,
    Outcome,
    TensorSpec,
    check_numeric,
    check_performance,
    check_structural,
    logit_stats,
    normalise_dtype,
    tensor_specs,
    validate,
    warm_latency,
)

MANIFEST = [
    {"name": "embed.weight", "shape": [256, 32], "dtype": "F32"},
    {"name": "layers.0.attn.qkv.weight", "shape": [96, 32], "dtype": "F32"},
    {"name": "layers.1.attn.qkv.weight", "shape": [96, 32], "dtype": "F32"},
    {"name": "head.weight", "shape": [256, 32], "dtype": "F32"},
]


def _live(**changes: tuple[tuple[int, ...], str] | None) -> dict[str, TensorSpec]:
    live = tensor_specs({t["name"]: (tuple(t["shape"]), "torch.float32") for t in MANIFEST})
    for name, spec in changes.items():
        name = name.replace("__", ".")
        if spec is None:
            del live[name]
        else:
            live[name] = TensorSpec(spec[0], normalise_dtype(spec[1]))
    return live


def test_dtype_spellings_agree() -> None:
    assert normalise_dtype("BF16") == normalise_dtype("torch.bfloat16") == "bfloat16"
    assert normalise_dtype("F8_E4M3") == "float8_e4m3fn"
    assert normalise_dtype("I8") == "int8"


def test_structural_passes_with_count_from_the_manifest() -> None:
    r = check_structural(tensor_specs(MANIFEST), _live())
    assert r.passed and r.outcome is Outcome.PASSED
    assert r.measured["expected"] == len(MANIFEST)
    assert f"all {len(MANIFEST)} manifest tensors" in r.detail


def test_structural_reports_missing_wrong_shape_and_dtype() -> None:
    expected = tensor_specs(MANIFEST)
    r = check_structural(expected, _live(head__weight=None))
    assert not r.passed and r.measured["missing"] == ["head.weight"] and "head.weight" in r.detail
    r = check_structural(expected, _live(embed__weight=((255, 32), "float32")))
    assert not r.passed and "embed.weight" in r.measured["shape_mismatch"] and "[256, 32]" in r.detail
    r = check_structural(expected, _live(embed__weight=((256, 32), "float16")))
    assert not r.passed and r.measured["dtype_mismatch"] == {"embed.weight": ["float32", "float16"]}


def test_structural_extra_tensors_do_not_fail_but_an_empty_manifest_does() -> None:
    live = _live()
    live["rope.cache"] = TensorSpec((16, 8), "float32")
    r = check_structural(tensor_specs(MANIFEST), live)
    assert r.passed and r.measured["extra"] == ["rope.cache"]
    assert check_structural({}, live).outcome is Outcome.FAILED


def test_structural_unsupported_is_not_a_pass() -> None:
    r = check_structural(tensor_specs(MANIFEST), None)
    assert r.outcome is Outcome.UNSUPPORTED and not r.passed


def test_tensor_specs_rejects_malformed_entries() -> None:
    with pytest.raises(InvalidPayload, match="shape"):
        tensor_specs([{"name": "x", "dtype": "F32"}])
    with pytest.raises(InvalidPayload, match="malformed shape"):
        tensor_specs({"x": {"shape": ["a"], "dtype": "F32"}})


def test_numeric_checks() -> None:
    ok = logit_stats([0.5, -1.0, 2.0, 0.1])
    assert check_numeric(ok, mean_bound=1.0).passed
    assert ok.mean == pytest.approx(0.4)
    nan = logit_stats([0.5, math.nan, math.inf])
    r = check_numeric(nan, mean_bound=1.0)
    assert not r.passed and "2 of 3 logits are not finite" in r.detail
    big = logit_stats([100.0, 102.0])
    r = check_numeric(big, mean_bound=50.0)
    assert not r.passed and "exceeds the bound 50" in r.detail
    assert check_numeric(logit_stats([]), mean_bound=1.0).outcome is Outcome.FAILED
    assert check_numeric(None, mean_bound=1.0).outcome is Outcome.UNSUPPORTED
    assert LogitStats.from_dict(ok.to_dict()) == ok
    with pytest.raises(InvalidPayload):
        LogitStats.from_dict({"count": 1})


def test_performance_checks() -> None:
    first = check_performance([0.5, 0.1, 0.1, 0.12], None, factor=1.2)
    # issue 13: without a baseline the check did not pass (it could not fail): it says "no baseline"
    assert first.outcome is Outcome.NO_BASELINE and not first.passed
    assert first.measured["record_baseline"] == pytest.approx(0.1)
    assert "records" in first.detail
    ok = check_performance([0.3, 0.11, 0.115], 0.1, factor=1.2)
    assert ok.passed and ok.measured["ratio"] == pytest.approx(1.125)
    slow = check_performance([0.3, 0.2, 0.2], 0.1, factor=1.2)
    assert not slow.passed and "exceeds 1.2 x baseline" in slow.detail
    assert not check_performance([], 0.1, factor=1.2).passed
    with pytest.raises(InvalidPayload):
        check_performance([0.1], -1.0, factor=1.2)
    assert warm_latency([9.0, 1.0, 2.0, 3.0]) == 2.0  # the cold first request is left out
    assert warm_latency([9.0, 1.0]) == 5.0


def test_report_combines_checks() -> None:
    kwargs = dict(expected=tensor_specs(MANIFEST), logits=logit_stats([0.1, 0.2]), latencies_s=[0.1, 0.1, 0.1],
                  baseline_s=None, mean_bound=50.0, latency_factor=1.2)
    rep = validate(live=_live(), **kwargs)  # type: ignore[arg-type]
    assert rep.passed and rep.record_baseline == pytest.approx(0.1) and rep.reason == "validated"
    bad = validate(live=_live(head__weight=None), **kwargs)  # type: ignore[arg-type]
    assert not bad.passed and [c.name for c in bad.failed] == [CheckName.STRUCTURAL]
    assert bad.reason.startswith("structural:")
    unsup = validate(live=None, **kwargs)  # type: ignore[arg-type]
    assert not unsup.passed
    lenient = validate(live=None, allow_unsupported=True, **kwargs)  # type: ignore[arg-type]
    assert lenient.passed and "structural unsupported" in lenient.reason
    assert lenient.get(CheckName.NUMERIC).passed
    assert lenient.to_dict()["checks"][0]["outcome"] == "unsupported"
