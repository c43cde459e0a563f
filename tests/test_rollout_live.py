"""A rollout's live comparison end to end: user requests through a real gateway, a real planner worker.

The pure rule (`prewarm.policy.rollout._live_verdict`) is tested in `test_rollout_policy.py`;
here its inputs are what the live path records: the gateway splits real requests by the
rollout's weights, answers them from real upstreams (the canary's answering 500), counts each
answer per revision into Redis, and the planner's tick reads those counts and rolls back.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from prewarm.cli import main
from prewarm.core import keys
from prewarm.core.domain import Replica, ReplicaState
from prewarm.registry.embedded import EmbeddedRedis
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.registry.rollouts import RolloutStore
from tests.celery_helpers import publish_node, queued_tasks, wait_for
from tests.httpservers import AppThread, Upstream
from tests.test_gateway import Harness
from tests.test_rollout_planner import canary_prewarms, plan_tick, planner, steady_load  # noqa: F401 - the fixture
from workers.names import RETIRE, node_queue

pytestmark = pytest.mark.slow


def _ready(reg: ReplicaRegistry, rid: str, endpoint: str) -> None:
    """What the node agent does with a prewarm that succeeds, the replica answering at `endpoint`."""
    model, rest = rid.split("@", 1)
    rev, node, slot = rest.split("/")
    now = time.time()
    reg.register(Replica(model, rev, node, int(slot), endpoint=endpoint, state=ReplicaState.PENDING, created_at=now),
                 now=now)
    for st in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        reg.transition(rid, st, now=time.time())


def test_live_canary_errors_through_the_gateway_roll_back(planner: dict[str, Any],  # noqa: F811
                                                          redis_server: EmbeddedRedis) -> None:
    client, reg = planner["client"], planner["registry"]
    servers = [AppThread(Upstream("stable").app()).start(), AppThread(Upstream("canary", mode="fail").app()).start()]
    gw = Harness(redis_server.url)
    try:
        publish_node(client, "n1", 4)
        publish_node(client, "n2", 8)
        client.hset(keys.node_info("n2"), "residency", json.dumps({"tiny@r2": "disk"}))  # r2 is known there
        client.sadd(keys.NODES, "n2")
        for slot in range(4):
            _ready(reg, f"tiny@r1/n1/{slot}", servers[0].url)
        steady_load(client)
        store = RolloutStore(client)
        # a long pause: the live comparison runs within it, not after it
        assert main(["rollout", "start", "tiny", "--revision", "r2", "--steps", "50,100", "--pause", "10m"]) == 0
        plan_tick(planner, 1)
        canary = canary_prewarms(client, 50)
        for rid in canary:  # validated (what the canary proof checks is tested elsewhere): ready, answering 500
            _ready(reg, rid, servers[1].url)
        plan_tick(planner, 2)
        wait_for(lambda: store.weights("tiny") == [("r2", 50.0), ("r1", 50.0)], 30,
                 lambda: f"the shift to 50% (planner log:\n{planner['proc'].log()[-3000:]})")

        statuses = [gw.complete("tiny")[0] for _ in range(80)]  # users' requests, split by the weights
        assert statuses.count(500) >= 20 and statuses.count(200) >= 20, statuses
        time.sleep(1.5)  # the gateway's per-revision counts reach Redis (flushed each second)
        plan_tick(planner, 3)
        st = wait_for(lambda: s if (s := store.get("tiny")) is not None and s.phase.value == "rolled_back" else None, 30,
                      lambda: f"the rollback (planner log:\n{planner['proc'].log()[-3000:]})")
        assert "canary error rate" in st.reason and "exceeds the stable 0.0%" in st.reason, st.reason
        assert store.weights("tiny") == [("r2", 0.0), ("r1", 100.0)]
        wait_for(lambda: sorted(m["args"][0] for n in ("n1", "n2") for m in queued_tasks(client, node_queue(n))
                                if m["task"] == RETIRE) == sorted(canary), 30, "the canary's replicas retired")
        with urllib.request.urlopen(f"http://127.0.0.1:{planner['metrics_port']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'prewarm_rollout_rollbacks_total{cause="live_errors",model="tiny"} 1.0' in text
        time.sleep(0.2)  # the gateway's cached weights (refreshed every 10 ms here)
        assert {gw.complete("tiny")[0] for _ in range(20)} == {200}  # every user back on the stable revision
    finally:
        gw.close()
        for s in servers:
            s.stop()
