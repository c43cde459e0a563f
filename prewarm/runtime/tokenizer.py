"""A byte-level tokenizer: deterministic, nothing to download, every id inside the vocabulary.

The test and benchmark models have random weights, so a learned vocabulary would buy
nothing; what the runtime needs is a reversible text <-> ids mapping that any replica
reproduces exactly. Ids 0..255 are the UTF-8 bytes; ids above 255 (the rest of the model's
vocabulary) are never produced by `encode` and decode to nothing.
"""

from __future__ import annotations

from typing import Iterable

BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; `vocab_size` must leave room for all 256 byte values."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"vocab_size must be at least {BYTE_VOCAB} for a byte tokenizer, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes of the ids below 256, decoded as UTF-8 (invalid sequences become U+FFFD)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 0 or i >= self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
            if i < BYTE_VOCAB:
                out.append(i)
        return out.decode("utf-8", errors="replace")
