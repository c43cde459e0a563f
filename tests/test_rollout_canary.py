"""Proof before traffic with real runtimes: a canary's greedy tokens and top logprobs against the stable's.

Three real `prewarm serve-model` processes (torch on CPU): the stable revision, a canary
with the same weights under a new revision, and a canary whose weights file was damaged
with finite values (and its manifest rewritten to match, so checksums and the structural
and finite-logits checks all pass: only the comparison with the stable revision sees it).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from pathlib import Path
from typing import Iterator

import pytest

from prewarm.core.domain import Replica, ReplicaState
from prewarm.core.settings import RedisSettings, Settings, WarmupSettings
from prewarm.policy import rollout as rp
from prewarm.policy.validation import Outcome
from prewarm.registry.rollouts import RolloutStore
from prewarm.runtime.manifest import Manifest, TensorEntry, load_manifest
from prewarm.runtime.model import ModelConfig, make_model
from tests.runtime_server import RuntimeProcess, start_runtime, wait_loaded
from workers.context import WorkerContext
from workers.node.canary import NoStableToCompare, compare_with_stable, speed_rule

pytestmark = pytest.mark.timeout(300)

#: The rollout's speed ratio here: wide, for two runtimes timed on a shared 2-core machine (production: 1.2).
SPEED_RATIO = 3.0
#: Blocks the slow canary adds to tiny's 4: per token many times the work, far past SPEED_RATIO.
SLOW_EXTRA_LAYERS = 60


def scramble(model_dir: Path, tensor: str, seed: int = 7) -> None:
    """Overwrite one tensor with finite noise and rewrite the manifest to match: corrupt, yet consistent."""
    m = load_manifest(model_dir)
    entry = m.entry(tensor)
    rng = random.Random(seed)
    raw = b"".join(struct.pack("<f", rng.uniform(-0.5, 0.5)) for _ in range(entry.length // 4))
    with open(model_dir / m.file, "r+b") as f:
        f.seek(entry.offset)
        f.write(raw)
    tensors = tuple(TensorEntry(t.name, t.shape, t.dtype, t.offset, t.length, hashlib.sha256(raw).hexdigest())
                    if t.name == tensor else t for t in m.tensors)
    (model_dir / "manifest.json").write_text(Manifest(**{**m.__dict__, "tensors": tensors}).to_json())


def deepen(stable_dir: Path, out_dir: Path, layers: int, revision: str) -> Path:
    """The stable model with `layers` more blocks whose residual outputs are zero: the same answers to
    the last bit (x + 0 is x), several times the work per token. A slower export of the same model."""
    stable = load_manifest(stable_dir)
    cfg = json.loads((stable_dir / "config.json").read_text())
    cfg = ModelConfig(**{**{k: cfg[k] for k in ("vocab_size", "d_model", "n_heads", "d_ff", "max_seq_len", "dtype")},
                         "n_layers": cfg["n_layers"] + layers})
    make_model(out_dir, cfg, seed=1, name=stable.name, revision=revision)
    m = load_manifest(out_dir)
    tensors = []
    with open(stable_dir / stable.file, "rb") as src, open(out_dir / m.file, "r+b") as dst:
        for t in m.tensors:
            if t.name in {e.name for e in stable.tensors}:
                e = stable.entry(t.name)
                src.seek(e.offset)
                raw = src.read(e.length)
            elif t.name.endswith(("attn.proj.weight", "attn.proj.bias", "mlp.fc2.weight", "mlp.fc2.bias")):
                raw = bytes(t.length)
            else:
                tensors.append(t)
                continue
            dst.seek(t.offset)
            dst.write(raw)
            tensors.append(TensorEntry(t.name, t.shape, t.dtype, t.offset, t.length, hashlib.sha256(raw).hexdigest()))
    (out_dir / "manifest.json").write_text(Manifest(**{**m.__dict__, "tensors": tuple(tensors)}).to_json())
    return out_dir


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RuntimeProcess]]:
    base = tmp_path_factory.mktemp("canary")
    dirs = {rev: make_model(base / rev, "tiny", seed=1, name="tiny", revision=rev) for rev in ("r1", "r2", "r3")}
    m = load_manifest(dirs["r3"])
    scramble(dirs["r3"], next(t.name for t in m.tensors if t.name.endswith("mlp.fc2.weight")))
    dirs["r4"] = deepen(dirs["r1"], base / "r4", SLOW_EXTRA_LAYERS, "r4")
    procs: dict[str, RuntimeProcess] = {}
    try:
        for rev, d in dirs.items():
            (base / f"rt-{rev}").mkdir()
            procs[rev] = start_runtime(d, base / f"rt-{rev}")
        for p in procs.values():
            wait_loaded(p.url, timeout=120)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture()
def ctx(redis_url: str) -> Iterator[WorkerContext]:
    from tests.runtime_server import SECRET

    c = WorkerContext.build(Settings(redis=RedisSettings(url=redis_url), warmup=WarmupSettings(secret=SECRET)))
    yield c
    c.client.close()


def roll(ctx: WorkerContext, canary: str) -> None:
    spec = rp.RolloutSpec(model="tiny", stable="r1", canary=canary, steps=(50, 100), pause_s=60.0,
                          logprob_tolerance=0.05, speed_ratio=SPEED_RATIO, error_rate_margin=0.01, latency_ratio=1.2,
                          min_requests=20)
    RolloutStore(ctx.client).update("tiny", lambda running: rp.start(
        spec, now=time.time(), live_revisions=["r1"], known_revisions=["r2", "r3", "r4"],
        running=rp.abort(running, now=time.time()) if running is not None and running.phase not in rp.TERMINAL
        else running))


def test_the_canary_is_compared_with_a_ready_stable_replica(ctx: WorkerContext,
                                                            runtimes: dict[str, RuntimeProcess]) -> None:
    now = time.time()
    assert compare_with_stable(ctx, model="tiny", revision="r2", served_model="tiny",
                               endpoint=runtimes["r2"].url) is None  # no rollout: no comparison
    roll(ctx, "r2")
    with pytest.raises(NoStableToCompare, match="no ready replica of tiny@r1"):
        compare_with_stable(ctx, model="tiny", revision="r2", served_model="tiny", endpoint=runtimes["r2"].url)
    stable = Replica("tiny", "r1", "n1", 0, endpoint=runtimes["r1"].url)
    ctx.registry.register(stable, now=now)
    for st in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(stable.id, st, now=now)
    assert speed_rule(ctx, "tiny", "r2") == ("r1", SPEED_RATIO)  # the canary's warm latency: the stable's baseline
    assert speed_rule(ctx, "tiny", "r1") == ("r1", ctx.settings.warmup.latency_factor)

    good = compare_with_stable(ctx, model="tiny", revision="r2", served_model="tiny", endpoint=runtimes["r2"].url)
    assert good is not None and good.numeric.outcome is Outcome.PASSED, good
    assert good.numeric.measured["positions_compared"] > 0 and "against r1" in good.numeric.detail
    assert good.speed.outcome is Outcome.PASSED, good.speed  # time to first token and decode, side by side
    assert good.problems == ""

    roll(ctx, "r3")
    bad = compare_with_stable(ctx, model="tiny", revision="r3", served_model="tiny", endpoint=runtimes["r3"].url)
    assert bad is not None and bad.numeric.outcome is Outcome.FAILED, bad
    assert "disagrees with the reference" in bad.numeric.detail and "canary numeric check" in bad.problems


def test_a_slower_canary_with_the_same_answers_fails_on_speed(ctx: WorkerContext,
                                                             runtimes: dict[str, RuntimeProcess]) -> None:
    """Issue 19: TTFT and decode rate within the rollout's ratio of the stable's. The slow canary answers
    exactly as the stable does (its extra blocks add zero), so only its speed gives it away."""
    now = time.time()
    stable = Replica("tiny", "r1", "n1", 0, endpoint=runtimes["r1"].url)
    ctx.registry.register(stable, now=now)
    for st in (ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.READY):
        ctx.registry.transition(stable.id, st, now=now)
    roll(ctx, "r4")
    slow = compare_with_stable(ctx, model="tiny", revision="r4", served_model="tiny", endpoint=runtimes["r4"].url)
    assert slow is not None
    assert slow.numeric.outcome is Outcome.PASSED, slow.numeric  # the same answers
    assert slow.speed.outcome is Outcome.FAILED, slow.speed
    assert "decode" in slow.speed.detail and "measured side by side" in slow.speed.detail
    assert "canary performance check" in slow.problems
