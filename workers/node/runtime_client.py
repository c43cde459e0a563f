"""The agent's view of a runtime: `prewarm.adapters.runtimes` plus what the pipeline reads besides.

The pipeline drives a replica through the runtime adapter (`BuiltinRuntimeAdapter` for
`prewarm serve-model`) and reads three more things from the runtime's own endpoints: the
phase durations the runtime measured (its `/metrics`, so the agent reports the loader's
timings rather than its polling interval), the requests in flight (`/stats`, for
draining) and the allocator fragmentation (`/stats` or `/metrics`, for recycling).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from prometheus_client.parser import text_string_to_metric_families

from prewarm.adapters.runtimes import BuiltinRuntimeAdapter
from prewarm.core import http
from prewarm.core.domain import Replica
from prewarm.core.settings import Settings
from workers.node.adapter_client import AdapterClient

if TYPE_CHECKING:
    from workers.node.vllm_client import VllmClient


def control_token(settings: Settings) -> str | None:
    """The runtime's control token: `runtime.token`, else the warmup secret (as the runtime does)."""
    for secret in (settings.runtime.token, settings.warmup.secret):
        if secret is not None and secret.get_secret_value():
            return secret.get_secret_value()
    return None


class RuntimeClient(AdapterClient[BuiltinRuntimeAdapter]):
    """One runtime endpoint, as the pipeline and the operations use it."""

    def __init__(self, settings: Settings, endpoint: str, *, model: str | None = None, timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        key = settings.runtime.api_key
        self.api_key = key.get_secret_value() if key is not None else None
        self.adapter = BuiltinRuntimeAdapter(self.endpoint, token=control_token(settings), timeout_s=timeout_s,
                                             model=model, api_key=self.api_key)

    # --- the runtime's own observations ------------------------------------------------
    def _get(self, path: str) -> bytes:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        resp = http.fetch("GET", self.endpoint + path, headers=headers, timeout=self.timeout_s)
        if resp.status != 200:
            raise http.Unreachable(f"GET {self.endpoint}{path}: status {resp.status}")
        return resp.body

    def _stats(self) -> dict[str, Any]:
        data = json.loads(self._get("/stats"))
        return data if isinstance(data, dict) else {}

    def _samples(self, family: str) -> list[tuple[str, Mapping[str, str], float]]:
        text = self._get("/metrics").decode("utf-8", "replace")
        out: list[tuple[str, Mapping[str, str], float]] = []
        for fam in text_string_to_metric_families(text):
            if fam.name == family:
                out += [(s.name, s.labels, float(s.value)) for s in fam.samples]
        return out

    def phase_durations(self) -> dict[str, float]:
        """Seconds per loading phase as the runtime measured them (empty if it does not export them)."""
        try:
            samples = self._samples("model_loading_phase_duration_seconds")
        except (OSError, ValueError):
            return {}
        return {labels["phase"]: value for name, labels, value in samples
                if name.endswith("_sum") and "phase" in labels}

    def inflight(self) -> int | None:
        value = self._stats().get("inflight")
        return int(value) if isinstance(value, (int, float)) else None

    def gpu_bytes(self) -> int | None:
        """What the runtime's CUDA allocator holds (its replica's GPU footprint); None on CPU or unknown."""
        mem = self._stats().get("memory")
        value = mem.get("cuda_reserved") if isinstance(mem, dict) else None
        return int(value) if isinstance(value, (int, float)) and value > 0 else None

    def sleep_supported(self) -> bool:
        return True  # the built-in runtime always has level-1 sleep

    def sleep(self, level: int = 1) -> bool:
        return self.adapter.sleep(level)

    def wake_up(self) -> bool:
        return self.adapter.wake_up()

    def is_sleeping(self) -> bool:
        return self.adapter.is_sleeping()

    def fragmentation(self) -> float | None:
        """1 - allocated/reserved of the runtime's allocator, when the runtime reports it."""
        try:
            value = self._stats().get("fragmentation")
            if isinstance(value, (int, float)):
                return float(value)
            samples = self._samples("gpu_fragmentation_rate")
        except (OSError, ValueError):
            return None
        return max((v for _, _, v in samples), default=None)


class _Hosted(Protocol):
    endpoint: str
    engine: str
    log: tuple[str, int] | None

    @property
    def replica(self) -> Replica: ...


def client_for(settings: Settings, hosted: _Hosted, *, timeout_s: float = 30.0) -> "RuntimeClient | VllmClient":
    """The client of a hosted runtime, by its engine (`workers/node/engines.py`)."""
    if hosted.engine == "vllm":
        from workers.node.vllm_client import VllmClient

        return VllmClient(settings, hosted.endpoint, model=hosted.replica.model, timeout_s=timeout_s,
                          startup_log=hosted.log)
    return RuntimeClient(settings, hosted.endpoint, timeout_s=timeout_s)
