"""Progressive loading: phases and progress, pipelined first request, snapshots, corruption."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch

from prewarm.core.domain import LoadPhase
from prewarm.core.errors import PermanentError
from prewarm.runtime.loader import ProgressiveLoader, default_first_layers, load_full
from prewarm.runtime.model import CorruptWeights, ModelConfig, greedy, last_logits, load_manifest, make_model
from prewarm.runtime.snapshot import SnapshotStore

CPU = torch.device("cpu")
PROMPT = list(b"Progressive loading overlaps the first request with the weights' arrival.")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=8, n_heads=4, d_ff=256, max_seq_len=256)
    return make_model(tmp_path_factory.mktemp("loader") / "m", cfg, seed=11, name="m8")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[torch.Tensor, list[int]]:
    full = load_full(model_dir, "cpu")
    return last_logits(full, PROMPT, CPU), list(greedy(full, PROMPT, 6, CPU))


def test_phases_progress_and_coldstart_log(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[float, LoadPhase]] = []
    phases: list[tuple[LoadPhase, float]] = []
    caplog.set_level(logging.INFO, logger="prewarm.coldstart")
    loader = ProgressiveLoader(model_dir, device="cpu", model_name="m8", node="n1", read_chunk_bytes=64 * 1024,
                               on_progress=lambda p, ph: seen.append((p, ph)),
                               on_phase=lambda ph, s: phases.append((ph, s)))
    assert loader.first_layers == default_first_layers(8) == 2
    assert loader.phase is LoadPhase.NONE and loader.progress == 0.0
    loader.start()
    loader.start()  # idempotent
    assert loader.wait(30)
    assert loader.phase is LoadPhase.DONE and loader.progress == 1.0 and loader.loaded
    values = [p for p, _ in seen]
    assert values == sorted(values) and values[-1] == pytest.approx(1.0) and len(values) > 20
    rank = {LoadPhase.EMBEDDINGS: 0, LoadPhase.FIRST_LAYERS: 1, LoadPhase.REST: 2}
    ranks = [rank[ph] for _, ph in seen]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1, 2}  # phases in order, none skipped
    assert [p for p, _ in phases] == [LoadPhase.EMBEDDINGS, LoadPhase.FIRST_LAYERS, LoadPhase.REST]
    assert all(s >= 0 for _, s in phases)
    # Phase 1 is exactly the embeddings, positions, final norm and head; phase 2 two blocks.
    m = load_manifest(model_dir)
    emb_bytes = sum(t.length for t in m.tensors if not t.name.startswith("layers."))
    first_emb = [p for p, ph in seen if ph is LoadPhase.EMBEDDINGS][-1]
    assert first_emb == pytest.approx(emb_bytes / m.total_bytes)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[COLDSTART]")]
    assert any("event=phase" in ln and "phase=embeddings" in ln and "node=n1" in ln and "model=m8" in ln for ln in lines)
    assert any("event=loaded" in ln for ln in lines)


def test_first_layers_is_configurable(model_dir: Path) -> None:
    seen: list[tuple[float, LoadPhase]] = []
    loader = ProgressiveLoader(model_dir, device="cpu", first_layers=5, on_progress=lambda p, ph: seen.append((p, ph)))
    loader.start().wait(30)
    m = load_manifest(model_dir)
    upto = sum(t.length for t in m.tensors if not t.name.startswith("layers.") or int(t.name.split(".")[1]) < 5)
    assert [p for p, ph in seen if ph is LoadPhase.FIRST_LAYERS][-1] == pytest.approx(upto / m.total_bytes)
    with pytest.raises(ValueError):
        ProgressiveLoader(model_dir, device="cpu", first_layers=0)


class HeldLoad:
    """A progressive load the test holds after layer 0 and releases when the forward pass asks for
    layer 1: pipelining shown by an order of events, whatever the machine's speed (issue 20, minor:
    `layer_waits >= 3` under a throttled read failed on a busy machine)."""

    def __init__(self, model_dir: Path) -> None:
        self.events: list[str] = []
        self.gate = threading.Event()
        self.held = threading.Event()
        self.loader = ProgressiveLoader(model_dir, device="cpu", on_progress=self._hold_after_layer_0)

    def _hold_after_layer_0(self, _progress: float, _phase: LoadPhase) -> None:
        # on the load thread after each tensor is installed; layer 0's readiness is set before the
        # first tensor of layer 1 is reported, so this holds the load with layer 1 incomplete
        if self.loader._layer_ready[0].is_set() and not self.gate.is_set():
            if not self.held.is_set():
                self.events.append("load held after layer 0")
                self.held.set()
            self.gate.wait(60)

    def start(self) -> "HeldLoad":
        self.loader.start()
        assert self.held.wait(60) and not self.loader.loaded  # the request really starts mid-load
        return self

    def before_layer(self, i: int) -> None:
        self.events.append(f"forward asks for layer {i}")
        if i == 1 and not self.gate.is_set():
            assert not self.loader.loaded  # layer 1 cannot be in: the load is held
            self.events.append("load released")
            self.gate.set()
        self.loader.before_layer(i)

    def pipelined(self) -> bool:
        return self.events[:4] == ["load held after layer 0", "forward asks for layer 0", "forward asks for layer 1",
                                   "load released"]


def test_pipelined_first_request_equals_the_fully_loaded_model(
    model_dir: Path, reference: tuple[torch.Tensor, list[int]]
) -> None:
    """The first request computes with the embeddings and layer 0 while the rest is held back, then
    gives exactly the fully loaded model's logits."""
    ref_logits, ref_tokens = reference
    held = HeldLoad(model_dir).start()
    got = last_logits(held.loader.model, PROMPT, CPU, held.before_layer)
    assert held.pipelined(), held.events
    assert torch.equal(got, ref_logits)
    assert held.loader.wait(30)
    assert list(greedy(held.loader.model, PROMPT, 6, CPU)) == ref_tokens


def test_pipelined_greedy_mid_load(model_dir: Path, reference: tuple[torch.Tensor, list[int]]) -> None:
    held = HeldLoad(model_dir).start()
    tokens = list(greedy(held.loader.model, PROMPT, 6, CPU, held.before_layer))
    assert held.pipelined(), held.events
    assert tokens == reference[1]


def test_second_load_maps_the_snapshot_and_never_opens_the_original(
    model_dir: Path, reference: tuple[torch.Tensor, list[int]], tmp_path: Path
) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    first = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    assert first.wait(30) and first.join(30)
    assert first.stats.source == "original" and first.stats.original_read == "mapped"  # CPU: views of the verified file
    assert first.stats.opened == [str(model_dir / "model.safetensors")]
    assert first.stats.snapshot_written and Path(first.stats.snapshot_written).exists()
    second = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    assert second.wait(30) and second.join(30)
    assert second.stats.source == "snapshot"
    assert second.stats.opened == [first.stats.snapshot_written]
    assert second.stats.bytes_from_original == 0 and second.stats.snapshot_written == ""
    # The weights are views of the mapping, not copies.
    assert second.mapped is not None
    assert torch.equal(last_logits(second.model, PROMPT, CPU), reference[0])
    second.release()
    first.release()


def test_a_replica_started_during_the_first_load_waits_for_its_snapshot_and_maps_it(
    model_dir: Path, reference: tuple[torch.Tensor, list[int]], tmp_path: Path
) -> None:
    """Two replicas of one model started together on a node: the first reads the original (slowed, so the
    second starts mid-read), the second waits for the snapshot the first fills and never opens the original."""
    store = SnapshotStore(tmp_path / "snaps", 1 << 30, fill_wait_s=60)
    total = load_manifest(model_dir).total_bytes
    first = ProgressiveLoader(model_dir, device="cpu", snapshots=store, read_limit_bps=total / 1.5).start()
    assert first.wait_embeddings(30) and not first.loaded  # mid-read
    second = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    assert second.wait(60) and second.join(60) and first.join(60)
    assert first.stats.source == "original" and first.stats.fill_waited_s == 0.0
    assert second.stats.source == "snapshot" and second.stats.bytes_from_original == 0
    assert second.stats.opened == [first.stats.snapshot_written]
    assert second.stats.fill_waited_s > 0.2  # it waited for the rest of the first one's read and write
    assert torch.equal(last_logits(second.model, PROMPT, CPU), reference[0])
    second.release()
    first.release()


def test_a_fill_that_outlasts_the_wait_or_no_wait_reads_the_original(model_dir: Path, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30, fill_wait_s=0.3)
    loader = ProgressiveLoader(model_dir, device="cpu", snapshots=store)
    with store.fill(loader.snapshot_key) as held:  # a stuck filler elsewhere on the node
        assert held.acquired and not held.contended
        loader.start()
        assert loader.wait(30)
        assert loader.stats.source == "original" and loader.stats.bytes_from_snapshot == 0
        assert loader.stats.fill_waited_s == pytest.approx(0.3, abs=0.25)
        assert loader.join(30) and loader.stats.snapshot_written  # it still writes one for the next
    loader.release()
    eager = SnapshotStore(tmp_path / "eager", 1 << 30)  # fill_wait_s 0: every replica reads at once (as before)
    a = ProgressiveLoader(model_dir, device="cpu", snapshots=eager)
    with eager.fill(a.snapshot_key):
        a.start()
        assert a.wait(30) and a.join(30)
    assert a.stats.source == "original" and a.stats.fill_waited_s < 0.05


def test_snapshot_in_another_dtype(model_dir: Path, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    first = ProgressiveLoader(model_dir, device="cpu", dtype="bfloat16", snapshots=store).start()
    first.wait(30)
    first.join(30)
    assert first.model.tok_emb.weight.dtype == torch.bfloat16
    second = ProgressiveLoader(model_dir, device="cpu", dtype="bfloat16", snapshots=store).start()
    second.wait(30)
    assert second.stats.source == "snapshot"
    assert torch.equal(last_logits(first.model, PROMPT, CPU), last_logits(second.model, PROMPT, CPU))
    # A float32 replica does not take the bfloat16 snapshot.
    third = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    third.wait(30)
    assert third.stats.source == "original"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_corrupt_snapshot_is_detected_served_from_the_original_and_rebuilt(
    model_dir: Path, reference: tuple[torch.Tensor, list[int]], tmp_path: Path
) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    first = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    first.wait(30)
    first.join(30)
    first.release()
    snap_path = Path(first.stats.snapshot_written)
    # Flip one bit inside block 5's fc1 weight (mid-load: earlier tensors pass their checks).
    probe = store.open(first.snapshot_key, first.config)
    assert probe is not None
    spec = probe.tensors["layers.5.mlp.fc1.weight"]
    probe.release()
    _flip(snap_path, spec.offset + spec.length // 2)
    second = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    assert second.wait(30) and second.join(30)
    assert "layers.5.mlp.fc1.weight" in second.stats.snapshot_rejected
    assert second.stats.source == "snapshot+original"
    assert second.stats.bytes_from_original > 0 and second.stats.bytes_from_snapshot > 0
    assert torch.equal(last_logits(second.model, PROMPT, CPU), reference[0])
    assert second.stats.snapshot_written == str(snap_path)  # rebuilt
    third = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    third.wait(30)
    assert third.stats.source == "snapshot" and third.stats.snapshot_rejected == ""
    assert torch.equal(last_logits(third.model, PROMPT, CPU), reference[0])


def test_truncated_snapshot_is_rebuilt(model_dir: Path, reference: tuple[torch.Tensor, list[int]], tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    first = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    first.wait(30)
    first.join(30)
    first.release()
    path = Path(first.stats.snapshot_written)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)  # a partial file under the final name
    second = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    second.wait(30)
    second.join(30)
    assert "truncated" in second.stats.snapshot_rejected
    assert second.stats.source == "original" and second.stats.bytes_from_snapshot == 0
    assert torch.equal(last_logits(second.model, PROMPT, CPU), reference[0])
    assert second.stats.snapshot_written == str(path) and path.exists()
    third = ProgressiveLoader(model_dir, device="cpu", snapshots=store).start()
    third.wait(30)
    assert third.stats.source == "snapshot"


def test_corrupt_weights_fail_permanently_naming_the_tensor(model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    entry = load_manifest(bad).entry("layers.6.attn.qkv.weight")
    _flip(bad / "model.safetensors", entry.offset + 17)
    loader = ProgressiveLoader(bad, device="cpu").start()
    with pytest.raises(CorruptWeights, match=r"layers\.6\.attn\.qkv\.weight") as info:
        loader.wait(30)
    assert isinstance(info.value, PermanentError) and info.value.tensor == "layers.6.attn.qkv.weight"
    assert loader.error is info.value and not loader.loaded
    # A request that was waiting on a later block is released with the same error.
    with pytest.raises(CorruptWeights):
        loader.before_layer(7)


def test_truncated_weights_file_is_corrupt(model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "short"
    shutil.copytree(model_dir, bad)
    path = bad / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    loader = ProgressiveLoader(bad, device="cpu").start()
    with pytest.raises(CorruptWeights, match="truncated|ends inside"):
        loader.wait(30)


def test_load_full_matches_progressive(model_dir: Path, reference: tuple[torch.Tensor, list[int]]) -> None:
    loader = ProgressiveLoader(model_dir, device="cpu").start()
    loader.wait(30)
    assert torch.equal(last_logits(loader.model, PROMPT, CPU), reference[0])
    if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines only
        gpu = ProgressiveLoader(model_dir, device="cuda").start()
        gpu.wait(60)
        assert gpu.model.tok_emb.weight.device.type == "cuda"
