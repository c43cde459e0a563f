"""`engine_timing`: the speed checks' figures as the engines time their own requests (pure part)."""

from __future__ import annotations

import pytest

from prewarm.adapters.engine_timing import Timers, timers_from

VLLM = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.3
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.1
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="tiny"} 0.02
"""

BUILTIN_UNUSED = """# HELP runtime_time_to_first_token_seconds Completions of a model host
# TYPE runtime_time_to_first_token_seconds histogram
# HELP runtime_time_per_output_token_seconds Completions of a model host
# TYPE runtime_time_per_output_token_seconds histogram
"""


def test_vllms_histograms_are_summed_over_their_engines() -> None:
    t = timers_from(VLLM)
    assert t.ttft == pytest.approx((0.4, 4.0)) and t.decode == pytest.approx((0.02, 2.0))


def test_a_reading_is_the_mean_of_the_requests_between_two_scrapes() -> None:
    before = Timers(ttft=(0.4, 4.0), decode=(0.02, 2.0))
    after = Timers(ttft=(0.7, 6.0), decode=(0.05, 3.0))
    assert after.since(before) == pytest.approx((0.15, 0.03))
    assert before.since(before) == (None, None)  # nothing timed in between
    assert before.since(after) == (None, None)  # counts went down: the server restarted


def test_a_host_that_timed_nothing_yet_reads_zero_and_a_server_without_timers_is_an_error() -> None:
    assert timers_from(BUILTIN_UNUSED) == Timers((0.0, 0.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="vllm:time_to_first_token_seconds"):
        timers_from("# TYPE other_total counter\nother_total 1\n")
