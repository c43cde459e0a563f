"""`prewarm planner`: the planner-queue worker process, with its listener for unmet demand."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from celery import Celery

from prewarm.core import keys
from prewarm.core.metrics import RegistryCollector
from prewarm.core.settings import Settings
from workers import context
from workers.app import make_app
from workers.context import WorkerContext
from workers.names import DEMAND_QUEUE, HANDLE_DEMAND, PLANNER_QUEUE
from workers.process import serve_metrics, setup_logging

if TYPE_CHECKING:
    import redis

log = logging.getLogger("prewarm.planner")


def listen_for_demand(client: "redis.Redis[str]", app: Celery, stop: threading.Event) -> None:
    """Scale from zero as soon as the gateway announces unmet demand (the beat's scan is the safety net).

    Coalesced: one `handle_demand` per model at most is queued (`keys.demand_pending`), however many
    requests announce it. Outlives any error: a Redis error reconnects; a send the broker refuses (a
    kombu error, not a Redis one) is logged and dropped — the beat's `scan_demand` finds that demand again."""
    while not stop.is_set():
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(keys.DEMAND_CHANNEL)
            while not stop.is_set():
                msg = pubsub.get_message(timeout=1.0)
                if msg and isinstance(msg.get("data"), str):
                    model = msg["data"]
                    if not client.set(keys.demand_pending(model), "1", nx=True, ex=keys.DEMAND_PENDING_TTL_S):
                        continue  # a handle_demand for it is queued or has just run: the same demand
                    try:
                        app.send_task(HANDLE_DEMAND, args=[model])
                    except Exception as exc:  # noqa: BLE001 - a kombu/broker error must not end the listener
                        client.delete(keys.demand_pending(model))
                        log.warning("demand for %s not sent (the beat's scan will catch it): %s", model, exc)
        except Exception as exc:  # noqa: BLE001 - the listener outlives any error; it reconnects
            log.warning("demand listener: %s; reconnecting", exc)
            stop.wait(1.0)


def run_planner(settings: Settings, *, loglevel: str = "INFO", metrics_port: int | None = None) -> int:
    """`prewarm planner`: the planner-queue worker, a listener for unmet demand, and replica counts on /metrics."""
    setup_logging(loglevel)
    ctx = WorkerContext.build(settings)
    context.install(ctx)
    ctx.metrics.registry.register(RegistryCollector(ctx.registry.counts))
    port = settings.metrics.port if metrics_port is None else metrics_port
    serve_metrics(ctx, port)
    app = make_app(settings)
    stop = threading.Event()

    threading.Thread(target=listen_for_demand, args=(ctx.client, app, stop), name="demand-listener",
                     daemon=True).start()
    argv = ["worker", "-Q", f"{PLANNER_QUEUE},{DEMAND_QUEUE}", "-P", "threads", "-c", "2", "-n", "planner@%h",
            f"--loglevel={loglevel}", "--without-mingle", "--without-gossip"]
    try:
        app.worker_main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        stop.set()
    return 0
