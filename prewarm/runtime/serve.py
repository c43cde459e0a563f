"""Process wiring of the model host: build an `Engine` from settings and serve it until a signal.

`prewarm serve-model` calls `build_host` then `serve`. Kept apart from the HTTP handlers
(`prewarm.runtime.host`) because this is where settings, metrics, the snapshot store and the
process's signals meet; the handlers know none of them.

Shutdown: SIGTERM and SIGINT stop the listener, let aiohttp close connections, cancel
queued generation jobs and return, so the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from prewarm.core.domain import LoadPhase
from prewarm.core.errors import SettingsError
from prewarm.core.metrics import Metrics
from prewarm.runtime.host import ModelHost
from prewarm.core.settings import Settings

log = logging.getLogger("prewarm.runtime")


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def build_host(
    model_dir: str | Path,
    settings: Settings,
    *,
    model_name: str | None = None,
    revision: str | None = None,
    node: str = "",
    metrics: Metrics | None = None,
    bind: str | None = None,
) -> ModelHost:
    """An `Engine` for `model_dir` built from settings, wrapped in a `ModelHost`.

    A host that listens beyond loopback (`bind`) needs its own control token
    (`PREWARM_RUNTIME_TOKEN`, never the warmup secret, which the gateway holds too) and an API
    key (`PREWARM_RUNTIME_API_KEY`) for its data endpoints: anyone in the cluster could
    otherwise bypass the gateway. On loopback the control token falls back to the warmup secret."""
    from prewarm.runtime.engine import Engine
    from prewarm.runtime.manifest import load_manifest

    rt, wu = settings.runtime, settings.warmup
    manifest = load_manifest(model_dir)
    name = model_name or manifest.name or Path(model_dir).name
    metrics = metrics or Metrics(CollectorRegistry())
    snapshots = None
    if rt.snapshot_dir:
        from prewarm.runtime.snapshot import SnapshotStore

        snapshots = SnapshotStore(rt.snapshot_dir, rt.snapshot_max_bytes, rt.snapshot_fill_wait_s)

    def on_phase(phase: Any, seconds: float, *rest: Any) -> None:
        value = phase.value if isinstance(phase, LoadPhase) else str(phase)
        metrics.loading_phase_duration.labels(name, value, node).observe(seconds)

    engine = Engine(model_dir, device=rt.device, first_layers=rt.first_layers, snapshots=snapshots,
                    model_name=name, node=node, on_phase=on_phase, read_limit_bps=rt.read_limit_bps)
    token = rt.token.get_secret_value() if rt.token is not None else None
    secret = wu.secret.get_secret_value() if wu.secret is not None else None
    api_key = rt.api_key.get_secret_value() if rt.api_key is not None else None
    if not is_loopback(bind or rt.host):
        if token is None or (secret is not None and token == secret):
            raise SettingsError(f"serve-model on {bind or rt.host} needs PREWARM_RUNTIME_TOKEN, distinct from the "
                                "warmup secret (which the gateway holds): or listen on 127.0.0.1")
        if api_key is None:
            raise SettingsError(f"serve-model on {bind or rt.host} needs PREWARM_RUNTIME_API_KEY for /v1/*, /stats and "
                                "/metrics (the gateway and the agents send it): or listen on 127.0.0.1")
    return ModelHost(
        engine,
        model_name=name,
        revision=revision or manifest.revision or "0",
        control_token=token or secret,
        api_key=api_key,
        warmup_secret=secret,
        workers=rt.workers,
        load_wait_s=rt.load_wait_s,
        drain_timeout_s=rt.drain_timeout_s,
        mean_bound=wu.logits_mean_bound,
        latency_factor=wu.latency_factor,
        metrics=metrics,
        node=node,
    )


async def serve(host: ModelHost, bind: str, port: int, *, autoload: bool = True, self_validate: bool = False,
                on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting, finish the shutdown and return.

    `autoload` starts loading at once; `self_validate` then validates the host when the load
    completes, and again after each wake from level-2 sleep, so `/readyz` turns 200 with no
    agent (a Kubernetes pod's readiness probe)."""
    runner = web.AppRunner(host.app(), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, bind, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = port
    server = getattr(site, "_server", None)
    if server is not None and server.sockets:
        bound = int(server.sockets[0].getsockname()[1])
    log.info("serving %s on http://%s:%d (device %s)", host.model_name, bind, bound, host.engine.device)
    if on_ready is not None:
        on_ready(bound)
    if autoload:
        host.engine.start_load()
        if self_validate:
            host.validate_itself()
    try:
        await stop.wait()
    finally:
        log.info("shutting down %s", host.model_name)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        host.executor.shutdown(wait=False, cancel_futures=True)
