"""History frames: every traffic source becomes one long frame of (model, ts, requests).

The forecaster learns from counts per time bucket, whatever produced them: a trace file
(see `forecasting.data.traces` for the formats), the gateway's own per-bucket counters in Redis
(the loop closes: what the gateway served is the next forecast's history), or a Prometheus
range query. All of them come out in the same shape:

- a pandas DataFrame with columns ``model`` (str), ``ts`` (float, bucket start in epoch
  seconds) and ``requests`` (float, requests in the bucket), every bucket present (a quiet
  bucket is a 0, not a missing row), sorted by model then ts;
- ``frame.attrs``: ``bucket_s`` (bucket size), ``source`` (where it came from) and
  ``bad_rows`` (``"file:line: reason"`` strings for every row that could not be used).

`rate_series` turns a frame into the req/s series the forecasters take.

This module does I/O (files, Redis through a client the caller passes, HTTP to Prometheus)
and makes no decisions; it never imports the redis library at module level, so pure code
may import its types.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.parse
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol

import numpy as np
import pandas as pd

from prewarm.core import http, keys
from forecasting.data.traces import (
    HistoryError,
    HistoryUnavailable,
    RateTrace,
    RequestTrace,
    TraceFormat,
    detect_format,
    load_rates,
    load_requests,
    load_trace,
)

__all__ = [
    "HistoryError", "HistoryUnavailable", "RateTrace", "RequestTrace", "TraceFormat",
    "detect_format", "load_trace", "load_requests", "load_rates", "load_file", "load_redis",
    "redis_models", "load_prometheus", "DEFAULT_PROMETHEUS_QUERY", "make_frame", "rate_series", "requests_frame",
    "rates_frame", "FRAME_COLUMNS", "counter_resolution", "load_fine_counters",
]

log = logging.getLogger(__name__)

FRAME_COLUMNS = ("model", "ts", "requests")
#: Keys per MGET round trip when reading gateway counters.
MGET_CHUNK = 1000


# --- frames ---------------------------------------------------------------------------------------
def make_frame(
    model: str, ts: np.ndarray, requests: np.ndarray, *, bucket_s: float, source: str,
    bad_rows: Iterable[str] = (),
) -> pd.DataFrame:
    """A history frame for one model from bucket starts and counts (validated, sorted)."""
    ts = np.asarray(ts, dtype=np.float64)
    requests = np.asarray(requests, dtype=np.float64)
    if ts.shape != requests.shape:
        raise HistoryError(f"{source}: {ts.size} bucket starts but {requests.size} counts")
    if not np.all(np.isfinite(ts)) or not np.all(np.isfinite(requests)) or np.any(requests < 0):
        raise HistoryError(f"{source}: bucket starts and counts must be finite and counts >= 0")
    if not bucket_s > 0:
        raise HistoryError(f"{source}: bucket_s must be positive, got {bucket_s}")
    order = np.argsort(ts, kind="stable")
    frame = pd.DataFrame({"model": model, "ts": ts[order], "requests": requests[order]})
    frame["model"] = frame["model"].astype(object)
    frame.attrs["bucket_s"] = float(bucket_s) if not float(bucket_s).is_integer() else int(bucket_s)
    frame.attrs["source"] = source
    frame.attrs["bad_rows"] = list(bad_rows)
    return frame


#: More buckets than this in one frame is a mistake (a stray timestamp decades away), not history.
MAX_BUCKETS = 20_000_000


def _check_bucket_count(count: float, what: str) -> None:
    if not count <= MAX_BUCKETS:
        raise HistoryError(f"{what}: {count:.3g} buckets is more than {MAX_BUCKETS:,}; a stray timestamp or a too-small bucket")


def _bucket_grid(first_ts: float, last_ts: float, bucket_s: float, source: str = "history") -> np.ndarray:
    """Bucket starts (multiples of bucket_s) covering [first_ts, last_ts]."""
    lo = math.floor(first_ts / bucket_s)
    hi = math.floor(last_ts / bucket_s)
    _check_bucket_count(hi - lo + 1, source)
    return np.arange(lo, hi + 1, dtype=np.float64) * bucket_s


def requests_frame(trace: RequestTrace, *, model: str = "default", bucket_s: float = 60) -> pd.DataFrame:
    """Count a request trace's arrivals per bucket (buckets aligned to multiples of bucket_s)."""
    if not bucket_s > 0:
        raise HistoryError(f"{trace.source}: bucket_s must be positive, got {bucket_s}")
    abs_t = trace.start_epoch + trace.t
    grid = _bucket_grid(float(abs_t[0]), float(abs_t[-1]), bucket_s, trace.source)
    idx = np.floor(abs_t / bucket_s).astype(np.int64) - int(round(grid[0] / bucket_s))
    counts = np.bincount(np.clip(idx, 0, grid.size - 1), minlength=grid.size).astype(np.float64)
    return make_frame(model, grid, counts, bucket_s=bucket_s, source=trace.source, bad_rows=trace.bad_rows)


def rates_frame(trace: RateTrace, *, model: str = "default", bucket_s: float = 60) -> pd.DataFrame:
    """Requests per bucket from a rate series, resampled honestly when bucket_s != window_s.

    Each window holds rate × window_s requests, assumed spread evenly over the window (the
    only assumption a mean rate allows); a bucket gets the share of every window it
    overlaps. Aligned multiples are exact: 60 s NASA windows summed into 600 s buckets
    give the same counts as summing the file. Missing windows count as zero traffic.
    """
    if not bucket_s > 0:
        raise HistoryError(f"{trace.source}: bucket_s must be positive, got {bucket_s}")
    starts = trace.start_epoch + trace.window_start_s
    ends = starts + trace.window_s
    if np.any(starts[1:] < ends[:-1] - 1e-9 * max(1.0, trace.window_s)):
        raise HistoryError(f"{trace.source}: windows overlap (irregular window starts)")
    counts = trace.rate * trace.window_s
    # Piecewise-linear cumulative count through every window's start and end.
    xs = np.empty(2 * starts.size)
    ys = np.empty(2 * starts.size)
    cum = np.concatenate([[0.0], np.cumsum(counts)])
    xs[0::2], xs[1::2] = starts, ends
    ys[0::2], ys[1::2] = cum[:-1], cum[1:]
    grid = _bucket_grid(float(starts[0]), float(ends[-1]) - 1e-9 * trace.window_s, bucket_s, trace.source)
    edges = np.append(grid, grid[-1] + bucket_s)
    per_bucket = np.diff(np.interp(edges, xs, ys))
    per_bucket = np.clip(per_bucket, 0.0, None)  # float noise around exact zeros
    return make_frame(model, grid, per_bucket, bucket_s=bucket_s, source=trace.source, bad_rows=trace.bad_rows)


def load_file(path: str | Path, *, model: str = "default", bucket_s: int = 60, origin: float | None = None) -> pd.DataFrame:
    """Any supported trace file as a history frame of ``bucket_s`` buckets.

    ``origin`` is the epoch second placed at offset 0 of traces that carry no date
    (Mooncake, ServeGen); by default the Unix epoch. Bad rows are in ``attrs["bad_rows"]``.
    """
    trace = load_trace(path, origin=origin)
    if isinstance(trace, RequestTrace):
        return requests_frame(trace, model=model, bucket_s=bucket_s)
    return rates_frame(trace, model=model, bucket_s=bucket_s)


def rate_series(frame: pd.DataFrame, model: str | None = None, bucket_s: int | None = None) -> pd.Series:
    """Requests per second per bucket of one model, indexed by bucket start (float epoch s).

    The index is regular (every bucket from the first to the last, gaps filled with 0).
    ``bucket_s`` coarser than the frame's must be a whole multiple of it (counts are summed);
    finer buckets cannot be made from counts and are refused.
    """
    missing = [c for c in FRAME_COLUMNS if c not in frame.columns]
    if missing:
        raise HistoryError(f"not a history frame: missing column(s) {missing}")
    models = pd.unique(frame["model"])
    if model is None:
        if len(models) != 1:
            raise HistoryError(f"the frame holds {len(models)} models {list(models)[:10]}; name one")
        model = str(models[0])
    sub = frame[frame["model"] == model]
    if sub.empty:
        raise HistoryError(f"the frame has no rows for model {model!r} (it has {list(models)[:10]})")
    base = frame.attrs.get("bucket_s")
    ts = sub["ts"].to_numpy(dtype=np.float64)
    if base is None:
        diffs = np.diff(np.unique(ts))
        if diffs.size == 0:
            raise HistoryError("one bucket and no attrs['bucket_s']: cannot tell the bucket size")
        base = float(diffs.min())
    base = float(base)
    target = float(bucket_s) if bucket_s is not None else base
    ratio = target / base
    if ratio < 1 - 1e-9 or abs(ratio - round(ratio)) > 1e-9:
        raise HistoryError(
            f"cannot resample {base:g} s buckets to {target:g} s: the new size must be a whole multiple"
        )
    # Buckets are counted from the first one, so unaligned starts (a Prometheus range) keep their phase.
    ts0 = float(ts.min())
    idx = np.floor((ts - ts0) / target + 1e-9).astype(np.int64)
    n = int(idx.max()) + 1
    counts = np.bincount(idx, weights=sub["requests"].to_numpy(dtype=np.float64), minlength=n)
    index = pd.Index(ts0 + np.arange(n, dtype=np.float64) * target, name="ts")
    return pd.Series(counts / target, index=index, name=model)


# --- the gateway's counters in Redis -----------------------------------------------------------------
class _RedisLike(Protocol):
    def mget(self, keys: list[str]) -> list[Any]: ...
    def smembers(self, name: str) -> Any: ...
    def sismember(self, name: str, value: str) -> Any: ...


def _text(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _redis_call(what: str, fn: Any, *args: Any) -> Any:
    try:
        from redis import exceptions as rexc
    except ImportError:  # a client from elsewhere: let its errors through unchanged
        return fn(*args)
    try:
        return fn(*args)
    except (rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError) as exc:
        raise HistoryUnavailable(f"Redis unavailable while {what}: {exc}", retry_after=5.0) from exc
    except rexc.RedisError as exc:
        raise HistoryError(f"Redis refused {what}: {exc}") from exc


def redis_models(client: _RedisLike) -> list[str]:
    """Model names the gateway has counted requests for (sorted)."""
    members = _redis_call("reading the model set", client.smembers, keys.REQUEST_MODELS)
    return sorted(_text(m) for m in members)


def load_redis(client: _RedisLike, model: str, *, resolution_s: int, start: float, end: float) -> pd.DataFrame:
    """The gateway's per-bucket request counters of one model as a history frame.

    Buckets whose start lies in [start, end) are read (start is rounded down to the
    resolution); a missing key is a bucket with no requests. A value that is not a
    non-negative integer is reported in ``attrs["bad_rows"]`` as ``redis:<key>: reason``
    and counted as 0. A model the gateway never counted (not in REQUEST_MODELS, no keys)
    is an error naming the models it does know.
    """
    if resolution_s <= 0:
        raise HistoryError(f"resolution_s must be positive, got {resolution_s}")
    if not end > start:
        raise HistoryError(f"empty time range: start {start} is not before end {end}")
    first = math.floor(start / resolution_s) * resolution_s
    _check_bucket_count((end - first) / resolution_s, f"redis counters of {model!r}")
    bucket_starts = np.arange(first, end, resolution_s, dtype=np.int64)
    names = [keys.requests(model, resolution_s, int(b)) for b in bucket_starts]
    counts = np.zeros(bucket_starts.size, dtype=np.float64)
    bad: list[str] = []
    seen_any = False
    for lo in range(0, len(names), MGET_CHUNK):
        chunk = names[lo:lo + MGET_CHUNK]
        values = _redis_call(f"reading counters of {model!r}", client.mget, chunk)
        for j, v in enumerate(values):
            if v is None:
                continue
            seen_any = True
            text = _text(v).strip()
            try:
                n = int(text)
            except ValueError:
                bad.append(f"redis:{chunk[j]}: value {text[:40]!r} is not an integer count")
                continue
            if n < 0:
                bad.append(f"redis:{chunk[j]}: negative count {n}")
                continue
            counts[lo + j] = n
    if not seen_any:
        known = _redis_call("checking the model set", client.sismember, keys.REQUEST_MODELS, model)
        if not known:
            raise HistoryError(
                f"no request counters for model {model!r} at {resolution_s} s resolution; "
                f"the gateway has counted {redis_models(client)[:20]}"
            )
    for msg in bad[:20]:
        log.warning("bad counter %s", msg)
    return make_frame(
        model, bucket_starts.astype(np.float64), counts, bucket_s=resolution_s,
        source=f"redis:{keys.requests(model, resolution_s, 0).rsplit(':', 1)[0]}", bad_rows=bad,
    )


# --- Prometheus ----------------------------------------------------------------------------------------
#: The query the gateway's history comes from: requests per step-long bucket, per model.
DEFAULT_PROMETHEUS_QUERY = 'sum by (model) (increase(gateway_requests_total{kind="user"}[1m]))'


def load_prometheus(
    base_url: str, query: str, *, start: float, end: float, step_s: float,
    model_label: str = "model", timeout_s: float = 10, value: Literal["count", "rate"] = "count",
    default_model: str = "default",
) -> pd.DataFrame:
    """A Prometheus range query as a history frame (one model per value of ``model_label``).

    The query must yield, at each evaluation time t, the requests of the step-long bucket
    that ENDS at t: ``value="count"`` for ``increase(x[<step>])`` (requests per bucket),
    ``value="rate"`` for ``rate(x[<step>])`` (req/s, multiplied by step_s here). The bucket
    start written to the frame is therefore ``t - step_s``. Series without the label go to
    ``default_model``; several series of one model are summed. NaN/Inf samples are
    reported in ``attrs["bad_rows"]`` and skipped (their bucket is 0).
    """
    if step_s <= 0:
        raise HistoryError(f"step_s must be positive, got {step_s}")
    if not end > start:
        raise HistoryError(f"empty time range: start {start} is not before end {end}")
    params = urllib.parse.urlencode({"query": query, "start": repr(float(start)), "end": repr(float(end)), "step": repr(float(step_s))})
    url = f"{base_url.rstrip('/')}/api/v1/query_range?{params}"
    where = f"Prometheus at {base_url}"
    try:  # the process's pooled client: the forecast loop queries the same Prometheus every round
        resp = http.fetch("GET", url, timeout=timeout_s)
    except OSError as exc:
        raise HistoryUnavailable(f"{where} unreachable: {exc}", retry_after=10.0) from exc
    body = resp.body
    if resp.status >= 400:
        detail = _prometheus_error(body)
        if resp.status >= 500 and resp.status != 422:
            raise HistoryUnavailable(f"{where} failed ({resp.status}) on {query!r}: {detail}", retry_after=10.0)
        raise HistoryError(f"{where} rejected query {query!r} ({resp.status}): {detail}")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise HistoryError(f"{where} answered something that is not JSON: {body[:200]!r}") from exc
    if doc.get("status") != "success":
        raise HistoryError(f"{where} rejected query {query!r}: {_prometheus_error(body)}")
    data = doc.get("data") or {}
    if data.get("resultType") != "matrix":
        raise HistoryError(f"{where}: query {query!r} gave a {data.get('resultType')!r}, expected a range vector (matrix)")
    results = data.get("result") or []
    if not results:
        raise HistoryError(f"{where}: query {query!r} returned no series between {start} and {end}")
    grid = np.arange(0, int(math.floor((end - start) / step_s + 1e-9)) + 1) * step_s + start - step_s
    per_model: dict[str, np.ndarray] = {}
    bad: list[str] = []
    for series in results:
        labels = series.get("metric") or {}
        model = str(labels.get(model_label, default_model))
        acc = per_model.setdefault(model, np.zeros(grid.size))
        for t, v in series.get("values") or []:
            x = float(v)
            bucket = int(round((float(t) - step_s - grid[0]) / step_s))
            if not math.isfinite(x) or x < 0:
                bad.append(f"prometheus:{model}@{float(t):.0f}: sample {v!r} is not a finite non-negative number")
                continue
            if 0 <= bucket < grid.size:
                acc[bucket] += x * step_s if value == "rate" else x
    for msg in bad[:20]:
        log.warning("bad sample %s", msg)
    frames = [
        make_frame(m, grid, acc, bucket_s=step_s, source=f"prometheus:{query}", bad_rows=bad)
        for m, acc in sorted(per_model.items())
    ]
    frame = pd.concat(frames, ignore_index=True)
    frame.attrs = dict(frames[0].attrs)
    return frame


def _prometheus_error(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return f"{doc.get('errorType', 'error')}: {doc.get('error', body[:200])}"
    except ValueError:
        return repr(body[:200])


def counter_resolution(bucket_s: float) -> int:
    """The coarsest resolution the gateway records (`keys.REQUEST_RESOLUTIONS_S`) that divides `bucket_s`:
    what a history of `bucket_s` buckets is summed from. None divides it: an error naming the choices."""
    fits = [r for r in sorted(keys.REQUEST_RESOLUTIONS_S) if bucket_s >= r and float(bucket_s) % r == 0]
    if not fits:
        raise HistoryError(f"bucket of {bucket_s:g} s is not a whole multiple of a counter resolution the gateway "
                           f"records ({sorted(keys.REQUEST_RESOLUTIONS_S)} s)")
    return fits[-1]


def load_fine_counters(client: _RedisLike, model: str, *, start: float, end: float,
                       bucket_s: int) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The gateway's fine counters of one model: (first bucket start, requests, peak in flight,
    request-seconds, requests that waited for capacity) per `bucket_s` bucket whose start lies in
    [start, end); missing keys are 0. The peak is the gateways' own peaks summed or the engines'
    reported level (`keys.engine_peak`, every gateway's requests), whichever is larger.

    The gateway records them at `keys.FINE_RESOLUTION_S`; a coarser `bucket_s` (a whole multiple)
    sums the requests and request-seconds and takes the largest peak of the buckets it covers.
    What the planner reads every step (`forecasting.planner.observed_from_counts`); the
    simulator builds the same arrays from a trace. Unreadable values count as 0.
    """
    res = keys.FINE_RESOLUTION_S
    if bucket_s < res or bucket_s % res:
        raise HistoryError(f"fine bucket of {bucket_s} s is not a whole multiple of the gateway's "
                           f"{res} s in-flight counters")
    k = bucket_s // res
    first = math.floor(start / bucket_s) * bucket_s
    n = max(0, math.ceil((end - first) / bucket_s))
    starts = first + np.arange(n * k, dtype=np.int64) * res
    out = []
    for key_of in (keys.requests, keys.inflight_peak, keys.busy, keys.waited, keys.engine_peak):
        names = [key_of(model, res, int(b)) for b in starts]
        values = np.zeros(starts.size, dtype=np.float64)
        for lo in range(0, len(names), MGET_CHUNK):
            got = _redis_call(f"reading counters of {model!r}", client.mget, names[lo:lo + MGET_CHUNK])
            for j, v in enumerate(got):
                if v is None:
                    continue
                try:
                    values[lo + j] = max(0.0, float(_text(v)))
                except ValueError:
                    continue
        per = values.reshape(n, k)
        out.append(per.max(axis=1) if key_of in (keys.inflight_peak, keys.engine_peak) else per.sum(axis=1))
    # the peak in flight: the gateways' own peaks summed, or the engines' count of every gateway's, the larger
    return float(first), out[0], np.maximum(out[1], out[4]), out[2], out[3]
