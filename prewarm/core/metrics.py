"""Every Prometheus metric prewarm exports, defined in one place.

`Metrics(registry)` builds the whole set on the given `CollectorRegistry` (tests pass a
fresh one); processes build one at start and hand it to the parts that record. Counts
that live in the registry (replicas per state and pool) are exported by
`RegistryCollector` at scrape time rather than mirrored in process memory.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: Names of every metric family prewarm exports (dashboards and alerts may name only these).
EXPORTED = (
    "model_loading_phase_duration_seconds",
    "model_loading_failures_total",
    "model_cold_start_seconds",
    "model_image_pull_seconds",
    "gateway_requests_total",
    "gateway_request_duration_seconds",
    "gateway_cold_start_wait_seconds",
    "gateway_routing_decisions_total",
    "gateway_inflight_requests",
    "gateway_registry_view_age_seconds",
    "gateway_registry_stale_reads_total",
    "warmup_requests_total",
    "warmup_cost_ratio",
    "gpu_fragmentation_rate",
    "prewarm_replicas",
    "prewarm_planner_target_replicas",
    "prewarm_planner_target_age_seconds",
    "prewarm_planner_revision_target_replicas",
    "prewarm_planner_revision_target_age_seconds",
    "prewarm_forecast_requests",
    "prewarm_actual_requests",
    "prewarm_forecast_timestamp_seconds",
    "prewarm_forecast_error_ratio",
    "prewarm_planner_mode",
    "prewarm_planned_events_total",
    "prewarm_dropped_events_total",
    "prewarm_task_duplicates_total",
    "prewarm_outbox_resent_total",
    "prewarm_validation_results_total",
    "runtime_requests_total",
    "runtime_time_to_first_token_seconds",
    "runtime_time_per_output_token_seconds",
    "gateway_revision_requests_total",
    "prewarm_rollout_weight",
    "prewarm_rollout_phase",
    "prewarm_rollout_rollbacks_total",
)

_LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    """The metric objects of one process, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.loading_phase_duration = Histogram(
            "model_loading_phase_duration_seconds",
            "Duration of each progressive loading phase",
            ["model", "phase", "node"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.loading_failures = Counter(
            "model_loading_failures_total",
            "Replica prewarms that failed, by reason",
            ["model", "node", "reason"],
            registry=registry,
        )
        self.cold_start = Histogram(
            "model_cold_start_seconds",
            "Time from a replica asked to start to ready (loaded and validated)",
            ["model", "node"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.image_pull = Histogram(
            "model_image_pull_seconds",
            "Image pulls a new pod waited for (the first start of an image on a node), left out of its cold start",
            ["model", "node"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "gateway_requests_total",
            "Requests answered by the gateway, by model, kind (user|warmup) and status code",
            ["model", "kind", "code"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "End-to-end request duration at the gateway",
            ["model"],
            registry=registry,
        )
        self.cold_start_wait = Histogram(
            "gateway_cold_start_wait_seconds",
            "Time a request waited at the gateway for a ready replica",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.routing_decisions = Counter(
            "gateway_routing_decisions_total",
            "Routing decisions by outcome (serving, warm_pool, hold, unavailable, unknown_model)",
            ["model", "outcome"],
            registry=registry,
        )
        self.registry_view_age = Gauge(
            "gateway_registry_view_age_seconds",
            "Age of the registry view the gateway routes from: 0 while Redis is reachable, else since the last read",
            registry=registry,
        )
        self.registry_stale_reads = Counter(
            "gateway_registry_stale_reads_total",
            "Reads answered from the last good registry view while Redis was away (view | models)",
            ["what"],
            registry=registry,
        )
        self.inflight = Gauge(
            "gateway_inflight_requests",
            "Requests in flight per replica, as tracked by the gateway",
            ["model", "replica"],
            registry=registry,
        )
        self.warmup_requests = Counter(
            "warmup_requests_total",
            "Synthetic warmup requests sent, by model and purpose (prewarm|keepalive)",
            ["model", "purpose"],
            registry=registry,
        )
        self.warmup_cost_ratio = Gauge(
            "warmup_cost_ratio",
            "Share of replica-time above need (forecasting.budget.warm_cost)",
            ["model"],
            registry=registry,
        )
        self.fragmentation = Gauge(
            "gpu_fragmentation_rate",
            "1 - allocated/reserved of the accelerator allocator",
            ["node"],
            registry=registry,
        )
        self.forecast_requests = Gauge(
            "prewarm_forecast_requests",
            "Forecast request rate (req/s) for the current bucket, by quantile",
            ["model", "quantile"],
            registry=registry,
        )
        self.actual_requests = Gauge(
            "prewarm_actual_requests",
            "Observed user request rate (req/s) of the last complete bucket",
            ["model"],
            registry=registry,
        )
        self.forecast_timestamp = Gauge(
            "prewarm_forecast_timestamp_seconds",
            "When the last forecast for a model was made (epoch seconds)",
            ["model"],
            registry=registry,
        )
        self.forecast_error = Gauge(
            "prewarm_forecast_error_ratio",
            "Typical relative error of the median forecast at the lead over the scored window, its errors beyond the "
            "planning quantile left out (the planner's quality gate)",
            ["model"],
            registry=registry,
        )
        self.planner_mode = Gauge(
            "prewarm_planner_mode",
            "1 for the planner's active mode per model: predictive, or reactive (scale-downs) while forecasts are poor",
            ["model", "mode"],
            registry=registry,
        )
        self.planned_events = Counter(
            "prewarm_planned_events_total",
            "Scale events planned, by kind",
            ["model", "kind"],
            registry=registry,
        )
        self.dropped_events = Counter(
            "prewarm_dropped_events_total",
            "Scale events the planner dropped (budget) or could not enqueue, by reason",
            ["model", "reason"],
            registry=registry,
        )
        self.task_duplicates = Counter(
            "prewarm_task_duplicates_total",
            "Task deliveries skipped as copies of a task settled or running elsewhere (workers/delivery.py)",
            ["task"],
            registry=registry,
        )
        self.outbox_resent = Counter(
            "prewarm_outbox_resent_total",
            "Tasks the outbox sweep published again: unsettled, not running and gone from the broker",
            ["task"],
            registry=registry,
        )
        self.runtime_requests = Counter(
            "runtime_requests_total",
            "Completions answered by a model host, by kind (user|warmup; a forged warmup counts as user) and code",
            ["model", "kind", "code"],
            registry=registry,
        )
        # the model host's own timing of each completion (`prewarm.adapters.engine_timing` reads them, as it
        # reads vLLM's vllm:time_to_first_token_seconds and vllm:request_time_per_output_token_seconds)
        self.runtime_ttft = Histogram(
            "runtime_time_to_first_token_seconds",
            "Completions of a model host: from admission to the first generated token",
            ["model"], buckets=_TOKEN_BUCKETS, registry=registry,
        )
        self.runtime_tpot = Histogram(
            "runtime_time_per_output_token_seconds",
            "Completions of a model host with two tokens or more: first to last token, per token after the first",
            ["model"], buckets=_TOKEN_BUCKETS, registry=registry,
        )
        self.validation_results = Counter(
            "prewarm_validation_results_total",
            "Replica validation checks, by check and result",
            ["model", "check", "result"],
            registry=registry,
        )
        # --- canary rollouts (prewarm.policy.rollout, workers/planning/rollout.py) ---
        self.revision_requests = Counter(
            "gateway_revision_requests_total",
            "User requests routed to each revision of a model (the split a rollout's weights make), by code",
            ["model", "revision", "code"],
            registry=registry,
        )
        self.rollout_weight = Gauge(
            "prewarm_rollout_weight",
            "Traffic weight (percent) of each revision of a model under a rollout",
            ["model", "revision"],
            registry=registry,
        )
        self.rollout_phase = Gauge(
            "prewarm_rollout_phase",
            "1 for the phase a model's rollout is in (running, paused, completed, rolled_back), else 0",
            ["model", "phase"],
            registry=registry,
        )
        self.rollout_rollbacks = Counter(
            "prewarm_rollout_rollbacks_total",
            "Rollouts the planner rolled back, by cause (validation, live_errors, live_latency)",
            ["model", "cause"],
            registry=registry,
        )


class RegistryCollector(Collector):
    """Exports `prewarm_replicas{model,state,pool}` from the registry at scrape time.

    `counts` returns {(model, state, pool): n}; a failure to read is reported as no samples,
    never as a scrape error.
    """

    def __init__(self, counts: Callable[[], Mapping[tuple[str, str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "prewarm_replicas", "Replicas per model, state and pool (from the registry)", labels=["model", "state", "pool"]
        )
        try:
            counts = self._counts()
        except Exception:  # noqa: BLE001 - a scrape must not fail because Redis is down
            counts = {}
        for (model, state, pool), n in sorted(counts.items()):
            family.add_metric([model, state, pool], n)
        yield family

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []
