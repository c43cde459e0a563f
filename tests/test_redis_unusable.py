"""Issue 20 (minor): a Redis that accepts connections but refuses their set-up (a database index
beyond the server's `databases`) gave a plain-text 500 with a traceback on every request,
`/readyz` included. It is an unusable registry: a JSON 503 with Retry-After, like Redis down."""

from __future__ import annotations

import json
import logging

import pytest

from prewarm.registry.embedded import EmbeddedRedis
from tests.test_gateway import Harness, request


def test_a_database_index_the_server_lacks_is_a_clean_503(caplog: pytest.LogCaptureFixture) -> None:
    with EmbeddedRedis() as server:
        h = Harness(f"redis://127.0.0.1:{server.port}/99")  # valid syntax; the server has 16 databases
        try:
            with caplog.at_level(logging.WARNING):
                for path in ("/readyz", "/v1/models"):
                    status, headers, body = request(h.url, path=path)
                    assert status == 503 and headers["content-type"].startswith("application/json"), body
                status, headers, body = h.complete()
                assert status == 503 and "retry-after" in headers, body
                assert json.loads(body)["error"]["code"] == "unavailable"
                status, _, body = request(h.url, path="/healthz")
                assert status == 200 and json.loads(body)["registry"] == "unavailable"
            assert "Traceback" not in caplog.text
            assert "DB index is out of range" in caplog.text  # the log says why, once per failed read
        finally:
            h.close()
