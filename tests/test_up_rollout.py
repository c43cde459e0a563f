"""`prewarm up --rollout good|corrupt` end to end: a second revision rolled out midway through a replay.

`good`: the rollout completes, each shift waiting for the canary's validated capacity, and no
request waits for a cold start or fails during the shift. `corrupt`: the canary's weights are
damaged on disk, the rollout rolls back, and no user sees an error."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.test_up import PREWARM, _env, _trace, _wait_gone


def up_with_rollout(tmp_path: Path, kind: str, seconds: int) -> dict[str, Any]:
    """`prewarm up` replaying `seconds` of a trace with a `kind` rollout midway; its report."""
    trace = _trace(tmp_path / "trace.jsonl", seconds=seconds)
    out = tmp_path / "out"
    proc = subprocess.run(
        [PREWARM, "up", "--trace", str(trace), "--duration", str(seconds), "--no-flower", "--out", str(out),
         "--rollout", kind],
        env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300 + 2 * seconds,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(next(out.glob("run-*/report.json")).read_text())
    return report


@pytest.mark.slow
def test_up_with_a_corrupt_canary_rolls_back_with_no_user_visible_error(tmp_path: Path) -> None:
    report = up_with_rollout(tmp_path, "corrupt", 90)
    ro = report["rollout"]
    assert ro["outcome"] == "rolled_back", ro
    assert "corrupt" in ro["reason"] or "bad_weights" in ro["reason"], ro["reason"]
    assert ro["errors_during_shift"] == 0 and ro["waited_during_shift"] == 0, ro
    assert set(ro["traffic_by_revision"]) <= {ro["stable"]}  # the canary never got a request
    assert all(v["state"] in ("failed", "retired") for v in ro["canary_validation"]), ro["canary_validation"]
    measured = report["measured"]
    assert measured["answered_2xx"] == measured["requests"]
    assert _wait_gone(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(900)  # a 240 s replay after a start-up, on a shared machine
def test_up_with_a_good_canary_completes_and_no_request_waits_during_the_shift(tmp_path: Path) -> None:
    # 240 s: the rollout runs in the second half, three steps of a canary bring-up and a 10 s pause each
    report = up_with_rollout(tmp_path, "good", 240)
    ro = report["rollout"]
    assert ro["outcome"] == "completed", {k: v for k, v in ro.items() if k != "weight_samples"}
    assert ro["waited_during_shift"] == 0 and ro["errors_during_shift"] == 0, ro
    assert ro["requests_during_shift"] > 0
    by_rev = ro["traffic_by_revision"]
    assert by_rev.get(ro["canary"], {}).get("200", 0) > 0 and by_rev.get(ro["stable"], {}).get("200", 0) > 0, by_rev
    assert ro["replicas_by_revision"][ro["canary"]].get("ready", 0) >= 1, ro["replicas_by_revision"]
    assert ro["canary_validation"] and all(v["state"] in ("ready", "retired", "draining") for v in ro["canary_validation"])
    measured = report["measured"]
    assert measured["answered_2xx"] == measured["requests"], measured
    assert _wait_gone(str(tmp_path)) == []
