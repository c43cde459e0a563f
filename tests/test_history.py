"""History loaders: every real trace, broken files, gateway counters in Redis, Prometheus.

The real traces in ../shared/traces are checked against their README (row counts, spans,
the NASA outage); broken files are written to tmp_path; the Redis loader reads counters
written with `prewarm.core.keys.requests` into the session's real Redis; the Prometheus loader
queries a real Prometheus whose TSDB was backfilled by promtool from an OpenMetrics file.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forecasting.data.history import (
    DEFAULT_PROMETHEUS_QUERY,
    HistoryError,
    HistoryUnavailable,
    RateTrace,
    RequestTrace,
    TraceFormat,
    detect_format,
    load_file,
    load_prometheus,
    load_rates,
    load_redis,
    load_requests,
    load_trace,
    make_frame,
    rate_series,
    redis_models,
)
from prewarm.core import keys
from prewarm.registry.embedded import free_port, stop_process

DAY = 86400.0


# --- the real traces ------------------------------------------------------------------------------------
def test_azure_code_trace(traces_dir: Path) -> None:
    trace = load_requests(traces_dir / "azure_llm_2023_code.csv")
    # The README table says 19,366 requests, but the shipped file holds 8,819 data rows
    # (8,820 lines with the header; `wc -l` counts 8,819 newlines): every one parses.
    assert len(trace) == 8819
    assert trace.bad_rows == ()
    assert trace.format is TraceFormat.REQUEST_CSV
    assert np.all(np.diff(trace.t) >= 0) and trace.t[0] == 0.0
    # 2023-11-16 18:17:03.9799600 (7 fractional digits, read as UTC) to 19:14:19.9280160.
    assert trace.start_epoch == pytest.approx(pd.Timestamp("2023-11-16 18:17:03.97996", tz="UTC").timestamp())
    assert trace.span_s == pytest.approx(57 * 60 + 15.94804, abs=1e-3)
    assert trace.context_tokens is not None and trace.generated_tokens is not None
    assert trace.context_tokens[0] > 0 and trace.context_tokens.min() >= 0
    frame = load_file(traces_dir / "azure_llm_2023_code.csv", model="code", bucket_s=10)
    assert frame["requests"].sum() == 8819
    assert frame.attrs["bucket_s"] == 10 and set(frame["model"]) == {"code"}
    assert np.all(np.diff(frame["ts"]) == 10)  # every bucket present, quiet ones as 0


def test_mooncake_trace(traces_dir: Path) -> None:
    trace = load_requests(traces_dir / "mooncake_2024_conversation.jsonl")
    assert len(trace) == 12031 and trace.bad_rows == ()
    assert trace.format is TraceFormat.REQUEST_JSONL
    assert 58 * 60 < trace.span_s < 60 * 60  # ~59 minutes of millisecond offsets
    assert trace.start_epoch == 0.0  # offset-only: placed at the Unix epoch
    assert trace.context_tokens is not None and trace.context_tokens.min() > 0
    frame = load_file(traces_dir / "mooncake_2024_conversation.jsonl", bucket_s=60, origin=1_700_000_000)
    assert frame["requests"].sum() == 12031
    assert frame["ts"].iloc[0] == 1_700_000_000 - 1_700_000_000 % 60


@pytest.mark.parametrize("name", ["servegen_m_large_rate.csv", "servegen_m_small_rate.csv"])
def test_servegen_rates(traces_dir: Path, name: str) -> None:
    trace = load_rates(traces_dir / name)
    assert isinstance(trace, RateTrace) and trace.format is TraceFormat.RATE_WINDOWS
    assert len(trace) == 2016 and trace.window_s == 600
    assert trace.span_s == pytest.approx(14 * DAY)
    total = trace.total_requests
    frame = load_file(traces_dir / name, bucket_s=600)
    assert len(frame) == 2016 and frame["requests"].sum() == pytest.approx(total)
    # Finer and coarser buckets keep every request (spread evenly within a window).
    fine = load_file(traces_dir / name, bucket_s=60)
    assert len(fine) == 20160 and fine["requests"].sum() == pytest.approx(total)
    coarse = load_file(traces_dir / name, bucket_s=3600)
    assert len(coarse) == 336 and coarse["requests"].sum() == pytest.approx(total)
    y = rate_series(frame)
    assert y.iloc[0] == pytest.approx(trace.rate[0])


def test_nasa_per_minute_with_outage(traces_dir: Path) -> None:
    path = traces_dir / "nasa_http_1995_per_minute.csv"
    trace = load_rates(path)
    assert trace.format is TraceFormat.COUNT_SERIES and trace.window_s == 60
    assert len(trace) == 84332
    assert trace.span_s / DAY == pytest.approx(58.56, abs=0.01)
    assert trace.start_epoch == pd.Timestamp("1995-07-01", tz="UTC").timestamp()
    frame = load_file(path, model="nasa", bucket_s=60)
    counts = frame["requests"].to_numpy()
    assert len(frame) == 84332
    # The outage: the longest run of zero minutes lasts more than a day. The README puts it
    # in early August; in this file it starts at 1995-07-29 04:25 and lasts 37.7 h.
    zero = np.concatenate([[0], (counts == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(zero))
    starts, ends = edges[0::2], edges[1::2]
    longest = int(np.argmax(ends - starts))
    assert (ends - starts)[longest] * 60 > DAY
    began = pd.Timestamp(frame["ts"].iloc[starts[longest]], unit="s")
    assert began == pd.Timestamp("1995-07-29 04:25")
    assert (ends - starts)[longest] == 2263
    ten = load_file(path, bucket_s=600)
    assert ten["requests"].sum() == pytest.approx(counts.sum())
    assert rate_series(ten).mean() == pytest.approx(counts.sum() / 600 / len(ten))


def test_load_trace_dispatches_and_types_are_checked(traces_dir: Path) -> None:
    assert isinstance(load_trace(traces_dir / "azure_llm_2023_code.csv"), RequestTrace)
    assert isinstance(load_trace(traces_dir / "servegen_m_small_rate.csv"), RateTrace)
    assert detect_format(traces_dir / "nasa_http_1995_per_minute.csv") is TraceFormat.COUNT_SERIES
    with pytest.raises(HistoryError, match="rate series.*use load_rates"):
        load_requests(traces_dir / "servegen_m_large_rate.csv")
    with pytest.raises(HistoryError, match="request-level.*use load_requests"):
        load_rates(traces_dir / "mooncake_2024_conversation.jsonl")


# --- broken files ------------------------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_bad_timestamp_is_reported_with_file_and_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path, "azure.csv", (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,10,2\n"
        "2023-11-16 18:17:04.0319600,11,3\n"
        "not a time,12,4\n"
        "2023-11-16 18:17:05.5000000,abc,5\n"
        "\n"
        "2023-11-16 18:17:06.0000000,13\n"
        "2023-11-16 18:18:10.0000000,14,6\n"
    ))
    trace = load_requests(path)
    assert len(trace) == 3
    assert trace.bad_rows == (
        "azure.csv:4: unreadable or out-of-range timestamp 'timestamp'",
        "azure.csv:5: context tokens is not a non-negative integer",
        "azure.csv:7: expected 3 fields, found 2",
    )
    assert "azure.csv:4" in caplog.text
    frame = load_file(path, bucket_s=60)
    assert frame.attrs["bad_rows"] == list(trace.bad_rows)
    assert frame["requests"].tolist() == [2.0, 1.0]


def test_bad_json_lines_are_reported(tmp_path: Path) -> None:
    path = _write(tmp_path, "mc.jsonl", (
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 1500, "input_length": 5\n'
        '{"timestamp": -3, "input_length": 5, "output_length": 1}\n'
        '[1, 2]\n'
        '{"timestamp": 2500, "input_length": 7, "output_length": 2}\n'
    ))
    trace = load_requests(path)
    assert trace.t.tolist() == [0.0, 2.5]
    assert [r.split(":")[1] for r in trace.bad_rows] == ["2", "3", "4"]
    assert "not JSON" in trace.bad_rows[0] and "not a JSON object" in trace.bad_rows[2]


def test_bad_rate_rows_and_duplicates(tmp_path: Path) -> None:
    path = _write(tmp_path, "rates.csv", (
        "window_start_s,rate_req_per_s\n0,1.0\n600,-2\n600,3.0\n1200,nan\n1800,4\n1800,5\n"
    ))
    trace = load_rates(path)
    assert trace.window_start_s.tolist() == [0.0, 600.0, 1800.0]
    assert trace.rate.tolist() == [1.0, 3.0, 4.0]
    assert [r.split(":")[1] for r in trace.bad_rows] == ["3", "5", "7"]
    # The missing window 1200 counts as zero traffic, not as an interpolated value.
    assert rate_series(load_file(path, bucket_s=600)).tolist() == [1.0, 3.0, 0.0, 4.0]


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("\n\n   \n", "empty"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no usable rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\nlater,3,4\n", r"no usable rows \(2 bad\).*f\.csv:2"),
    ("window_start_s,rate_req_per_s\n0,-1\n", "no usable rows"),
    ("window_start_s,rate_req_per_s\n0,1\n", "at least two windows"),
    ("a,b,c\n1,2,3\n", "unknown format"),
    ('{"ts": 1}\n', "unknown format"),
    ("{not json\n", "unknown format"),
])
def test_unusable_files_raise_history_error_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, "f.csv", text)
    with pytest.raises(HistoryError, match=message) as info:
        load_file(path)
    assert "f.csv" in str(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no such file"):
        load_file(tmp_path / "nope.csv")
    with pytest.raises(HistoryError, match="not a regular file"):
        load_file(tmp_path)


ATOMS = [
    "0", "1", "600", "-1", "2.5", "1e308", "1e15", "nan", "inf", "9" * 40, "", " ", '"7"',
    "2023-11-16 18:17:03.9799600", "1995-07-01 00:00:00", "3000-01-01 00:00:00", "0001-01-01", "x",
]


@pytest.mark.parametrize("name, text, outcome", [
    ("huge.jsonl", '{"timestamp": 0}\n{"timestamp": %s}\n' % ("9" * 400), "ok"),
    # json refuses an integer past Python's 4300-digit limit with a plain ValueError (no .msg)
    ("digits.jsonl", '{"timestamp": 0}\n{"timestamp": %s}\n' % ("9" * 5000), "ok"),
    ("far.jsonl", '{"timestamp": 0}\n{"timestamp": 1e300}\n', "ok"),
    ("far.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n1e10,1,1\n", "more than"),
    ("inf.csv", "window_start_s,rate_req_per_s\n0,1e308\n600,1\n1200,2\n", "ok"),
    ("year3000.csv", "timestamp,requests\n3000-01-01 00:00:00,1\n3000-01-01 00:01:00,2\n", "ok"),
])
def test_extreme_values_are_bad_rows_or_clear_errors(tmp_path: Path, name: str, text: str, outcome: str) -> None:
    path = _write(tmp_path, name, text)
    if outcome == "ok":
        frame = load_file(path)
        assert np.all(np.isfinite(frame["requests"])) and len(frame) <= 20
    else:
        with pytest.raises(HistoryError, match=outcome):
            load_file(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.sampled_from([
        "TIMESTAMP,ContextTokens,GeneratedTokens", "window_start_s,rate_req_per_s",
        "timestamp,requests", '{"timestamp": 0}', "", "x,y",
    ]),
    body=st.one_of(
        st.binary(max_size=400),
        st.lists(st.text(alphabet=st.sampled_from(list("0123456789,.-: {}\"eE+naT\t")), max_size=40), max_size=12)
        .map(lambda ls: "\n".join(ls).encode()),
        # Rows of plausible and extreme fields: huge numbers, far dates, NaN, JSON objects.
        st.lists(
            st.lists(st.sampled_from(ATOMS), min_size=1, max_size=4).map(",".join)
            | st.sampled_from(ATOMS).map(lambda a: '{"timestamp": %s, "input_length": 3}' % a),
            max_size=10,
        ).map(lambda ls: "\n".join(ls).encode()),
    ),
)
def test_fuzz_loaders_give_a_frame_or_history_error(tmp_path_factory: pytest.TempPathFactory, header: str, body: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "f.txt"
    path.write_bytes(header.encode() + b"\n" + body)
    try:
        frame = load_file(path, bucket_s=60)
    except HistoryError:
        return
    assert list(frame.columns) == ["model", "ts", "requests"]
    assert len(frame) > 0 and np.all(np.isfinite(frame["ts"])) and np.all(frame["requests"] >= 0)


# --- frames and rate_series ----------------------------------------------------------------------------------
def test_rate_series_fills_gaps_and_resamples() -> None:
    frame = make_frame("m", np.array([0.0, 60.0, 240.0]), np.array([6.0, 12.0, 30.0]), bucket_s=60, source="t")
    y = rate_series(frame)
    assert y.index.tolist() == [0.0, 60.0, 120.0, 180.0, 240.0]
    assert y.tolist() == [0.1, 0.2, 0.0, 0.0, 0.5]
    two = rate_series(frame, bucket_s=120)
    assert two.tolist() == pytest.approx([18 / 120, 0.0, 30 / 120])
    with pytest.raises(HistoryError, match="whole multiple"):
        rate_series(frame, bucket_s=90)
    both = pd.concat([frame, make_frame("n", np.array([0.0]), np.array([1.0]), bucket_s=60, source="t")])
    both.attrs = dict(frame.attrs)
    with pytest.raises(HistoryError, match="2 models"):
        rate_series(both)
    assert rate_series(both, "n").tolist() == [1 / 60]
    with pytest.raises(HistoryError, match="no rows for model 'x'"):
        rate_series(both, "x")


# --- Redis counters ---------------------------------------------------------------------------------------------
def test_load_redis_reads_counters_in_chunks(redis_client) -> None:
    res = 10
    t0 = 1_700_000_000
    n = 2500  # more than two MGET chunks
    pipe = redis_client.pipeline()
    for i in range(n):
        if i % 7 == 3:
            continue  # a bucket without requests has no key
        pipe.set(keys.requests("llama", res, t0 + i * res), i % 5)
    pipe.set(keys.requests("llama", res, t0 + 11 * res), "lots")
    pipe.sadd(keys.REQUEST_MODELS, "llama", "qwen")
    pipe.execute()
    frame = load_redis(redis_client, "llama", resolution_s=res, start=t0 + 3, end=t0 + n * res)
    assert len(frame) == n and frame["ts"].iloc[0] == t0
    expected = np.array([0 if (i % 7 == 3 or i == 11) else i % 5 for i in range(n)], dtype=float)
    assert np.array_equal(frame["requests"].to_numpy(), expected)
    assert frame.attrs["bucket_s"] == res
    assert frame.attrs["bad_rows"] == [f"redis:{keys.requests('llama', res, t0 + 11 * res)}: value 'lots' is not an integer count"]
    assert redis_models(redis_client) == ["llama", "qwen"]
    # A known model with a quiet window is zeros; an unknown one is an error naming the known ones.
    quiet = load_redis(redis_client, "qwen", resolution_s=res, start=t0, end=t0 + 100)
    assert quiet["requests"].sum() == 0 and len(quiet) == 10
    with pytest.raises(HistoryError, match=r"'mistral'.*\['llama', 'qwen'\]"):
        load_redis(redis_client, "mistral", resolution_s=res, start=t0, end=t0 + 100)
    with pytest.raises(HistoryError, match="empty time range"):
        load_redis(redis_client, "llama", resolution_s=res, start=t0, end=t0)


def test_load_redis_unreachable_is_temporary() -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    with pytest.raises(HistoryUnavailable):
        load_redis(client, "m", resolution_s=60, start=0, end=600)


# --- Prometheus ----------------------------------------------------------------------------------------------------
PROM_QUERY = DEFAULT_PROMETHEUS_QUERY  # what the gateway's counters give the forecaster


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A real Prometheus on a free port, its TSDB backfilled by promtool: (url, data start).

    Model "a" gets 10 requests a minute for an hour, then 30; model "b" 4 a minute; one
    sample every 15 s, for two hours ending an hour ago (inside the default retention).
    """
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.fail("the Debian prometheus and promtool binaries are required for this test")
    root = tmp_path_factory.mktemp("prometheus")
    start = (int(time.time()) // 60) * 60 - 3 * 3600
    lines = ["# HELP gateway_requests Requests by model.", "# TYPE gateway_requests counter"]
    for model, per_min in (("a", (10, 30)), ("b", (4, 4))):
        count = 0.0
        for i in range(0, 2 * 3600, 15):
            lines.append(f'gateway_requests_total{{model="{model}",kind="user"}} {count} {start + i}')
            count += (per_min[0] if i < 3600 else per_min[1]) / 4
    lines.append("# EOF")
    (root / "data.om").write_text("\n".join(lines) + "\n")
    tsdb = root / "tsdb"
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(root / "data.om"), str(tsdb)],
        check=True, capture_output=True, timeout=60,
    )
    (root / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    log = open(root / "prometheus.log", "wb")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not become ready: {(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url, start
    finally:
        stop_process(proc)
        log.close()


def test_load_prometheus_counts_per_model(prometheus: tuple[str, int]) -> None:
    url, start = prometheus
    frame = load_prometheus(url, PROM_QUERY, start=start + 60, end=start + 7200, step_s=60)
    assert set(frame["model"]) == {"a", "b"} and frame.attrs["bucket_s"] == 60
    a = rate_series(frame, "a") * 60  # requests per minute
    assert a.index[0] == start  # a sample at t counts the minute ending at t
    assert len(a) == 120
    assert a.loc[: start + 3540].to_numpy() == pytest.approx(np.full(60, 10.0))
    assert a.loc[start + 3600:].to_numpy() == pytest.approx(np.full(60, 30.0))
    b = rate_series(frame, "b") * 60
    assert b.to_numpy() == pytest.approx(np.full(120, 4.0))
    rates = load_prometheus(
        url, 'sum by (model) (rate(gateway_requests_total{model="b"}[1m]))', start=start + 60,
        end=start + 600, step_s=60, value="rate",
    )
    assert rates["requests"].to_numpy() == pytest.approx(np.full(10, 4.0))


def test_load_prometheus_errors(prometheus: tuple[str, int]) -> None:
    url, start = prometheus
    with pytest.raises(HistoryError, match=r"rejected query 'sum by \(model \(' \(400\): bad_data: .*parse error"):
        load_prometheus(url, "sum by (model (", start=start, end=start + 600, step_s=60)
    with pytest.raises(HistoryError, match="returned no series"):
        load_prometheus(url, "no_such_metric_total", start=start, end=start + 600, step_s=60)
    with pytest.raises(HistoryUnavailable, match="unreachable"):
        load_prometheus(f"http://127.0.0.1:{free_port()}", PROM_QUERY, start=start, end=start + 600, step_s=60, timeout_s=2)
    with pytest.raises(HistoryError, match="empty time range"):
        load_prometheus(url, PROM_QUERY, start=start, end=start, step_s=60)
    assert math.isfinite(start)
