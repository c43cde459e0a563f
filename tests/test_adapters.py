"""Both runtime adapters against a real `prewarm serve-model` process.

The OpenAI-compatible adapter is tested against the built-in runtime, which implements the
vLLM-style endpoints it relies on (`/health`, `/v1/models`, `/sleep`, `/wake_up`,
`/is_sleeping`, `logprobs`).
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from prewarm.adapters.runtimes import (
    BuiltinRuntimeAdapter,
    OpenAICompatibleAdapter,
    RuntimeAdapter,
    RuntimeRequestError,
    RuntimeUnavailable,
)
from prewarm.core.domain import LoadPhase
from prewarm.registry.embedded import free_port
from prewarm.core.errors import PermanentError, TemporaryError
from prewarm.runtime.model import make_model
from prewarm.policy.validation import CheckName, Outcome, ValidationReport, check_numeric, validate
from prewarm.policy.warmup import TopicMix, WarmupPlan, generate_requests
from tests.runtime_server import SECRET, TOKEN, RuntimeProcess, call, start_runtime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    model_dir = make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=1, name="tiny", revision="r1")
    rp = start_runtime(model_dir, tmp_path_factory.mktemp("rt"), "--no-autoload")
    try:
        yield rp
    finally:
        rp.stop()


@pytest.fixture()
def builtin(server: RuntimeProcess) -> BuiltinRuntimeAdapter:
    return BuiltinRuntimeAdapter(server.url, token=TOKEN, timeout_s=30, model="tiny")


def _wait(adapter: RuntimeAdapter, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not adapter.load_status().loaded:
        assert time.monotonic() < deadline, "runtime did not load"
        time.sleep(0.05)


def _report(adapter: RuntimeAdapter, latencies: list[float], *, allow_unsupported: bool = False) -> ValidationReport:
    inputs = adapter.validation_inputs()
    return validate(expected=inputs.expected or {}, live=inputs.live, logits=inputs.logits, latencies_s=latencies,
                    baseline_s=None, mean_bound=50.0, latency_factor=1.2, allow_unsupported=allow_unsupported)


def test_both_satisfy_the_protocol(builtin: BuiltinRuntimeAdapter) -> None:
    assert isinstance(builtin, RuntimeAdapter)
    assert isinstance(OpenAICompatibleAdapter("http://127.0.0.1:1"), RuntimeAdapter)
    with pytest.raises(PermanentError, match="http"):
        BuiltinRuntimeAdapter("localhost:8000")


def test_builtin_full_prewarm_cycle(builtin: BuiltinRuntimeAdapter, server: RuntimeProcess) -> None:
    before = builtin.load_status()
    if not before.loaded:
        assert before.phase is LoadPhase.NONE or before.progress >= 0
    status = builtin.load()
    assert status.error is None
    assert builtin.load().error is None  # idempotent
    _wait(builtin)
    assert builtin.load_status() == builtin.load_status()
    assert builtin.load_status().phase is LoadPhase.DONE and builtin.load_status().progress == 1.0
    assert not builtin.ready()  # loaded, not validated

    done = builtin.complete("Hello", max_tokens=4)
    assert done.completion_tokens == 4 and done.prompt_tokens == 5 and done.latency_s > 0
    assert done.finish_reason == "length" and isinstance(done.text, str)

    _, stats0, _ = call(server.url + "/stats")
    plan = WarmupPlan(model="tiny", count=6, topics=TopicMix.of({"code": 1, "chat": 1}), seed=3)
    latencies = builtin.warmup(generate_requests(plan, secret=SECRET, now=time.time()))
    assert len(latencies) == 6 and all(x > 0 for x in latencies)
    _, stats1, _ = call(server.url + "/stats")
    assert stats1["warmup"] - stats0["warmup"] == 6 and stats1["user"] == stats0["user"]

    inputs = builtin.validation_inputs()
    assert inputs.expected is not None and inputs.live is not None and inputs.logits is not None
    assert set(inputs.expected) == set(inputs.live) and inputs.device == "cpu"
    report = _report(builtin, latencies)
    assert report.passed, report.reason
    assert builtin.mark_ready(report) is True
    assert builtin.ready()

    assert builtin.sleep(1) is True and builtin.is_sleeping()
    assert not builtin.ready()
    with pytest.raises(RuntimeUnavailable) as exc:
        builtin.complete("Hello", max_tokens=1)
    assert exc.value.retry_after >= 1 and "sleeping" in str(exc.value)
    assert builtin.wake_up() is True and not builtin.is_sleeping()
    assert builtin.ready()
    assert builtin.complete("Hello", max_tokens=4).text == done.text


def test_builtin_refused_and_unreachable(builtin: BuiltinRuntimeAdapter, server: RuntimeProcess) -> None:
    wrong = BuiltinRuntimeAdapter(server.url, token="nope")
    with pytest.raises(RuntimeRequestError) as exc:
        wrong.load_status()
    assert exc.value.status == 403 and "control token is wrong" in str(exc.value)
    assert isinstance(exc.value, PermanentError)
    with pytest.raises(RuntimeRequestError, match="max_tokens"):
        builtin.complete("Hello", max_tokens=0)
    with pytest.raises(PermanentError, match="sleep level"):
        builtin.sleep(3)
    gone = BuiltinRuntimeAdapter(f"http://127.0.0.1:{free_port()}", token=TOKEN, timeout_s=2)
    with pytest.raises(RuntimeUnavailable, match="cannot reach"):
        gone.load_status()
    assert isinstance(RuntimeUnavailable("x"), TemporaryError)


def test_openai_compatible_adapter_against_the_builtin_runtime(server: RuntimeProcess, builtin: BuiltinRuntimeAdapter) -> None:
    builtin.load()
    _wait(builtin)
    oa = OpenAICompatibleAdapter(server.url, token=TOKEN, model="tiny")
    assert oa.load_status().loaded and oa.ready()
    assert oa.sleep(2) is True and oa.is_sleeping()
    assert not oa.ready() and not oa.load_status().loaded
    status = oa.load()  # load = wake_up
    assert status.loaded and status.phase is LoadPhase.DONE and not oa.is_sleeping()

    text = oa.complete("Hello", max_tokens=4)
    assert text.text == builtin.complete("Hello", max_tokens=4).text

    plan = WarmupPlan(model="tiny", count=3, seed=5)
    latencies = oa.warmup(generate_requests(plan, secret=SECRET, now=time.time()))
    assert len(latencies) == 3

    inputs = oa.validation_inputs()
    assert inputs.live is None and inputs.expected is None and inputs.source == "top_logprobs"
    assert inputs.logits is not None and inputs.logits.count == 5 and inputs.logits.nonfinite == 0
    assert check_numeric(inputs.logits, mean_bound=50.0).passed
    strict = _report(oa, latencies)
    assert not strict.passed
    assert strict.get(CheckName.STRUCTURAL).outcome is Outcome.UNSUPPORTED  # never a silent pass
    lenient = _report(oa, latencies, allow_unsupported=True)
    assert lenient.passed and "structural unsupported" in lenient.reason
    assert oa.mark_ready(lenient) is True and oa.mark_ready(strict) is False


def test_openai_adapter_falls_back_to_the_next_health_path(server: RuntimeProcess) -> None:
    """A server without the first probe path (404) is judged by the next one, here /v1/models."""
    oa = OpenAICompatibleAdapter(server.url, token=TOKEN, has_sleep_mode=False,
                                 health_paths=("/no-such-probe", "/v1/models"))
    assert oa.ready() and oa._health_path == "/v1/models"
    none = OpenAICompatibleAdapter(server.url, token=TOKEN, has_sleep_mode=False, health_paths=("/no-such-probe",))
    assert not none.ready()
    gone = OpenAICompatibleAdapter(f"http://127.0.0.1:{free_port()}", timeout_s=1, has_sleep_mode=False)
    assert not gone.ready() and not gone.load_status().loaded


def test_warmup_and_health_checks_reuse_one_pooled_connection() -> None:
    """Issue 9/13: one pooled HTTP client (`prewarm.core.http`); a warmup of N requests used to open N
    connections (urllib). A real HTTP server records the client's address and port of each request."""
    from tests.httpservers import AppThread, Upstream

    up = Upstream("u")
    with AppThread(up.app()) as server:
        adapter = BuiltinRuntimeAdapter(server.url, token=TOKEN, timeout_s=10)
        plan = WarmupPlan(model="tiny", count=6, seed=3, max_tokens=2, topics=TopicMix((("chat", 1.0),)))
        adapter.warmup(generate_requests(plan, secret=SECRET, now=time.time()))
        adapter.warmup(generate_requests(plan, secret=SECRET, now=time.time()))
    assert len(up.peers) == 12
    assert len(set(up.peers)) == 1, f"{len(set(up.peers))} connections for 12 requests"


def test_a_vllm_server_started_eager_has_torch_compile_off() -> None:
    from prewarm.adapters.vllm import SERVER_ENV, server_env

    eager = server_env(enforce_eager=True, threads_bind="nobind")
    assert eager["TORCHDYNAMO_DISABLE"] == "1" and eager["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert SERVER_ENV.items() <= eager.items()
    # compiled (CUDA graphs, torch.compile): vLLM's compilation is left as it configures it
    assert "TORCHDYNAMO_DISABLE" not in server_env(enforce_eager=False, threads_bind="auto")


def test_the_dtype_in_a_vllm_servers_start_up_line() -> None:
    """The engine's start-up line names the dtype it resolved; the last one counts (a slot's log holds every
    server it ran), and `kv_cache_dtype` further along the line is not it. No such line: None."""
    from prewarm.adapters.vllm import dtype_in_log

    line = ("(EngineCore pid=7) INFO 12-02 04:10:11 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with "
            "config: model='/m/tiny/r1', speculative_config=None, tokenizer='/m/tiny/r1', skip_tokenizer_init=False, "
            "tokenizer_mode=auto, revision=None, trust_remote_code=False, dtype={}, max_seq_len=512, "
            "kv_cache_dtype=auto, device_config=cpu, served_model_name=tiny\n")
    assert dtype_in_log("starting\n" + line.format("torch.bfloat16") + "INFO ready\n") == "torch.bfloat16"
    assert dtype_in_log(line.format("torch.bfloat16") + "--- restart\n" + line.format("torch.float32")) == "torch.float32"
    assert dtype_in_log("INFO Starting vLLM API server on http://127.0.0.1:8000\n") is None
