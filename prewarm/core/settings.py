"""One settings root with grouped sub-settings, validated when built.

Each group reads `PREWARM_<GROUP>_<FIELD>` environment variables (for example
`PREWARM_REDIS_URL`, `PREWARM_GATEWAY_PORT`); an optional file (`PREWARM_CONFIG` or
`--config`, TOML or YAML, one table per group) supplies values the environment does not
set. An invalid value fails at start with a `SettingsError` naming the variable.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import socket
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from typing import Annotated

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from prewarm.core import redis_url
from prewarm.core.domain import check_key_ref
from prewarm.core.errors import InvalidPayload, SettingsError
from prewarm.core.engine_settings import EngineName, EngineSettings
from prewarm.core.planner_settings import PlannerSettings
from prewarm.core.settings_base import _Group

__all__ = ["EngineName", "EngineSettings", "PlannerSettings"]  # re-exported: every group is read from here


class RedisSettings(_Group):
    """Where the registry and the Celery broker live. Unset url: prewarm starts an embedded Redis."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_REDIS_", extra="forbid")
    group: ClassVar[str] = "redis"

    # redis://[:password@]host:port/db, rediss:// for TLS, unix:///path, or a Sentinel group
    # sentinel://[:password@]host:port[,host:port...]/db with sentinel_master (prewarm/core/redis_url.py)
    url: str | None = None
    password: SecretStr | None = None  # used when the URL carries none
    socket_timeout_s: float = Field(2.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    broker_db: int | None = Field(None, ge=0)  # a separate db for Celery; default: the same as the registry
    tls_ca_file: str | None = None
    tls_verify: bool = True
    sentinel_master: str | None = Field(None, validate_default=True)  # the primary's name the Sentinels watch (required with sentinel://)
    sentinel_password: SecretStr | None = None  # the Sentinels' own password, when they require one
    # Replicas that must hold an outbox record (and a registration) before the write counts (Redis WAIT):
    # what a failover cannot lose. None: 1 with sentinel:// (a group has a replica to promote), 0 otherwise.
    # A group left with fewer replicas (its old primary dead) waits for those it has (docs/operating.md, "Tasks across a failover").
    wait_replicas: int | None = Field(None, ge=0)
    wait_timeout_ms: int = Field(100, ge=1)  # longest WAIT; a replica slower than this is counted short

    @property
    def effective_wait_replicas(self) -> int:
        if self.wait_replicas is not None:
            return self.wait_replicas
        address = self.address
        return 1 if address is not None and address.is_sentinel else 0

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        redis_url.parse(v)  # ValueError naming what is wrong: scheme, database index, Sentinel list
        return v

    @field_validator("sentinel_master")
    @classmethod
    def _master_with_sentinel(cls, v: str | None, info: Any) -> str | None:
        url = info.data.get("url")
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        if url and url.startswith("sentinel://") and v is None:
            raise ValueError("is required with a sentinel:// PREWARM_REDIS_URL (the name the Sentinels monitor)")
        return v

    @property
    def address(self) -> redis_url.RedisAddress | None:
        return redis_url.parse(self.url) if self.url else None


class GatewaySettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_GATEWAY_", extra="forbid")
    group: ClassVar[str] = "gateway"

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    warm_threshold: float = Field(0.7, ge=0, le=1)  # loading progress under which requests go to the warm pool
    hold_timeout_s: float = Field(0.0, ge=0)  # hold a request this long for a replica to become ready; 0: 503 at once
    # a held request that waited longer than this counts as waited for capacity (the cold-start budget's
    # observation); the simulator's wait_threshold_s, so live and replayed misses are the same thing
    wait_threshold_s: float = Field(0.5, ge=0)
    retry_after_s: int = Field(5, ge=1)  # Retry-After on 503
    max_body_bytes: int = Field(1_048_576, gt=0)
    upstream_timeout_s: float = Field(120.0, gt=0)  # idle timeout: longest wait for the next bytes of an answer
    connect_timeout_s: float = Field(2.0, gt=0)  # a replica that does not accept a connection this fast is gone
    refresh_interval_s: float = Field(0.5, gt=0)  # how long a routing view may be reused
    # Redis away (restart, Sentinel failover): route from the last good view for at most this long
    # (prewarm/policy/stale_view.py). Longer than a failover (~5-15 s) or a restart with AOF
    # (~10-30 s); short enough that a replica drained or dead meanwhile is not routed for long. 0: off.
    stale_view_max_s: float = Field(60.0, ge=0)
    warmup_forged: Literal["plain", "refuse"] = "plain"  # a forged X-Warmup: routed as user traffic, or 403
    failure_threshold: int = Field(3, ge=1)  # consecutive upstream failures before a replica is marked failed
    replica_concurrency: int = Field(8, ge=1)  # requests in flight that saturate a replica: more spill to the warm pool
    replica_queue_limit: int = Field(128, ge=1)  # requests in flight to one replica at most; all full: 429 + Retry-After
    header_timeout_s: float = Field(10.0, gt=0)  # a connection must send a request's headers within this (slowloris)
    max_connections_per_client: int = Field(256, ge=0)  # open connections per client address; 0: no cap (over it: 429)
    # Directory of the upstreams' own API keys, one file per key named by its reference `<secret>/<key>`
    # (the chart mounts each model's key Secret here). A replica registered with `auth_ref` gets that key;
    # one without gets `runtime.api_key`. The registry holds only references, never keys.
    upstream_keys_dir: str | None = None
    upstream_keys_refresh_s: float = Field(30.0, gt=0)  # a key file is read again after this (Secret rotation)
    # Clients' API keys (prewarm.gateway.client_auth): a directory with one file per client (its name; its
    # content the key), as a mounted Secret. Set: a user request without a known key is 401, and fair shares
    # are per named client. Unset: no authentication (a bearer token, if any, still names the client).
    client_keys_dir: str | None = None
    client_keys_refresh_s: float = Field(30.0, gt=0)  # the directory is read again after this (rotation)
    # Issue 20 (fair under abuse). A body trickled a byte at a time held a connection for a minute:
    body_timeout_s: float = Field(30.0, gt=0)  # a request body must arrive within this of its headers (else 408)
    write_timeout_s: float = Field(30.0, gt=0)  # a client that reads nothing of an answer this long is cut, its slot freed
    # Behind an ingress every client shares its address: X-Forwarded-For is believed only from these
    # networks (CIDRs), which are exempt from the connection cap; their clients are capped by request instead.
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Admission bounds the expected wait, not a count (a 500-token request is not a 4-token one): a request
    # is admitted while the work queued for the model drains within max_queue_wait_s, and past that only a
    # client under its fair share (the bound split between the clients with work queued) is. 20 s: the
    # client timeout the clients used; a request queued longer than that is a request lost.
    max_queue_wait_s: float = Field(20.0, gt=0)
    # Drain rate (tokens/s per model) assumed until the gateway has measured one (after a busy second):
    # one replica generating one request at a time on a small GPU model; a new model starts here.
    assumed_tokens_per_s: float = Field(100.0, gt=0)

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _proxies(cls, v: Any) -> Any:
        items = [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v
        for item in items:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"{item!r} is not an IP network (CIDR) of a trusted proxy: {exc}") from None
        return items


class RegistrySettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_REGISTRY_", extra="forbid")
    group: ClassVar[str] = "registry"

    heartbeat_interval_s: float = Field(5.0, gt=0)
    heartbeat_ttl_s: float = Field(15.0, gt=0)  # a replica without a heartbeat this long is not routable
    reaper_interval_s: float = Field(5.0, gt=0)
    retired_keep_s: float = Field(3600.0, ge=0)  # how long retired/failed records stay for inspection

    @field_validator("heartbeat_ttl_s")
    @classmethod
    def _ttl_above_interval(cls, v: float, info: Any) -> float:
        interval = info.data.get("heartbeat_interval_s")
        if interval is not None and v <= interval:
            raise ValueError(f"must be greater than heartbeat_interval_s ({interval})")
        return v


class WarmupSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_WARMUP_", extra="forbid")
    group: ClassVar[str] = "warmup"

    secret: SecretStr | None = None  # shared HMAC secret for warmup traffic and control endpoints

    @field_validator("secret")
    @classmethod
    def _secret_not_empty(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("must not be empty: an empty HMAC key signs nothing (unset it instead)")
        return v
    requests: int = Field(8, ge=1)  # synthetic requests per warmup
    prompt_mean_tokens: float = Field(23.0, gt=0)
    prompt_sd_tokens: float = Field(5.0, ge=0)
    prompt_distribution: Literal["gaussian", "uniform", "lognormal", "fixed"] = "gaussian"  # shape of prompt lengths
    prompt_max_tokens: int | None = Field(None, ge=1)  # clip long prompts; None: no upper clip
    prompt_token_unit: Literal["word", "byte"] = "word"  # what a prompt "token" counts: words, or UTF-8 bytes (byte tokenizers)
    max_tokens: int = Field(1, ge=1)
    topics: dict[str, float] = Field(
        default_factory=lambda: {"code": 0.4, "chat": 0.3, "summarize": 0.2, "translate": 0.1}
    )
    seed: int = 0
    keepalive_interval_s: float = Field(10.0, gt=0)  # period of synthetic requests on held replicas
    logits_mean_bound: float = Field(50.0, gt=0)  # |mean logit| above this fails numeric validation
    latency_factor: float = Field(1.2, gt=1)  # warm latency must be <= factor x baseline
    # The baseline is the median of the first this many validated replicas of a model on a node class,
    # not the first one alone: one slow (or lucky) first replica must not set the bar for a week.
    # Until that many have passed, the speed check has nothing to compare with (it records a sample).
    baseline_samples: int = Field(5, ge=1)

    def require_secret(self) -> str:
        if self.secret is None or not self.secret.get_secret_value():
            raise SettingsError("PREWARM_WARMUP_SECRET is not set: warmup signing needs a shared secret")
        return self.secret.get_secret_value()


class KubernetesSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_KUBERNETES_", extra="forbid")
    group: ClassVar[str] = "kubernetes"

    enabled: bool = False  # the cluster owns the replica count; agents and the pod warmer only warm and register
    namespace: str = "default"
    # Which one path carries the planner's target to the Deployment: "keda" (the external scaler
    # serves it), "hpa" (the HPA reads prewarm_planner_target_replicas as an External metric) or
    # "none" (the planner sets the Deployment's replicas through the scale subresource).
    autoscaling: Literal["keda", "hpa", "none"] = "none"
    deployment: str | None = None  # inference Deployment to scale (autoscaling "none")
    deployments: dict[str, str] = Field(default_factory=dict)  # model -> its Deployment, when there are several
    # The most replicas the planner sets on a Deployment with autoscaling "none" (with KEDA or the HPA,
    # their maxReplicaCount / maxReplicas bound it): a forecast or a feedback loop gone wrong must not
    # scale a GPU Deployment without limit. The chart passes its autoscaling.maxReplicas (8 by default).
    max_replicas: int = Field(8, ge=0)
    max_replicas_by_model: dict[str, int] = Field(default_factory=dict)  # model -> its own cap (chart targets)
    kubeconfig: str | None = None  # default: in-cluster config, then ~/.kube/config
    dry_run: bool = False
    node_selector: str = "gpu.feature/preload=true"
    pod_port: int = Field(8000, ge=1, le=65535)
    # --- prewarming the pods of an inference Deployment (`prewarm k8s prewarm-pods`) ---
    pod_api_key: SecretStr | None = None  # bearer token of the pods' OpenAI-compatible servers (vLLM --api-key)
    # the reference (`<secret>/<key>`) of that token registered with each pod's replica: the gateway reads the
    # key under that name from `gateway.upstream_keys_dir`; '' the pods take the runtimes' own key (runtime.api_key)
    pod_api_key_ref: str = ""
    pod_sleep_mode: bool = False  # the pods' servers have vLLM-style /sleep, /wake_up, /is_sleeping
    pod_ready_timeout_s: float = Field(120.0, gt=0)  # a Ready pod's server must pass its health check within this
    pod_require_logprobs: bool = True  # numeric validation needs logprobs; False: "unsupported" is accepted
    pod_concurrency: int = Field(4, ge=1)  # pods warmed at the same time

    @field_validator("pod_api_key_ref")
    @classmethod
    def _key_ref(cls, v: str) -> str:
        try:
            return check_key_ref(v)
        except InvalidPayload as exc:
            raise ValueError(str(exc)) from None


class RuntimeSettings(_Group):
    """The model host (`prewarm serve-model`)."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_RUNTIME_", extra="forbid")
    group: ClassVar[str] = "runtime"

    host: str = "127.0.0.1"
    port: int = Field(8001, ge=0, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    first_layers: int | None = Field(None, ge=1)  # K of phase 2; default a quarter of the layers
    snapshot_dir: str = "/dev/shm/prewarm-snapshots"
    snapshot_max_bytes: int = Field(8 * 1024**3, gt=0)
    # A replica whose node has no snapshot of its weights yet waits this long for another replica already
    # filling it (`SnapshotStore.fill`) before it reads the original itself: about one whole read of a large
    # model (140 GB at 1.2 GB/s), so only a stuck filler runs it out. 0: never wait (all read at once).
    snapshot_fill_wait_s: float = Field(120.0, ge=0)
    models_dir: str = ".prewarm/models"
    token: SecretStr | None = None  # Bearer token of the control endpoints; unset (loopback only): the warmup secret
    api_key: SecretStr | None = None  # Bearer token /v1/*, /stats and /metrics require (gateway, agents send it)
    workers: int = Field(2, ge=1)  # threads that run generation (the event loop never computes)
    load_wait_s: float = Field(0.0, ge=0)  # a request before phase 1 is in waits this long, then 503 + Retry-After
    drain_timeout_s: float = Field(30.0, gt=0)  # sleep waits this long for in-flight requests to finish
    read_limit_bps: float | None = Field(None, gt=0)  # cap on weight-read bandwidth (spare the node's disk); None: no cap


class AgentSettings(_Group):
    """A node agent: a Celery worker consuming `prewarm.node.<node>`."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_AGENT_", extra="forbid")
    group: ClassVar[str] = "agent"

    node: str = Field(default_factory=socket.gethostname)  # in Kubernetes: spec.nodeName via the downward API
    node_class: str = "cpu"  # GPU model or machine class; latency baselines are per class
    replica_slots: int = Field(2, ge=1)
    gpu_memory_gb: float = Field(0.0, ge=0)  # GPU memory the fleet planner may fill here (0: unknown, slots only)
    host_memory_gb: float = Field(0.0, ge=0)  # host memory for sleeping replicas' weights
    port_base: int = Field(18000, ge=1024, le=65000)  # runtime ports are port_base + slot
    advertise_host: str = "127.0.0.1"
    max_attempts: int = Field(3, ge=1)  # deliveries of one task before it is given up
    fragmentation_threshold: float = Field(0.3, gt=0, le=1)
    task_time_limit_s: int = Field(900, gt=0)
    # --- the Celery pipeline (workers/) ---
    visibility_timeout_s: int | None = Field(None, gt=0)  # broker redelivery of unacked tasks; None: time limit + 60 s
    restore_interval_s: int = Field(10, ge=1)  # how often a worker sweeps for unacked tasks past the visibility timeout
    lock_ttl_s: float = Field(30.0, gt=0)  # replica work lock; refreshed every third of it while a task works
    retry_backoff_s: float = Field(2.0, gt=0)  # first retry delay of a temporary failure (doubles per attempt)
    concurrency: int | None = Field(None, ge=1)  # worker threads; None: replica_slots + 2
    state_dir: str = ".prewarm/agent"  # runtime pid files and logs (adoption after an agent crash)
    runtime_start_timeout_s: float = Field(120.0, gt=0)  # a spawned runtime must answer /healthz within this
    drain_timeout_s: float = Field(30.0, ge=0)  # how long a retiring replica may finish in-flight requests
    orphan_grace_s: float = Field(300.0, gt=0)  # a runtime no agent vouched for this long stops itself
    # Issue 20: a frozen runtime's wake waited 30 s, was retried, and the replica stayed asleep for minutes.
    # A wake (a fraction of a load) not done in this long fails the replica and another is prewarmed, so keep
    # it well under gateway.hold_timeout_s: the held requests are served by the replacement.
    wake_timeout_s: float = Field(10.0, gt=0)
    health_failures: int = Field(3, ge=1)  # consecutive failed /readyz checks of a ready replica before it is failed
    # The task outbox (workers/delivery.py, docs/operating.md): a sent task nobody settled, that is neither
    # running nor in the broker (lost in a failover) this long after it was due, is sent again (same id).
    outbox_resend_after_s: float = Field(30.0, gt=0)
    outbox_sweep_interval_s: float = Field(5.0, gt=0)  # how often the beat's sweep looks (one ZRANGEBYSCORE)

    @field_validator("visibility_timeout_s")
    @classmethod
    def _visibility_above_time_limit(cls, v: int | None, info: Any) -> int | None:
        limit = info.data.get("task_time_limit_s")
        if v is not None and limit is not None and v <= limit:
            raise ValueError(f"must be greater than task_time_limit_s ({limit}), or a running task is redelivered")
        return v

    @property
    def effective_visibility_timeout_s(self) -> int:
        return self.visibility_timeout_s or self.task_time_limit_s + 60

    @property
    def effective_concurrency(self) -> int:
        return self.concurrency or self.replica_slots + 2


class KedaSettings(_Group):
    """`prewarm keda-scaler` (issue 20: anyone in the cluster could open streams until IsActive starved)."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_KEDA_", extra="forbid")
    group: ClassVar[str] = "keda"

    # StreamIsActive streams open at once; more are refused (RESOURCE_EXHAUSTED, KEDA retries). Each is a
    # coroutine, not a thread, so the bound is about Redis polls, not workers: one per ScaledObject is the need.
    max_streams: int = Field(256, ge=1)
    stream_poll_s: float = Field(1.0, gt=0)  # how often an open stream re-reads the planner's record
    # TLS as KEDA's external scaler speaks it (trigger metadata caCert, tlsClientCert/tlsClientKey): the
    # server's certificate and key, and the CA whose client certificates are required (mutual TLS).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # A shared token every call must carry: in the trigger's metadata (`tokenFromEnv: PREWARM_KEDA_TOKEN`, which
    # KEDA resolves from the scaled Deployment's environment; or `token` in the clear; KEDA sends an external
    # scaler no TriggerAuthentication parameter) or as gRPC `authorization: Bearer <token>`. None: no token asked.
    token: SecretStr | None = None


class MetricsSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_METRICS_", extra="forbid")
    group: ClassVar[str] = "metrics"

    port: int = Field(9400, ge=0, le=65535)  # agents and workers expose /metrics here
    host: str = "127.0.0.1"  # the address /metrics binds; 0.0.0.0 where Prometheus scrapes from outside (Helm, compose)


class RolloutSettings(_Group):
    """Defaults of a canary rollout's judgements (`prewarm rollout start` may set each per rollout)."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_ROLLOUT_", extra="forbid")
    group: ClassVar[str] = "rollout"

    # max |top-logprob difference| between canary and stable on the seeded warmup prompts: a new
    # quantisation moves logprobs by a few hundredths, a corrupted weight file by whole units
    logprob_tolerance: float = Field(0.05, gt=0)
    speed_ratio: float = Field(1.2, ge=1)  # canary TTFT / decode time within this multiple of the stable baseline (the seed's rule)
    # canary live 5xx rate may exceed the stable revision's by this much (absolute) during a pause
    error_rate_margin: float = Field(0.01, ge=0, le=1)
    latency_ratio: float = Field(1.2, ge=1)  # canary mean live latency within this multiple of the stable one's
    min_requests: int = Field(20, ge=1)  # fewer canary requests in a window is no evidence either way
    pause_s: float = Field(600.0, gt=0)  # each step runs this long before the next (the default of --pause)


_GROUPS: dict[str, type[_Group]] = {
    g.group: g
    for g in (
        RedisSettings,
        GatewaySettings,
        RegistrySettings,
        WarmupSettings,
        KubernetesSettings,
        RuntimeSettings,
        AgentSettings,
        PlannerSettings,
        MetricsSettings,
        RolloutSettings,
        KedaSettings,
        EngineSettings,
    )
}


class Settings:
    """The root: one attribute per group. Build it with `Settings.load()`."""

    redis: RedisSettings
    gateway: GatewaySettings
    registry: RegistrySettings
    warmup: WarmupSettings
    kubernetes: KubernetesSettings
    runtime: RuntimeSettings
    agent: AgentSettings
    planner: PlannerSettings
    metrics: MetricsSettings
    rollout: RolloutSettings
    keda: KedaSettings
    engine: EngineSettings

    def __init__(self, **groups: _Group) -> None:
        for name, cls in _GROUPS.items():
            setattr(self, name, groups.get(name) or cls())

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> "Settings":
        """Read the environment and the optional file; raise SettingsError naming a bad setting."""
        _check_environment()
        path = path or os.environ.get("PREWARM_CONFIG") or None
        data = _read_file(Path(path)) if path else {}
        unknown = set(data) - set(_GROUPS)
        if unknown:
            raise SettingsError(f"{path}: unknown settings group(s) {sorted(unknown)}; known: {sorted(_GROUPS)}")
        built: dict[str, _Group] = {}
        for name, group_cls in _GROUPS.items():
            section = data.get(name) or {}
            if not isinstance(section, dict):
                raise SettingsError(f"{path}: [{name}] must be a table")
            try:
                built[name] = group_cls(**section)
            except ValidationError as exc:
                raise SettingsError(_describe(group_cls, exc)) from None
            except SourceError as exc:  # a value the environment source could not decode (JSON expected)
                raise SettingsError(f"{exc}; a list or table setting takes JSON, e.g. "
                                    f"PREWARM_PLANNER_BATCH_JOBS='[{{\"cron\": \"0 9 * * *\", ...}}]'") from None
        return cls(**built)


def known_variables() -> set[str]:
    """Every PREWARM_* environment variable a setting reads, plus PREWARM_CONFIG."""
    names = {"PREWARM_CONFIG"}
    for group_cls in _GROUPS.values():
        prefix = str(group_cls.model_config.get("env_prefix", ""))
        names.update(f"{prefix}{name}".upper() for name in group_cls.model_fields)
    return names


def _check_environment() -> None:
    """A PREWARM_* variable that no setting reads is a typo that would silently do nothing."""
    known = known_variables()
    unknown = sorted(n for n in os.environ if n.startswith("PREWARM_") and n not in known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise SettingsError("unknown setting(s): " + ", ".join(hints))


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"PREWARM_CONFIG: cannot read {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"PREWARM_CONFIG: {path} is not valid {path.suffix or 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"PREWARM_CONFIG: {path} must hold a mapping of settings groups")
    return data


def _describe(group_cls: type[_Group], exc: ValidationError) -> str:
    prefix = str(group_cls.model_config.get("env_prefix", ""))
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "?"
        env = f"{prefix}{field}".upper()
        parts.append(f"{env} ([{group_cls.group}] {field}): {err['msg']}")
    return "invalid setting: " + "; ".join(parts)
