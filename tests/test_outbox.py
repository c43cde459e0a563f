"""The task outbox (issue 20: 0 lost and 0 duplicated tasks across a Sentinel failover).

The rules are pure and table-tested (`prewarm.policy.outbox`); the store is a real Redis (and,
for WAIT, a real replica of it); the end-to-end tests run a real `prewarm agent` worker that
consumes real Celery messages from the Redis broker. A failover's two losses are made by hand
and exactly: a message deleted from its queue after it was published (what a lost LPUSH or a
lost BRPOP leaves), and one message delivered twice (what a pop the replica never saw leaves).
The sweep is the production function (`workers.delivery.sweep`) called with a clock moved past
the resend bound, so no test waits for it.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.errors import InvalidPayload, SettingsError
from prewarm.core.metrics import Metrics
from prewarm.core.settings import AgentSettings, RedisSettings, Settings
from prewarm.policy.outbox import OutboxRecord, ReplicaShortfall, SweepAction, replicas_to_wait, sweep_action
from prewarm.registry.embedded import EmbeddedRedis, free_port, redis_binary, stop_process, wait_for_port
from prewarm.registry.outbox import Begin, Outbox
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.replication import ReplicatedWrites
from tests.celery_helpers import WorkerProcess, queued_tasks, settings_from_env, wait_for, worker_env
from workers.app import make_app
from workers.delivery import Delivery, sweep
from workers.names import RETIRE, node_queue

NODE = "n1"


# --- the rules --------------------------------------------------------------------------------
@pytest.mark.parametrize("settled,running,in_broker,expected", [
    (True, False, False, SweepAction.FORGET),
    (True, True, True, SweepAction.FORGET),  # a settled task is done whatever else is seen
    (False, True, False, SweepAction.LATER),  # a delivery holds its lease: it runs
    (False, False, True, SweepAction.LATER),  # queued, or held unacked by a worker
    (False, False, False, SweepAction.RESEND),  # nowhere: lost
])
def test_sweep_action(settled: bool, running: bool, in_broker: bool, expected: SweepAction) -> None:
    assert sweep_action(settled=settled, running=running, in_broker=in_broker) is expected


@pytest.mark.parametrize("shortfall,now,expected", [
    (None, 0.0, 2),
    (ReplicaShortfall(acked=0, at=10.0), 12.0, 0),  # the group is short: wait for what it has
    (ReplicaShortfall(acked=1, at=10.0), 14.9, 1),
    (ReplicaShortfall(acked=0, at=10.0), 15.0, 2),  # the recheck: ask for the full count again
])
def test_replicas_to_wait(shortfall: ReplicaShortfall | None, now: float, expected: int) -> None:
    assert replicas_to_wait(2, shortfall, now=now, recheck_s=5.0) == expected


def test_outbox_record_round_trip_and_bad_records() -> None:
    rec = OutboxRecord("t1", RETIRE, node_queue(NODE), ["m@r/n1/0", "why"], {}, 1, sent_at=10.0, due_at=12.5)
    assert OutboxRecord.from_json(rec.to_json()) == rec
    assert rec.check_at(30.0) == 42.5
    for raw, what in [("not json", "not JSON"), ("[1]", "JSON object"),
                      ('{"task_id": "t", "name": "n", "queue": "q", "extra": 1}', "unknown fields"),
                      ('{"task_id": "t", "name": "n"}', "queue"),
                      ('{"task_id": "", "name": "n", "queue": "q"}', "task_id"),
                      ('{"task_id": "t", "name": "n", "queue": "q", "retries": -1}', "retries"),
                      ('{"task_id": "t", "name": "n", "queue": "q", "args": "x"}', "args must be a list")]:
        with pytest.raises(InvalidPayload, match=what):
            OutboxRecord.from_json(raw)


def test_a_failure_because_redis_went_away_is_not_a_verdict() -> None:
    from kombu.exceptions import OperationalError

    from prewarm.core.errors import PermanentError, RegistryUnavailable
    from workers.delivery import lost_connection

    def wrapped(outer: Exception, cause: BaseException) -> Exception:
        outer.__cause__ = cause
        return outer

    assert lost_connection(redis.ConnectionError("reset by peer"))
    assert lost_connection(redis.TimeoutError("read timed out"))
    assert lost_connection(OperationalError("broker away"))
    assert lost_connection(wrapped(RegistryUnavailable("registry unavailable", retry_after=1.0),
                                   redis.ConnectionError("refused")))
    assert not lost_connection(PermanentError("bad weights"))
    assert not lost_connection(redis.ResponseError("WRONGTYPE"))  # Redis answered: a bug, not a failover
    assert not lost_connection(ValueError("boom"))


@pytest.mark.parametrize("env,expected", [
    ({"PREWARM_REDIS_URL": "redis://127.0.0.1:6379/0"}, 0),  # one server: nothing to wait for
    ({"PREWARM_REDIS_URL": "sentinel://127.0.0.1:26379/0", "PREWARM_REDIS_SENTINEL_MASTER": "m"}, 1),
    ({"PREWARM_REDIS_URL": "sentinel://127.0.0.1:26379/0", "PREWARM_REDIS_SENTINEL_MASTER": "m",
      "PREWARM_REDIS_WAIT_REPLICAS": "2"}, 2),
])
def test_how_many_replicas_a_write_waits_for(clean_env: pytest.MonkeyPatch, env: dict[str, str], expected: int) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert Settings.load().redis.effective_wait_replicas == expected


@pytest.mark.parametrize("var,value", [("PREWARM_REDIS_WAIT_REPLICAS", "-1"), ("PREWARM_REDIS_WAIT_TIMEOUT_MS", "0"),
                                       ("PREWARM_AGENT_OUTBOX_RESEND_AFTER_S", "0"),
                                       ("PREWARM_AGENT_OUTBOX_SWEEP_INTERVAL_S", "nan")])
def test_bad_outbox_settings_name_the_variable(clean_env: pytest.MonkeyPatch, var: str, value: str) -> None:
    clean_env.setenv(var, value)
    with pytest.raises(SettingsError, match=var):
        Settings.load()


# --- the store, on a real Redis ---------------------------------------------------------------
def test_begin_settle_and_release(redis_client: "redis.Redis[str]") -> None:
    outbox = Outbox(redis_client, ReplicatedWrites(0, 100))
    rec = OutboxRecord("t1", RETIRE, node_queue(NODE), ["x@r/n1/0", "why"], sent_at=100.0, due_at=100.0)
    assert outbox.record(rec, resend_after_s=30.0) is None  # no replica asked for
    assert outbox.due(129.0, 10) == [] and outbox.due(130.0, 10) == [rec]
    assert outbox.begin("t1", 0, token="a", lease_s=60) is Begin.RUN
    assert outbox.begin("t1", 0, token="b", lease_s=60) is Begin.RUNNING  # a copy while it runs
    assert outbox.begin("t1", 1, token="c", lease_s=60) is Begin.RUN  # the next attempt (a retry) is its own
    outbox.release("t1", 0, token="b")  # not the holder: nothing happens
    # the holder refreshes its lease while it runs; a token that does not hold one extends nothing
    assert outbox.refresh([("t1", 0, "a"), ("t1", 1, "not-c")], lease_s=120) == 1
    assert redis_client.pttl(keys.task_running("t1", 0)) > 60_000 >= redis_client.pttl(keys.task_running("t1", 1))
    assert outbox.facts([rec]) == [(False, True)]
    assert outbox.settle("t1", "retired") is True
    assert outbox.settle("t1", "retired again") is False  # the first settle wins
    outbox.release("t1", 0, token="a")
    assert outbox.facts([rec]) == [(True, False)]
    assert outbox.size() == 0 and outbox.due(1e12, 10) == []
    assert outbox.settled("t1") == "retired"
    assert outbox.begin("t1", 0, token="d", lease_s=60) is Begin.SETTLED  # a redelivered copy


def test_a_running_task_keeps_its_lease_past_its_ttl_and_a_dropped_one_runs_out(redis_url: str) -> None:
    """The process's lease keeper refreshes every lease a delivery holds (every third of agent.lock_ttl_s)."""
    delivery = Delivery(Settings(redis=RedisSettings(url=redis_url), agent=AgentSettings(lock_ttl_s=3.0)))
    try:
        outbox = delivery.outbox
        assert outbox.begin("long-1", 0, token="me", lease_s=delivery.lease_s) is Begin.RUN
        assert outbox.begin("gone-1", 0, token="me", lease_s=delivery.lease_s) is Begin.RUN
        delivery.hold("long-1", 0, "me")  # still running
        time.sleep(4.5)  # past the 3 s TTL: only a refreshed lease is still there
        assert outbox.begin("long-1", 0, token="copy", lease_s=delivery.lease_s) is Begin.RUNNING
        assert outbox.begin("gone-1", 0, token="copy", lease_s=delivery.lease_s) is Begin.RUN  # never held: ran out
    finally:
        delivery.close()


@pytest.fixture()
def replica_of(redis_server: EmbeddedRedis) -> Iterator[int]:
    """A real replica of the session Redis, in sync, for WAIT to count."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="prewarm-replica-") as d:
        proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", "",
                                 "--appendonly", "no", "--replicaof", "127.0.0.1", str(redis_server.port)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port("127.0.0.1", port, 10.0, "the replica")
            with redis.Redis(port=port, decode_responses=True) as r:
                wait_for(lambda: r.info("replication").get("master_link_status") == "up", 30, "the replica in sync")
            yield port
        finally:
            stop_process(proc)


def test_a_record_is_on_the_replica_before_record_returns(redis_client: "redis.Redis[str]", replica_of: int) -> None:
    outbox = Outbox(redis_client, ReplicatedWrites(1, 5000))
    rec = OutboxRecord("t-repl", RETIRE, node_queue(NODE), ["x@r/n1/0", "why"], sent_at=1.0, due_at=1.0)
    assert outbox.record(rec, resend_after_s=30.0) == 1
    with redis.Redis(port=replica_of, decode_responses=True) as replica:
        assert replica.hget(keys.OUTBOX, "t-repl") == rec.to_json()  # read at once: WAIT made it so


def test_a_registration_is_on_the_replica_before_register_returns(redis_client: "redis.Redis[str]",
                                                                   replica_of: int) -> None:
    registry = ReplicaRegistry(redis_client, writes=ReplicatedWrites(1, 5000))
    rep = Replica("reg", "r1", NODE, 7)
    assert registry.register(rep, now=time.time()) is True
    assert registry.register(rep, now=time.time()) is False  # a live duplicate, as without WAIT
    with redis.Redis(port=replica_of, decode_responses=True) as replica:
        assert replica.hget(keys.replica(rep.id), "state") == ReplicaState.PENDING.value


def test_a_group_short_of_replicas_waits_once_then_for_what_it_has(redis_client: "redis.Redis[str]") -> None:
    """The session Redis has no replica: a failover's promoted primary, its old one dead."""
    now = [0.0]
    writes = ReplicatedWrites(1, 50, recheck_s=5.0, clock=lambda: now[0])
    outbox = Outbox(redis_client, writes)
    rec = OutboxRecord("t-short", RETIRE, node_queue(NODE), [], sent_at=1.0, due_at=1.0)
    assert outbox.record(rec, resend_after_s=30.0) == 0  # one WAIT timeout: nobody acknowledged
    now[0] = 1.0
    assert outbox.record(rec, resend_after_s=30.0) is None  # known short: no WAIT at all
    now[0] = 6.0
    assert outbox.record(rec, resend_after_s=30.0) == 0  # the recheck asks for the replica again
    assert redis_client.hget(keys.OUTBOX, "t-short") == rec.to_json()  # the write stands either way


# --- a real agent -----------------------------------------------------------------------------
class Stack:
    def __init__(self, redis_url: str, tmp: Path) -> None:
        self.metrics_port = free_port()
        self.env = worker_env(redis_url, tmp, PREWARM_AGENT_NODE=NODE, PREWARM_METRICS_PORT=str(self.metrics_port),
                              PREWARM_AGENT_OUTBOX_RESEND_AFTER_S="5")
        self.settings = settings_from_env(self.env)
        self.app = make_app(self.settings)
        self.client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
        self.registry = ReplicaRegistry(self.client, self.settings.registry)
        self.metrics = Metrics(CollectorRegistry())  # the sweep's (a planner's metrics in production)
        self.agent = WorkerProcess(["agent", "--node", NODE], self.env, tmp / "agent.log")

    def replica(self, slot: int) -> str:
        rep = Replica("reg", "r1", NODE, slot)  # registered with no runtime: a retire ends it at once
        self.registry.register(rep, now=time.time())
        return rep.id

    def ends(self, rid: str) -> int:
        """How many times the replica was ended (the effect of a retire), from the registry's event stream."""
        return sum(1 for _, f in self.client.xrange(keys.EVENTS)
                   if f.get("replica") == rid and f.get("to") == ReplicaState.RETIRED.value)

    def duplicates_counted(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        line = next((ln for ln in text.splitlines()
                     if ln.startswith(f'prewarm_task_duplicates_total{{task="{RETIRE}"}}')), None)
        return float(line.split()[-1]) if line else 0.0

    @contextlib.contextmanager
    def agent_paused(self) -> Iterator[None]:
        """The agent stops consuming its queue (Celery's remote control), so the test can shape the broker."""
        queue, who = node_queue(NODE), [f"agent@{NODE}"]
        assert self.app.control.cancel_consumer(queue, destination=who, reply=True, timeout=10), "no reply"
        time.sleep(2.5)  # a BRPOP in flight (kombu's brpop timeout, 1 s) has returned
        try:
            yield
        finally:
            assert self.app.control.add_consumer(queue, destination=who, reply=True, timeout=10), "no reply"

    def close(self) -> None:
        self.agent.stop()
        self.app.close()
        self.client.close()


@pytest.fixture()
def stack(redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(redis_url, tmp_path)
    try:
        s.agent.start()
        yield s
    finally:
        s.close()


@pytest.mark.slow
def test_a_message_lost_after_publish_is_sent_again_by_the_sweep_and_runs_once(stack: Stack) -> None:
    lost, kept = stack.replica(100), stack.replica(101)
    queue = node_queue(NODE)
    with stack.agent_paused():
        stack.app.send_task(RETIRE, args=[lost, "outbox test"], task_id="lost-1")
        stack.app.send_task(RETIRE, args=[kept, "outbox test"], task_id="kept-1")
        assert [m["id"] for m in queued_tasks(stack.client, queue)] == ["kept-1", "lost-1"]  # LPUSH: newest first
        # the failover: the message of lost-1 is gone from the broker (a lost LPUSH, or a pop whose unacked
        # record the promoted replica never had); its outbox record was replicated before it was published
        raw = next(r for r in stack.client.lrange(queue, 0, -1) if '"lost-1"' in r)
        assert stack.client.lrem(queue, 1, raw) == 1

        now = time.time()
        assert sweep(stack.app, stack.metrics, now=now) == {"resent": [], "later": [], "forgotten": []}  # not due
        report = sweep(stack.app, stack.metrics, now=now + 6)  # past outbox_resend_after_s
        assert report["resent"] == ["lost-1"], report
        assert report["later"] == ["kept-1"], report  # still queued: not sent twice
        assert sorted(m["id"] for m in queued_tasks(stack.client, queue)) == ["kept-1", "lost-1"]
    wait_for(lambda: stack.client.get(keys.task_done("lost-1")) and stack.client.get(keys.task_done("kept-1")), 60,
             lambda: f"both retires settled\n{stack.agent.log()[-3000:]}")
    assert (stack.ends(lost), stack.ends(kept)) == (1, 1)
    assert int(stack.client.get(keys.task_deliveries("lost-1", 0)) or 0) == 1
    assert stack.client.hlen(keys.OUTBOX) == 0 and stack.client.zcard(keys.OUTBOX_DUE) == 0
    assert sweep(stack.app, stack.metrics, now=time.time() + 3600) == {"resent": [], "later": [], "forgotten": []}
    assert stack.duplicates_counted() == 0


@pytest.mark.slow
def test_a_task_delivered_twice_runs_its_effect_once(stack: Stack) -> None:
    rid, running_rid = stack.replica(200), stack.replica(201)
    with stack.agent_paused():
        # one message twice in the broker, as a pop the promoted replica never saw leaves it
        stack.app.send_task(RETIRE, args=[rid, "outbox test"], task_id="twice-1")
        stack.app.send_task(RETIRE, args=[rid, "outbox test"], task_id="twice-1")
        # and a copy delivered while another delivery of the same attempt runs (the test holds its lease)
        outbox = stack.app.delivery.outbox
        assert outbox.begin("running-1", 0, token="elsewhere", lease_s=600) is Begin.RUN
        stack.app.send_task(RETIRE, args=[running_rid, "outbox test"], task_id="running-1")
    wait_for(lambda: stack.client.get(keys.task_done("twice-1")) and stack.duplicates_counted() >= 2, 60,
             lambda: f"the retire settled and both copies skipped\n{stack.agent.log()[-3000:]}")
    wait_for(lambda: not stack.client.llen(node_queue(NODE)) and not stack.client.hlen("unacked"), 30,
             "every message consumed")
    assert stack.ends(rid) == 1
    assert int(stack.client.get(keys.task_deliveries("twice-1", 0)) or 0) == 1  # the copy never reached the task
    assert stack.duplicates_counted() == 2
    # the copy of the running attempt did nothing and left the task to its holder: unsettled, still recorded
    assert stack.ends(running_rid) == 0 and stack.client.get(keys.task_done("running-1")) is None
    assert stack.client.hget(keys.OUTBOX, "running-1") is not None
    assert sweep(stack.app, stack.metrics, now=time.time() + 6)["later"] == ["running-1"]  # its lease holds: not resent
    # the holder dies (its lease ends): the sweep sends it again, and it runs once
    stack.client.delete(keys.task_running("running-1", 0))
    assert sweep(stack.app, stack.metrics, now=time.time() + 12)["resent"] == ["running-1"]
    wait_for(lambda: stack.client.get(keys.task_done("running-1")), 60,
             lambda: f"the resent retire settled\n{stack.agent.log()[-3000:]}")
    assert stack.ends(running_rid) == 1
    assert stack.client.hlen(keys.OUTBOX) == 0
