"""Warmup traffic generation: synthetic, signed requests that look like the real thing.

A freshly loaded replica is slow on its first requests (lazy allocations, kernel
selection, caches). The agent therefore sends it synthetic requests before it is routed
user traffic, and keeps held replicas warm with more of them. Those requests should
resemble production traffic (prompt lengths, topics) so that the warm path is the one
users hit, and they must be marked and signed so that they are never counted as user
traffic (see `prewarm.core.signing`).

Everything here is pure: a seeded `random.Random`, `now` passed in, no I/O. The same seed
and settings always yield the same requests, so a redelivered task sends the same warmup.

A "token" here is one whitespace-separated word by default (roughly one BPE token of a
real LLM), or one UTF-8 byte (`token_unit="byte"`, what the built-in runtime's byte
tokenizer counts), or whatever a caller's `count_tokens` counts; the runtime reports the
real count in `usage.prompt_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping

from prewarm.core.errors import InvalidPayload
from prewarm.core.settings import WarmupSettings
from prewarm.core.signing import warmup_headers

COMPLETIONS_PATH = "/v1/completions"


class LengthDistributionKind(str, Enum):
    GAUSSIAN = "gaussian"  # N(mean, sd), rounded, clipped
    UNIFORM = "uniform"  # uniform with the given mean and sd: mean ± sd·√3
    LOGNORMAL = "lognormal"  # right-skewed with the given mean and sd (long prompts are rare)
    FIXED = "fixed"  # always round(mean)


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt lengths in tokens: a distribution given by its mean and sd, clipped to [min, max]."""

    kind: LengthDistributionKind = LengthDistributionKind.GAUSSIAN
    mean: float = 23.0
    sd: float = 5.0
    min_tokens: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LengthDistributionKind):
            try:
                object.__setattr__(self, "kind", LengthDistributionKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in LengthDistributionKind)
                raise InvalidPayload(f"prompt length distribution must be one of {kinds}, got {self.kind!r}") from None
        if not math.isfinite(self.mean) or self.mean <= 0:
            raise InvalidPayload(f"prompt length mean must be a positive number, got {self.mean!r}")
        if not math.isfinite(self.sd) or self.sd < 0:
            raise InvalidPayload(f"prompt length sd must be >= 0, got {self.sd!r}")
        if self.min_tokens < 1:
            raise InvalidPayload(f"prompt length min_tokens must be >= 1, got {self.min_tokens}")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise InvalidPayload(
                f"prompt length max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})"
            )

    def sample(self, rng: random.Random) -> int:
        """One length in tokens, rounded and clipped to [min_tokens, max_tokens]."""
        if self.kind is LengthDistributionKind.GAUSSIAN:
            raw = rng.gauss(self.mean, self.sd)
        elif self.kind is LengthDistributionKind.UNIFORM:
            half = self.sd * math.sqrt(3.0)
            raw = rng.uniform(self.mean - half, self.mean + half)
        elif self.kind is LengthDistributionKind.LOGNORMAL:
            sigma2 = math.log1p((self.sd / self.mean) ** 2)
            raw = rng.lognormvariate(math.log(self.mean) - sigma2 / 2.0, math.sqrt(sigma2))
        else:
            raw = self.mean
        n = max(self.min_tokens, int(round(raw)))
        if self.max_tokens is not None:
            n = min(n, self.max_tokens)
        return n


#: Word pools of the default topics; an unknown topic uses the generic pool.
_TOPIC_WORDS: Mapping[str, tuple[str, ...]] = {
    "code": (
        "def", "return", "class", "import", "list", "dict", "loop", "index", "function", "variable",
        "error", "test", "parse", "string", "value", "array", "async", "await", "query", "compile",
    ),
    "chat": (
        "hello", "please", "thanks", "could", "you", "help", "me", "with", "today", "what",
        "why", "how", "tell", "about", "friend", "weekend", "plan", "idea", "sure", "great",
    ),
    "summarize": (
        "report", "meeting", "quarter", "revenue", "growth", "risk", "summary", "points", "key", "findings",
        "customer", "market", "decision", "action", "owner", "deadline", "budget", "team", "result", "next",
    ),
    "translate": (
        "bonjour", "merci", "hola", "gracias", "danke", "bitte", "ciao", "grazie", "sentence", "into",
        "french", "spanish", "german", "italian", "word", "phrase", "meaning", "polite", "formal", "casual",
    ),
}
_GENERIC_WORDS: tuple[str, ...] = (
    "the", "a", "of", "and", "to", "in", "is", "for", "on", "with",
    "data", "model", "time", "system", "user", "request", "answer", "question", "example", "detail",
)
_TOPIC_LEAD: Mapping[str, str] = {
    "code": "Write code:",
    "chat": "Chat:",
    "summarize": "Summarize:",
    "translate": "Translate:",
}


def _words_count(text: str) -> int:
    return len(text.split())


def _bytes_count(text: str) -> int:
    return len(text.encode("utf-8"))


class TokenUnit(str, Enum):
    WORD = "word"
    BYTE = "byte"


TOKEN_COUNTERS: Mapping[TokenUnit, Callable[[str], int]] = {TokenUnit.WORD: _words_count, TokenUnit.BYTE: _bytes_count}


@dataclass(frozen=True)
class TopicMix:
    """A weighted list of topics; weights need not sum to 1."""

    weights: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        if not self.weights:
            raise InvalidPayload("warmup topics must name at least one topic")
        for name, w in self.weights:
            if not isinstance(name, str) or not name.strip():
                raise InvalidPayload(f"warmup topic names must be non-empty strings, got {name!r}")
            if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise InvalidPayload(f"warmup topic {name!r} has weight {w!r}; weights must be finite and >= 0")
        if sum(w for _, w in self.weights) <= 0:
            raise InvalidPayload("warmup topic weights must not all be zero")

    @classmethod
    def of(cls, topics: Mapping[str, float]) -> "TopicMix":
        return cls(tuple((str(k), float(v)) for k, v in topics.items()))

    def probabilities(self) -> dict[str, float]:
        total = sum(w for _, w in self.weights)
        return {name: w / total for name, w in self.weights}

    def sample(self, rng: random.Random) -> str:
        names = [n for n, _ in self.weights]
        return rng.choices(names, weights=[w for _, w in self.weights], k=1)[0]


@dataclass(frozen=True)
class WarmupRequest:
    """One synthetic completion request: the exact body bytes and the headers that sign them."""

    index: int
    topic: str
    prompt: str
    prompt_tokens: int  # the sampled target length, as counted by the generator
    max_tokens: int
    body: bytes  # the JSON body, byte for byte what was signed
    headers: tuple[tuple[str, str], ...]  # X-Warmup marking and signature, plus Content-Type
    path: str = COMPLETIONS_PATH
    method: str = "POST"

    def header_dict(self) -> dict[str, str]:
        return dict(self.headers)

    def resigned(self, secret: str, now: float) -> "WarmupRequest":
        """The same request signed again at `now` (signatures expire; keepalives reuse requests)."""
        return _with_headers(self, _signed_headers(secret, self.method, self.path, self.body, now, self.index))


@dataclass(frozen=True)
class WarmupPlan:
    """Everything that determines a batch of warmup requests; built from `WarmupSettings`."""

    model: str
    count: int = 8
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    topics: TopicMix = field(default_factory=lambda: TopicMix.of({"chat": 1.0}))
    max_tokens: int = 1
    seed: int = 0
    token_unit: TokenUnit = TokenUnit.WORD

    def __post_init__(self) -> None:
        if not isinstance(self.token_unit, TokenUnit):
            try:
                object.__setattr__(self, "token_unit", TokenUnit(self.token_unit))
            except ValueError:
                raise InvalidPayload(f"warmup token unit must be 'word' or 'byte', got {self.token_unit!r}") from None
        if not isinstance(self.model, str) or not self.model:
            raise InvalidPayload("warmup plan needs a model name")
        if self.count < 0:
            raise InvalidPayload(f"warmup request count must be >= 0, got {self.count}")
        if self.max_tokens < 1:
            raise InvalidPayload(f"warmup max_tokens must be >= 1, got {self.max_tokens}")

    @classmethod
    def from_settings(cls, model: str, settings: WarmupSettings, *, count: int | None = None,
                      seed: int | None = None) -> "WarmupPlan":
        """Build from the `warmup` settings group; `count` and `seed` override theirs."""
        return cls(
            model=model,
            count=int(count if count is not None else settings.requests),
            lengths=LengthDistribution(
                kind=LengthDistributionKind(settings.prompt_distribution),
                mean=float(settings.prompt_mean_tokens),
                sd=float(settings.prompt_sd_tokens),
                max_tokens=settings.prompt_max_tokens,
            ),
            topics=TopicMix.of(settings.topics),
            max_tokens=int(settings.max_tokens),
            seed=int(seed if seed is not None else settings.seed),
            token_unit=TokenUnit(settings.prompt_token_unit),
        )

def make_prompt(
    topic: str, tokens: int, rng: random.Random, count_tokens: Callable[[str], int] | None = None
) -> str:
    """A prompt about `topic` of `tokens` tokens (words, or as `count_tokens` counts them)."""
    if tokens < 1:
        raise InvalidPayload(f"a prompt needs at least one token, got {tokens}")
    count = count_tokens or _words_count
    pool = _TOPIC_WORDS.get(topic, _GENERIC_WORDS)
    lead = _TOPIC_LEAD.get(topic, f"{topic}:")
    words: list[str] = [lead] if count(lead) <= tokens else []
    while True:
        text = " ".join(words)
        n = count(text) if words else 0
        if n >= tokens:
            break
        words.append(rng.choice(pool))
    # A tokenizer that splits words finer than whitespace can overshoot: drop words until it fits.
    while len(words) > 1 and count(" ".join(words)) > tokens:
        words.pop()
    return " ".join(words)


def generate_requests(
    plan: WarmupPlan,
    *,
    secret: str,
    now: float,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[WarmupRequest, ...]:
    """The plan's requests, deterministic under `plan.seed`, each signed at `now`.

    Prompt lengths are counted in `plan.token_unit` unless `count_tokens` is given.
    """
    if not secret:
        raise InvalidPayload("warmup requests must be signed: the shared secret is empty")
    rng = random.Random(f"prewarm-warmup:{plan.model}:{plan.seed}")
    out: list[WarmupRequest] = []
    for i in range(plan.count):
        topic = plan.topics.sample(rng)
        length = plan.lengths.sample(rng)
        prompt = make_prompt(topic, length, rng, count_tokens or TOKEN_COUNTERS[plan.token_unit])
        body = json.dumps(
            {"model": plan.model, "prompt": prompt, "max_tokens": plan.max_tokens, "stream": False},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        req = WarmupRequest(
            index=i, topic=topic, prompt=prompt, prompt_tokens=length, max_tokens=plan.max_tokens, body=body, headers=()
        )
        out.append(_with_headers(req, _signed_headers(secret, req.method, req.path, body, now, i)))
    return tuple(out)


def _signed_headers(secret: str, method: str, path: str, body: bytes, now: float,
                    index: int) -> tuple[tuple[str, str], ...]:
    # the nonce is derived, not drawn: the same (request, time) gives the same headers (pure), and a
    # send at another time — a redelivery, a keep-alive — a new nonce
    nonce = hashlib.sha256(f"{now:.3f}|{index}|".encode() + body).hexdigest()[:24]
    headers = {"Content-Type": "application/json", **warmup_headers(secret, method, path, body, now, nonce)}
    return tuple(sorted(headers.items()))


def _with_headers(req: WarmupRequest, headers: tuple[tuple[str, str], ...]) -> WarmupRequest:
    return WarmupRequest(
        index=req.index,
        topic=req.topic,
        prompt=req.prompt,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.max_tokens,
        body=req.body,
        headers=headers,
        path=req.path,
        method=req.method,
    )
