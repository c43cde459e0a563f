"""A real `prewarm serve-model` child process for the runtime and adapter tests.

The server runs the installed console script on a free port with a tiny random model
made in a temporary directory, so the tests exercise the same process a node agent starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from prewarm.registry.embedded import free_port, stop_process, wait_for_port
from prewarm.runtime.manifest import Manifest, TensorEntry, load_manifest

TOKEN = "control-token-for-tests"
SECRET = "warmup-secret-for-tests"


def prewarm_command() -> list[str]:
    script = Path(sys.executable).parent / "prewarm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prewarm.cli"]


@dataclass
class RuntimeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, timeout: float = 15.0) -> int:
        return stop_process(self.proc, timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_runtime(model_dir: Path, workdir: Path, *args: str, env: Mapping[str, str] | None = None) -> RuntimeProcess:
    port = free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    base_env.update({
        "PREWARM_RUNTIME_TOKEN": TOKEN,
        "PREWARM_WARMUP_SECRET": SECRET,
        "PREWARM_RUNTIME_DEVICE": "cpu",
        "PREWARM_RUNTIME_SNAPSHOT_DIR": str(workdir / "snapshots"),
        "PREWARM_RUNTIME_SNAPSHOT_MAX_BYTES": str(256 * 1024 * 1024),
        "OMP_NUM_THREADS": "1",
    })
    base_env.update(env or {})
    log = workdir / f"runtime-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prewarm_command(), "serve-model", "--model-dir", str(model_dir), "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=base_env,
        )
    rp = RuntimeProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_for_port("127.0.0.1", port, 60.0, "prewarm serve-model")
    except Exception:
        rp.stop()
        raise RuntimeError(f"serve-model did not start:\n{rp.output()}") from None
    return rp


def call(
    url: str,
    method: str = "GET",
    body: Any = None,
    *,
    token: str | None = None,
    headers: Mapping[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, Any, Mapping[str, str]]:
    """One HTTP call; returns (status, parsed JSON or text, headers), never raises on a status."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **(headers or {})}
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload, hdrs = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        status, payload, hdrs = exc.code, exc.read(), dict(exc.headers or {})
        exc.close()
    text = payload.decode("utf-8", "replace")
    try:
        return status, json.loads(text), hdrs
    except json.JSONDecodeError:
        return status, text, hdrs


def wait_loaded(url: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body, _ = call(url + "/load", token=TOKEN)
        if status == 200 and body.get("loaded"):
            return body
        if status == 200 and body.get("error"):
            raise RuntimeError(f"runtime failed to load: {body['error']}")
        time.sleep(0.05)
    raise TimeoutError(f"runtime at {url} did not load within {timeout}s")


def poison(model_dir: Path, tensor: str) -> None:
    """Fill one tensor with NaN and rewrite the manifest to match: bad numbers, intact files."""
    m = load_manifest(model_dir)
    entry = m.entry(tensor)
    assert entry.dtype == "float32"
    raw = struct.pack("<f", float("nan")) * (entry.length // 4)
    with open(model_dir / m.file, "r+b") as f:
        f.seek(entry.offset)
        f.write(raw)
    tensors = tuple(TensorEntry(t.name, t.shape, t.dtype, t.offset, t.length, hashlib.sha256(raw).hexdigest())
                    if t.name == tensor else t for t in m.tensors)
    (model_dir / "manifest.json").write_text(Manifest(**{**m.__dict__, "tensors": tensors}).to_json())
