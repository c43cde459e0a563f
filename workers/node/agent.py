"""The node agent process: a Celery worker for `prewarm.node.<node>` plus what keeps replicas honest.

Lifecycle of `prewarm agent`:
1. start: build the worker context, serve /metrics, reconcile (adopt the runtimes a crashed
   predecessor left whose replicas are still live, stop the other orphans, mark failed every
   replica the registry places on this node that the agent does not host), and queue a
   prewarm for adopted replicas that were still loading, so they need not wait for the
   broker to redeliver the crashed task;
2. run: a Celery worker with the *threads* pool consumes the node queue, while a
   heartbeat thread refreshes every hosted replica (and the node's view for placement) and
   a keeper thread sends synthetic requests to replicas held warm;
3. stop (SIGTERM: warm shutdown, running tasks finish): hosted replicas are drained and
   retired (or failed if not ready yet) and their runtimes stopped.

Why the threads pool: the heavy work (torch, CUDA) runs in one `serve-model` child process
per replica, so a task only waits on HTTP and Redis. Threads keep metrics, the slot table
and the heartbeats in one process (a prefork child's metrics and runtimes would be
invisible to the parent), and CUDA is never initialised in a process that forks. Losing
the worker process (SIGKILL, OOM) leaves its messages unacked: with acks_late they come
back after the visibility timeout, and the next agent adopts the orphaned runtimes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from prewarm.core import keys
from prewarm.core.domain import TERMINAL_STATES, Replica, ReplicaState
from prewarm.core.errors import PrewarmError
from prewarm.core.settings import Settings
from prewarm.policy.sleep_tier import FIELD as SLEEP_FIELD, sleep_report
from workers import context
from workers.node import operations
from workers.node.memory import ASLEEP, GB, GPU, footprint_bytes, models_on_disk, residency, warmest
from workers.app import make_app
from workers.names import PREWARM, node_queue
from workers.context import WorkerContext
from workers.node.engine_load import publish_engine_load
from workers.node.engines import BUILTIN, VLLM, probe_sleep_mode
from workers.node.supervision import readiness
from workers.process import serve_metrics, setup_logging

log = logging.getLogger("prewarm.agent")

#: How often the node view re-reads which models lie in the models directory (the disk tier).
DISK_SCAN_S = 30.0


@dataclass(frozen=True)
class ReconcileReport:
    adopted: tuple[str, ...]  # runtimes of a previous agent taken over
    failed: tuple[str, ...]  # replicas the registry placed here that nothing hosts


class Agent:
    """Everything of a node agent but the Celery consumer itself."""

    def __init__(self, settings: Settings, *, metrics_port: int | None = None) -> None:
        self.settings = settings
        self.ctx = WorkerContext.build(settings)
        self.metrics_port = settings.metrics.port if metrics_port is None else metrics_port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._metrics_server: Any = None
        self._loaded: set[str] = set()  # model@revision this agent brought to ready (snapshot hint)
        self._disk_scan: tuple[float, set[str]] = (-DISK_SCAN_S - 1.0, set())  # (when, model@revision on disk)
        self._unhealthy: dict[str, int] = {}  # replica id -> consecutive failed readiness checks
        # engine -> whether it can sleep here, as the engine says (None: not asked yet); the built-in runtime
        # always has level-1 sleep (runtime_client), vLLM answers at start (`record_sleep_mode`)
        self._sleep_modes: dict[str, bool | None] = {BUILTIN: True}

    @property
    def node(self) -> str:
        return self.settings.agent.node

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> ReconcileReport:
        context.install(self.ctx)
        self._metrics_server = serve_metrics(self.ctx, self.metrics_port)
        report = self.reconcile()
        self.heartbeat_once()
        for name, target in (("heartbeat", self._heartbeat_loop), ("keeper", self._keeper_loop),
                             ("health", self._health_loop)):
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return report

    def stop(self) -> None:
        """Retire what this agent hosts and stop its runtimes (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for hosted in self.ctx.runtimes.all():
            self._retire_on_shutdown(hosted.replica)
        self.ctx.runtimes.stop_all(grace_s=10.0)
        try:
            self.ctx.client.delete(keys.node_info(self.node))
        except redis.RedisError:
            pass
        if self._metrics_server is not None:
            server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else self._metrics_server
            server.shutdown()
        context.uninstall()
        log.info("agent of node %s stopped", self.node)

    def _retire_on_shutdown(self, replica: Replica) -> None:
        reason = f"agent of node {self.node} shut down"
        try:
            rec = self.ctx.registry.get(replica.id)
            if rec is None or rec.state in TERMINAL_STATES:
                return
            if rec.state is ReplicaState.READY:
                rec = self.ctx.registry.transition(replica.id, ReplicaState.DRAINING, now=self.ctx.clock(),
                                                   reason=reason)
            if rec.state in (ReplicaState.DRAINING, ReplicaState.PENDING, ReplicaState.ASLEEP):
                self.ctx.registry.transition(replica.id, ReplicaState.RETIRED, now=self.ctx.clock(), reason=reason)
            else:
                operations.safe_fail(self.ctx, replica.id, reason)
        except (PrewarmError, redis.RedisError) as exc:
            log.warning("could not retire %s on shutdown: %s", replica.id, exc)

    # --- reconciliation ---------------------------------------------------------------
    def reconcile(self) -> ReconcileReport:
        """Adopt live orphans, stop dead ones, fail registry entries nothing hosts."""
        def keep(replica: Replica) -> Replica | None:
            rec = self.ctx.registry.get(replica.id)
            return rec if rec is not None and rec.state not in TERMINAL_STATES else None

        adopted = self.ctx.runtimes.adopt_orphans(keep)
        for h in adopted:  # an adopted runtime already holds its memory: book it as it is
            try:
                nbytes = footprint_bytes(self.settings, h.replica.model, h.model_dir)
            except Exception as exc:  # noqa: BLE001 - a runtime whose directory went away still holds memory
                log.warning("could not read the footprint of adopted %s: %s", h.replica.id, exc)
                continue
            self.ctx.runtimes.ledger.book(h.replica.id, h.replica.model, nbytes,
                                      ASLEEP if h.replica.state is ReplicaState.ASLEEP else GPU)
        hosted = self.ctx.runtimes.hosted_ids()
        failed = []
        for rec in self.ctx.registry.live_on_node(self.node):
            if rec.id in hosted:
                continue
            if operations.safe_fail(self.ctx, rec.id, f"reconcile: not hosted by the agent of node {self.node} "
                                                      f"at its start") is not None:
                self.ctx.metrics.loading_failures.labels(rec.model, self.node, "reconcile").inc()
                failed.append(rec.id)
                log.warning("[COLDSTART] replica=%s model=%s node=%s state=failed reason=reconcile", rec.id,
                            rec.model, self.node)
        report = ReconcileReport(tuple(h.replica.id for h in adopted), tuple(failed))
        log.info("reconciled node %s: adopted %s, failed %s", self.node, list(report.adopted), list(report.failed))
        return report

    def resume_adopted(self, app: Celery) -> list[str]:
        """Queue a prewarm for every adopted replica its dead predecessor had not finished.

        The crashed task's own message comes back only after the broker's visibility timeout
        (minutes in production); this new message resumes the work at once. Both are the same
        idempotent prewarm of the same replica id, so whichever runs second finds it ready.
        """
        resumed = []
        for hosted in self.ctx.runtimes.all():
            rec = self.ctx.registry.get(hosted.replica.id)
            if rec is not None and rec.state in (ReplicaState.PENDING, ReplicaState.LOADING, ReplicaState.WARMING):
                app.send_task(PREWARM, args=[rec.id, rec.pool.value, hosted.model_dir or None])
                resumed.append(rec.id)
                log.info("resuming the prewarm of adopted replica %s (it was %s)", rec.id, rec.state.value)
        return resumed

    def record_sleep_mode(self, engine: str, available: bool | None) -> None:
        """The engine's answer to "can you sleep on this node?", published in the node view from the next
        heartbeat on (`prewarm.policy.sleep_tier`): the planner plans no asleep tier where it says no."""
        self._sleep_modes[engine] = available

    # --- heartbeats -------------------------------------------------------------------
    def heartbeat_once(self) -> None:
        now = self.ctx.clock()
        self.ctx.runtimes.touch_leases()  # first, so that a Redis outage does not orphan the runtimes
        for hosted in self.ctx.runtimes.all():
            rid = hosted.replica.id
            code = hosted.exit_code()
            if code is not None:
                rec = operations.safe_fail(self.ctx, rid, f"runtime_exited: status {code}")
                if rec is not None:
                    self.ctx.metrics.loading_failures.labels(rec.model, self.node, "runtime_exited").inc()
                    log.error("[COLDSTART] replica=%s model=%s node=%s state=failed reason=runtime_exited "
                              "detail=status %s", rid, rec.model, self.node, code)
                self.ctx.runtimes.stop(rid)
                continue
            stored = self.ctx.registry.heartbeat(hosted.replica, now=now)
            self.ctx.runtimes.update(stored)
            if stored.state in TERMINAL_STATES and self.ctx.client.get(keys.replica_lock(rid)) is None:
                log.warning("replica %s is %s in the registry (%s): stopping its runtime", rid, stored.state.value,
                            stored.reason)
                self.ctx.runtimes.stop(rid)
        publish_engine_load(self.ctx)
        self._publish_node(now)

    def _publish_node(self, now: float) -> None:
        # A model brought to ready here left a node-local snapshot (the first load writes it): a
        # placement hint for the planner (LRU eviction may have dropped it since; then it costs a load).
        self._loaded |= {f"{h.replica.model}@{h.replica.revision}" for h in self.ctx.runtimes.all()
                         if h.replica.state in (ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.ASLEEP)}
        info = {**self._memory_view(),"name": self.node, "node_class": self.settings.agent.node_class,
                "snapshots": ",".join(sorted(self._loaded)),
                "replica_slots": str(self.settings.agent.replica_slots), "replicas": str(len(self.ctx.runtimes.all())),
                "port_base": str(self.settings.agent.port_base), "ready": "1", "heartbeat_at": repr(now),
                "gpu_memory_gb": repr(self.settings.agent.gpu_memory_gb),
                "host_memory_gb": repr(self.settings.agent.host_memory_gb),
                SLEEP_FIELD: json.dumps(sleep_report(self.settings.engine.default, self.settings.engine.models,
                                                     self._sleep_modes), sort_keys=True)}
        pipe = self.ctx.client.pipeline(transaction=True)
        pipe.hset(keys.node_info(self.node), mapping=info)
        pipe.expire(keys.node_info(self.node), keys.NODE_INFO_TTL_S)
        pipe.execute()

    def _memory_view(self) -> dict[str, str]:
        """Per-tier residency and free memory for the node view (`keys.node_info`).

        `residency`: model@revision -> its warmest tier here (gpu, asleep, cached, disk);
        `replica_tiers`: hosted replica id -> gpu or asleep; `*_used_gb` what hosted replicas
        book, `*_free_gb` what is left under the budget ('' when that memory is not accounted;
        host memory then reports what the OS has available).
        """
        ledger = self.ctx.runtimes.ledger
        per_replica = {h.replica.id: ASLEEP if h.replica.state is ReplicaState.ASLEEP else GPU
                       for h in self.ctx.runtimes.all()}
        per_model: dict[str, list[str]] = {}
        for h in self.ctx.runtimes.all():
            per_model.setdefault(f"{h.replica.model}@{h.replica.revision}", []).append(per_replica[h.replica.id])
        now = time.monotonic()
        if now - self._disk_scan[0] > DISK_SCAN_S:
            self._disk_scan = (now, models_on_disk(self.settings.runtime.models_dir))
        res = residency({k: warmest(v) for k, v in per_model.items()}, self._disk_scan[1] | self._loaded,
                        self.settings.runtime.snapshot_dir)
        gpu_free, host_free = ledger.free(GPU), ledger.free(ASLEEP)
        if host_free is None:
            try:
                host_free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                host_free = None
        return {"gpu_used_gb": repr(ledger.used(GPU) / GB), "host_used_gb": repr(ledger.used(ASLEEP) / GB),
                "gpu_free_gb": "" if gpu_free is None else repr(gpu_free / GB),
                "host_free_gb": "" if host_free is None else repr(host_free / GB),
                "residency": json.dumps(res, sort_keys=True), "replica_tiers": json.dumps(per_replica, sort_keys=True)}

    def _heartbeat_loop(self) -> None:
        interval = self.settings.registry.heartbeat_interval_s
        while not self._stop.wait(interval):
            try:
                self.heartbeat_once()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a Redis blip
                log.warning("heartbeat round failed: %s", exc)

    # --- health checks -----------------------------------------------------------------
    def check_health_once(self) -> list[str]:
        """Ask every runtime the registry has as ready for its own verdict (`/readyz`); fail one that
        says no (or does not answer) `agent.health_failures` times in a row. This, with connection
        failures seen by the gateway, is what takes a broken replica out: never what a client sent
        (a request the runtime answers with an error proves it alive). Returns the replicas failed."""
        failed = []
        hosted_ids = set()
        for hosted in self.ctx.runtimes.all():
            rid = hosted.replica.id
            hosted_ids.add(rid)
            if hosted.replica.state is not ReplicaState.READY or not hosted.replica.endpoint or \
                    hosted.exit_code() is not None:
                self._unhealthy.pop(rid, None)
                continue
            ok, why = readiness(hosted.replica.endpoint, path=hosted.ready_path)
            if ok:
                self._unhealthy.pop(rid, None)
                continue
            n = self._unhealthy.get(rid, 0) + 1
            self._unhealthy[rid] = n
            log.warning("replica %s failed its health check (%d in a row): %s", rid, n, why)
            if n < self.settings.agent.health_failures:
                continue
            self._unhealthy.pop(rid, None)
            rec = operations.safe_fail(self.ctx, rid, f"health check: {why}")
            if rec is not None:
                log.error("[COLDSTART] replica=%s model=%s node=%s state=failed reason=health_check detail=%s", rid,
                          rec.model, self.node, why)
                failed.append(rid)  # the next heartbeat sees the failed record and stops the runtime
        for rid in set(self._unhealthy) - hosted_ids:
            del self._unhealthy[rid]
        return failed

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.registry.heartbeat_interval_s):
            try:
                self.check_health_once()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a Redis blip
                log.warning("health check round failed: %s", exc)

    def _keeper_loop(self) -> None:
        interval = self.settings.warmup.keepalive_interval_s
        while not self._stop.wait(interval):
            now = self.ctx.clock()
            for hosted in self.ctx.runtimes.all():
                try:
                    until = self.ctx.client.get(keys.keep_warm(hosted.replica.id))
                    if until is not None and float(until) > now:
                        operations.send_keepalive(self.ctx, hosted.replica.id)
                except Exception as exc:  # noqa: BLE001
                    log.warning("keepalive of %s failed: %s", hosted.replica.id, exc)


def run_agent(settings: Settings, *, loglevel: str = "INFO", metrics_port: int | None = None) -> int:
    """`prewarm agent`: reconcile, then consume this node's queue until SIGTERM (blocks)."""
    setup_logging(loglevel)
    # SIGTERM before Celery installs its handlers (during reconciliation) still runs the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    agent = Agent(settings, metrics_port=metrics_port)
    argv = ["worker", "-Q", node_queue(agent.node), "-P", "threads", "-c", str(settings.agent.effective_concurrency),
            "-n", f"agent@{agent.node}", f"--loglevel={loglevel}", "--without-mingle", "--without-gossip"]
    try:
        agent.start()
        agent.record_sleep_mode(VLLM, probe_sleep_mode(settings))
        app = make_app(settings)
        agent.resume_adopted(app)
        app.worker_main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        agent.stop()
    return 0
