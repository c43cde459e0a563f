"""The engine facade: one model replica's weights, loading, generation and sleep mode.

The HTTP runtime (`prewarm serve-model`) and the node agent talk to a replica through
this class only. It owns a `ProgressiveLoader`: `start_load()` returns at once, `generate`
works during loading (the prefill waits per layer, so the first token overlaps the load)
and afterwards, and `sleep`/`wake_up` follow vLLM's sleep mode (level 1 moves the weights
to host memory, level 2 drops them and reloads from the node snapshot or the original).

Concurrency: every method may be called from any thread (an asyncio server's executor).
One generation runs at a time: `generate` returns an iterator that takes the engine's
generation lock on its first step and releases it when exhausted or closed, so a caller
must exhaust or `close()` the iterator (a dropped iterator is closed by the garbage
collector). Sleep and wake take the same lock, so they wait for a running generation.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Generator, Sequence

import torch

from prewarm.core.domain import LoadPhase
from prewarm.core.errors import TemporaryError
from prewarm.runtime.loader import PhaseCallback, ProgressCallback, ProgressiveLoader, resolve_device
from prewarm.runtime.manifest import Manifest
from prewarm.runtime.model import DTYPE_NAMES, ModelConfig, greedy, last_logits
from prewarm.runtime.snapshot import SnapshotStore
from prewarm.runtime.tokenizer import ByteTokenizer


class EngineSleeping(TemporaryError):
    """The engine is asleep (sleep mode); wake it up first."""


class EngineNotLoaded(TemporaryError):
    """The weights are not loaded (`start_load` was not called, or they were dropped)."""


class Engine:
    """One replica's model: load progressively, generate greedily, sleep and wake."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        first_layers: int | None = None,
        snapshots: SnapshotStore | None = None,
        model_name: str | None = None,
        node: str = "",
        on_progress: ProgressCallback | None = None,
        on_phase: PhaseCallback | None = None,
        dtype: str | None = None,
        read_chunk_bytes: int | None = None,
        read_limit_bps: float | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self._kwargs = dict(
            device=resolve_device(device), dtype=dtype, first_layers=first_layers, snapshots=snapshots,
            model_name=model_name, node=node, on_progress=on_progress, on_phase=on_phase,
            read_limit_bps=read_limit_bps,
        )
        if read_chunk_bytes is not None:
            self._kwargs["read_chunk_bytes"] = read_chunk_bytes
        self._loader = ProgressiveLoader(self.model_dir, **self._kwargs)  # type: ignore[arg-type]
        self.device: torch.device = self._loader.device
        self.config: ModelConfig = self._loader.config
        self.manifest: Manifest = self._loader.manifest
        self.model_name = self._loader.model_name
        self.tokenizer = ByteTokenizer(self.config.vocab_size)
        self._gen_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._sleep_level = 0
        self._dropped = False  # level-2 sleep: no weights at all

    # -- loading -------------------------------------------------------------------------
    @property
    def loader(self) -> ProgressiveLoader:
        """The current load (a new one after a level-2 wake)."""
        return self._loader

    def start_load(self) -> None:
        """Start loading in the background; returns at once; a second call does nothing."""
        self._loader.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """True once every weight is in; False on timeout; raises the load's error."""
        if not self._loader.started:
            raise EngineNotLoaded("start_load() has not been called")
        return self._loader.wait(timeout)

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Wait until the load thread is over, including writing the node snapshot."""
        return self._loader.join(timeout) if self._loader.started else True

    @property
    def load_started(self) -> bool:
        return self._loader.started

    @property
    def progress(self) -> float:
        return self._loader.progress

    @property
    def phase(self) -> LoadPhase:
        return self._loader.phase

    @property
    def loaded(self) -> bool:
        return self._loader.loaded and not self._dropped

    @property
    def error(self) -> BaseException | None:
        return self._loader.error

    # -- text ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        return ids

    def _ready_hook(self) -> tuple[ProgressiveLoader, object]:
        """Check the engine can compute now; the per-layer wait hook when still loading."""
        if self._sleep_level:
            raise EngineSleeping(f"engine is asleep (level {self._sleep_level}); call wake_up()", retry_after=1.0)
        loader = self._loader
        if not loader.started:
            raise EngineNotLoaded("start_load() has not been called")
        loader.wait_embeddings()
        return loader, (None if loader.loaded else loader.before_layer)

    # -- inference -----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int) -> Generator[int, None, None]:
        """Greedy token ids, one at a time; during loading the prefill waits per layer.

        The prompt is validated now (ValueError); sleeping/not-loaded errors are raised on
        the first step. A prompt longer than the context keeps its last tokens.
        """
        ids = self._ids(prompt)
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        return self._generate(ids, max_tokens)

    def _generate(self, ids: list[int], max_tokens: int) -> Generator[int, None, None]:
        with self._gen_lock:
            loader, hook = self._ready_hook()
            yield from greedy(loader.model, ids, max_tokens, self.device, hook)  # type: ignore[arg-type]

    def logits(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """Float32 logits at the last prompt position, on the CPU."""
        ids = self._ids(prompt)
        with self._gen_lock:
            loader, hook = self._ready_hook()
            return last_logits(loader.model, ids, self.device, hook)  # type: ignore[arg-type]

    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of every parameter present (not yet loaded/dropped: absent)."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, p in self._loader.model.named_parameters():
            if p.device.type != "meta":
                out[name] = (tuple(p.shape), DTYPE_NAMES.get(p.dtype, str(p.dtype)))
        return out

    def weights_fault(self) -> str | None:
        """Why the live weights can no longer be trusted (the snapshot they map was modified in
        place since it was checked), or None."""
        mapped = getattr(self._loader, "mapped", None)
        return mapped.changed() if mapped is not None else None

    # -- sleep mode ----------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights to host memory (on CPU they already are). Level 2: drop them.

        Waits for a running load and generation to finish; sleeping again is a no-op
        unless it deepens level 1 to level 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._state_lock:
            if self._loader.started:
                self._loader.wait()
            with self._gen_lock:
                if self._sleep_level >= level:
                    return
                model = self._loader.model
                if level == 1:
                    if self.device.type == "cuda":
                        for name, p in list(model.named_parameters()):
                            model.set_tensor(name, p.detach().to("cpu").pin_memory())
                else:
                    for name, p in list(model.named_parameters()):
                        model.set_tensor(name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
                    self._loader.release()
                    self._dropped = True
                self._sleep_level = level
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def wake_up(self, timeout: float | None = None) -> None:
        """Undo `sleep`: level 1 moves the weights back, level 2 reloads them (blocking)."""
        with self._state_lock:
            with self._gen_lock:
                if self._sleep_level == 0:
                    return
                if self._dropped:
                    loader = ProgressiveLoader(self.model_dir, **self._kwargs)  # type: ignore[arg-type]
                    loader.start()
                    if not loader.wait(timeout):
                        raise TemporaryError(f"wake_up: reload did not finish within {timeout} s", retry_after=5.0)
                    self._loader = loader
                    self._dropped = False
                elif self.device.type == "cuda":
                    model = self._loader.model
                    for name, p in list(model.named_parameters()):
                        model.set_tensor(name, p.detach().to(self.device, non_blocking=True))
                    torch.cuda.current_stream(self.device).synchronize()
                self._sleep_level = 0

    # -- memory --------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes of weights on the device and in host memory; on CUDA what this process's allocator holds.

        One runtime process serves one replica, so `cuda_reserved` is the replica's GPU
        footprint as the node agent books it (weights, activations, the allocator's cache).
        """
        on_device = on_host = 0
        for _, p in self._loader.model.named_parameters():
            if p.device.type == "meta":
                continue
            n = p.numel() * p.element_size()
            if p.device.type == "cuda":
                on_device += n
            else:
                on_host += n
        out = {"weights_device": on_device, "weights_host": on_host, "cuda_allocated": 0, "cuda_reserved": 0}
        if self.device.type == "cuda":
            out["cuda_allocated"] = int(torch.cuda.memory_allocated(self.device))
            out["cuda_reserved"] = int(torch.cuda.memory_reserved(self.device))
        return out

    def fragmentation(self) -> float:
        """1 - allocated/reserved from the CUDA caching allocator; 0.0 on CPU or nothing reserved."""
        if self.device.type != "cuda":
            return 0.0
        stats = torch.cuda.memory_stats(self.device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        allocated = stats.get("allocated_bytes.all.current", 0)
        return 0.0 if reserved <= 0 else max(0.0, 1.0 - allocated / reserved)

    def close(self) -> None:
        """Drop the weights and the snapshot lock (the engine cannot be used afterwards)."""
        try:
            self.sleep(2)
        except BaseException:
            self._loader.release()
