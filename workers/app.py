"""The Celery application: broker, queues, routing and the delivery guarantees of DESIGN.md.

- JSON only (never pickle): tasks carry replica ids and small scalars, nothing else.
- `task_acks_late` + `task_reject_on_worker_lost`: a task whose worker dies is delivered
  again, and an attempt cap (a delivery counter in Redis, see `workers.node.tasks`) gives up
  on a task that kills its worker every time.
- The broker's `visibility_timeout` is longer than the longest task time limit, so a task
  that still runs is never handed to a second worker; after a crash the message comes back
  once that timeout has passed (workers sweep every `agent.restore_interval_s`, under a
  restore mutex that a killed worker cannot hold for long).
- `worker_prefetch_multiplier = 1`: a node agent reserves no more messages than it has
  threads, so a queued prewarm can still be taken by the agent's next start.
- Results are ignored: nothing reads them (state lives in the replica registry).
- Every task but the beat's periodic ones goes through the task outbox (`workers/delivery.py`):
  recorded and replicated before it is published, settled once by the worker that ran it, and
  sent again by the beat's sweep if a Sentinel failover lost it (issue 20).

Routing (`workers.names`): replica tasks go to their node's queue, cluster-wide tasks to
the planner's. `workers.app:app` is built lazily from the environment, for
`celery -A workers.app ...` and Flower.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from prewarm.registry.connection import broker_transport_options, broker_url
from prewarm.core.settings import Settings
from workers import broker, schedule
from workers.delivery import Delivery, PrewarmCelery, SettledTask
from workers.names import PLANNER_QUEUE, route_task
from workers.node import tasks as node_tasks
from workers.planning import tasks as planning_tasks

def make_app(settings: Settings) -> Celery:
    """The Celery app for these settings, with every prewarm task registered."""
    agent = settings.agent
    visibility = agent.effective_visibility_timeout_s
    app = PrewarmCelery("prewarm", broker=broker_url(settings.redis), set_as_current=False, task_cls=SettledTask)
    app.delivery = Delivery(settings)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        event_serializer="json",
        result_accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_time_limit=agent.task_time_limit_s,
        broker_transport_options={
            "visibility_timeout": visibility,
            "unacked_restore_interval": agent.restore_interval_s,
            "unacked_restore_throttle": 1,
            # kombu's restore of unacked messages runs under a Redis mutex that expires after 300 s
            # by default: a worker killed while holding it (SIGKILL, OOM) held up every redelivery
            # for five minutes. A restore is a few Redis calls, and each message is moved back in a
            # WATCH transaction, so a short expiry cannot deliver one twice.
            "unacked_mutex_expire": max(10, int(5 * agent.restore_interval_s)),
            "socket_timeout": max(settings.redis.socket_timeout_s, 5.0),
            **broker_transport_options(settings.redis),  # sentinel://: master_name, the Sentinels' auth
        },
        broker_connection_retry_on_startup=True,
        **({"broker_transport": broker.TRANSPORT} if settings.redis.address and settings.redis.address.is_sentinel
           else {}),
        task_default_queue=PLANNER_QUEUE,
        task_routes=(route_task,),
        task_create_missing_queues=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        enable_utc=True,
        timezone="UTC",
    )
    app.conf.prewarm_settings = settings  # the tasks read their settings from the app they run in

    node_tasks.register(app)
    planning_tasks.register(app)
    app.conf.beat_schedule = schedule.schedule(settings)
    return app


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """`workers.app.app`: the app built from the environment on first use (Celery's -A, Flower)."""
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _app = make_app(Settings.load())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
