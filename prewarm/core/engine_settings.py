"""The engine settings group (`PREWARM_ENGINE_*`): which engine serves each model and how an agent runs vLLM.
Part of the one settings root (`prewarm.core.settings`), in its own module by size."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from prewarm.core.settings_base import _Group


EngineName = Literal["builtin", "vllm"]


class EngineSettings(_Group):
    """Which engine serves each model, and how an agent runs vLLM (one `vllm.entrypoints.openai.api_server`
    per replica, from the vLLM environment, validated against its revision's reference probes)."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_ENGINE_", extra="forbid")
    group: ClassVar[str] = "engine"

    default: EngineName = "builtin"  # the engine of a model `models` does not name
    models: dict[str, EngineName] = Field(default_factory=dict)  # model -> engine, e.g. {"chat": "vllm"}
    # vLLM pins its own torch and transformers: it runs from its own environment (`make vllm-env`).
    vllm_python: str = ".venv-vllm/bin/python"
    vllm_max_model_len: int = Field(512, ge=16)  # context the server is started with; the structural check reads it back
    # A fixed KV cache per replica (--kv-cache-memory-bytes): on a shared node the default (a share of all
    # memory) would let one replica take what the others need. None: vLLM's --gpu-memory-utilization.
    vllm_kv_cache_bytes: int | None = Field(64 * 1024**2, ge=1024**2)
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # used when vllm_kv_cache_bytes is None
    vllm_enforce_eager: bool = True  # no graph capture / torch.compile: minutes less to start, on CPU a must
    vllm_extra_args: list[str] = Field(default_factory=list)  # appended to the server's command line
    # VLLM_CPU_OMP_THREADS_BIND of a CPU vLLM: its "auto" pins every server on a node to the same cores
    # (each one alone, it cannot know of the others: two replicas on 2 cores shared core 0); "nobind"
    # leaves placement to the OS. A core list per server would need a per-slot plan.
    vllm_cpu_threads_bind: str = "nobind"
    vllm_start_timeout_s: float = Field(300.0, gt=0)  # /health must answer within this (imports + profiling: 30-60 s on CPU)
    # --- validation of an external engine (prewarm.policy.reference, prewarm.policy.engine_checks) ---
    probe_prompts: int = Field(4, ge=1)  # seeded prompts whose greedy tokens and logprobs are compared
    probe_tokens: int = Field(8, ge=2)  # greedy tokens per probe; also the decode-rate sample
    probe_logprobs: int = Field(5, ge=1)  # top-k logprobs per position
    probe_seed: int = 0  # the prompts are the same for every replica of every revision
    # Validated replicas whose probes make a revision's reference (per-logprob median of the majority) and
    # whose speed figures make its speed baseline per node class (their median):
    # 3 out-votes one bad early replica; 1 trusts the first (small fleets, tests).
    reference_replicas: int = Field(3, ge=1)
    # |logprob| disagreement allowed per weight dtype: same weights in float32 agree to ~1e-5 on one
    # kernel set, bf16/fp16 accumulate differently across batch shapes and kernels.
    logprob_tolerance: dict[str, float] = Field(
        default_factory=lambda: {"float32": 0.02, "float16": 0.1, "bfloat16": 0.25})
    # A replica slower than factor x its revision's baseline on the node class fails. Looser than the
    # built-in's warmup.latency_factor: a millisecond-scale TTFT over HTTP on shared cores varies ~1.5x.
    speed_factor: float = Field(2.0, gt=1)

    @field_validator("logprob_tolerance")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if not x > 0}
        if bad:
            raise ValueError(f"tolerances must be > 0, got {bad}")
        return v

    def engine_of(self, model: str) -> EngineName:
        """The engine that serves `model` (a name, or model@revision)."""
        return self.models.get(model.split("@", 1)[0], self.default)
