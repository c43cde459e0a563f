"""Flower against a real broker: a real Redis (the session server), a real node agent
(`prewarm agent`, a Celery worker process) and a real Flower (`prewarm flower`), both
started as the CLI starts them; Flower's HTTP API shows the agent's worker and its queue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from prewarm.registry.embedded import free_port, wait_for_port

pytest.importorskip("flower")
NODE = "flower-n1"
QUEUE = f"prewarm.node.{NODE}"


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "prewarm.cli", *args],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture()
def stack(redis_url: str, tmp_path: Path) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env.update({
        "PREWARM_REDIS_URL": redis_url,
        "PREWARM_WARMUP_SECRET": "flower-test-secret",
        "PREWARM_AGENT_STATE_DIR": str(tmp_path / "agent"),
        "PREWARM_RUNTIME_MODELS_DIR": str(tmp_path / "models"),
        "PREWARM_RUNTIME_SNAPSHOT_DIR": str(tmp_path / "snapshots"),
        "FLOWER_UNAUTHENTICATED_API": "1",
    })
    port = free_port()
    agent = _start(["agent", "--node", NODE, "--metrics-port", "0", "--loglevel", "WARNING"], env, tmp_path / "agent.log")
    flower = _start(["flower", "--port", str(port), "--address", "127.0.0.1"], env, tmp_path / "flower.log")
    try:
        wait_for_port("127.0.0.1", port, 60, "flower")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(flower)
        _stop(agent)
        if agent.returncode not in (0, -signal.SIGTERM):
            print((tmp_path / "agent.log").read_text()[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_flower_sees_the_agents_worker_and_queue(stack: str) -> None:
    deadline = time.monotonic() + 60
    workers: dict[str, Any] = {}
    while time.monotonic() < deadline:
        workers = _get(f"{stack}/api/workers?refresh=1")
        if any(NODE in name and info.get("active_queues") for name, info in workers.items()):
            break
        time.sleep(1)
    ours = {name: info for name, info in workers.items() if NODE in name}
    assert ours, f"Flower sees no worker of node {NODE}: {sorted(workers)}"
    queues = {q["name"] for info in ours.values() for q in info.get("active_queues") or []}
    assert QUEUE in queues
    lengths = _get(f"{stack}/api/queues/length")
    assert QUEUE in {q["name"] for q in lengths["active_queues"]}
