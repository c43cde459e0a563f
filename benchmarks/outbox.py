"""What the task outbox costs (issue 20): a send with the outbox against a plain Celery send, and a
sweep, in one run on the same Redis.

A real Redis primary with a real replica (`--replicaof`, in sync). The producer is the app
`workers.app.make_app` builds; the baseline is Celery's own `send_task` on the same app and
connection (no record, no WAIT). Three send paths, each timed per call:

- `plain`: Celery's publish alone;
- `outbox_nowait`: record + publish (`redis.wait_replicas=0`, a single Redis);
- `outbox_wait1`: record + WAIT for the replica + publish (the default with Sentinel).

Then the sweep: with `N` records none overdue (what it costs every tick: one ZRANGEBYSCORE) and
with `N` overdue records whose messages are still queued (the worst case: it reads the queue).

Keys: `send_p50_ms_*`, `send_p99_ms_*`, `send_ratio_wait1_p50` (outbox_wait1 / plain, p50),
`sweep_idle_ms`, `sweep_overdue_ms`, `records`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from benchmarks.common import parser, percentile, report
from prewarm.core.metrics import Metrics
from prewarm.core.settings import AgentSettings, RedisSettings, Settings
from prewarm.registry.embedded import EmbeddedRedis, free_port, redis_binary, stop_process, wait_for_port
from workers.app import make_app
from workers.delivery import PrewarmCelery, sweep
from workers.names import RETIRE


def _time_sends(send: object, n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        send(RETIRE, args=[f"bench@r1/n1/{i % 4}", "bench"], task_id=f"{tag}-{i}")  # type: ignore[operator]
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    n = 200 if args.quick else 2000
    primary = EmbeddedRedis().start()
    port = free_port()
    tmp = tempfile.TemporaryDirectory(prefix="prewarm-bench-replica-")
    replica = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp.name,
                                "--save", "", "--appendonly", "no", "--replicaof", "127.0.0.1", str(primary.port)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    apps: list[PrewarmCelery] = []
    try:
        wait_for_port("127.0.0.1", port, 10.0, "the replica")
        with redis.Redis(port=port, decode_responses=True) as r:
            deadline = time.monotonic() + 30
            while r.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise SystemExit("the replica did not sync within 30 s")
                time.sleep(0.1)
        results: dict[str, float | int] = {}
        rows = []
        for label, wait in (("outbox_nowait", 0), ("outbox_wait1", 1)):
            settings = Settings(redis=RedisSettings(url=primary.url, wait_replicas=wait),
                                agent=AgentSettings(outbox_resend_after_s=30.0))
            app = make_app(settings)
            apps.append(app)
            if label == "outbox_nowait":  # the baseline, on the same app and connection, first warmed up
                _time_sends(lambda *a, **k: Celery.send_task(app, *a, **k), 50, "warm")
                plain = _time_sends(lambda *a, **k: Celery.send_task(app, *a, **k), n, "plain")
                results["send_p50_ms_plain"] = percentile(plain, 50)
                results["send_p99_ms_plain"] = percentile(plain, 99)
                rows += [("send p50 plain", results["send_p50_ms_plain"], "ms, Celery's publish alone"),
                         ("send p99 plain", results["send_p99_ms_plain"], "ms")]
            timed = _time_sends(app.send_task, n, label)
            results[f"send_p50_ms_{label}"] = percentile(timed, 50)
            results[f"send_p99_ms_{label}"] = percentile(timed, 99)
            rows += [(f"send p50 {label}", results[f"send_p50_ms_{label}"], "ms, record (+ WAIT) + publish"),
                     (f"send p99 {label}", results[f"send_p99_ms_{label}"], "ms")]
        results["send_ratio_wait1_p50"] = results["send_p50_ms_outbox_wait1"] / results["send_p50_ms_plain"]
        rows.append(("ratio p50 outbox_wait1 / plain", results["send_ratio_wait1_p50"], "same run, same Redis"))

        app = apps[-1]
        metrics = Metrics(CollectorRegistry())
        records = app.delivery.outbox.size()
        t0 = time.perf_counter()
        idle = sweep(app, metrics, now=time.time())
        results["sweep_idle_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        overdue = sweep(app, metrics, now=time.time() + 60)
        results["sweep_overdue_ms"] = (time.perf_counter() - t0) * 1000
        results["records"] = records
        assert not idle["resent"] and not overdue["resent"], "a queued message must never be sent again"
        rows += [("sweep, nothing overdue", results["sweep_idle_ms"], f"ms, {records} records"),
                 ("sweep, all overdue and queued", results["sweep_overdue_ms"],
                  f"ms, {len(overdue['later'])} looked at (limit per sweep), queue read once")]
        report("The task outbox: send and sweep cost", rows, results, args.json)
    finally:
        for app in apps:
            app.close()
        stop_process(replica)
        tmp.cleanup()
        primary.close()


if __name__ == "__main__":
    main()
