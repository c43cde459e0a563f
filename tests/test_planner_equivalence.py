"""The backtest replays exactly what ships: one trace, two paths, the same scale events.

Simulator path: the trace replayed under the `prewarm` policy, which calls
`forecasting.planner.step` every `planner.interval_s` with the counters a gateway would
have recorded and the replicas the replay has.

Live path: a driver writes the same gateway counters (requests, peak in flight, busy
seconds per fine bucket; requests per coarse bucket) into a real Redis as time advances,
puts the replay's replica counts in the registry, and sends `forecast_and_plan` (with the
replay's clock) to a real `prewarm planner` Celery worker, which reads everything back
from Redis through the live code (`workers.planning.forecast`). The scale events each
step decided are read from the planner's record and compared with the simulator's.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import numpy as np
import pytest
import redis

from forecasting.data.traces import RequestTrace
from forecasting.planner import PlannerParams, ReplicaCounts
from forecasting.sim.policies import Prewarm
from forecasting.sim.simulate import SimParams, build_workload, replay
from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import PlannerSettings, RedisSettings, RegistrySettings, Settings
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.replicas import ReplicaRegistry
from tests.celery_helpers import WorkerProcess, publish_node, wait_for, worker_env
from workers.app import make_app
from workers.names import FORECAST

pytestmark = pytest.mark.slow

MODEL, REVISION = "trace", "replay"
EPOCH = 1_700_000_400.0  # a multiple of 600 s: fine and coarse buckets align with the gateway's
DURATION_S = 900.0


def _trace() -> RequestTrace:
    """Fifteen minutes: quiet, a ramp to a busy plateau, a burst, a fall, a calmer plateau (seeded)."""
    rng = np.random.default_rng(7)
    rate = np.interp(np.arange(DURATION_S), [0, 150, 300, 600, 680, 900], [2.0, 2.0, 60.0, 60.0, 15.0, 15.0])
    n = rng.poisson(rate)
    steady = np.repeat(np.arange(DURATION_S), n) + rng.random(int(n.sum()))
    t = np.sort(np.concatenate([steady, 520.0 + rng.random(60) * 3.0]))  # and a burst at 520 s
    return RequestTrace(t=t, context_tokens=np.full(t.size, 2048.0), generated_tokens=np.full(t.size, 60.0),
                        source="equivalence", start_epoch=EPOCH)


@pytest.fixture(scope="module")
def live(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    redis_server.start()
    tmp = tmp_path_factory.mktemp("equivalence")
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    env = worker_env(redis_server.url, tmp, PREWARM_PLANNER_MODELS=json.dumps([f"{MODEL}@{REVISION}"]))
    proc = WorkerProcess(["planner", "--metrics-port", "0"], env, tmp / "planner.log").start()
    app = make_app(Settings(redis=RedisSettings(url=redis_server.url)))
    try:
        yield {"client": client, "proc": proc, "app": app,
               "registry": ReplicaRegistry(client, RegistrySettings())}
    finally:
        proc.stop()
        app.close()
        client.close()


class Driver:
    """Plays the gateway (its counters) and the cluster (the replica counts) for the live planner."""

    def __init__(self, client: "redis.Redis[str]", registry: ReplicaRegistry, policy: Prewarm) -> None:
        self.client, self.registry, self.policy = client, registry, policy
        self.fine_written = 0
        self.coarse_written = 0
        self.replicas: dict[str, ReplicaState] = {}
        client.hset(keys.REQUESTS_FIRST, MODEL, int(EPOCH))
        client.sadd(keys.REQUEST_MODELS, MODEL)

    def counters_until(self, t: float) -> None:
        """Write every complete bucket before trace time `t`, as the gateway would have by then."""
        p, pol = self.policy.params, self.policy
        fb, cb = int(p.fine_bucket_s), int(p.bucket_s)
        pipe = self.client.pipeline(transaction=False)
        for i in range(self.fine_written, min(int(t // fb), pol.fine_req.size)):
            start = int(EPOCH) + i * fb
            pipe.set(keys.requests(MODEL, fb, start), int(pol.fine_req[i]))
            pipe.set(keys.inflight_peak(MODEL, fb, start), repr(float(pol.fine_peak[i])))
            pipe.set(keys.busy(MODEL, fb, start), repr(float(pol.fine_busy[i])))
            self.fine_written = i + 1
        for i in range(self.coarse_written, min(int(t // cb), pol.coarse_rate.size)):
            pipe.set(keys.requests(MODEL, cb, int(EPOCH) + i * cb), int(round(pol.coarse_rate[i] * cb)))
            self.coarse_written = i + 1
        pipe.execute()

    def replicas_as(self, counts: ReplicaCounts) -> None:
        """Make the registry hold `counts.ready` ready and `counts.loading` loading serving replicas."""
        want = [ReplicaState.READY] * counts.ready + [ReplicaState.LOADING] * counts.loading
        now = time.time()
        for slot in range(max(len(want), len(self.replicas))):
            rid = f"{MODEL}@{REVISION}/n1/{slot}"
            have = self.replicas.get(rid)
            target = want[slot] if slot < len(want) else None
            if have == target:
                continue
            if have is not None:
                self.registry.transition(rid, ReplicaState.FAILED, now=now, reason="driver")
                del self.replicas[rid]
            if target is not None:
                self.registry.register(Replica(MODEL, REVISION, "n1", slot, state=target, created_at=now), now=now)
                self.replicas[rid] = target


def _events(payloads: list[dict[str, Any]]) -> list[tuple[str, str, str, int, float]]:
    return [(e["event_id"], e["kind"], e["pool"], int(e["replicas"]), round(float(e["at"]), 6)) for e in payloads]


def test_live_path_and_simulator_emit_the_same_scale_events(live: dict[str, Any]) -> None:
    params = SimParams(cold_start_s=8.7, cold_start_cv=0.0, actuation_delay_s=0.0, load_share=0.0)
    work = build_workload(_trace(), params)
    planner = PlannerParams.from_settings(PlannerSettings())
    policy = Prewarm(planner=planner, record=True)
    replay(work, policy, params)
    assert len(policy.decisions) >= 80
    sim_events = [_events([ev.to_payload() for ev in d.events]) for _, _, d in policy.decisions]
    assert sum(len(e) for e in sim_events) >= 3  # the trace makes the planner act, not only watch

    client = live["client"]
    publish_node(client, "n1", 1000)  # room everywhere: placement never cuts an event
    driver = Driver(client, live["registry"], policy)
    live_events = []
    modes = []
    for (t, counts, decision), expected in zip(policy.decisions, sim_events):
        publish_node(client, "n1", 1000)
        driver.counters_until(t)
        driver.replicas_as(counts)
        now = EPOCH + t
        live["app"].send_task(FORECAST, kwargs={"now": now})
        record = wait_for(
            lambda: (lambda r: r if r.get("at") == repr(now) else None)(client.hgetall(keys.last_forecast(MODEL))),
            30, lambda: f"the plan at {now} (planner log:\n{live['proc'].log()[-3000:]})")
        got = _events(json.loads(record["plan"]))
        live_events.append(got)
        modes.append((record["mode"], decision.mode))
        assert got == expected, f"t={t}: live {got} != simulated {expected} ({record})"
    assert [a for a, _ in modes] == [b for _, b in modes]
    assert "Traceback" not in live["proc"].log()
