"""vLLM replicas behind the gateway for `benchmarks/load.py --engine vllm`.

Each replica is a real vLLM server (`python -m vllm.entrypoints.openai.api_server` from
the vLLM environment, `make vllm-env`) serving the tiny Llama of
`prewarm.runtime.tiny_llama` under the benchmark's model name, with an API key the
gateway sends; each is brought up the agent's way (`workers.node.bringup.bring_up` with
the vLLM adapter: warmup, probes, reference and speed checks) before any load is sent.
At most two run at once (each holds ~1.6 GB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from benchmarks.common import pinned

from prewarm.adapters.vllm import VllmAdapter, expected_dtype, expected_max_context, server_command, server_env
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.metrics import Metrics
from prewarm.core.settings import Settings
from prewarm.policy.engine_checks import EngineFacts
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.runtime.hf_checkpoint import make_tiny_llama
from workers.context import WorkerContext
from workers.node.bringup import BringUpSpec, ValidationFailed, bring_up

ROOT = Path(__file__).resolve().parents[1]
MAX_SERVERS = 2


def python_path(settings: Settings) -> str:
    path = (ROOT / settings.engine.vllm_python) if not Path(settings.engine.vllm_python).is_absolute() \
        else Path(settings.engine.vllm_python)
    if not path.is_file():
        raise SystemExit(f"no vLLM environment at {path}: run `make vllm-env`")
    return str(path)


def start_servers(tmp: Path, model: str, ports: list[int], key: str, settings: Settings,
                  cpus: str | None = None) -> tuple[Path, list[subprocess.Popen[bytes]]]:
    """One vLLM server per port; with `cpus`, pinned there (`taskset`, and vLLM's own OpenMP thread binding)."""
    if len(ports) > MAX_SERVERS:
        raise SystemExit(f"--engine vllm runs at most {MAX_SERVERS} replicas (each vLLM holds ~1.6 GB)")
    python = python_path(settings)
    model_dir = make_tiny_llama(tmp / "vllm-model", python, name=model, revision="bench")
    ecfg = settings.engine
    procs = []
    for slot, port in enumerate(ports):
        cmd = server_command(python, model_dir=str(model_dir), served_name=model, host="127.0.0.1", port=port,
                             api_key=key, max_model_len=ecfg.vllm_max_model_len, kv_cache_bytes=ecfg.vllm_kv_cache_bytes,
                             gpu_memory_utilization=ecfg.vllm_gpu_memory_utilization,
                             enforce_eager=ecfg.vllm_enforce_eager, sleep_mode=False, dtype=expected_dtype(model_dir))
        with open(tmp / f"vllm-{slot}.log", "ab") as out:
            env = {**os.environ, **server_env(enforce_eager=ecfg.vllm_enforce_eager,
                                              threads_bind=cpus or ecfg.vllm_cpu_threads_bind)}
            procs.append(subprocess.Popen(pinned(cmd, cpus), env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return model_dir, procs


def bring_up_vllm(reg: ReplicaRegistry, replica: Replica, model_dir: Path, key: str, settings: Settings,
                  node_class: str, timeout_s: float = 900.0, attempts: int = 3) -> Replica:
    """pending → loading (until /health) → warming → validated → ready, as an agent brings up a vLLM replica."""
    ctx = WorkerContext(settings=settings, client=reg.client, registry=reg, metrics=Metrics(CollectorRegistry()))
    now = time.time()
    reg.register(replica, now=now)
    adapter = VllmAdapter(replica.endpoint, api_key=key, model=replica.model, timeout_s=120.0)
    spec = BringUpSpec(model=replica.model, node=replica.node, node_class=node_class, served_model=replica.model,
                       expected=None, started_at=now, load_timeout_s=timeout_s, revision=replica.revision,
                       engine_expect=EngineFacts(replica.model, expected_max_context(
                           model_dir, settings.engine.vllm_max_model_len), expected_dtype(model_dir)))
    def transition(to: ReplicaState, expected: ReplicaState, reason: str) -> Replica:
        return reg.transition(replica.id, to, now=time.time(), expected=expected, reason=reason)

    # as load.py's built-in bring-up: a noisy neighbour can push one warm batch past the speed rule, so a
    # failed validation is warmed and checked again (resuming from `warming`) up to `attempts` times
    for attempt in range(1, attempts + 1):
        rec = reg.get(replica.id)
        if rec is None:
            raise RuntimeError(f"replica {replica.id} vanished from the registry")
        try:
            return bring_up(ctx, rec, spec, connect=lambda _rec: adapter, transition=transition, poll_s=0.5).replica
        except ValidationFailed as exc:
            print(f"replica {replica.id}: validation attempt {attempt} failed: {exc}", file=sys.stderr)
    raise RuntimeError(f"replica {replica.id} failed validation {attempts} times")


def served_requests(port: int) -> int:
    """Requests a vLLM server finished (`vllm:request_success_total`, warmup included: a share, not a count)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return int(sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)))
