"""Prewarm the pods of an inference Deployment run by any OpenAI-compatible server (vLLM, TGI).

Kubernetes starts these replicas, not a prewarm agent: the pod watcher
(`prewarm.adapters.k8s_watch.PodWatcher`) hands over each pod that turns Ready, and this module
makes it a validated replica in the registry, so the gateway routes to it only once it
computes the right thing at the expected speed:

    pending -> loading (the server answers its health check; woken from sleep if it has
    vLLM's sleep mode) -> warming (signed synthetic requests, `prewarm.policy.warmup`, sent
    through `OpenAICompatibleAdapter`; then validation) -> ready, with the pod's endpoint.

The steps are `workers.node.bringup.bring_up`, the same bring-up the node agents run; this
module adds what is particular to a pod: its replica id, the pod going away mid-warmup, its
time to ready counted from the pod's creation (the planner's lead, per model, revision and node
class, with the image pulls it waited for recorded apart), heartbeats and keep-alives while it lives.

Validation over the OpenAI API: the numeric check reads the top-k log-probabilities of a
probe's next token (`logprobs`) and the performance check compares the warm latency with
the baseline recorded for the model on this node class (the median of the first
`warmup.baseline_samples` validated replicas). The structural check cannot run, because such servers do not list their
tensors: it is recorded as "unsupported" (metric and report), which is an honest result,
not a pass. A server without logprobs fails the numeric check unless
`kubernetes.pod_require_logprobs` is false, in which case it is recorded as unsupported.

Failures (server unreachable, garbage answers, NaN logits, too slow) mark the replica
`failed` with a reason and count `model_loading_failures_total{model,node,reason}`.

Replica ids: `model@revision/<node>/<slot>` where node is the pod's `spec.nodeName` and
slot = EXTERNAL_SLOT_BASE + (first 8 bytes of sha256("<namespace>/<pod name>") as an
integer) mod EXTERNAL_SLOT_SPAN. The same pod always gets the same id (a pod seen twice,
or by a restarted watcher, is one replica); the slots start at one million so they never
meet the small slot numbers of agent-hosted replicas on the same node; two pods on one
node collide with probability about n^2 / 2e9 (n pods on the node).

Heartbeats: every `registry.heartbeat_interval_s` the pods are listed once and each
tracked replica whose pod is still there and Ready gets a heartbeat; a replica whose pod
was deleted or turned unready is drained and retired (failed, if it was still warming).
A pod that turns Ready again is handed over again and warmed again (its container may
have restarted cold). When this process stops, the replicas stay as they are: a watcher
started again adopts the ready ones without warming them again, and otherwise their
heartbeats expire and the reaper fails them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

from kubernetes import client as k8s_client

from prewarm.adapters.k8s import call
from prewarm.adapters.k8s_watch import ImagePull, PodWatcher, ReadyPod, WatchStats, image_pulls, pod_is_ready
from prewarm.adapters.runtimes import OpenAICompatibleAdapter
from prewarm.adapters.vllm import VllmAdapter
from prewarm.policy.engine_checks import EngineFacts
from prewarm.core import keys
from prewarm.core.domain import TERMINAL_STATES, Pool, Replica, ReplicaState, check_key_ref, check_name, replica_id
from prewarm.core.errors import IllegalTransition, InvalidPayload, PermanentError, PrewarmError, ReplicaNotFound, \
    TemporaryError, failure_reason
from prewarm.core.settings import Settings
from prewarm.policy.warmup import WarmupPlan, generate_requests
from workers.context import WorkerContext
from workers.node.bringup import BringUpSpec, bring_up, owner_token
from workers.node.lock import ReplicaLock
from workers.pod_tiers import tier_round

log = logging.getLogger("prewarm.external")

EXTERNAL_SLOT_BASE = 1_000_000
EXTERNAL_SLOT_SPAN = 1_000_000_000
RESULTS_KEPT = 1000


def pod_slot(namespace: str, pod_name: str) -> int:
    """The stable slot of a pod (see the module docstring)."""
    digest = hashlib.sha256(f"{namespace}/{pod_name}".encode()).digest()
    return EXTERNAL_SLOT_BASE + int.from_bytes(digest[:8], "big") % EXTERNAL_SLOT_SPAN


def pod_replica_id(model: str, revision: str, pod: ReadyPod) -> str:
    """`model@revision/<pod's node>/<pod_slot>`; a pod without a node name cannot be placed."""
    if not pod.node:
        raise InvalidPayload(f"pod {pod.namespace}/{pod.name} has no spec.nodeName; cannot name its replica")
    return replica_id(model, revision, check_name(pod.node, f"node of pod {pod.name}"), pod_slot(pod.namespace, pod.name))


@dataclass(frozen=True)
class PodTarget:
    """What the pods serve and how they are validated."""

    model: str  # registry name (what clients of the gateway ask for)
    revision: str
    served_model: str  # the name the pods' server knows the model by (the `model` field it expects)
    pool: Pool = Pool.SERVING
    node_class: str = "cpu"  # latency baselines are kept per model and node class
    require_logprobs: bool = True
    sleep_mode: bool = False
    api_key: str | None = None
    api_key_ref: str = ""  # registered with each replica: the name under which the gateway holds `api_key`
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    vllm: bool = False  # the pods run vLLM (engine.models): validated by probes against the revision's reference

    def __post_init__(self) -> None:
        check_name(self.model, "model")
        check_name(self.revision, "revision")
        check_name(self.node_class, "node class")
        check_key_ref(self.api_key_ref, "the pods' API key reference")
        if not self.served_model:
            raise InvalidPayload("the served model name must not be empty")


class PodOutcome(str, Enum):
    READY = "ready"  # warmed, validated and registered now
    ALREADY_READY = "already_ready"  # ready in the registry at this endpoint (a restarted watcher): adopted
    FAILED = "failed"
    SKIPPED = "skipped"  # the same pod is being warmed already


@dataclass(frozen=True)
class PodResult:
    pod: str
    replica_id: str
    outcome: PodOutcome
    reason: str = ""
    cold_start_s: float | None = None  # creation (or re-registration) to validated, for READY


class PodGone(PermanentError):
    reason = "pod_gone"
    """The pod went away (or unready) while it was being warmed."""


@dataclass
class _Tracked:
    pod: ReadyPod
    replica: Replica


class PodPrewarmer:
    """The `on_ready` side of the pod watcher, plus the heartbeats of the replicas it made."""

    def __init__(self, ctx: WorkerContext, target: PodTarget, *,
                 adapter_factory: Callable[[str], OpenAICompatibleAdapter] | None = None,
                 pulls: Callable[[ReadyPod], tuple[ImagePull, ...]] | None = None) -> None:
        self.ctx = ctx
        self.target = target
        self.pulls = pulls  # the image pulls a pod waited for (its events); None: none known
        self.adapter_factory = adapter_factory or self._adapter
        self.poll_s = 0.1
        self._mu = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}  # replica id -> pod, for heartbeats and retirement
        self._inflight: set[str] = set()
        self.results: deque[PodResult] = deque(maxlen=RESULTS_KEPT)  # the latest outcomes, for logs and the CLI

    def _adapter(self, endpoint: str) -> OpenAICompatibleAdapter:
        t = self.target
        if t.vllm:
            return VllmAdapter(endpoint, api_key=t.api_key, model=t.served_model, timeout_s=t.request_timeout_s)
        return OpenAICompatibleAdapter(endpoint, token=t.api_key, timeout_s=t.request_timeout_s,
                                       model=t.served_model, has_sleep_mode=t.sleep_mode)

    def tracked(self) -> dict[str, ReadyPod]:
        with self._mu:
            return {rid: t.pod for rid, t in self._tracked.items()}

    # --- a pod turned Ready -------------------------------------------------------------
    def handle(self, pod: ReadyPod) -> PodResult:
        """Warm, validate and register one Ready pod. Never raises for the pod's own failures."""
        try:
            rid = pod_replica_id(self.target.model, self.target.revision, pod)
        except InvalidPayload as exc:
            log.error("pod %s/%s skipped: %s", pod.namespace, pod.name, exc)
            return self._done(PodResult(pod.name, "", PodOutcome.FAILED, str(exc)))
        with self._mu:
            if rid in self._inflight:
                return self._done(PodResult(pod.name, rid, PodOutcome.SKIPPED, "being warmed already"))
            self._inflight.add(rid)
        try:
            lock = ReplicaLock(self.ctx.client, rid, owner_token(f"pod:{pod.uid}"), self.ctx.settings.agent.lock_ttl_s)
            try:
                lock.acquire(deadline=time.monotonic() + self.target.ready_timeout_s)
            except TimeoutError as exc:  # another watcher works on this pod: leave it to that one
                log.warning("pod %s: %s; left to its holder", pod.name, exc)
                return self._done(PodResult(pod.name, rid, PodOutcome.SKIPPED, str(exc)))
            with lock:
                return self._done(self._prewarm(rid, pod, lock))
        except Exception as exc:  # noqa: BLE001 - one pod's failure is recorded, never raised into the watch
            return self._done(self._fail(rid, pod, exc))
        finally:
            with self._mu:
                self._inflight.discard(rid)

    def _done(self, result: PodResult) -> PodResult:
        with self._mu:
            self.results.append(result)
        return result

    def _prewarm(self, rid: str, pod: ReadyPod, lock: ReplicaLock) -> PodResult:
        ctx, t = self.ctx, self.target
        rec = ctx.registry.get(rid)
        with self._mu:
            seen_here = rid in self._tracked and self._tracked[rid].pod.uid == pod.uid
        if rec is not None and rec.state is ReplicaState.READY and rec.endpoint == pod.endpoint and not seen_here:
            self._track(pod, rec)
            log.info("pod %s: replica %s is already ready at %s; adopted", pod.name, rid, pod.endpoint)
            return PodResult(pod.name, rid, PodOutcome.ALREADY_READY)
        if rec is not None and rec.state not in TERMINAL_STATES:
            # Handed over again (it was unready in between: its server may have restarted cold),
            # moved to another IP, or left half-done by a watcher that died: start over.
            self._end(rid, rec, f"pod {pod.name} was handed over again: warming it anew", fail_code="superseded")
        # Time to ready runs from the pod's creation the first time this pod is seen (scheduling, server
        # start and load are all part of a cold start in a cluster), less the image pulls it waited for
        # (recorded apart: only a node's first start of an image pays them); a pod handed over again (its
        # container restarted) counts from its new registration.
        first_time = rec is None and pod.created_at is not None
        pulled = self._image_pulls(pod) if first_time else 0.0
        now = ctx.clock()
        fresh = Replica(model=t.model, revision=t.revision, node=pod.node, slot=pod_slot(pod.namespace, pod.name),
                        endpoint=pod.endpoint, pool=t.pool, state=ReplicaState.PENDING, created_at=now,
                        updated_at=now, heartbeat_at=now, auth_ref=t.api_key_ref)
        ctx.registry.register(fresh, now=now)
        self._track(pod, fresh)
        spec = BringUpSpec(model=t.model, node=pod.node, node_class=t.node_class, served_model=t.served_model,
                           expected=None,  # such servers do not list their tensors: structural is "unsupported"
                           started_at=pod.created_at if first_time and pod.created_at is not None else now,
                           require_logprobs=t.require_logprobs, load_timeout_s=t.ready_timeout_s,
                           label=f"pod={pod.name}", revision=t.revision, excluded_s=pulled,
                           engine_expect=EngineFacts(t.served_model, None, None) if t.vllm else None)
        adapter = self.adapter_factory(pod.endpoint)
        done = bring_up(ctx, fresh, spec, connect=lambda _rec: adapter,
                        transition=lambda to, expected, reason: self._step(rid, to, expected, reason),
                        check=lambda: self._check(rid, pod, lock), poll_s=self.poll_s)
        self._track(pod, done.replica)
        return PodResult(pod.name, rid, PodOutcome.READY, done.report.reason if done.report else "",
                         done.cold_start_s)

    def _image_pulls(self, pod: ReadyPod) -> float:
        """Seconds the pod waited for image pulls, recorded apart (`record_image_pull`, `model_image_pull_seconds`):
        the first start of an image on a node pulls it, later starts find it there, so the pull is no part of
        the lead the planner plans with. Unknown (no events readable): 0, the lead keeps it (the safe side)."""
        if self.pulls is None:
            return 0.0
        try:
            pulls = self.pulls(pod)
        except (PrewarmError, OSError) as exc:
            log.warning("pod %s: its image pulls are unknown (%s); its lead includes them", pod.name, exc)
            return 0.0
        t = self.target
        for p in pulls:
            self.ctx.registry.record_image_pull(t.model, t.revision, t.node_class, p.seconds)
            self.ctx.metrics.image_pull.labels(t.model, pod.node).observe(p.seconds)
            log.info("pod %s on %s waited %.1fs for image %s (kept out of its lead)", pod.name, pod.node, p.seconds,
                     p.image)
        return sum(p.seconds for p in pulls)

    def _step(self, rid: str, to: ReplicaState, expected: ReplicaState, reason: str = "") -> Replica:
        try:
            return self.ctx.registry.transition(rid, to, now=self.ctx.clock(), expected=expected, reason=reason)
        except IllegalTransition as exc:
            rec = self.ctx.registry.get(rid)
            if rec is not None and rec.state in TERMINAL_STATES:
                raise PodGone(f"replica {rid} became {rec.state.value} while it was warmed: {rec.reason}") from exc
            raise

    def _check(self, rid: str, pod: ReadyPod, lock: ReplicaLock) -> None:
        if lock.lost.is_set():
            raise TemporaryError(f"replica {rid}: another watcher took its lock over")
        with self._mu:
            still = rid in self._tracked and self._tracked[rid].pod.uid == pod.uid
        if not still:
            raise PodGone(f"pod {pod.name} went away or turned unready while it was warmed")

    def _fail(self, rid: str, pod: ReadyPod, exc: BaseException) -> PodResult:
        code = failure_reason(exc)
        detail = f"{code}: {exc}"[:500]
        with self._mu:
            self._tracked.pop(rid, None)
        counted = False  # a replica the heartbeat loop already ended (its pod left) is not a load failure
        if rid:
            try:
                rec = self.ctx.registry.get(rid)
                if rec is not None and rec.state not in TERMINAL_STATES:
                    self.ctx.registry.transition(rid, ReplicaState.FAILED, now=self.ctx.clock(), reason=detail)
                    counted = True
            except (PrewarmError, OSError) as rexc:
                log.warning("could not mark %s failed: %s", rid, rexc)
        if counted:
            self.ctx.metrics.loading_failures.labels(self.target.model, pod.node or "unknown", code).inc()
        log.error("[COLDSTART] replica=%s model=%s node=%s pod=%s state=failed reason=%s detail=%s", rid,
                  self.target.model, pod.node, pod.name, code, str(exc).replace("\n", " | ")[:1000])
        return PodResult(pod.name, rid, PodOutcome.FAILED, detail)

    def _track(self, pod: ReadyPod, rec: Replica) -> None:
        with self._mu:
            self._tracked[rec.id] = _Tracked(pod, rec)

    # --- while the pods live ------------------------------------------------------------
    def keepalive_round(self) -> dict[str, int]:
        """KEEP_WARM for pods: each ready tracked replica the planner holds (`keys.keep_warm(rid)` in the
        future, set by the executor's HOLD) gets a round of signed synthetic requests, as agents send to
        theirs. Returns {replica id: requests sent}."""
        ctx, t = self.ctx, self.target
        now = ctx.clock()
        with self._mu:
            tracked = dict(self._tracked)
        sent: dict[str, int] = {}
        for rid, tr in tracked.items():
            until = ctx.client.get(keys.keep_warm(rid))
            if until is None or float(until) <= now or tr.replica.state is not ReplicaState.READY:
                continue
            wcfg = ctx.settings.warmup
            plan = WarmupPlan.from_settings(t.served_model, wcfg, count=max(1, min(wcfg.requests, 2)),
                                            seed=wcfg.seed + int(now))
            requests = generate_requests(plan, secret=wcfg.require_secret(), now=now)
            try:
                self.adapter_factory(tr.pod.endpoint).warmup(requests)
            except (PrewarmError, OSError) as exc:
                log.warning("keep-alive of %s (pod %s) failed: %s", rid, tr.pod.name, exc)
                continue
            ctx.metrics.warmup_requests.labels(t.model, "keepalive").inc(len(requests))
            sent[rid] = len(requests)
        return sent

    def tier_round(self) -> dict[str, str]:
        """With `sleep_mode`: park ready pods asleep, or wake them, to the planner's awake count
        (`workers.pod_tiers`). A pod whose server refused to sleep is warmed and registered again."""
        t = self.target
        if not t.sleep_mode:
            return {}
        with self._mu:
            tracked = {rid: tr.pod for rid, tr in self._tracked.items()}
        done = tier_round(self.ctx, t.model, t.node_class, {rid: pod.endpoint for rid, pod in tracked.items()},
                          self.adapter_factory, owner_token("pod-tiers"), self._retrack, revision=t.revision)
        for rid, what in done.items():
            if what == "failed":
                self.handle(tracked[rid])
        return done

    def _retrack(self, rec: Replica) -> None:
        with self._mu:
            if rec.id in self._tracked:
                self._tracked[rec.id] = _Tracked(self._tracked[rec.id].pod, rec)

    def sync(self, pods: Mapping[str, Any]) -> dict[str, str]:
        """One heartbeat round over `pods` (name -> pod object as listed): a tracked replica whose
        pod is there and Ready gets a heartbeat; one whose pod is gone or unready is retired.
        Returns {replica id: "heartbeat" | "retired" | "failed" | "dropped"} for what it did."""
        now = self.ctx.clock()
        done: dict[str, str] = {}
        with self._mu:
            tracked = dict(self._tracked)
        for rid, t in tracked.items():
            pod = pods.get(t.pod.name)
            alive = pod is not None and str(pod.metadata.uid or "") == t.pod.uid and pod_is_ready(pod)
            try:
                if alive:
                    stored = self.ctx.registry.heartbeat(t.replica, now=now)
                    if stored.state in TERMINAL_STATES:
                        self._untrack(rid, t)
                        done[rid] = "dropped"
                    else:
                        done[rid] = "heartbeat"
                    continue
                why = f"pod {t.pod.name} was deleted" if pod is None or str(pod.metadata.uid or "") != t.pod.uid \
                    else f"pod {t.pod.name} is not Ready"
                self._untrack(rid, t)
                rec = self.ctx.registry.get(rid)
                done[rid] = self._end(rid, rec, why) if rec is not None else "dropped"
                log.info("replica %s: %s -> %s", rid, why, done[rid])
            except (PrewarmError, OSError) as exc:
                log.warning("heartbeat of %s failed: %s", rid, exc)
        return done

    def _untrack(self, rid: str, t: _Tracked) -> None:
        with self._mu:
            if self._tracked.get(rid) is t:
                del self._tracked[rid]

    def _end(self, rid: str, rec: Replica | None, why: str, *, fail_code: str = "pod_gone") -> str:
        """Drain and retire a ready replica; fail one still warming; leave a terminal one."""
        now = self.ctx.clock()
        try:
            if rec is None or rec.state in TERMINAL_STATES:
                return "dropped"
            if rec.state is ReplicaState.READY:
                rec = self.ctx.registry.transition(rid, ReplicaState.DRAINING, now=now, reason=why)
            if rec.state in (ReplicaState.DRAINING, ReplicaState.PENDING):
                self.ctx.registry.transition(rid, ReplicaState.RETIRED, now=now, reason=why)
                return "retired"
            self.ctx.registry.transition(rid, ReplicaState.FAILED, now=now, reason=f"{fail_code}: {why}")
            return "failed"
        except (IllegalTransition, ReplicaNotFound):
            return "dropped"  # someone else moved it meanwhile


def list_pods(watcher: PodWatcher, selector: str) -> dict[str, Any]:
    """The watched Deployment's pods by name (one list call)."""
    what = f"pods (labelSelector {selector}) in namespace {watcher.namespace}"
    listing = call(lambda: watcher.core.list_namespaced_pod(watcher.namespace, label_selector=selector,
                                                             _request_timeout=10), "list", what)
    return {p.metadata.name: p for p in listing.items or [] if p.metadata is not None and p.metadata.name}


@dataclass(frozen=True)
class PrewarmPodsStats:
    watch: WatchStats
    results: tuple[PodResult, ...]


def run_pod_prewarmer(
    ctx: WorkerContext,
    api: k8s_client.ApiClient,
    namespace: str,
    deployment: str,
    target: PodTarget,
    *,
    stop: threading.Event | None = None,
    max_ready: int | None = None,
    watch_timeout_s: int = 30,
    concurrency: int | None = None,
) -> PrewarmPodsStats:
    """Watch `deployment` and prewarm its pods until `stop` is set (or `max_ready` handovers were
    handled, then wait for their warmups). Pods are warmed on a thread pool so that a slow pod
    never holds up the watch; a heartbeat thread keeps the replicas fresh while their pods live."""
    stop = stop or threading.Event()
    kube = ctx.settings.kubernetes
    watcher = PodWatcher(api, namespace, deployment, pod_port=kube.pod_port, watch_timeout_s=watch_timeout_s)
    selector = watcher.selector()
    prewarmer = PodPrewarmer(ctx, target, pulls=lambda pod: image_pulls(watcher.core, pod))
    pool = ThreadPoolExecutor(max_workers=concurrency or kube.pod_concurrency, thread_name_prefix="pod-warm")
    beat_stop = threading.Event()

    def beat() -> None:
        interval = ctx.settings.registry.heartbeat_interval_s
        while not beat_stop.wait(interval):
            try:
                prewarmer.sync(list_pods(watcher, selector))
            except Exception as exc:  # noqa: BLE001 - the loop must outlive an API server or Redis blip
                log.warning("pod heartbeat round failed: %s", exc)

    def keeper() -> None:
        while not beat_stop.wait(ctx.settings.warmup.keepalive_interval_s):
            try:
                prewarmer.tier_round()  # asleep or awake, as the planner wants, before keeping the awake warm
                prewarmer.keepalive_round()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a Redis blip
                log.warning("pod keep-alive round failed: %s", exc)

    beater = threading.Thread(target=beat, name="pod-heartbeat", daemon=True)
    beater.start()
    kept = threading.Thread(target=keeper, name="pod-keepalive", daemon=True)
    kept.start()
    log.info("prewarming the pods of deployments/%s in %s (selector %s) as %s@%s", deployment, namespace, selector,
             target.model, target.revision)
    try:
        stats = watcher.run(lambda pod: pool.submit(prewarmer.handle, pod), stop=stop, max_ready=max_ready)
        pool.shutdown(wait=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        beat_stop.set()
        beater.join(timeout=5)
        kept.join(timeout=5)
    return PrewarmPodsStats(stats, tuple(prewarmer.results))


def target_from(settings: Settings, *, model: str, revision: str, served_model: str | None, pool: str,
                node_class: str | None) -> PodTarget:
    """A `PodTarget` from the CLI's arguments and the `kubernetes.pod_*` settings."""
    kube = settings.kubernetes
    return PodTarget(
        model=model, revision=revision, served_model=served_model or model, pool=Pool(pool),
        node_class=node_class or settings.agent.node_class, require_logprobs=kube.pod_require_logprobs,
        sleep_mode=kube.pod_sleep_mode, api_key=kube.pod_api_key.get_secret_value() if kube.pod_api_key else None,
        api_key_ref=kube.pod_api_key_ref,
        ready_timeout_s=kube.pod_ready_timeout_s, vllm=settings.engine.engine_of(model) == "vllm",
    )


def run_cli(settings: Settings, api: k8s_client.ApiClient, namespace: str, deployment: str, target: PodTarget, *,
            count: int | None = None, metrics_port: int | None = None) -> int:
    """`prewarm k8s prewarm-pods`: runs until SIGTERM/SIGINT (or `count` handovers); prints one line per pod."""
    import json

    from prometheus_client import CollectorRegistry, start_http_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = WorkerContext.build(settings, registry=CollectorRegistry())
    settings.warmup.require_secret()  # fail at start, not at the first pod
    if metrics_port:
        start_http_server(metrics_port, addr="0.0.0.0", registry=ctx.metrics.registry)
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        out = run_pod_prewarmer(ctx, api, namespace, deployment, target, stop=stop, max_ready=count)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for r in out.results:
        print(json.dumps({"pod": r.pod, "replica_id": r.replica_id, "outcome": r.outcome.value, "reason": r.reason}),
              flush=True)
    failed = sum(1 for r in out.results if r.outcome is PodOutcome.FAILED)
    log.info("pod prewarmer of %s stopped (pid %d): %d pods handled, %d failed", deployment, os.getpid(),
             len(out.results), failed)
    return 1 if failed and count is not None else 0
