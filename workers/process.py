"""What every long-running worker process sets up the same way: logging and its /metrics endpoint."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import start_http_server

from workers.context import WorkerContext

log = logging.getLogger("prewarm.process")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_metrics(ctx: WorkerContext, port: int | None) -> Any:
    if not port:
        return None
    host = ctx.settings.metrics.host
    server = start_http_server(port, addr=host, registry=ctx.metrics.registry)
    log.info("metrics on %s:%d/metrics", host, port)
    return server
