"""Every Redis key template and TTL prewarm uses, each with a one-line comment.

Nothing else in the code base spells a key: adapters call these functions, so a key's
shape can be found and changed in one place.
"""

from __future__ import annotations

PREFIX = "prewarm"

# --- replica registry -------------------------------------------------------------------
#: Hash of one replica's fields (see `Replica.to_fields`); deleted on deregistration.
def replica(rid: str) -> str:
    return f"{PREFIX}:replica:{rid}"


#: Set of the ids of every registered replica (any state) of one model.
def model_replicas(model: str) -> str:
    return f"{PREFIX}:model:{model}:replicas"


#: Set of the ids of every registered replica on one node.
def node_replicas(node: str) -> str:
    return f"{PREFIX}:node:{node}:replicas"


#: Set of model names that have (or had) replicas; the gateway's /v1/models reads it.
MODELS = f"{PREFIX}:models"

#: Set of node names that have (or had) replicas.
NODES = f"{PREFIX}:nodes"

#: Sorted set of ready replica ids of a model in a pool, scored by heartbeat expiry (epoch s).
def ready(model: str, pool: str) -> str:
    return f"{PREFIX}:ready:{model}:{pool}"


#: Sorted set of loading/warming replica ids of a model, scored by heartbeat expiry.
def loading(model: str) -> str:
    return f"{PREFIX}:loading:{model}"


#: Sorted set of every live replica id, scored by heartbeat expiry; the reaper scans it.
HEARTBEATS = f"{PREFIX}:heartbeats"

#: Stream of every state transition (audit trail and metrics source), capped at EVENTS_MAXLEN.
EVENTS = f"{PREFIX}:events"
# Hash {seen, since} in Redis's own clock: when the registry last saw a heartbeat or a reap, and
# since when it has seen them without a gap (a Redis stall or restart resets `since`; the reaper
# waits a heartbeat TTL past it, so agents alive through the stall heartbeat before any reap).
REGISTRY_ACTIVITY = f"{PREFIX}:registry:activity"
EVENTS_MAXLEN = 100_000

# --- gateway ------------------------------------------------------------------------------
#: Counter of user requests for a model in one time bucket: history for the forecaster.
def requests(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:requests:{model}:{resolution_s}:{bucket_start}"


#: Peak user requests in flight for a model in one fine bucket (the planner's burst signal): the sum
#: over the gateways of each one's peak in the bucket (kept equal to the sum of `inflight_peaks`).
def inflight_peak(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:inflight:{model}:{resolution_s}:{bucket_start}"


#: Hash gateway instance -> that gateway's peak in flight in one fine bucket (the parts of `inflight_peak`).
def inflight_peaks(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:inflight-gateways:{model}:{resolution_s}:{bucket_start}"


#: The highest requests in flight the model's engines reported during one fine bucket (their own count of every
#: gateway's requests: the largest any gateway saw, not a sum). The planner's peak is the larger of it and
#: `inflight_peak`.
def engine_peak(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:inflight-engines:{model}:{resolution_s}:{bucket_start}"


#: Request-seconds of the user requests of a model in flight during one fine bucket, each request's time
#: split over the buckets it spans (the bucket's mean requests in flight x its length).
def busy(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:busy:{model}:{resolution_s}:{bucket_start}"


#: User requests of a model in one fine bucket that waited for capacity (held for a load or a wake past the
#: gateway's wait threshold, or refused for want of a ready replica): what the cold-start budget calibrates on.
def waited(model: str, resolution_s: int, bucket_start: int) -> str:
    return f"{PREFIX}:waited:{model}:{resolution_s}:{bucket_start}"


#: The resolution (seconds) of the in-flight peak and busy-time counters: the planner's fine buckets.
FINE_RESOLUTION_S = 10


#: Set of model names the gateway has counted requests for.
REQUEST_MODELS = f"{PREFIX}:requests:models"

#: Hash model -> the first bucket start (epoch s) the gateway counted: where history begins.
REQUESTS_FIRST = f"{PREFIX}:requests:first"

#: Bucket sizes (seconds) of the request counters, and how long each bucket is kept.
REQUEST_RESOLUTIONS_S: dict[int, int] = {10: 2 * 86400, 60: 35 * 86400}

#: Hash of unmet demand per model (requests that found nothing ready): count and last time.
def demand(model: str) -> str:
    return f"{PREFIX}:demand:{model}"


#: Marker that a signed warmup request's nonce was accepted by a gateway (any of them): a second use is a
#: replay. Set NX with a TTL running to the end of its timestamp's skew window (`signing.MAX_SKEW_S`).
def warmup_nonce(nonce: str) -> str:
    return f"{PREFIX}:warmupnonce:{nonce}"


#: Pub/sub channel on which the gateway announces unmet demand (scale from zero).
DEMAND_CHANNEL = f"{PREFIX}:demand"
#: Demand records expire after this long without a new unmet request.
DEMAND_TTL_S = 3600
#: A request the gateway holds for a replica announces its demand again this often. The planner may
#: have answered the first announcement while the model's only replica was still draining (to sleep, or
#: out): it then started nothing, and no one asked again until the beat's demand scan, up to 10 s later
#: (`prewarm up --models 3`: on-demand loads started after 0.15 s or after up to 10 s, nothing between).
#: The planner's listener coalesces announcements (DEMAND_COALESCE_S), so a held burst costs one task a second.
DEMAND_REANNOUNCE_S = 1.0

# --- agent and planner ----------------------------------------------------------------------
#: Hash of the recorded warm-latency baseline of a model on a node class (the median of the first
#: `warmup.baseline_samples` validated replicas).
def baseline(model: str, node_class: str, revision: str = "") -> str:
    return f"{PREFIX}:baseline:{model}@{revision}:{node_class}" if revision else f"{PREFIX}:baseline:{model}:{node_class}"


#: List of the warm latencies of the first validated replicas, until the baseline is made of them.
def baseline_samples(model: str, node_class: str, revision: str = "") -> str:
    return baseline(model, node_class, revision) + ":samples"


# A baseline is re-measured after this long: hardware, drivers and the runtime change under it.
BASELINE_TTL_S = 7 * 86400


#: List of recent leads (seconds) of a model at a revision on a node class, newest first, capped at
#: LOADTIMES_KEEP: from the scale event (registration, or a pod's creation) to validated, image pulls left out.
def load_times(model: str, revision: str, node_class: str) -> str:
    return f"{PREFIX}:loadtimes:{model}@{revision}:{node_class}"


#: Set of "<revision>/<node class>" a model has load times for (where `load_time_p95` looks).
def load_time_classes(model: str) -> str:
    return f"{PREFIX}:loadtimeclasses:{model}"


#: List of recent image pulls (seconds) a pod of a model at a revision waited for on a node class, newest
#: first, capped at LOADTIMES_KEEP: the first start of an image on a node, reported apart from the lead.
def image_pulls(model: str, revision: str, node_class: str) -> str:
    return f"{PREFIX}:imagepulls:{model}@{revision}:{node_class}"


#: String: the reference probes (JSON) of a revision, built from its first validated replicas
#: (prewarm.policy.reference); kept BASELINE_TTL_S, like the speed it was measured beside.
def reference(model: str, revision: str) -> str:
    return f"{PREFIX}:reference:{model}@{revision}"


#: Hash replica id -> probes (JSON) of the validated replicas a revision's reference is built from.
def reference_samples(model: str, revision: str) -> str:
    return f"{PREFIX}:reference-samples:{model}@{revision}"


#: Hash replica id -> requests running + waiting in its engine (vLLM's own gauges), written by the agent on
#: each heartbeat, expiring a heartbeat TTL after the last: the gateway's routing load and in-flight peak.
def engine_load(model: str) -> str:
    return f"{PREFIX}:engine-load:{model}"


#: List of recent durations (seconds, newest first, LOADTIMES_KEEP) of one bring-up phase of an external
#: engine's replicas on a node class: "server_start" (spawn to /health) and "warm_validate" (to ready).
def engine_phase_times(model: str, phase: str, node_class: str) -> str:
    return f"{PREFIX}:engine-phase:{model}:{phase}:{node_class}"


LOADTIMES_KEEP = 200


#: List of recent times to ready (seconds) of a model from one tier of warmth (`asleep`: a wake,
#: `cached`: a load from the node snapshot, `disk`: a full load) on a node class, newest first.
def ready_times(model: str, tier: str, node_class: str) -> str:
    return f"{PREFIX}:readytimes:{model}:{tier}:{node_class}"

#: Marker that a planned scale event was enqueued (idempotency of re-plans); kept EVENT_TTL_S.
def planned_event(event_id: str) -> str:
    return f"{PREFIX}:planned:{event_id}"


EVENT_TTL_S = 2 * 86400

#: Lock held by the task working on a replica, so a redelivered task does not run twice at once.
def replica_lock(rid: str) -> str:
    return f"{PREFIX}:lock:{rid}"


#: Hash of the last forecast per model (time, quantiles) for metrics and the stale-plan alert.
def last_forecast(model: str) -> str:
    return f"{PREFIX}:forecast:{model}"


#: Sorted set of past p50 forecasts of a model: member "bucket_start:rps", score bucket start.
#: Joined with the observed rates to export the forecast error; trimmed to FORECAST_LOG_S.
def forecast_log(model: str) -> str:
    return f"{PREFIX}:forecastlog:{model}"


FORECAST_LOG_S = 3600

#: Hash of the planner's state per model (carried between `plan` calls).
def planner_state(model: str) -> str:
    return f"{PREFIX}:plannerstate:{model}"


#: Hash of a node's view (snapshots held, capacity), refreshed by its agent.
def node_info(node: str) -> str:
    return f"{PREFIX}:nodeinfo:{node}"


NODE_INFO_TTL_S = 60
#: The fleet planner's last round (JSON: every model's tier and nodes, the memory price): the live view.
FLEET_PLAN = f"{PREFIX}:fleet:plan"
#: The fleet planner's carried state (hash: the memory price, budget spent, seconds planned).
FLEET_STATE = f"{PREFIX}:fleet:state"

# --- the Celery pipeline (workers/) ---------------------------------------------------------
#: Counter of deliveries of one task message (task id and retry number): the redelivery cap.
def task_deliveries(task_id: str, retries: int) -> str:
    return f"{PREFIX}:deliveries:{task_id}:{retries}"


#: Delivery counters outlive any visibility timeout by far, then vanish.
TASK_DELIVERIES_TTL_S = 7 * 86400

#: List of recently refused task payloads (JSON: task, id, error), newest first, capped at REJECTED_KEEP.
REJECTED_TASKS = f"{PREFIX}:rejected"
REJECTED_KEEP = 500

#: Epoch second until which a replica is kept warm with synthetic requests (dynamic warmup trigger).
def keep_warm(rid: str) -> str:
    return f"{PREFIX}:keepwarm:{rid}"


#: Lock held while a planning round runs (`workers.planning.round_lock`): rounds do not overlap.
PLAN_ROUND_LOCK = f"{PREFIX}:lock:planround"

#: Lock held by the one active beat; a second beat waits as a standby until it expires.
BEAT_LOCK = f"{PREFIX}:beat:lock"
BEAT_LOCK_TTL_S = 30

#: Marker that unmet demand for a model was turned into a prewarm (scale from zero), kept briefly.
def demand_claim(model: str) -> str:
    return f"{PREFIX}:demandclaim:{model}"


#: Set of nodes whose memory recently refused a load or a wake of model@revision (not asked again meanwhile).
def placement_refused(model_key: str) -> str:
    return f"{PREFIX}:refused:{model_key}"


#: The replica a node's slot is reserved for between its choice (a scale-up, a scale from zero, a placement
#: elsewhere) and the end of the agent's prewarm, which releases it: two choosers at once never pick one slot.
def slot_claim(node: str, slot: int) -> str:
    return f"{PREFIX}:slotclaim:{node}:{slot}"


#: The replica id a refused replica was placed again as (a redelivered retry re-sends the same prewarm).
def placement_claim(replica_id: str) -> str:
    return f"{PREFIX}:elsewhere:{replica_id}"


#: How long a node that refused a model for memory is passed over, and a placement claim is kept: long
#: enough for the planner's next rounds to see the node's memory published anew.
PLACEMENT_REFUSED_TTL_S = 300


#: Marker that a `handle_demand` task for a model is queued or has just run: the planner's demand
#: listener sends one at most at a time per model (issue 20: 3,000 requests queued 1,723 tasks, and
#: the planner's periodic tasks waited behind them). The task shortens it to DEMAND_COALESCE_S when done.
def demand_pending(model: str) -> str:
    return f"{PREFIX}:demandpending:{model}"


#: A pending marker whose task was lost (its message gone with the broker) blocks new ones this long at
#: most; the beat's `scan_demand` still finds the demand meanwhile.
DEMAND_PENDING_TTL_S = 120
#: After a `handle_demand` ran, announcements within this long are the same demand (one task per window).
DEMAND_COALESCE_S = 1

#: Sorted set of planned scale-event ids waiting to be carried out, scored by their due time (epoch s).
PLANNED_EVENTS = f"{PREFIX}:plannedq"

#: Outcome of a task message that finished (done or failed for good): a redelivered copy does nothing.
#: Set NX by the delivery that settles it (workers/delivery.py); kept TASK_DELIVERIES_TTL_S.
def task_done(task_id: str) -> str:
    return f"{PREFIX}:taskdone:{task_id}"


#: Lease of the delivery running one attempt of a task (its retry number): a copy delivered meanwhile is
#: a duplicate and does nothing. Refreshed while the task runs; expires `agent.lock_ttl_s` after its holder
#: stopped refreshing it (a killed worker, or a release Redis could not take).
def task_running(task_id: str, retries: int) -> str:
    return f"{PREFIX}:taskrun:{task_id}:{retries}"


#: The task outbox: hash task id -> JSON of a sent, unsettled task (name, args, kwargs, queue, retries,
#: sent_at, due_at), written and replicated (WAIT) before the message is published (prewarm/registry/outbox.py).
OUTBOX = f"{PREFIX}:outbox"
#: Sorted set of outbox task ids scored by when the sweep looks at them again (due + outbox_resend_after_s).
OUTBOX_DUE = f"{PREFIX}:outbox:due"

# --- canary rollouts (prewarm/registry/rollouts.py) ----------------------------------------
#: JSON of a model's rollout state (`prewarm.policy.rollout.RolloutState`); kept after it ends, for status.
def rollout(model: str) -> str:
    return f"{PREFIX}:rollout:{model}"


#: Set of the models that have a rollout record (running or ended).
ROLLOUTS = f"{PREFIX}:rollouts"

#: JSON list of [revision, weight] of a model, canary first: the gateway's traffic split; absent: no split.
def revision_weights(model: str) -> str:
    return f"{PREFIX}:revweights:{model}"


#: Hash of the planner's target for one revision of a model (prewarm/registry/targets.py: the same target
#: fields as `last_forecast`): its share while a rollout splits the model across two Deployments, else the
#: model's whole target for the revision it plans. Read by KEDA and the HPA for a trigger naming a revision.
def revision_target(model: str, revision: str) -> str:
    return f"{PREFIX}:revtarget:{model}@{revision}"


#: A revision's target record expires this long after its last write: a revision no longer planned goes away.
REVISION_TARGET_TTL_S = 7 * 86400


#: Hash of what the gateway saw per revision of a model in one fine bucket: "<rev>|requests", "<rev>|errors",
#: "<rev>|latency_s" (the rollout's live comparison of canary and stable).
def revision_stats(model: str, bucket_start: int) -> str:
    return f"{PREFIX}:revstats:{model}:{bucket_start}"


REVISION_STATS_TTL_S = 2 * 86400
