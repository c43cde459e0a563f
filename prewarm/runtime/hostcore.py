"""What every role of the model host shares: its state, its engine's facts, strict JSON.

`ModelHost` (`prewarm.runtime.host`) is split by role into small modules, each a mixin over
`HostCore`: completions and admission (`completions.py`), load/sleep/wake control
(`control.py`) and self-validation (`selfcheck.py`); `host.py` keeps the app, its auth and
the probes. Kept apart so each role reads on its own, and none passes ~200 lines.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from prewarm.core.domain import LoadPhase
from prewarm.core.errors import failure_reason
from prewarm.core.metrics import Metrics
from prewarm.core.signing import NonceCache
from prewarm.runtime import api

def _json(data: Any, *, status: int = 200, headers: Any = None) -> web.Response:
    """Every JSON answer of the host: strict (a NaN from broken weights is null, never `NaN`)."""
    return web.json_response(data, status=status, headers=headers, dumps=api.dumps)

#: Phases after which phase 1 (embeddings, positions, final norm, head) is in memory.
_SERVABLE_PHASES = frozenset({LoadPhase.FIRST_LAYERS, LoadPhase.REST, LoadPhase.DONE})


@dataclass
class HostState:
    """What the host knows beyond the engine: validation verdict and traffic counts."""

    validated: bool = False
    report: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"user": 0, "warmup": 0, "forged_warmup": 0})
    inflight: int = 0
    pausing: bool = False  # a sleep is draining in-flight requests; new ones are refused


class HostCore:
    """The state every role of the host shares, and the facts about its engine. The roles
    (`CompletionHandlers`, `ControlHandlers`, `ValidationHandlers`) are mixins over it;
    `prewarm.runtime.host.ModelHost` puts them together behind one aiohttp app."""

    def __init__(
        self,
        engine: Any,
        *,
        model_name: str,
        revision: str,
        control_token: str | None,
        warmup_secret: str | None,
        api_key: str | None = None,
        workers: int = 2,
        load_wait_s: float = 0.0,
        drain_timeout_s: float = 30.0,
        mean_bound: float = 50.0,
        latency_factor: float = 1.2,
        metrics: Metrics | None = None,
        node: str = "",
    ) -> None:
        self.engine = engine
        self.node = node
        self.model_name = model_name
        self.revision = revision
        self.control_token = control_token or None
        self.api_key = api_key or None  # set: /v1/*, /stats and /metrics need it (or the control token)
        self.warmup_secret = warmup_secret or None
        self.load_wait_s = load_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.mean_bound = mean_bound
        self.latency_factor = latency_factor
        self.metrics = metrics or Metrics(CollectorRegistry())
        self.state = HostState()
        self.nonces = NonceCache()  # a replayed warmup request counts as user traffic
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prewarm-gen")
        self.started_at = int(time.time())
        self._idle = asyncio.Event()
        self._idle.set()
        self._control_lock = asyncio.Lock()
        self.self_validate = False  # validate itself after each load (no agent: `serve-model --self-validate`)
        self._self_check: asyncio.Task[dict[str, Any] | None] | None = None

    # -- engine facts ------------------------------------------------------------------
    @property
    def servable(self) -> bool:
        """Phase 1 is in (or everything is): requests can compute, pipelined if need be."""
        return bool(self.engine.loaded) or self._phase() in _SERVABLE_PHASES

    def _phase(self) -> LoadPhase:
        try:
            return LoadPhase(self.engine.phase)
        except ValueError:
            return LoadPhase.NONE

    def weights_fault(self) -> str | None:
        check = getattr(self.engine, "weights_fault", None)
        return check() if check is not None else None

    def ready(self) -> tuple[bool, str]:
        if self.engine.error is not None:
            return False, f"loading failed: {self.engine.error}"
        fault = self.weights_fault()
        if fault is not None:
            return False, f"weights no longer trusted: {fault}"
        if not self.engine.loaded:
            return False, f"loading: phase {self._phase().value}, {self.engine.progress:.0%}"
        if self.engine.is_sleeping:
            return False, "sleeping"
        if not self.state.validated:
            return False, "loaded but not validated"
        return True, "loaded and validated"

    def _run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _loading_started(self) -> bool:
        return bool(getattr(self.engine, "load_started", self.engine.progress > 0))

    def _load_body(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "progress": float(self.engine.progress),
            "phase": self._phase().value,
            "loaded": bool(self.engine.loaded),
            "error": None if self.engine.error is None else str(self.engine.error),
            "error_kind": None if self.engine.error is None else failure_reason(self.engine.error),
            "device": str(self.engine.device),
            "sleeping": bool(self.engine.is_sleeping),
            # where the weights came from ("snapshot", "original", "snapshot+original"; "" until loaded), and how
            # long the load waited for another replica of the node filling its snapshot (`SnapshotStore.fill`)
            "source": self.engine.loader.stats.source,
            "fill_waited_s": round(float(self.engine.loader.stats.fill_waited_s), 3),
        }

    def _require_loaded(self) -> None:
        if self.engine.error is not None:
            raise api.ApiError(409, f"the model failed to load: {self.engine.error}", code="load_failed")
        if not self.engine.loaded or self.engine.is_sleeping:
            raise api.ApiError(409, "validation needs a fully loaded, awake model", code="not_loaded")

    def validate_itself(self) -> None:  # the self-validation role (selfcheck.py) provides it
        raise NotImplementedError
