"""`prewarm up --rollout corrupt` end to end: the canary's weights are damaged on disk, the rollout rolls back,
and no user sees an error. (`--rollout good` takes minutes longer; its figures are in the README.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.test_up import PREWARM, _env, _trace, _wait_gone


@pytest.mark.slow
def test_up_with_a_corrupt_canary_rolls_back_with_no_user_visible_error(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "trace.jsonl", seconds=90)
    out = tmp_path / "out"
    proc = subprocess.run(
        [PREWARM, "up", "--trace", str(trace), "--duration", "90", "--no-flower", "--out", str(out),
         "--rollout", "corrupt"],
        env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(out.glob("run-*/report.json")).read_text())
    ro = report["rollout"]
    assert ro["outcome"] == "rolled_back", ro
    assert "corrupt" in ro["reason"] or "bad_weights" in ro["reason"], ro["reason"]
    assert ro["errors_during_shift"] == 0 and ro["waited_during_shift"] == 0, ro
    assert set(ro["traffic_by_revision"]) <= {ro["stable"]}  # the canary never got a request
    assert all(v["state"] in ("failed", "retired") for v in ro["canary_validation"]), ro["canary_validation"]
    measured = report["measured"]
    assert measured["answered_2xx"] == measured["requests"]
    assert _wait_gone(str(tmp_path)) == []
