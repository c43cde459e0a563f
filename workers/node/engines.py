"""Which server a node agent starts for a replica, per the model's engine (`engine.models`).

`builtin` is `prewarm serve-model` (health `/healthz`, readiness `/readyz`); `vllm` is a
vLLM OpenAI server from the vLLM environment (`engine.vllm_python`), health and readiness
`/health`, started with the replica's port, the runtime API key the gateway sends, the
model directory, the checkpoint's dtype (vLLM on CPU would otherwise compute a float32
checkpoint in bfloat16), the context and KV-cache limits, and sleep mode only where the
vLLM platform says it is available (asked once per agent: on CPU it is not, and passing
`--enable-sleep-mode` there makes the server refuse to start).
"""

from __future__ import annotations

import functools
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from prewarm.adapters.vllm import SERVER_ENV, expected_dtype, server_command, server_env
from prewarm.core.domain import Replica
from prewarm.core.errors import PermanentError
from prewarm.core.settings import Settings

log = logging.getLogger("prewarm.agent.engines")

BUILTIN = "builtin"
VLLM = "vllm"


@dataclass(frozen=True)
class ServerSpec:
    engine: str
    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)


def health_path(engine: str) -> str:
    return "/health" if engine == VLLM else "/healthz"


def ready_path(engine: str) -> str:
    """The server's own readiness verdict: the built-in's `/readyz` (loaded and validated); vLLM's /health."""
    return "/health" if engine == VLLM else "/readyz"


def vllm_python(settings: Settings) -> str:
    path = Path(settings.engine.vllm_python)
    if not path.is_file():
        raise PermanentError(f"engine vllm: no interpreter at {path} (PREWARM_ENGINE_VLLM_PYTHON); "
                             "`make vllm-env` builds the vLLM environment")
    return str(path)


@functools.lru_cache(maxsize=4)
def sleep_mode_available(python: str) -> bool:
    """vLLM's own answer (`current_platform.is_sleep_mode_available()`), asked once per interpreter."""
    code = "from vllm.platforms import current_platform as p; print(bool(p.is_sleep_mode_available()))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                             env={**_base_env(), **SERVER_ENV})
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not ask vLLM whether sleep mode is available (%s): starting without it", exc)
        return False
    return out.stdout.strip().splitlines()[-1:] == ["True"]


def probe_sleep_mode(settings: Settings) -> bool | None:
    """Ask vLLM about sleep mode once, at agent start, before any task is taken (importing vLLM takes
    10-60 s): asked inside a bring-up, the registered replica would wait that long with no runtime to
    heartbeat for it, and be reaped. None where no model runs on vLLM."""
    ecfg = settings.engine
    if ecfg.default != VLLM and VLLM not in ecfg.models.values():
        return None
    try:
        python = vllm_python(settings)
    except PermanentError as exc:
        log.warning("%s", exc)
        return None
    available = sleep_mode_available(python)
    log.info("vLLM (%s) says sleep mode is %savailable on this platform", python, "" if available else "not ")
    return available


def _base_env() -> dict[str, str]:
    import os

    return dict(os.environ)


def server_spec(settings: Settings, replica: Replica, model_dir: str, port: int) -> ServerSpec | None:
    """The vLLM server of `replica`, or None when its model runs on the built-in engine."""
    if settings.engine.engine_of(replica.model) != VLLM:
        return None
    python = vllm_python(settings)
    ecfg = settings.engine
    key = settings.runtime.api_key
    argv = server_command(
        python, model_dir=model_dir, served_name=replica.model, host=settings.runtime.host, port=port,
        api_key=key.get_secret_value() if key is not None else None, max_model_len=ecfg.vllm_max_model_len,
        kv_cache_bytes=ecfg.vllm_kv_cache_bytes, gpu_memory_utilization=ecfg.vllm_gpu_memory_utilization,
        enforce_eager=ecfg.vllm_enforce_eager, sleep_mode=sleep_mode_available(python),
        dtype=expected_dtype(model_dir), extra=ecfg.vllm_extra_args)
    return ServerSpec(VLLM, argv, server_env(enforce_eager=ecfg.vllm_enforce_eager,
                                             threads_bind=ecfg.vllm_cpu_threads_bind))
