"""Trace files as they come: format detection and parsing, with every bad row reported.

Traffic history arrives in a handful of public formats (see ``../shared/traces``): request
level CSV with a timestamp column (Azure LLM), JSON lines with millisecond offsets
(Mooncake), and rate series (ServeGen's ``window_start_s,rate_req_per_s``, NASA's
``timestamp,requests`` per minute). This module turns a file into one of two frozen types,
`RequestTrace` (one arrival per request) or `RateTrace` (a rate per window), and leaves
bucketing into history frames to `forecasting.data.history`.

Parsing is vectorised with pandas so the real files load in milliseconds, yet a row that
cannot be read is never dropped silently: it is named as ``file:line: reason``, logged, and
kept in the trace's ``bad_rows``. A file with no usable row is an error, not an empty trace.

Time conventions:
- naive timestamps are read as UTC (NASA's are local time, UTC-4, so its epoch seconds are
  4 h off true UTC; that keeps its calendar features in the server's local time);
- offset-only traces (Mooncake, ServeGen) carry no date, so their offset 0 is placed at the
  Unix epoch (1970-01-01 00:00 UTC, a Thursday) unless the caller passes ``origin=``.
"""

from __future__ import annotations

import csv
import enum
import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from prewarm.core.errors import PermanentError, TemporaryError

log = logging.getLogger(__name__)

#: Rates or counts above this are not traffic but corruption (and would overflow sums).
MAX_VALUE = 1e12
#: Timestamps (epoch or offset seconds) beyond this (year ~5100) are corruption, not traffic.
MAX_ABS_TIME_S = 1e11
#: How many bad rows are logged one by one (all of them are kept in ``bad_rows``).
LOG_BAD_ROWS = 20

_CONTEXT_COLUMNS = ("contexttokens", "context_tokens", "input_tokens", "input_length", "prompt_tokens")
_GENERATED_COLUMNS = (
    "generatedtokens", "generated_tokens", "output_tokens", "output_length", "completion_tokens",
)
_TIME_COLUMNS = ("timestamp", "time", "ts", "arrival_time")


class HistoryError(PermanentError):
    """History cannot be read: missing file, unknown format, no usable rows, bad query."""


class HistoryUnavailable(TemporaryError):
    """The history source (Redis, Prometheus) cannot be reached right now; retry later."""


class TraceFormat(str, enum.Enum):
    """The file formats `detect_format` recognises."""

    REQUEST_CSV = "request_csv"  # one row per request, a timestamp column (Azure LLM)
    REQUEST_JSONL = "request_jsonl"  # one JSON object per request, ms offsets (Mooncake)
    RATE_WINDOWS = "rate_windows"  # window_start_s,rate_req_per_s (ServeGen)
    COUNT_SERIES = "count_series"  # timestamp,requests per regular bucket (NASA)


@dataclass(frozen=True, eq=False)
class RequestTrace:
    """Every request of a trace: arrival seconds from the trace start, sorted.

    ``start_epoch`` is the epoch second of ``t == 0`` (the first request for dated traces,
    the chosen origin for offset-only ones). Token arrays are None when the file has none.
    """

    t: np.ndarray
    context_tokens: np.ndarray | None
    generated_tokens: np.ndarray | None
    source: str
    start_epoch: float = 0.0
    format: TraceFormat = TraceFormat.REQUEST_CSV
    bad_rows: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def span_s(self) -> float:
        return float(self.t[-1] - self.t[0]) if self.t.size else 0.0


@dataclass(frozen=True, eq=False)
class RateTrace:
    """A mean request rate (req/s) per window; windows are ``window_s`` long.

    ``window_start_s`` are seconds from the trace start (the first window starts at 0),
    sorted and unique; ``start_epoch`` is the epoch second of offset 0.
    """

    window_start_s: np.ndarray
    rate: np.ndarray
    window_s: float
    source: str
    start_epoch: float = 0.0
    format: TraceFormat = TraceFormat.RATE_WINDOWS
    bad_rows: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return int(self.rate.size)

    @property
    def span_s(self) -> float:
        return float(self.window_start_s[-1] + self.window_s) if self.rate.size else 0.0

    @property
    def total_requests(self) -> float:
        return float(self.rate.sum() * self.window_s)


# --- reading and detection --------------------------------------------------------------------
def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        raise HistoryError(f"{path}: no such file")
    if not path.is_file():
        raise HistoryError(f"{path}: not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise HistoryError(f"{path}: cannot read: {exc}") from exc
    # Undecodable bytes become U+FFFD, so the row holding them is reported as a bad row.
    text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
    if not text.strip():
        raise HistoryError(f"{path}: the file is empty")
    return text.splitlines()


def _first_content_line(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        if line.strip():
            return i
    return -1


def _header_columns(line: str) -> list[str]:
    return [c.strip().strip('"').strip().lower() for c in line.split(",")]


def _detect(path: Path, lines: list[str]) -> tuple[TraceFormat, int]:
    """The format of a file and the index of its header (or first JSON) line."""
    first = _first_content_line(lines)
    head = lines[first].strip()
    if head.startswith("{"):
        try:
            obj = json.loads(head)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and "timestamp" in obj:
            return TraceFormat.REQUEST_JSONL, first
        raise HistoryError(
            f"{path}:{first + 1}: unknown format: a JSON line without a 'timestamp' field "
            "(expected Mooncake-style JSON lines)"
        )
    cols = _header_columns(head)
    if "window_start_s" in cols and "rate_req_per_s" in cols:
        return TraceFormat.RATE_WINDOWS, first
    if "requests" in cols and any(c in cols for c in _TIME_COLUMNS):
        return TraceFormat.COUNT_SERIES, first
    if any(c in cols for c in _TIME_COLUMNS):
        return TraceFormat.REQUEST_CSV, first
    raise HistoryError(
        f"{path}:{first + 1}: unknown format: header {head[:120]!r}; expected a request CSV "
        "with a TIMESTAMP column, Mooncake JSON lines, 'window_start_s,rate_req_per_s' or "
        "'timestamp,requests'"
    )


def detect_format(path: str | Path) -> TraceFormat:
    """Which `TraceFormat` a file holds, from its header or first JSON line."""
    p = Path(path)
    return _detect(p, _read_lines(p))[0]


# --- helpers shared by the parsers ---------------------------------------------------------------
class _BadRows:
    """Collects ``file:line: reason`` strings and logs the first few."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[tuple[int, str]] = []

    def add(self, line_numbers: np.ndarray | list[int], reason: str) -> None:
        for n in np.asarray(line_numbers, dtype=np.int64).tolist():
            self.items.append((int(n), reason))

    def finish(self) -> tuple[str, ...]:
        self.items.sort()
        out = tuple(f"{self.path.name}:{n}: {reason}" for n, reason in self.items)
        for msg in out[:LOG_BAD_ROWS]:
            log.warning("bad row in %s", msg)
        if len(out) > LOG_BAD_ROWS:
            log.warning("%s: %d bad rows in all (first %d logged)", self.path, len(out), LOG_BAD_ROWS)
        return out


def _split_rows(lines: list[str], header_idx: int, ncols: int, bad: _BadRows) -> tuple[pd.DataFrame, np.ndarray]:
    """Data rows as string columns and their 1-based line numbers; ragged rows are reported.

    The C CSV parser reads the body in one pass (blank lines kept, so row i is line
    header+2+i); only when it refuses the text (a row with too many fields) does the slower
    split-every-line path run, which names each ragged line.
    """
    body = lines[header_idx + 1:]
    first_line = header_idx + 2
    if not body:
        return pd.DataFrame(columns=range(ncols), dtype=object), np.empty(0, dtype=np.int64)
    text = "\n".join(body)
    try:
        parts = pd.read_csv(
            io.StringIO(text), header=None, names=list(range(ncols)), dtype=str,
            keep_default_na=False, na_values=[], skip_blank_lines=False, skipinitialspace=True,
            engine="c", quoting=csv.QUOTE_MINIMAL,
        )
    except (pd.errors.ParserError, ValueError, csv.Error):
        return _split_rows_slow(body, first_line, ncols, bad)
    if len(parts) != len(body):  # a quoted field spanned lines: line numbers would drift
        return _split_rows_slow(body, first_line, ncols, bad)
    numbers = np.arange(first_line, first_line + len(body), dtype=np.int64)
    commas, quoted, blank = _line_shapes(text, len(body))
    # The C parser pads short rows with "", so field counts come from the raw lines; a
    # line with quotes is trusted to the parser (a quoted comma is not a separator).
    ragged = (commas != ncols - 1) & ~quoted & ~blank
    if ragged.any():
        for n, c in zip(numbers[ragged].tolist(), commas[ragged].tolist()):
            bad.add([n], f"expected {ncols} fields, found {c + 1}")
    keep = ~(blank | ragged)
    parts = parts[keep]
    parts.index = range(len(parts))
    return parts, numbers[keep]


def _line_shapes(text: str, n_lines: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per line of ``text``: comma count, whether it has a quote, whether it is blank (vectorised)."""
    buf = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ends = np.append(np.flatnonzero(buf == 10), buf.size)  # each line's end (exclusive)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert ends.size == n_lines

    def per_line(positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)

    commas = per_line(np.flatnonzero(buf == 44))
    quotes = per_line(np.flatnonzero(buf == 34))
    visible = per_line(np.flatnonzero((buf != 32) & (buf != 9) & (buf != 10) & (buf != 13)))
    return commas, quotes > 0, visible == 0


def _split_rows_slow(body: list[str], first_line: int, ncols: int, bad: _BadRows) -> tuple[pd.DataFrame, np.ndarray]:
    series = pd.Series(body, dtype=object)
    numbers = np.arange(first_line, first_line + len(body), dtype=np.int64)
    nonblank = (series.str.strip().str.len() > 0).to_numpy()
    series, numbers = series[nonblank], numbers[nonblank]
    commas = series.str.count(",").to_numpy()
    ragged = commas != ncols - 1
    if ragged.any():
        for n, c in zip(numbers[ragged].tolist(), commas[ragged].tolist()):
            bad.add([n], f"expected {ncols} fields, found {c + 1}")
        series, numbers = series[~ragged], numbers[~ragged]
    if series.empty:
        return pd.DataFrame(columns=range(ncols), dtype=object), numbers
    parts = series.str.split(",", expand=True)
    parts = parts.apply(lambda col: col.str.strip().str.strip('"'))
    parts.index = range(len(parts))
    return parts, numbers


def _to_float(values: pd.Series) -> np.ndarray:
    """Floats from strings, NaN where unreadable (numpy's fast cast first, pandas' coercion if it refuses)."""
    try:
        return values.to_numpy(dtype=object).astype(np.float64)
    except (ValueError, TypeError):
        return pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)


def _in_range(secs: np.ndarray) -> np.ndarray:
    """``secs`` with out-of-range times (beyond MAX_ABS_TIME_S) turned to NaN."""
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(secs) <= MAX_ABS_TIME_S, secs, np.nan)


def _parse_times(values: pd.Series) -> tuple[np.ndarray, bool]:
    """Epoch seconds (NaN where unreadable or out of range) and whether the column held dates."""
    sample = pd.to_numeric(values.iloc[:200], errors="coerce")
    if sample.notna().mean() > 0.5:
        return _in_range(_to_float(values)), False
    parsed = pd.to_datetime(values.str.strip(), format="ISO8601", errors="coerce", utc=True)
    # pandas picks the resolution from the strings (s .. ns); microseconds hold any year
    # pandas can parse without overflow, and keep the Azure traces' 7th digit to 0.1 us.
    stamps = parsed.dt.tz_convert(None).to_numpy().astype("datetime64[us]").astype(np.int64)
    secs = np.where(parsed.isna().to_numpy(), np.nan, stamps / 1e6)
    return _in_range(secs), True


def _parse_tokens(values: pd.Series, numbers: np.ndarray, name: str, bad: _BadRows) -> tuple[np.ndarray, np.ndarray]:
    """Integer token counts and a mask of rows where they are readable (>= 0 integers)."""
    num = _to_float(values)
    ok = np.isfinite(num) & (num >= 0) & (num == np.floor(num)) & (num < 2**53)
    if (~ok).any():
        bad.add(numbers[~ok], f"{name} is not a non-negative integer")
    return np.where(ok, num, 0).astype(np.int64), ok


def _no_rows(path: Path, bad_rows: tuple[str, ...]) -> HistoryError:
    hint = f"; first problem: {bad_rows[0]}" if bad_rows else ""
    return HistoryError(f"{path}: no usable rows ({len(bad_rows)} bad){hint}")


def _sorted_request_trace(
    path: Path, secs: np.ndarray, ctx: np.ndarray | None, gen: np.ndarray | None,
    origin: float, fmt: TraceFormat, bad_rows: tuple[str, ...],
) -> RequestTrace:
    if secs.size == 0:
        raise _no_rows(path, bad_rows)
    order = np.argsort(secs, kind="stable")
    secs = secs[order]
    start = float(secs[0])
    return RequestTrace(
        t=secs - start,
        context_tokens=None if ctx is None else ctx[order],
        generated_tokens=None if gen is None else gen[order],
        source=str(path),
        start_epoch=start + origin,
        format=fmt,
        bad_rows=bad_rows,
    )


# --- parsers ---------------------------------------------------------------------------------------
def _parse_request_csv(path: Path, lines: list[str], header_idx: int, origin: float | None) -> RequestTrace:
    cols = _header_columns(lines[header_idx])
    bad = _BadRows(path)
    parts, numbers = _split_rows(lines, header_idx, len(cols), bad)
    time_col = next(cols.index(c) for c in _TIME_COLUMNS if c in cols)
    secs, dated = _parse_times(parts[time_col]) if len(parts) else (np.empty(0), True)
    ok = np.isfinite(secs)
    if (~ok).any():
        bad.add(numbers[~ok], f"unreadable or out-of-range timestamp {cols[time_col]!r}")
    if not dated:
        neg = ok & (secs < 0)
        if neg.any():
            bad.add(numbers[neg], "negative timestamp")
            ok &= ~neg
    token_arrays: list[np.ndarray | None] = []
    for names, label in ((_CONTEXT_COLUMNS, "context tokens"), (_GENERATED_COLUMNS, "generated tokens")):
        idx = next((cols.index(c) for c in names if c in cols), None)
        if idx is None:
            token_arrays.append(None)
            continue
        # Tokens are checked only on rows whose time is readable, so each row is reported once.
        arr, tok_ok = _parse_tokens(parts[idx][ok], numbers[ok], label, bad)
        full = np.zeros(len(parts), dtype=np.int64)
        full[ok] = arr
        keep = ok.copy()
        keep[ok] = tok_ok
        ok = keep
        token_arrays.append(full)
    bad_rows = bad.finish()
    ctx = token_arrays[0][ok] if token_arrays[0] is not None else None
    gen = token_arrays[1][ok] if token_arrays[1] is not None else None
    # Dated rows carry their own epoch; numeric offsets are placed at `origin` (default 0).
    base = 0.0 if dated else (origin or 0.0)
    return _sorted_request_trace(path, secs[ok], ctx, gen, base, TraceFormat.REQUEST_CSV, bad_rows)


def _parse_request_jsonl(path: Path, lines: list[str], first: int, origin: float | None) -> RequestTrace:
    bad = _BadRows(path)
    secs: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    has_ctx = has_gen = True
    for i in range(first, len(lines)):
        line = lines[i]
        if not line.strip():
            continue
        n = i + 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.add([n], f"not JSON ({exc.msg})")
            continue
        except ValueError as exc:  # valid syntax json refuses, e.g. an integer past Python's digit limit
            bad.add([n], f"not JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            bad.add([n], "not a JSON object")
            continue
        ts = obj.get("timestamp")
        try:
            ms = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else math.nan
        except OverflowError:  # an integer beyond float range
            ms = math.nan
        if not math.isfinite(ms) or ms < 0 or ms / 1000.0 > MAX_ABS_TIME_S:
            bad.add([n], f"timestamp {str(ts)[:40]} is not a non-negative number of milliseconds")
            continue
        c, g = obj.get("input_length"), obj.get("output_length")
        row_ok = True
        for value, label in ((c, "input_length"), (g, "output_length")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                bad.add([n], f"{label} {value!r} is not a non-negative integer")
                row_ok = False
                break
        if not row_ok:
            continue
        has_ctx &= c is not None
        has_gen &= g is not None
        secs.append(ms / 1000.0)
        ctx.append(int(c) if c is not None else 0)
        gen.append(int(g) if g is not None else 0)
    bad_rows = bad.finish()
    return _sorted_request_trace(
        path, np.asarray(secs, dtype=np.float64),
        np.asarray(ctx, dtype=np.int64) if has_ctx else None,
        np.asarray(gen, dtype=np.int64) if has_gen else None,
        origin or 0.0, TraceFormat.REQUEST_JSONL, bad_rows,
    )


def _regular_windows(path: Path, starts: np.ndarray) -> float:
    """The window length of a rate series: the most common spacing of its window starts."""
    if starts.size < 2:
        raise HistoryError(f"{path}: a rate series needs at least two windows to know their length")
    diffs = np.diff(starts)
    values, counts = np.unique(diffs, return_counts=True)
    return float(values[np.argmax(counts)])


def _parse_rates(path: Path, lines: list[str], header_idx: int, fmt: TraceFormat, origin: float | None) -> RateTrace:
    cols = _header_columns(lines[header_idx])
    bad = _BadRows(path)
    parts, numbers = _split_rows(lines, header_idx, len(cols), bad)
    if fmt is TraceFormat.RATE_WINDOWS:
        t_idx, v_idx = cols.index("window_start_s"), cols.index("rate_req_per_s")
        starts = _in_range(_to_float(parts[t_idx])) if len(parts) else np.empty(0)
        dated = False
        value_name = "rate_req_per_s"
    else:
        t_idx = next(cols.index(c) for c in _TIME_COLUMNS if c in cols)
        v_idx = cols.index("requests")
        starts, dated = _parse_times(parts[t_idx]) if len(parts) else (np.empty(0), True)
        value_name = "requests"
    values = _to_float(parts[v_idx]) if len(parts) else np.empty(0)
    t_ok = np.isfinite(starts)
    if (~t_ok).any():
        bad.add(numbers[~t_ok], f"unreadable or out-of-range {cols[t_idx]!r}")
    v_ok = t_ok & np.isfinite(values) & (values >= 0) & (values <= MAX_VALUE)
    if (t_ok & ~v_ok).any():
        bad.add(numbers[t_ok & ~v_ok], f"{value_name} is not a number in [0, {MAX_VALUE:g}]")
    ok = v_ok
    starts, values, numbers = starts[ok], values[ok], numbers[ok]
    order = np.argsort(starts, kind="stable")
    starts, values, numbers = starts[order], values[order], numbers[order]
    dup = np.zeros(starts.size, dtype=bool)
    dup[1:] = starts[1:] == starts[:-1]
    if dup.any():
        bad.add(numbers[dup], "duplicate window start")
        starts, values = starts[~dup], values[~dup]
    bad_rows = bad.finish()
    if starts.size == 0:
        raise _no_rows(path, bad_rows)
    window = _regular_windows(path, starts)
    if window <= 0:
        raise HistoryError(f"{path}: window starts are not increasing")
    rate = values if fmt is TraceFormat.RATE_WINDOWS else values / window
    first = float(starts[0])
    if fmt is TraceFormat.RATE_WINDOWS:
        # Window starts are offsets from the trace start: keep them, place 0 at `origin`.
        return RateTrace(starts, rate, window, str(path), origin or 0.0, fmt, bad_rows)
    base = first if dated else first + (origin or 0.0)
    return RateTrace(starts - first, rate, window, str(path), base, fmt, bad_rows)


# --- public API --------------------------------------------------------------------------------------
def load_trace(path: str | Path, *, origin: float | None = None) -> RequestTrace | RateTrace:
    """Read any supported trace file; request-level formats give a `RequestTrace`, rate series a `RateTrace`.

    ``origin`` is the epoch second given to offset 0 of traces that carry no date.
    """
    p = Path(path)
    lines = _read_lines(p)
    fmt, idx = _detect(p, lines)
    if fmt is TraceFormat.REQUEST_CSV:
        return _parse_request_csv(p, lines, idx, origin)
    if fmt is TraceFormat.REQUEST_JSONL:
        return _parse_request_jsonl(p, lines, idx, origin)
    return _parse_rates(p, lines, idx, fmt, origin)


def load_requests(path: str | Path, *, origin: float | None = None) -> RequestTrace:
    """Read a request-level trace (Azure CSV, Mooncake JSON lines); a rate series is an error."""
    trace = load_trace(path, origin=origin)
    if not isinstance(trace, RequestTrace):
        raise HistoryError(
            f"{path}: is a rate series ({trace.format.value}), not a request-level trace; use load_rates"
        )
    return trace


def load_rates(path: str | Path, *, origin: float | None = None) -> RateTrace:
    """Read a rate series (ServeGen windows, NASA per-minute counts); a request trace is an error."""
    trace = load_trace(path, origin=origin)
    if not isinstance(trace, RateTrace):
        raise HistoryError(
            f"{path}: is a request-level trace ({trace.format.value}), not a rate series; use load_requests"
        )
    return trace
