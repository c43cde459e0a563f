"""The served model: a small decoder-only transformer defined by a JSON config.

Everything a replica needs to rebuild the exact same network lives here: `ModelConfig`
(dimensions and dtype, and the size ladder `for_size` that `prewarm make-model` uses),
`TransformerLM` (pre-norm blocks, causal attention, untied output head, deterministic
greedy decoding with a KV cache) and the ordered list of its tensors, which fixes both the
order of `model.safetensors` and the order progressive loading reads it in, and
`make_model`, which writes a model directory tensor by tensor (never two copies of the
weights in memory). The manifest types live in `prewarm.runtime.manifest` and are re-exported.

The forward pass takes an optional `before_layer(i)` hook: the progressive loader passes a
function that blocks until layer i's weights are in, which is how a first request computes
while the tail of the model is still loading (PipeSwitch-style), on the very same code path
as a fully loaded model, so the two answers are bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from prewarm.runtime.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CorruptWeights,
    Manifest,
    ModelError,
    TensorEntry,
    json_object,
    load_manifest,
)

__all__ = [
    "ModelConfig", "TransformerLM", "KVCache", "Manifest", "TensorEntry", "ModelError", "CorruptWeights",
    "load_manifest", "load_config", "make_model", "greedy", "last_logits", "parse_size",
    "CONFIG_FILE", "MANIFEST_FILE", "WEIGHTS_FILE",
]

DType = Literal["float32", "float16", "bfloat16"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
#: safetensors' names for the dtypes we write.
SAFETENSORS_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_size(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ModelError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}") from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(size: str | int) -> int:
    """'512MB', '1GB', '2GiB', '300000' -> bytes (binary units: 1 MB = 2**20 bytes)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ModelError(f"size must be positive, got {size}")
        return size
    m = _SIZE.match(str(size))
    if not m:
        raise ModelError(f"size must be 'tiny', 'small', a byte count or e.g. '512MB'/'1GB', got {size!r}")
    unit = (m.group(2) or "")[:1].lower()
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ModelError(f"size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The dimensions of a `TransformerLM`; written next to the weights as config.json."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelError(f"config field {name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads:
            raise ModelError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.vocab_size < 256:
            raise ModelError(f"vocab_size must be >= 256 (byte tokenizer), got {self.vocab_size}")
        torch_dtype(self.dtype)

    # -- serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        fields = set(cls.__dataclass_fields__)
        data = json_object(text, CONFIG_FILE, sorted(fields - {"dtype"}))
        return cls(**{k: data[k] for k in fields if k in data})

    def with_dtype(self, dtype: str) -> "ModelConfig":
        torch_dtype(dtype)
        return ModelConfig(**{**asdict(self), "dtype": dtype})

    # -- sizes ---------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter, in load order: phase-1 tensors first, then layer by layer."""
        d, ff = self.d_model, self.d_ff
        out: list[tuple[str, tuple[int, ...]]] = [
            ("tok_emb.weight", (self.vocab_size, d)),
            ("pos_emb.weight", (self.max_seq_len, d)),
            ("norm.weight", (d,)),
            ("norm.bias", (d,)),
            ("lm_head.weight", (self.vocab_size, d)),
        ]
        for i in range(self.n_layers):
            p = f"layers.{i}."
            out += [
                (p + "ln1.weight", (d,)),
                (p + "ln1.bias", (d,)),
                (p + "attn.qkv.weight", (3 * d, d)),
                (p + "attn.qkv.bias", (3 * d,)),
                (p + "attn.proj.weight", (d, d)),
                (p + "attn.proj.bias", (d,)),
                (p + "ln2.weight", (d,)),
                (p + "ln2.bias", (d,)),
                (p + "mlp.fc1.weight", (ff, d)),
                (p + "mlp.fc1.bias", (ff,)),
                (p + "mlp.fc2.weight", (d, ff)),
                (p + "mlp.fc2.bias", (d,)),
            ]
        return out

    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensor_shapes())

    def n_bytes(self) -> int:
        return self.n_params() * dtype_size(self.dtype)

    @classmethod
    def for_size(cls, size: str | int, dtype: DType = "float32") -> "ModelConfig":
        """'tiny' (~4 MB fp32, loads in milliseconds), 'small' (~54 MB fp32), or a byte target.

        For a byte target the width comes from a ladder (the smallest that needs at most 24
        layers), the layer count from the target, and d_ff is then tuned so the total lands
        at or a little above it (rounded up to a multiple of 64).
        """
        if size == "tiny":
            return cls(vocab_size=512, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=512, dtype=dtype)
        if size == "small":
            return cls(vocab_size=4096, d_model=384, n_layers=6, n_heads=6, d_ff=1536, max_seq_len=1024, dtype=dtype)
        target = parse_size(size)
        esize = dtype_size(dtype)
        params = target // esize
        vocab, seq = 4096, 1024
        for d in (128, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192):
            fixed = 2 * vocab * d + seq * d + 2 * d
            per_layer = 12 * d * d + 13 * d
            layers = (params - fixed) / per_layer
            if layers <= 24:
                break
        n_layers = max(1, round(layers))
        per_layer_target = max(0, params - fixed) / n_layers
        attn = 4 * d * d + 4 * d + 4 * d  # qkv, proj, their biases, two norms
        ff = math.ceil((per_layer_target - attn - d) / (2 * d + 1))
        ff = max(64, -(-ff // 64) * 64)  # round up: the model reaches at least the target
        return cls(vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=max(1, d // 64), d_ff=ff,
                   max_seq_len=seq, dtype=dtype)


# -- the network ------------------------------------------------------------------------

class KVCache:
    """Keys and values per layer, grown by concatenation (generations here are short)."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pk, pv = self.k[layer], self.v[layer]
        if pk is not None and pv is not None:
            k = torch.cat([pk, k], dim=2)
            v = torch.cat([pv, v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int, past: int) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # a chunk after a prefix: query i sees keys up to past + i
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int, past: int) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer, past)
        return x + self.mlp(self.ln2(x))


BeforeLayer = Callable[[int], None]


class TransformerLM(nn.Module):
    """Decoder-only LM: token + learned position embeddings, pre-norm blocks, untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @classmethod
    def skeleton(cls, cfg: ModelConfig) -> "TransformerLM":
        """The module tree with every parameter on the meta device (allocates nothing)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.eval()
        model.requires_grad_(False)
        return model

    def set_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Install a loaded tensor as parameter `name` (no copy)."""
        path, _, leaf = name.rpartition(".")
        module = self.get_submodule(path) if path else self
        if leaf not in module._parameters:
            raise ModelError(f"model has no parameter {name!r}")
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        before_layer: BeforeLayer | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for `ids` (batch, time); `before_layer(i)` runs before block i (may block)."""
        past = cache.length if cache is not None else 0
        t = ids.shape[1]
        if past + t > self.config.max_seq_len:
            raise ValueError(f"sequence of {past + t} tokens exceeds max_seq_len {self.config.max_seq_len}")
        pos = torch.arange(past, past + t, device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)
        for i, block in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = block(x, cache, i, past)
        if cache is not None:
            cache.length = past + t
        if last_only:
            x = x[:, -1:, :]
        return self.lm_head(self.norm(x))


def fit_prompt(ids: Sequence[int], cfg: ModelConfig, max_tokens: int) -> list[int]:
    """Keep the last tokens of a prompt so that prompt + `max_tokens` fits the context."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    keep = max(1, cfg.max_seq_len - max(0, max_tokens))
    return ids[-keep:]


def greedy(
    model: TransformerLM,
    prompt: Sequence[int],
    max_tokens: int,
    device: torch.device,
    before_layer: BeforeLayer | None = None,
) -> Iterator[int]:
    """Greedy decoding with a KV cache; yields each new token id as soon as it is computed.

    `before_layer` is used for the prefill only (the pass that may overlap loading).
    Each step runs under `torch.inference_mode` on its own, so the iterator may be advanced
    from different threads (an asyncio server's executor).
    """
    cfg = model.config
    ids = fit_prompt(prompt, cfg, max_tokens)
    cache = KVCache(cfg.n_layers)
    step = torch.tensor([ids], dtype=torch.long, device=device)
    for n in range(max_tokens):
        if cache.length + step.shape[1] > cfg.max_seq_len:
            return
        with torch.inference_mode():
            logits = model(step, cache, before_layer if n == 0 else None, last_only=True)
            nxt = int(logits[0, -1].float().argmax().item())
        yield nxt
        step = torch.tensor([[nxt]], dtype=torch.long, device=device)


def last_logits(
    model: TransformerLM, prompt: Sequence[int], device: torch.device, before_layer: BeforeLayer | None = None
) -> torch.Tensor:
    """Float32 logits at the last prompt position (numeric validation, equality tests)."""
    ids = fit_prompt(prompt, model.config, 0)
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        return model(x, None, before_layer, last_only=True)[0, -1].float().cpu()


# -- model directories ------------------------------------------------------------------

def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / CONFIG_FILE
    try:
        return ModelConfig.from_json(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist: not a model directory (run `prewarm make-model`)") from None


def _init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """GPT-2-style init: N(0, 0.02) weights, residual projections scaled down, norms at 1."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("ln1.weight", "ln2.weight")) or name == "norm.weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = 0.02
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
    if name == "pos_emb.weight":
        std = 0.01
    return torch.randn(shape, generator=gen) * std


def make_model(
    out_dir: str | Path,
    size: str | int | ModelConfig,
    *,
    seed: int = 0,
    dtype: DType = "float32",
    name: str | None = None,
    revision: str | None = None,
) -> Path:
    """Write config.json, model.safetensors and manifest.json for a random-weight model.

    The safetensors file is written by hand (8-byte header length, JSON header, raw data,
    exactly the format `safetensors.torch.save_file` writes) one tensor at a time, so a
    2 GB model never needs more than its largest tensor in memory. Each tensor comes from
    its own generator seeded by (seed, index): the same arguments give the same bytes.
    The revision defaults to the first 12 hex digits of the manifest checksum.
    """
    cfg = size if isinstance(size, ModelConfig) else ModelConfig.for_size(size, dtype=dtype)
    if isinstance(size, ModelConfig) and dtype != "float32":
        cfg = cfg.with_dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    esize = dtype_size(cfg.dtype)
    shapes = cfg.tensor_shapes()
    header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "prewarm make-model"}}
    pos = 0
    for tname, shape in shapes:
        n = math.prod(shape) * esize
        header[tname] = {"dtype": SAFETENSORS_DTYPES[cfg.dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    base = 8 + len(hbytes)
    entries: list[TensorEntry] = []
    weights = out / WEIGHTS_FILE
    tmp = weights.with_name(weights.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        offset = base
        for i, (tname, shape) in enumerate(shapes):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            t = _init_tensor(tname, shape, cfg, gen).to(cfg.torch_dtype).contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            f.write(raw.data)
            entries.append(TensorEntry(tname, tuple(shape), cfg.dtype, offset, raw.nbytes,
                                       hashlib.sha256(raw.data).hexdigest()))
            offset += raw.nbytes
            del t, raw
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, weights)
    draft = Manifest(name=name or "model", revision="pending", dtype=cfg.dtype, file=WEIGHTS_FILE,
                     file_bytes=weights.stat().st_size, total_bytes=offset - base, tensors=tuple(entries))
    manifest = Manifest(**{**draft.__dict__, "revision": revision or draft.checksum[:12]})
    if name is None:
        manifest = Manifest(**{**manifest.__dict__, "name": f"tx-d{cfg.d_model}-l{cfg.n_layers}"})
    (out / CONFIG_FILE).write_text(cfg.to_json())
    (out / MANIFEST_FILE).write_text(manifest.to_json())
    return out
