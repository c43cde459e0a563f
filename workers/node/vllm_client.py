"""The agent's view of a vLLM replica: what `RuntimeClient` is for the built-in runtime.

The operations (keep-warm, drain, recycle) and the tiers read a few things besides the
adapter: requests in flight (here the engine's own `vllm:num_requests_running` +
`num_requests_waiting`), the allocator's fragmentation and GPU bytes (vLLM does not report
them: None, never a guess) and the loading phases (vLLM has no progressive loading: none).
"""

from __future__ import annotations

from typing import Sequence

from prewarm.adapters.vllm import ProbeRun, VllmAdapter
from prewarm.core.errors import PermanentError
from prewarm.core.settings import Settings
from prewarm.policy.engine_checks import EngineFacts
from workers.node.adapter_client import AdapterClient


class VllmClient(AdapterClient[VllmAdapter]):
    engine = "vllm"

    def __init__(self, settings: Settings, endpoint: str, *, model: str, timeout_s: float = 60.0,
                 startup_log: tuple[str, int] | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        key = settings.runtime.api_key
        self.adapter = VllmAdapter(self.endpoint, api_key=key.get_secret_value() if key is not None else None,
                                   model=model, timeout_s=timeout_s, startup_log=startup_log)

    def inflight(self) -> int | None:
        return self.adapter.inflight()

    def gpu_bytes(self) -> int | None:
        return None

    def fragmentation(self) -> float | None:
        return None

    def phase_durations(self) -> dict[str, float]:
        return {}

    def probes(self, prompts: Sequence[str], *, tokens: int, logprobs: int) -> ProbeRun:
        return self.adapter.probes(prompts, tokens=tokens, logprobs=logprobs)

    def facts(self) -> EngineFacts:
        return self.adapter.facts()

    def sleep_supported(self) -> bool:
        return self.adapter.sleep_supported()

    def sleep(self, level: int = 1) -> bool:
        """Only where the server runs with sleep mode: without it, vLLM's dev-mode /sleep pauses
        scheduling and frees nothing (a request sent meanwhile blocks until /wake_up)."""
        if not self.adapter.sleep_supported():
            raise PermanentError(f"{self.endpoint}: this vLLM runs without sleep mode (its platform has none); "
                                 "the asleep tier is absent for it")
        return self.adapter.sleep(level)

    def wake_up(self) -> bool:
        return self.adapter.wake_up()

    def is_sleeping(self) -> bool:
        return self.adapter.is_sleeping()
