"""Celery application, tasks and the node agent: the only place where stages meet.

- `app`: the Celery app (JSON only, acks_late, reject on worker loss, prefetch 1, a
  visibility timeout above the task time limit) and the routing of replica tasks to
  `prewarm.node.<node>`, everything else to `prewarm.planner`.
- `tasks` (node queue) and `planner` (planner queue): thin task bodies over `payload`
  (validation), `pipeline` (the prewarm state machine), `operations` (retire, keep warm,
  recycle), `executor` (scale events) and `forecast` (forecast_and_plan).
- `agent`: the node agent process (threads-pool worker, heartbeats, reconciliation,
  /metrics); `host`: the runtime child processes it spawns, adopts and stops; `lock`: the
  per-replica work lock; `beat`: the schedule and the one-beat lock.
"""
