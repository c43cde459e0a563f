"""The model host as a real process: completions, streaming, control token, sleep/wake, readiness.

One `prewarm serve-model` process (autoload) serves most tests; a second one started with
`--no-autoload` covers explicit loading and the SIGTERM shutdown.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from prewarm.runtime.model import make_model
from prewarm.core.signing import warmup_headers
from prewarm.policy.validation import LogitStats, tensor_specs, validate
from prewarm.policy.warmup import COMPLETIONS_PATH
from tests.runtime_server import SECRET, TOKEN, RuntimeProcess, call, poison, start_runtime, wait_loaded

pytestmark = pytest.mark.timeout(120)

PROMPT = "Hello, prewarm!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0, name="tiny", revision="r1")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    rp = start_runtime(model_dir, tmp_path_factory.mktemp("rt"), "--model-name", "tiny")
    try:
        wait_loaded(rp.url)
        yield rp
    finally:
        rp.stop()


def _complete(url: str, **body: Any) -> tuple[int, Any, Any]:
    return call(url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": 8, **body})


def _sse(url: str, body: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp.read().decode().split("\n\n"):
            if not line.strip():
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _validate_via_inputs(url: str) -> dict[str, Any]:
    """What the agent does: fetch inputs, run the pure checks, post the verdict."""
    status, inputs, _ = call(url + "/validate/inputs", "POST", {}, token=TOKEN)
    assert status == 200, inputs
    report = validate(expected=tensor_specs(inputs["manifest"]), live=tensor_specs(inputs["tensors"]),
                      logits=LogitStats.from_dict(inputs["logits"]), latencies_s=[0.01, 0.01, 0.01],
                      baseline_s=None, mean_bound=50.0, latency_factor=1.2)
    assert report.passed, report.reason
    status, body, _ = call(url + "/ready", "POST", {"passed": True, "report": report.to_dict()}, token=TOKEN)
    assert status == 200 and body["ready"], body
    return inputs


def test_probes_and_models(server: RuntimeProcess) -> None:
    assert call(server.url + "/healthz")[0] == 200
    assert call(server.url + "/health")[0] == 200
    status, body, _ = call(server.url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == "tiny" and body["data"][0]["revision"] == "r1"


def test_completion_is_greedy_and_counts_usage(server: RuntimeProcess, model_dir: Path) -> None:
    status, a, _ = _complete(server.url)
    assert status == 200, a
    assert a["object"] == "text_completion" and a["model"] == "tiny"
    choice = a["choices"][0]
    assert choice["finish_reason"] == "length"
    assert a["usage"] == {"prompt_tokens": len(PROMPT.encode()), "completion_tokens": 8,
                          "total_tokens": len(PROMPT.encode()) + 8}
    _, b, _ = _complete(server.url)
    assert b["choices"][0]["text"] == choice["text"]  # greedy: deterministic
    # token-id prompts give the same answer as the text they encode
    _, c, _ = call(server.url + "/v1/completions", "POST", {"prompt": list(PROMPT.encode()), "max_tokens": 8})
    assert c["choices"][0]["text"] == choice["text"]
    # and the answer is the model's own greedy continuation, computed here in-process
    from prewarm.runtime.engine import Engine

    ref = Engine(model_dir, device="cpu")
    ref.start_load()
    assert ref.wait_loaded(30)
    assert choice["text"] == ref.decode(list(ref.generate(PROMPT, 8)))


def test_streaming_matches_the_plain_answer(server: RuntimeProcess) -> None:
    _, plain, _ = _complete(server.url, max_tokens=12)
    events = _sse(server.url, {"prompt": PROMPT, "max_tokens": 12, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert len({c["id"] for c in chunks}) == 1


def test_the_host_times_each_completion_for_the_speed_checks(server: RuntimeProcess) -> None:
    """Time to first token and decode time per token, from the host's own clock (`engine_timing`):
    a plain and a streamed completion each add one request to both histograms."""
    from prewarm.adapters.runtimes import BuiltinRuntimeAdapter

    scrape = BuiltinRuntimeAdapter(server.url).engine_timers
    before = scrape()
    for stream in (False, True):
        start = scrape()
        if stream:
            _sse(server.url, {"prompt": PROMPT, "max_tokens": 12, "stream": True})
        else:
            assert _complete(server.url, max_tokens=12)[0] == 200
        ttft, decode = scrape().since(start)
        assert ttft is not None and decode is not None and 0 < ttft < 30 and 0 < decode < 30, (stream, ttft, decode)
    after = scrape()
    assert after.ttft[1] - before.ttft[1] == 2 and after.decode[1] - before.decode[1] == 2
    assert _complete(server.url, max_tokens=1)[0] == 200  # one token: a first token, no decode time
    once = scrape()
    assert once.ttft[1] == after.ttft[1] + 1 and once.decode == after.decode


def test_concurrent_streams_beyond_the_worker_count_all_finish(server: RuntimeProcess) -> None:
    """More streams than generation threads (2): the engine serialises them, none starves."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"prompt": PROMPT, "max_tokens": 6, "stream": True}
    with ThreadPoolExecutor(max_workers=6) as pool:
        streams = [pool.submit(_sse, server.url, body) for _ in range(5)]
        plain = [pool.submit(_complete, server.url, max_tokens=6) for _ in range(3)]
        texts = {"".join(c["choices"][0]["text"] for c in f.result(timeout=60)[:-1]) for f in streams}
        texts |= {f.result(timeout=60)[1]["choices"][0]["text"] for f in plain}
    assert len(texts) == 1


def test_logprobs_agree_with_the_greedy_token(server: RuntimeProcess) -> None:
    status, body, _ = _complete(server.url, max_tokens=2, logprobs=5)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 and len(lp["top_logprobs"]) == 2
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 5 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b"", None, "empty"),
        (json.dumps({"max_tokens": 1}).encode(), "prompt", "'prompt' is required"),
        (json.dumps({"prompt": ""}).encode(), "prompt", "must not be empty"),
        (json.dumps({"prompt": 5}).encode(), "prompt", "non-empty string"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), "prompt", "batched prompts"),
        (json.dumps({"prompt": [1, 99999]}).encode(), "prompt", "outside the vocabulary"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens", ">= 1"),
        (json.dumps({"prompt": "x", "max_tokens": "3"}).encode(), "max_tokens", "integer"),
        (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), "max_tokens", "context length"),
        (json.dumps({"prompt": "x" * 510, "max_tokens": 10}).encode(), "prompt", "exceeds the context length"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream", "boolean"),
        (json.dumps({"prompt": "x", "n": 2}).encode(), "n", "n=1"),
        (json.dumps({"prompt": "x", "stop": ["\n"]}).encode(), "stop", "not supported"),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), "temperature", "number"),
        (json.dumps({"prompt": "x", "logprobs": 5, "stream": True}).encode(), "logprobs", "stream"),
    ],
)
def test_bad_input_is_a_400_in_the_openai_shape(server: RuntimeProcess, raw: bytes, param: str | None, fragment: str) -> None:
    status, body, _ = call(server.url + "/v1/completions", "POST", raw=raw)
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"]


def test_unknown_model_is_a_404(server: RuntimeProcess) -> None:
    status, body, _ = _complete(server.url, model="other")
    assert status == 404 and body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("method", "path"), [("POST", "/load"), ("GET", "/load"), ("POST", "/sleep?level=1"),
                                              ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                                              ("POST", "/validate/inputs"), ("POST", "/validate"), ("POST", "/ready")])
def test_control_endpoints_need_the_token(server: RuntimeProcess, method: str, path: str) -> None:
    body: dict[str, Any] | None = {} if method == "POST" else None
    status, resp, hdrs = call(server.url + path, method, body)
    assert status == 401 and resp["error"]["code"] == "missing_token"
    status, resp, _ = call(server.url + path, method, body, token="wrong")
    assert status == 403 and resp["error"]["code"] == "bad_token"
    status, resp, _ = call(server.url + path, method, body, headers={"Authorization": f"Basic {TOKEN}"})
    assert status == 403
    assert call(server.url + "/is_sleeping", token=TOKEN)[1] == {"is_sleeping": False}


def test_readyz_only_after_validation(server: RuntimeProcess) -> None:
    call(server.url + "/ready", "POST", {"passed": False}, token=TOKEN)
    status, body, _ = call(server.url + "/readyz")
    assert status == 503 and body["reason"] == "loaded but not validated"
    inputs = _validate_via_inputs(server.url)
    assert set(inputs["manifest"]) == set(inputs["tensors"])
    assert call(server.url + "/readyz")[0] == 200
    status, body, _ = call(server.url + "/ready", "POST", {"passed": "yes"}, token=TOKEN)
    assert status == 400 and body["error"]["param"] == "passed"
    call(server.url + "/ready", "POST", {"passed": False}, token=TOKEN)
    assert call(server.url + "/readyz")[0] == 503
    # the in-process validation: all three checks, no baseline yet -> records one
    status, report, _ = call(server.url + "/validate", "POST", {"requests": 3}, token=TOKEN)
    assert status == 200 and report["passed"], report
    names = [c["name"] for c in report["checks"]]
    assert names == ["structural", "numeric", "performance"]
    assert "records" in report["checks"][2]["detail"]
    assert call(server.url + "/readyz")[0] == 200
    # an impossible baseline fails the performance check and withdraws readiness
    status, report, _ = call(server.url + "/validate", "POST", {"requests": 3, "baseline_s": 1e-9}, token=TOKEN)
    assert status == 200 and not report["passed"] and report["checks"][2]["outcome"] == "failed"
    assert call(server.url + "/readyz")[0] == 503
    _validate_via_inputs(server.url)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake(server: RuntimeProcess, level: int) -> None:
    _validate_via_inputs(server.url)
    _, before, _ = _complete(server.url)
    status, body, _ = call(server.url + f"/sleep?level={level}", "POST", {}, token=TOKEN)
    assert status == 200 and body == {"is_sleeping": True, "level": level}
    assert call(server.url + "/is_sleeping", token=TOKEN)[1] == {"is_sleeping": True}
    status, body, hdrs = _complete(server.url)
    assert status == 503 and body["error"]["code"] == "sleeping" and int(hdrs["Retry-After"]) >= 1
    assert call(server.url + "/readyz")[0] == 503
    status, body, _ = call(server.url + "/wake_up", "POST", {}, token=TOKEN)
    assert status == 200 and body["is_sleeping"] is False and body["loaded"] is True
    _, after, _ = _complete(server.url)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    # level 1 kept the same bytes: still validated; level 2 dropped them: validate again
    assert call(server.url + "/readyz")[0] == (200 if level == 1 else 503)
    _validate_via_inputs(server.url)


def test_bad_sleep_level(server: RuntimeProcess) -> None:
    status, body, _ = call(server.url + "/sleep?level=3", "POST", {}, token=TOKEN)
    assert status == 400 and body["error"]["param"] == "level"


def test_warmup_requests_are_counted_apart(server: RuntimeProcess) -> None:
    _, before, _ = call(server.url + "/stats")
    body = json.dumps({"prompt": "warm", "max_tokens": 1}).encode()
    signed = warmup_headers(SECRET, "POST", COMPLETIONS_PATH, body, time.time())
    assert call(server.url + "/v1/completions", "POST", raw=body, headers=signed)[0] == 200
    forged = {**signed, "X-Warmup-Signature": "0" * 64}
    assert call(server.url + "/v1/completions", "POST", raw=body, headers=forged)[0] == 200
    assert call(server.url + "/v1/completions", "POST", raw=body)[0] == 200
    _, after, _ = call(server.url + "/stats")
    assert after["warmup"] - before["warmup"] == 1
    assert after["user"] - before["user"] == 2
    assert after["forged_warmup"] - before["forged_warmup"] == 1
    _, metrics, _ = call(server.url + "/metrics")
    assert 'runtime_requests_total{code="200",kind="warmup",model="tiny"}' in metrics
    assert 'gpu_fragmentation_rate{node=""} 0.0' in metrics  # CPU: no caching allocator
    assert after["fragmentation"] == 0.0 and after["inflight"] == 0 and after["device"] == "cpu"


@pytest.fixture(scope="module")
def lazy_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    # reads capped at 400 kB/s: the ~4 MB model takes ~10 s to load, long enough to serve during it even on a
    # loaded CI machine (at 800 kB/s a starved test process once polled only after the load had finished)
    rp = start_runtime(model_dir, tmp_path_factory.mktemp("lazy"), "--no-autoload", "--model-name", "tiny",
                       env={"PREWARM_RUNTIME_READ_LIMIT_BPS": "400000"})
    try:
        yield rp
    finally:
        rp.stop()


def test_explicit_load_then_serve_then_sigterm(lazy_server: RuntimeProcess, server: RuntimeProcess) -> None:
    url = lazy_server.url
    status, body, _ = call(url + "/load", token=TOKEN)
    assert status == 200 and body["loaded"] is False and body["phase"] == "none" and body["progress"] == 0
    status, body, hdrs = _complete(url)
    assert status == 503 and body["error"]["code"] == "not_loaded" and "Retry-After" in hdrs
    assert call(url + "/readyz")[0] == 503 and call(url + "/healthz")[0] == 200
    status, body, _ = call(url + "/sleep?level=1", "POST", {}, token=TOKEN)
    assert status == 409
    first = call(url + "/load", "POST", {}, token=TOKEN)
    second = call(url + "/load", "POST", {}, token=TOKEN)  # idempotent
    assert first[0] == 202 and second[0] == 202 and first[1]["loaded"] is False
    # phase 1 in, the tail still loading: a request is served pipelined, not refused
    deadline = time.monotonic() + 30
    while True:
        _, st, _ = call(url + "/load", token=TOKEN)
        if st["phase"] in ("first_layers", "rest") or st["loaded"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    assert not st["loaded"], "the capped load finished before a request could overlap it"
    status, during, _ = _complete(url)
    assert status == 200, during
    assert call(url + "/readyz")[1]["reason"].startswith(("loading", "loaded but not validated"))
    wait_loaded(url)
    _, after, _ = _complete(url)
    _, b, _ = _complete(server.url)
    assert during["choices"][0]["text"] == after["choices"][0]["text"] == b["choices"][0]["text"]
    _, metrics, _ = call(url + "/metrics")
    for phase in ("embeddings", "first_layers", "rest"):
        assert f'model_loading_phase_duration_seconds_count{{model="tiny",node="",phase="{phase}"}} 1.0' in metrics
    assert call(url + "/load", "POST", {}, token=TOKEN)[0] == 200
    rc = lazy_server.stop(timeout=15)
    assert rc == 0, lazy_server.output()
    assert "shutting down tiny" in lazy_server.output()


def test_two_replicas_of_a_node_one_reads_the_other_waits_and_maps_its_snapshot(
        model_dir: Path, tmp_path: Path, server: RuntimeProcess) -> None:
    """Two `serve-model` processes of one model sharing a node's snapshot directory: the second, asked to load
    while the first reads the original (capped), waits for the first's snapshot and maps it (`/load` says so)."""
    # the ~4 MB model reads in ~10 s: long enough that the second's load starts within the first's read on a
    # machine busy with other tests (at ~5 s, once, with two replay sweeps beside it, it started after the fill)
    env = {"PREWARM_RUNTIME_READ_LIMIT_BPS": "400000"}
    first = start_runtime(model_dir, tmp_path, "--no-autoload", "--model-name", "tiny", env=env)
    second = start_runtime(model_dir, tmp_path, "--no-autoload", "--model-name", "tiny", env=env)
    try:
        assert call(first.url + "/load", "POST", {}, token=TOKEN)[0] == 202
        deadline = time.monotonic() + 30
        while call(first.url + "/load", token=TOKEN)[1]["phase"] == "none":  # the first is reading
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert call(second.url + "/load", "POST", {}, token=TOKEN)[0] == 202
        assert not call(first.url + "/load", token=TOKEN)[1]["loaded"], "the first had read it all already"
        one, two = wait_loaded(first.url), wait_loaded(second.url)
        assert one["source"] == "original" and one["fill_waited_s"] == 0.0
        assert two["source"] == "snapshot" and two["fill_waited_s"] > 0.5, two
        _, a, _ = _complete(first.url)
        _, b, _ = _complete(second.url)
        _, c, _ = _complete(server.url)
        assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]
    finally:
        first.stop()
        second.stop()


def test_serve_model_refuses_a_directory_without_a_model(tmp_path: Path, clean_env: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from prewarm.cli import main

    assert main(["serve-model", "--model-dir", str(tmp_path), "--port", "0"]) == 2
    assert "not a model directory" in capsys.readouterr().err


def _readyz_after_load(rp: RuntimeProcess, marker: str, timeout: float = 60.0) -> tuple[int, Any]:
    """/readyz once the host's log says its own validation is over (`marker`)."""
    deadline = time.monotonic() + timeout
    while marker not in rp.output():
        assert rp.proc.poll() is None, rp.output()
        assert time.monotonic() < deadline, f"no {marker!r} in the runtime's log:\n{rp.output()}"
        time.sleep(0.05)
    status, body, _ = call(rp.url + "/readyz")
    return status, body


def test_self_validate_makes_a_host_ready_with_no_agent(model_dir: Path, tmp_path: Path) -> None:
    """A pod's runtime: it loads, validates itself, and /readyz turns 200 with no control call."""
    rp = start_runtime(model_dir, tmp_path, "--model-name", "tiny", "--self-validate")
    try:
        status, body = _readyz_after_load(rp, "tiny validated itself")
        assert (status, body) == (200, {"ready": True, "reason": "loaded and validated"})
        status, stats, _ = call(rp.url + "/stats")
        assert status == 200 and stats["user"] == 0  # the checks are not user traffic
        # level 2 drops the weights: unready until what comes back has validated itself again
        assert call(rp.url + "/sleep?level=2", "POST", token=TOKEN)[0] == 200
        assert call(rp.url + "/readyz")[0] == 503
        assert call(rp.url + "/wake_up", "POST", token=TOKEN)[0] == 200
        deadline = time.monotonic() + 30
        while rp.output().count("tiny validated itself") < 2:
            assert time.monotonic() < deadline, rp.output()[-2000:]
            time.sleep(0.05)
        assert call(rp.url + "/readyz")[:2] == (200, {"ready": True, "reason": "loaded and validated"})
    finally:
        rp.stop()


def test_self_validate_keeps_a_broken_model_unready(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "nan", "tiny", seed=2, name="nan", revision="r1")
    poison(model_dir, "lm_head.weight")
    rp = start_runtime(model_dir, tmp_path, "--self-validate")
    try:
        status, body = _readyz_after_load(rp, "failed its own validation")
        assert status == 503 and body["ready"] is False, body
        assert "numeric" in rp.output() and "not finite" in rp.output(), rp.output()[-2000:]
        status, _, _ = _complete(rp.url)
        assert status == 200  # still alive and answering: only readiness is withheld
    finally:
        rp.stop()


def test_self_validate_needs_the_autoload(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from prewarm.cli import main

    assert main(["serve-model", "--model-dir", str(model_dir), "--no-autoload", "--self-validate"]) == 2
    assert "--self-validate needs the load to start by itself" in capsys.readouterr().err


def test_nan_weights_fail_numeric_validation_end_to_end(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    """An in-process host on a real port: the poisoned model loads, answers, and is refused readiness."""
    import asyncio

    import aiohttp

    from prewarm.registry.embedded import free_port
    from prewarm.runtime.serve import build_host
    from prewarm.core.settings import Settings

    model_dir = make_model(tmp_path / "nan", "tiny", seed=2, name="nan", revision="r1")
    poison(model_dir, "lm_head.weight")
    clean_env.setenv("PREWARM_RUNTIME_TOKEN", TOKEN)
    clean_env.setenv("PREWARM_RUNTIME_DEVICE", "cpu")
    clean_env.setenv("PREWARM_RUNTIME_SNAPSHOT_DIR", "")
    host = build_host(model_dir, Settings.load())
    host.engine.start_load()
    assert host.engine.wait_loaded(30)

    async def scenario() -> tuple[dict[str, Any], int, int]:
        from aiohttp import web

        runner = web.AppRunner(host.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
                async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                    completion_status = r.status
                async with s.post("/validate", json={"requests": 2}, headers=auth) as r:
                    report = await r.json()
                async with s.get("/readyz") as r:
                    ready_status = r.status
        finally:
            await runner.cleanup()
            host.executor.shutdown(wait=False)
        return report, completion_status, ready_status

    report, completion_status, ready_status = asyncio.run(scenario())
    assert completion_status == 200  # it computes — only validation can tell it is broken
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["structural"]["outcome"] == "passed"
    assert checks["numeric"]["outcome"] == "failed" and "not finite" in checks["numeric"]["detail"]
    assert not report["passed"] and ready_status == 503
