"""The model definition, its size ladder, make_model's files and manifest, the tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from prewarm.cli import main
from prewarm.runtime.model import (
    KVCache,
    ModelConfig,
    ModelError,
    TransformerLM,
    greedy,
    last_logits,
    load_config,
    load_manifest,
    make_model,
    parse_size,
)
from prewarm.runtime.tokenizer import ByteTokenizer

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3, name="tiny")


def _model(d: Path) -> TransformerLM:
    cfg = load_config(d)
    model = TransformerLM.skeleton(cfg)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            model.set_tensor(name, f.get_tensor(name))
    return model


def test_tiny_config_is_a_few_mb_and_round_trips() -> None:
    cfg = ModelConfig.for_size("tiny")
    assert 1 << 20 < cfg.n_bytes() < 8 << 20
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.for_size("tiny", dtype="float16").n_bytes() * 2 == cfg.n_bytes()


@pytest.mark.parametrize("size", ["small", "64MB", "512MB", "1GB", "2GB", 300_000_000])
def test_size_ladder_reaches_the_target(size: str | int) -> None:
    cfg = ModelConfig.for_size(size)
    target = 54 * 2**20 if size == "small" else parse_size(size)
    assert target <= cfg.n_bytes() <= target * 1.06 or size == "small"
    assert cfg.d_model % cfg.n_heads == 0 and 1 <= cfg.n_layers <= 24


@pytest.mark.parametrize("bad", ["huge", "12XB", "0", -5])
def test_bad_sizes_are_refused_with_the_value_named(bad: str | int) -> None:
    with pytest.raises(ModelError, match="size"):
        ModelConfig.for_size(bad)


def test_config_rejects_bad_dimensions() -> None:
    with pytest.raises(ModelError, match="divisible"):
        ModelConfig(vocab_size=512, d_model=100, n_layers=1, n_heads=3, d_ff=64, max_seq_len=8)
    with pytest.raises(ModelError, match="missing"):
        ModelConfig.from_json('{"vocab_size": 512}')


def test_manifest_byte_ranges_and_checksums_match_the_file(tiny_dir: Path) -> None:
    m = load_manifest(tiny_dir)
    cfg = load_config(tiny_dir)
    raw = (tiny_dir / "model.safetensors").read_bytes()
    assert [t.name for t in m.tensors] == [n for n, _ in cfg.tensor_shapes()]
    assert m.file_bytes == len(raw)
    header_len = int.from_bytes(raw[:8], "little")
    pos = 8 + header_len
    for t in m.tensors:
        assert t.offset == pos, t.name  # contiguous, in order, after the header
        assert hashlib.sha256(raw[t.offset : t.offset + t.length]).hexdigest() == t.sha256
        pos += t.length
    assert pos == len(raw)
    assert m.total_bytes == sum(t.length for t in m.tensors) == cfg.n_bytes()
    assert m.revision == m.checksum[:12] and m.name == "tiny"
    # The file is genuine safetensors, and the manifest's ranges hold each tensor's bytes.
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        for t in m.tensors:
            tensor = f.get_tensor(t.name)
            assert tuple(tensor.shape) == t.shape and str(tensor.dtype) == f"torch.{t.dtype}"
            assert tensor.contiguous().view(torch.uint8).numpy().tobytes() == raw[t.offset : t.offset + t.length]


def test_make_model_is_deterministic_per_seed(tmp_path: Path, tiny_dir: Path) -> None:
    again = load_manifest(make_model(tmp_path / "a", "tiny", seed=3))
    other = load_manifest(make_model(tmp_path / "b", "tiny", seed=4))
    assert again.checksum == load_manifest(tiny_dir).checksum
    assert other.checksum != again.checksum


def test_make_model_bfloat16(tmp_path: Path) -> None:
    d = make_model(tmp_path / "bf", "tiny", dtype="bfloat16")
    m = load_manifest(d)
    assert m.dtype == "bfloat16" and load_config(d).dtype == "bfloat16"
    model = _model(d)
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert torch.isfinite(last_logits(model, [1, 2, 3], CPU)).all()


def test_edited_manifest_is_refused(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", "tiny")
    data = json.loads((d / "manifest.json").read_text())
    data["tensors"][0]["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="checksum"):
        load_manifest(d)


def test_greedy_with_kv_cache_matches_recomputing_the_whole_sequence(tiny_dir: Path) -> None:
    model = _model(tiny_dir)
    prompt = list(b"The quick brown fox")
    fast = list(greedy(model, prompt, 12, CPU))
    seq = list(prompt)
    for _ in range(12):
        with torch.inference_mode():
            logits = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    assert fast == seq[len(prompt):]
    assert fast == list(greedy(model, prompt, 12, CPU))  # deterministic


def test_attention_is_causal(tiny_dir: Path) -> None:
    model = _model(tiny_dir)
    a = torch.tensor([[5, 6, 7, 8, 9]])
    b = torch.tensor([[5, 6, 7, 100, 200]])
    with torch.inference_mode():
        la, lb = model(a), model(b)
    assert torch.allclose(la[0, :3], lb[0, :3], atol=1e-6)
    assert not torch.allclose(la[0, 4], lb[0, 4])


def test_chunked_prefill_with_cache_matches_one_pass(tiny_dir: Path) -> None:
    model = _model(tiny_dir)
    ids = torch.tensor([list(b"abcdefghij")])
    with torch.inference_mode():
        whole = model(ids)
        cache = KVCache(model.config.n_layers)
        first = model(ids[:, :6], cache)
        second = model(ids[:, 6:], cache)
    assert torch.allclose(torch.cat([first, second], dim=1), whole, atol=1e-5)


def test_prompt_longer_than_the_context_keeps_its_tail(tiny_dir: Path) -> None:
    model = _model(tiny_dir)
    long = [65 + i % 26 for i in range(model.config.max_seq_len + 50)]
    out = list(greedy(model, long, 3, CPU))
    assert len(out) == 3
    assert out == list(greedy(model, long[-(model.config.max_seq_len - 3):], 3, CPU))


def test_byte_tokenizer_round_trips_and_stays_in_vocab() -> None:
    tok = ByteTokenizer(512)
    text = "héllo, wörld — 日本 🚀"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [300, 511]) == text  # ids above the bytes decode to nothing
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([512])
    with pytest.raises(ValueError):
        ByteTokenizer(100)


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch) -> None:
    rc = main(["make-model", "--size", "tiny", "--out", str(tmp_path / "cli"), "--name", "cli-model", "--seed", "7"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    m = load_manifest(tmp_path / "cli")
    assert out["name"] == m.name == "cli-model" and out["checksum"] == m.checksum
    assert main(["make-model", "--size", "12XB", "--out", str(tmp_path / "bad")]) == 2
