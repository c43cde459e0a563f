"""What the model host computes for validation and `logprobs`, on a generation thread.

These functions call the engine (which may block on its generation lock or on loading),
so the HTTP server runs them in its thread pool, never on the event loop. They turn torch
tensors into plain JSON-ready values: the pure checks in `prewarm.policy.validation` and the
agent on the other side of HTTP only ever see numbers and names.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import torch

from prewarm.policy.validation import LogitStats

#: The prompt whose next-token logits the numeric check inspects.
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog."


class _Engine(Protocol):
    """The part of `prewarm.runtime.engine.Engine` used here."""

    manifest: Any
    device: torch.device

    def logits(self, prompt: str | Sequence[int]) -> torch.Tensor: ...
    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def generate(self, prompt: str | Sequence[int], max_tokens: int) -> Any: ...


def logit_stats(logits: torch.Tensor) -> LogitStats:
    """Count, non-finite count, and mean/std/min/max over the finite values (nan when none is)."""
    flat = logits.detach().float().reshape(-1)
    finite = torch.isfinite(flat)
    vals = flat[finite]
    nan = float("nan")
    has = vals.numel() > 0
    return LogitStats(
        count=int(flat.numel()),
        nonfinite=int((~finite).sum()),
        mean=float(vals.mean()) if has else nan,
        std=float(vals.std(unbiased=False)) if has else nan,
        min=float(vals.min()) if has else nan,
        max=float(vals.max()) if has else nan,
    )


def validation_inputs(engine: _Engine, model_name: str, prompt: str = PROBE_PROMPT) -> dict[str, Any]:
    """The manifest's tensors, the live model's tensors and the probe's logit statistics."""
    stats = logit_stats(engine.logits(prompt))
    manifest = {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in engine.manifest.tensors}
    live = {n: {"shape": list(shape), "dtype": str(dtype)} for n, (shape, dtype) in engine.tensors().items()}
    return {"model": model_name, "device": str(engine.device), "probe": prompt,
            "manifest": manifest, "tensors": live, "logits": stats.to_dict()}


def timed_completion(engine: _Engine, ids: Sequence[int], max_tokens: int) -> float:
    """Seconds to generate `max_tokens` tokens for `ids` (one warm-latency sample)."""
    t0 = time.perf_counter()
    for _ in engine.generate(list(ids), max_tokens):
        pass
    return time.perf_counter() - t0


def logprobs(engine: _Engine, ids: list[int], out: list[int], k: int) -> dict[str, Any]:
    """OpenAI `logprobs` of generated tokens `out`: each chosen token's log-probability and the top k."""
    tokens: list[str] = []
    token_lp: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = 0
    for i, tok in enumerate(out):
        lp = torch.log_softmax(engine.logits(ids + out[:i]).float(), dim=-1)
        piece = engine.decode([tok])
        tokens.append(piece)
        token_lp.append(float(lp[tok]))
        offsets.append(offset)
        offset += len(piece)
        entry: dict[str, float] = {}
        if k:
            vals, idx = torch.topk(lp, k)
            for v, j in zip(vals.tolist(), idx.tolist()):
                entry.setdefault(engine.decode([j]) or f"<{j}>", float(v))
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}
