"""`prewarm up --engine vllm`: the main job with a real vLLM per replica on the two local nodes.

What changes against the built-in engine: the model is the tiny Llama checkpoint of
`prewarm.runtime.tiny_llama` (built once with the vLLM environment's interpreter, nothing
downloaded); the agents start one vLLM server per replica with the run's API key; each
node hosts one replica (a vLLM server holds ~1.6 GB: two at once on a shared machine is
the most this demo allows); one validated replica makes the revision's reference. The
report adds the engine, the time from the scale event's task to a validated replica per
tier, and the engine's own start time beside what warmup and validation added to it.
"""

from __future__ import annotations

import json
import secrets
import statistics
from pathlib import Path
from typing import Any

from prewarm.core import keys
from prewarm.core.settings import Settings
from prewarm.registry.references import EnginePhases
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.runtime.hf_checkpoint import make_tiny_llama
from prewarm.runtime.manifest import MANIFEST_FILE

REVISION = "tiny-llama"
TIERS = ("disk", "cached", "asleep")


def model_dir(settings: Settings, model: str, seed: int) -> str:
    """The demo checkpoint, built once; returns its revision."""
    target = Path(settings.runtime.models_dir) / model / f"{REVISION}-{seed}"
    if not (target / MANIFEST_FILE).is_file():
        make_tiny_llama(target, python_path(settings), name=model, revision=target.name, seed=seed)
    return target.name


def python_path(settings: Settings) -> str:
    path = Path(settings.engine.vllm_python).absolute()  # not resolve(): a venv interpreter is a symlink
    if not path.is_file():
        raise RuntimeError(f"no vLLM environment at {path}: run `make vllm-env` (or set PREWARM_ENGINE_VLLM_PYTHON)")
    return str(path)


def env(settings: Settings, model: str) -> dict[str, str]:
    key = settings.runtime.api_key.get_secret_value() if settings.runtime.api_key else secrets.token_hex(16)
    return {
        "PREWARM_ENGINE_MODELS": json.dumps({model: "vllm"}),
        "PREWARM_ENGINE_VLLM_PYTHON": python_path(settings),
        "PREWARM_RUNTIME_API_KEY": key,
        "PREWARM_AGENT_REPLICA_SLOTS": "1",  # ~1.6 GB per vLLM server: at most two on the machine
        "PREWARM_ENGINE_REFERENCE_REPLICAS": "1",  # the first validated replica makes the reference
        # as the demo's latency factor: speed on a shared CPU varies far more than on a dedicated GPU
        "PREWARM_ENGINE_SPEED_FACTOR": "5",
    }


def _stats(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(values), "p50": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, max(0, -(-95 * len(ordered) // 100) - 1))], "max": ordered[-1]}


def report_fields(settings: Settings, registry: ReplicaRegistry, model: str) -> dict[str, Any]:
    """Time to a validated replica per tier (from the agent taking the scale event's task), and the
    engine's start beside what warmup and validation added to it (the ratio of medians)."""
    cls = settings.agent.node_class
    per_tier = {t: _stats([float(v) for v in registry.client.lrange(keys.ready_times(model, t, cls), 0, -1)])
                for t in TIERS}
    phases = EnginePhases(registry.client)
    start = phases.times(model, EnginePhases.SERVER_START, cls)
    added = phases.times(model, EnginePhases.WARM_VALIDATE, cls)
    ratio = statistics.median(added) / statistics.median(start) if start and added else None
    return {"engine": "vllm", "time_to_validated_s": {t: s for t, s in per_tier.items() if s is not None},
            "engine_server_start_s": _stats(start), "engine_warm_validate_s": _stats(added),
            "warm_validate_over_server_start": ratio}
