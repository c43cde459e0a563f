"""A real Prometheus scrapes a running gateway and a running node agent; PromQL over the
scraped data returns what was done to them.

Everything is real and started here: Redis (conftest), `prewarm agent --metrics-port` (a
Celery worker process that spawns a `serve-model` runtime with a tiny model), `prewarm
gateway`, and the Debian `prometheus` binary with a 1 s scrape interval, its TSDB in a
temporary directory. The test prewarms one replica through the agent, sends known traffic
through the gateway (requests served by the replica, requests for an unknown model), asks
the agent to measure fragmentation, then checks the numbers Prometheus holds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from prewarm.registry.embedded import free_port, stop_process, wait_for_port
from prewarm.runtime.model import make_model
from prewarm.registry.replicas import ReplicaRegistry
from prewarm.core.settings import Settings
from tests.celery_helpers import WorkerProcess, wait_for, worker_env
from workers.app import make_app
from workers.names import PREWARM, RECYCLE

pytestmark = pytest.mark.timeout(120)

NODE = "scrape-n1"
RID = f"tiny@r1/{NODE}/0"
USER_REQUESTS = 5
UNKNOWN_REQUESTS = 3


def _post(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


class Prometheus:
    """The Debian `prometheus` server scraping the given targets every second."""

    def __init__(self, root: Path, targets: dict[str, int]) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
                       for job, port in targets.items())
        (root / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{jobs}")
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--query.lookback-delta=30s"],
                stdout=out, stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_for(ready, timeout, "prometheus to be ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            data = json.loads(resp.read())
        assert data["status"] == "success", data
        return list(data["data"]["result"])

    def value(self, promql: str) -> float | None:
        """The single value of an instant query, None when it has no result."""
        result = self.query(promql)
        assert len(result) <= 1, f"{promql} returned {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, promql: str, expected: float, timeout: float = 15.0) -> float:
        wait_for(lambda: self.value(promql) == expected, timeout, f"{promql} == {expected}", poll=0.25)
        return expected

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture()
def stack(redis_url: str, tmp_path: Path) -> Iterator[tuple[Prometheus, WorkerProcess, str, ReplicaRegistry]]:
    if not shutil.which("prometheus"):
        pytest.fail("the Debian prometheus binary is required for this test")
    make_model(tmp_path / "models" / "tiny" / "r1", "tiny", seed=0, name="tiny", revision="r1")
    agent_port, gateway_port = free_port(), free_port()
    env = worker_env(redis_url, tmp_path, PREWARM_AGENT_NODE=NODE, PREWARM_METRICS_PORT="0")
    agent = WorkerProcess(["agent", "--node", NODE, "--metrics-port", str(agent_port)], env, tmp_path / "agent.log")
    gateway = WorkerProcess(["gateway", "--host", "127.0.0.1", "--port", str(gateway_port)], env,
                            tmp_path / "gateway.log")
    # started side by side: each spends its first seconds importing
    agent.start(ready_marker=None)
    gateway.start(ready_marker=None)
    prom = Prometheus(tmp_path, {"gateway": gateway_port, "agent": agent_port})
    client: "redis.Redis[str]" = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        agent.wait_ready(timeout=60)
        wait_for_port("127.0.0.1", gateway_port, 30.0, "prewarm gateway")
        prom.wait_ready()
        yield prom, agent, f"http://127.0.0.1:{gateway_port}", ReplicaRegistry(client)
    finally:
        prom.stop()
        gateway.stop()
        agent.stop()
        client.close()


def test_prometheus_scrapes_the_gateway_and_the_agent(
    stack: tuple[Prometheus, WorkerProcess, str, ReplicaRegistry], redis_url: str, clean_env: pytest.MonkeyPatch
) -> None:
    prom, agent, gateway, registry = stack
    clean_env.setenv("PREWARM_REDIS_URL", redis_url)
    settings = Settings.load()
    app = make_app(settings)
    try:
        app.send_task(PREWARM, args=[RID, "serving", None])
        wait_for(lambda: (rec := registry.get(RID)) is not None and rec.state.value in ("ready", "failed"), 60,
                 lambda: f"{RID} to be ready (agent log: {agent.log()[-2000:]})")
        rec = registry.get(RID)
        assert rec is not None
        assert rec.state.value == "ready", rec.reason

        # known traffic through the gateway: served by the replica, and refused for an unknown model
        for i in range(USER_REQUESTS):
            assert _post(f"{gateway}/v1/completions", {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2}) == 200
        for _ in range(UNKNOWN_REQUESTS):
            assert _post(f"{gateway}/v1/completions", {"model": "no-such-model", "prompt": "hi"}) == 404

        # the agent measures the replica's allocator fragmentation (0.0 on CPU: nothing is reserved)
        with urllib.request.urlopen(f"{rec.endpoint}/stats", timeout=5) as resp:
            runtime_fragmentation = float(json.loads(resp.read())["fragmentation"])
        app.send_task(RECYCLE, args=[RID])
    finally:
        app.close()

    prom.wait_value('up{job="gateway"}', 1)
    prom.wait_value('up{job="agent"}', 1)
    prom.wait_value('sum(gateway_requests_total{job="gateway",model="tiny",kind="user",code="200"})', USER_REQUESTS)
    # a request for a model nobody serves is answered 404 and counted as a routing decision, not as model traffic
    prom.wait_value('gateway_routing_decisions_total{job="gateway",model="unknown",outcome="unknown_model"}',
                    UNKNOWN_REQUESTS)
    assert prom.value('sum(gateway_routing_decisions_total{job="gateway",model="tiny",outcome="serving"})') \
        == USER_REQUESTS
    # replica counts come from the registry, through the gateway's collector, at scrape time
    prom.wait_value('prewarm_replicas{job="gateway",model="tiny",state="ready",pool="serving"}', 1)
    # what the agent did: one cold start, its warmup, each validation check, and the fragmentation it measured
    warmups = float(agent.env["PREWARM_WARMUP_REQUESTS"])
    prom.wait_value(f'model_cold_start_seconds_count{{job="agent",model="tiny",node="{NODE}"}}', 1)
    assert prom.value('warmup_requests_total{job="agent",model="tiny",purpose="prewarm"}') == warmups
    # the first replica of a revision on a node class has nothing to compare with: "no_baseline" (issue 13)
    for check, result in (("structural", "passed"), ("numeric", "passed"), ("performance", "no_baseline")):
        assert prom.value(f'prewarm_validation_results_total{{job="agent",model="tiny",check="{check}",'
                          f'result="{result}"}}') == 1
    assert prom.value('sum(model_loading_failures_total{job="agent"})') is None  # no failure, no series
    prom.wait_value(f'gpu_fragmentation_rate{{job="agent",node="{NODE}"}}', runtime_fragmentation)
    phases = prom.query(f'model_loading_phase_duration_seconds_count{{job="agent",model="tiny",node="{NODE}"}}')
    assert sorted(s["metric"]["phase"] for s in phases) == ["embeddings", "first_layers", "rest"]
