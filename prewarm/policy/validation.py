"""Validation rules for a warm replica: structural, numeric and performance checks.

"Ready" must mean the replica computes the right thing at the expected speed, not that
some GPU memory is allocated. Each check is a separate pure function over values the
runtime measured (its live tensors, logits statistics, warm latencies) and returns its
own frozen `CheckResult`, so a failure names exactly which rule broke and by how much.

- structural: every tensor of the model's manifest is present in the live model with the
  same shape and dtype. The expected set is whatever the manifest lists — never a
  hard-coded count. A runtime that cannot expose its tensors yields UNSUPPORTED, which is
  reported as such and does not pass silently.
- numeric: every logit finite, |mean| within a configurable bound.
- performance: warm latency <= factor x the baseline recorded for the model on this node
  class; with no baseline yet the check passes and says that this run records it.

No I/O, no clock: the caller supplies every measurement.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from prewarm.core.errors import InvalidPayload


class CheckName(str, Enum):
    STRUCTURAL = "structural"
    NUMERIC = "numeric"
    PERFORMANCE = "performance"


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # the runtime cannot provide what the check needs
    NO_BASELINE = "no_baseline"  # performance: nothing to compare with yet; this run's value becomes the baseline


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict, a one-line reason, and the values it measured."""

    name: CheckName
    outcome: Outcome
    detail: str
    measured: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.outcome is Outcome.PASSED

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name.value, "outcome": self.outcome.value, "passed": self.passed,
                "detail": self.detail, "measured": dict(self.measured)}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # normalised, e.g. "float32", "bfloat16", "int8"


_DTYPE_ALIASES: Mapping[str, str] = {
    "f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
    "float": "float32", "half": "float16", "double": "float64",
    "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
    "long": "int64", "int": "int32", "bool": "bool",
    "f8_e4m3": "float8_e4m3fn", "f8_e4m3fn": "float8_e4m3fn", "f8_e5m2": "float8_e5m2",
}


def normalise_dtype(dtype: object) -> str:
    """One spelling for safetensors ("BF16"), torch ("torch.bfloat16") and plain ("bfloat16") dtypes."""
    text = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


def tensor_specs(items: Mapping[str, Any] | Iterable[Any]) -> dict[str, TensorSpec]:
    """Normalise tensor descriptions to {name: TensorSpec}.

    Accepts a mapping name -> (shape, dtype) or name -> {"shape", "dtype"}, or an iterable
    of objects/dicts with `name`, `shape`, `dtype` (manifest entries).
    """
    out: dict[str, TensorSpec] = {}
    if isinstance(items, Mapping):
        pairs: Iterable[tuple[str, Any]] = items.items()
    else:
        pairs = ((_get(t, "name"), t) for t in items)
    for name, desc in pairs:
        if isinstance(desc, (tuple, list)) and len(desc) == 2 and not isinstance(desc[0], (str, bytes)):
            shape, dtype = desc
        else:
            shape, dtype = _get(desc, "shape"), _get(desc, "dtype")
        try:
            out[str(name)] = TensorSpec(tuple(int(d) for d in shape), normalise_dtype(dtype))
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(f"tensor {name!r} has a malformed shape {shape!r}") from exc
    return out


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        if key not in obj:
            raise InvalidPayload(f"tensor description is missing {key!r}: {obj!r}")
        return obj[key]
    if not hasattr(obj, key):
        raise InvalidPayload(f"tensor description has no {key!r}: {obj!r}")
    return getattr(obj, key)


def check_structural(
    expected: Mapping[str, TensorSpec], live: Mapping[str, TensorSpec] | None, *, max_names: int = 20
) -> CheckResult:
    """Every manifest tensor present in the live model with the same shape and dtype.

    `live is None` means the runtime cannot list its tensors: UNSUPPORTED, not a pass.
    Extra live tensors (buffers the manifest does not list) are reported but do not fail.
    """
    if live is None:
        return CheckResult(
            CheckName.STRUCTURAL, Outcome.UNSUPPORTED,
            "the runtime does not expose its tensors; structure was not verified",
            {"expected": len(expected)},
        )
    if not expected:
        return CheckResult(CheckName.STRUCTURAL, Outcome.FAILED, "the manifest lists no tensors", {"expected": 0})
    missing = sorted(n for n in expected if n not in live)
    shape_bad = sorted(n for n in expected if n in live and live[n].shape != expected[n].shape)
    dtype_bad = sorted(n for n in expected if n in live and live[n].dtype != expected[n].dtype)
    extra = sorted(n for n in live if n not in expected)
    measured: dict[str, Any] = {
        "expected": len(expected),
        "present": len(expected) - len(missing),
        "missing": missing[:max_names],
        "shape_mismatch": {n: [list(expected[n].shape), list(live[n].shape)] for n in shape_bad[:max_names]},
        "dtype_mismatch": {n: [expected[n].dtype, live[n].dtype] for n in dtype_bad[:max_names]},
        "extra": extra[:max_names],
    }
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({_names(missing, max_names)})")
    if shape_bad:
        first = shape_bad[0]
        problems.append(
            f"{len(shape_bad)} with the wrong shape ({first}: expected {list(expected[first].shape)}, "
            f"got {list(live[first].shape)}{', ...' if len(shape_bad) > 1 else ''})"
        )
    if dtype_bad:
        first = dtype_bad[0]
        problems.append(
            f"{len(dtype_bad)} with the wrong dtype ({first}: expected {expected[first].dtype}, "
            f"got {live[first].dtype}{', ...' if len(dtype_bad) > 1 else ''})"
        )
    if problems:
        return CheckResult(CheckName.STRUCTURAL, Outcome.FAILED, "tensors " + "; ".join(problems), measured)
    return CheckResult(
        CheckName.STRUCTURAL, Outcome.PASSED,
        f"all {len(expected)} manifest tensors present with the right shape and dtype", measured,
    )


def _names(names: Sequence[str], limit: int) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


@dataclass(frozen=True)
class LogitStats:
    """Summary of the logits of one probe prompt at the last position."""

    count: int
    nonfinite: int
    mean: float  # over the finite values; nan when none is finite
    std: float
    min: float
    max: float

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-safe: a non-finite summary value (no finite logit at all) travels as null."""
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        return {"count": self.count, "nonfinite": self.nonfinite, "mean": num(self.mean),
                "std": num(self.std), "min": num(self.min), "max": num(self.max)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LogitStats":
        try:
            num = {k: math.nan if data[k] is None else float(data[k]) for k in ("mean", "std", "min", "max")}
            return cls(int(data["count"]), int(data["nonfinite"]), num["mean"], num["std"], num["min"], num["max"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidPayload(f"logit statistics are malformed: {exc!r}") from exc


def logit_stats(values: Iterable[float]) -> LogitStats:
    """Statistics of a flat sequence of logits (pure Python; runtimes compute the same with torch)."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    nan = float("nan")
    if not finite:
        return LogitStats(len(vals), len(vals), nan, nan, nan, nan)
    return LogitStats(
        count=len(vals),
        nonfinite=len(vals) - len(finite),
        mean=statistics.fmean(finite),
        std=statistics.pstdev(finite),
        min=min(finite),
        max=max(finite),
    )


def check_numeric(stats: LogitStats | None, *, mean_bound: float) -> CheckResult:
    """Logits all finite and |mean| <= mean_bound."""
    if not mean_bound > 0:
        raise InvalidPayload(f"logits mean bound must be > 0, got {mean_bound}")
    if stats is None:
        return CheckResult(CheckName.NUMERIC, Outcome.UNSUPPORTED, "the runtime does not expose logits")
    measured = {**stats.to_dict(), "mean_bound": mean_bound}
    if stats.count == 0:
        return CheckResult(CheckName.NUMERIC, Outcome.FAILED, "no logits were produced", measured)
    if stats.nonfinite:
        return CheckResult(
            CheckName.NUMERIC, Outcome.FAILED, f"{stats.nonfinite} of {stats.count} logits are not finite (NaN/inf)", measured
        )
    if abs(stats.mean) > mean_bound:
        return CheckResult(
            CheckName.NUMERIC, Outcome.FAILED, f"|mean logit| {abs(stats.mean):.4g} exceeds the bound {mean_bound:g}", measured
        )
    return CheckResult(
        CheckName.NUMERIC, Outcome.PASSED,
        f"{stats.count} logits finite, mean {stats.mean:.4g} within ±{mean_bound:g}", measured,
    )


def warm_latency(latencies_s: Sequence[float]) -> float:
    """The warm latency of a series of requests: the median, after the first (cold) one when there are >= 3."""
    vals = [float(v) for v in latencies_s]
    if not vals:
        raise InvalidPayload("no latencies to measure")
    bad = [v for v in vals if not math.isfinite(v) or v < 0]
    if bad:
        raise InvalidPayload(f"latencies must be finite and >= 0, got {bad[:3]}")
    return statistics.median(vals[1:] if len(vals) >= 3 else vals)


def check_performance(latencies_s: Sequence[float], baseline_s: float | None, *, factor: float) -> CheckResult:
    """Warm latency <= factor x baseline. With no baseline the outcome is NO_BASELINE (not PASSED: a
    check that cannot fail did not pass), which does not block readiness, and this run's value is
    the one to record: `measured["record_baseline"]`.
    """
    if not factor >= 1:
        raise InvalidPayload(f"latency factor must be >= 1, got {factor}")
    if not latencies_s:
        return CheckResult(CheckName.PERFORMANCE, Outcome.FAILED, "no warm requests were timed", {"samples": 0})
    warm = warm_latency(latencies_s)
    measured: dict[str, Any] = {"warm_latency_s": warm, "samples": len(latencies_s), "factor": factor}
    if baseline_s is None:
        measured["record_baseline"] = warm
        return CheckResult(
            CheckName.PERFORMANCE, Outcome.NO_BASELINE,
            f"no baseline yet: this run records {warm * 1000:.1f} ms as the baseline", measured,
        )
    if not math.isfinite(baseline_s) or baseline_s <= 0:
        raise InvalidPayload(f"latency baseline must be a positive number, got {baseline_s!r}")
    limit = factor * baseline_s
    measured.update(baseline_s=baseline_s, limit_s=limit, ratio=warm / baseline_s)
    if warm > limit:
        return CheckResult(
            CheckName.PERFORMANCE, Outcome.FAILED,
            f"warm latency {warm * 1000:.1f} ms exceeds {factor:g} x baseline {baseline_s * 1000:.1f} ms "
            f"(limit {limit * 1000:.1f} ms)", measured,
        )
    return CheckResult(
        CheckName.PERFORMANCE, Outcome.PASSED,
        f"warm latency {warm * 1000:.1f} ms within {factor:g} x baseline {baseline_s * 1000:.1f} ms", measured,
    )


@dataclass(frozen=True)
class ValidationReport:
    """The three checks together. `passed` needs every check PASSED, or UNSUPPORTED where allowed."""

    checks: tuple[CheckResult, ...]
    allow_unsupported: bool = False

    @property
    def passed(self) -> bool:
        ok = {Outcome.PASSED, Outcome.NO_BASELINE} | ({Outcome.UNSUPPORTED} if self.allow_unsupported else set())
        return bool(self.checks) and all(c.outcome in ok for c in self.checks)

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.outcome is Outcome.FAILED)

    @property
    def unsupported(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.outcome is Outcome.UNSUPPORTED)

    def get(self, name: CheckName) -> CheckResult:
        for c in self.checks:
            if c.name is name:
                return c
        raise KeyError(name.value)

    @property
    def record_baseline(self) -> float | None:
        """The latency the caller should record as the baseline, when the performance check asks for it."""
        for c in self.checks:
            if c.name is CheckName.PERFORMANCE and "record_baseline" in c.measured:
                return float(c.measured["record_baseline"])
        return None

    @property
    def reason(self) -> str:
        """A one-line summary naming the failing (or unsupported) checks."""
        if self.passed:
            extra = "; ".join(f"{c.name.value} unsupported" for c in self.unsupported)
            return "validated" + (f" ({extra})" if extra else "")
        bad = [c for c in self.checks if c.outcome is not Outcome.PASSED]
        return "; ".join(f"{c.name.value}: {c.detail}" for c in bad) or "no checks ran"

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "checks": [c.to_dict() for c in self.checks]}


def validate(
    *,
    expected: Mapping[str, TensorSpec],
    live: Mapping[str, TensorSpec] | None,
    logits: LogitStats | None,
    latencies_s: Sequence[float],
    baseline_s: float | None,
    mean_bound: float,
    latency_factor: float,
    allow_unsupported: bool = False,
) -> ValidationReport:
    """Run all three checks and combine them."""
    return ValidationReport(
        (
            check_structural(expected, live),
            check_numeric(logits, mean_bound=mean_bound),
            check_performance(latencies_s, baseline_s, factor=latency_factor),
        ),
        allow_unsupported=allow_unsupported,
    )
