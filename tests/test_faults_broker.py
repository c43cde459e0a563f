"""The broker unreachable when the planner enqueues: scale events are kept and reported, never dropped.

The registry is the session Redis; the Celery broker is a second, real Redis server
(`EmbeddedRedis`) that the test stops and starts again, so a send meets a closed port the way
a planner does when its broker goes away. The producer is the real Celery app of
`workers.app.make_app`, and what reached the broker is read back from its queues (the
Redis transport's lists), where a worker would consume it.

Before the fix in `workers.planning.executor`, `dispatch_due` removed an event from the queue (ZREM
as the claim) before sending its apply task: a send that failed lost the event for good,
with status "dispatched" and nothing in the broker. And an apply whose prewarm sends failed
left the event "dispatched" forever.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from prewarm.core import keys
from prewarm.core.domain import ScaleEvent, ScaleEventKind
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.core.metrics import Metrics
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import RedisSettings, Settings
from tests.celery_helpers import publish_node, queued_tasks
from workers.app import make_app
from workers.names import APPLY_EVENT, DEMAND_QUEUE, PLANNER_QUEUE, PREWARM, node_queue
from workers.context import WorkerContext
from workers.planning.executor import apply_event, dispatch_due, submit_events


@pytest.fixture()
def broker() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture()
def ctx(redis_url: str) -> Iterator[WorkerContext]:
    settings = Settings(redis=RedisSettings(url=redis_url))
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
    c = WorkerContext(settings=settings, client=client, registry=ReplicaRegistry(client, settings.registry),
                      metrics=Metrics(CollectorRegistry()))
    yield c
    client.close()


def _dropped(ctx: WorkerContext, model: str, reason: str) -> float:
    return ctx.metrics.dropped_events.labels(model, reason)._value.get()


def test_dispatch_with_the_broker_down_keeps_the_event_and_sends_it_once_when_back(
        ctx: WorkerContext, broker: EmbeddedRedis) -> None:
    app = make_app(Settings(redis=RedisSettings(url=broker.url)))
    broker_client: "redis.Redis[str]" = redis.Redis.from_url(broker.url, decode_responses=True)
    try:
        now = time.time()
        ev = ScaleEvent("up-broker", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=1, nodes=("n1",))
        assert submit_events(ctx, [ev]) == ["up-broker"]

        broker.stop()
        started = time.monotonic()
        assert dispatch_due(ctx, app, now=now) == []  # no exception escapes: the round reports and stops
        assert time.monotonic() - started < 15, "a send to a closed port should fail fast"
        record = ctx.client.hgetall(keys.planned_event("up-broker"))
        assert record["status"] == "planned", record
        assert "last_error" in record and record["last_error"], record
        assert ctx.client.zscore(keys.PLANNED_EVENTS, "up-broker") is not None, "the event left the queue"
        assert _dropped(ctx, "m", "enqueue_failed") == 1.0
        assert dispatch_due(ctx, app, now=now + 2) == []  # still down: still kept
        assert _dropped(ctx, "m", "enqueue_failed") == 2.0

        broker.start()  # same port, empty
        assert dispatch_due(ctx, app, now=now + 4) == ["up-broker"]
        assert dispatch_due(ctx, app, now=now + 6) == []  # leased: not sent twice
        assert queued_tasks(broker_client, PLANNER_QUEUE) == [
            {"task": APPLY_EVENT, "args": ["up-broker"], "id": f"up-broker@{now + 4:.3f}/{APPLY_EVENT}"}]  # per dispatch
        assert ctx.client.hget(keys.planned_event("up-broker"), "status") == "dispatched"
    finally:
        broker_client.close()
        app.close()


def test_apply_with_the_broker_down_is_retried_with_the_same_replicas(ctx: WorkerContext,
                                                                       broker: EmbeddedRedis) -> None:
    app = make_app(Settings(redis=RedisSettings(url=broker.url)))
    broker_client: "redis.Redis[str]" = redis.Redis.from_url(broker.url, decode_responses=True)
    try:
        publish_node(ctx.client, "n1", 4)
        now = time.time()
        ev = ScaleEvent("up-apply", ScaleEventKind.SCALE_UP, "m", "r1", at=now - 1, replicas=2, nodes=("n1", "n1"))
        submit_events(ctx, [ev])
        assert dispatch_due(ctx, app, now=now) == ["up-apply"]
        broker_client.delete(PLANNER_QUEUE)  # this test runs the apply itself, as the planner worker would

        broker.stop()
        applied = apply_event(ctx, app, "up-apply")
        assert applied.outcome == "enqueue_failed" and applied.replica_ids == ("m@r1/n1/0", "m@r1/n1/1")
        record = ctx.client.hgetall(keys.planned_event("up-apply"))
        assert record["status"] == "planned" and record["last_error"], record
        assert ctx.client.zscore(keys.PLANNED_EVENTS, "up-apply") == pytest.approx(ctx.clock(), abs=5)
        assert _dropped(ctx, "m", "enqueue_failed") == 1.0

        broker.start()
        assert dispatch_due(ctx, app, now=time.time()) == ["up-apply"]  # due again at once
        applied = apply_event(ctx, app, "up-apply")
        assert applied.outcome == "applied" and applied.replica_ids == ("m@r1/n1/0", "m@r1/n1/1")
        assert apply_event(ctx, app, "up-apply").outcome == "already_applied"  # a redelivered apply sends nothing
        assert sorted(m["args"][0] for m in queued_tasks(broker_client, node_queue("n1"))) == ["m@r1/n1/0", "m@r1/n1/1"]
        assert {m["task"] for m in queued_tasks(broker_client, node_queue("n1"))} == {PREWARM}
        # issue 13: the task ids derive from the event, so the same event sent twice is the same task
        assert sorted(m["id"] for m in queued_tasks(broker_client, node_queue("n1"))) == [
            f"up-apply/{PREWARM}/m@r1/n1/0", f"up-apply/{PREWARM}/m@r1/n1/1"]
        assert ctx.client.zscore(keys.PLANNED_EVENTS, "up-apply") is None  # applied: it left the queue
        assert dispatch_due(ctx, app, now=time.time() + 10_000) == []
    finally:
        broker_client.close()
        app.close()


def test_the_demand_listener_outlives_a_broker_that_refuses(ctx: WorkerContext, broker: EmbeddedRedis) -> None:
    """Issue 13 (minor): the planner's demand listener caught only redis errors; a kombu error from
    `send_task` (the broker down) ended its thread, and scale-from-zero waited for the beat's scan."""
    import threading

    from workers.planning.worker import listen_for_demand

    app = make_app(Settings(redis=RedisSettings(url=broker.url)))
    broker_client: "redis.Redis[str]" = redis.Redis.from_url(broker.url, decode_responses=True)
    stop = threading.Event()
    listener = threading.Thread(target=listen_for_demand, args=(ctx.client, app, stop), daemon=True)
    try:
        broker.stop()
        listener.start()
        deadline = time.monotonic() + 10
        while ctx.client.pubsub_numsub(keys.DEMAND_CHANNEL)[0][1] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx.client.publish(keys.DEMAND_CHANNEL, "lost-while-down")
        time.sleep(3.0)  # the send fails against the stopped broker
        assert listener.is_alive(), "the listener died on a broker error"
        broker.start()
        deadline = time.monotonic() + 30
        sent: list[str] = []
        while not sent and time.monotonic() < deadline:
            ctx.client.publish(keys.DEMAND_CHANNEL, "after")
            time.sleep(0.5)
            sent = [m["args"][0] for m in queued_tasks(broker_client, DEMAND_QUEUE)]
        assert "after" in sent, sent
    finally:
        stop.set()
        listener.join(10)
        broker_client.close()
        app.close()
