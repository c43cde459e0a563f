"""Warmup generation: determinism, length distributions, topic weights, signing, calibration cases."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from prewarm.core.errors import InvalidPayload
from prewarm.core.settings import WarmupSettings
from prewarm.core.signing import HEADER, is_valid_warmup
from prewarm.policy.warmup import (
    COMPLETIONS_PATH,
    LengthDistribution,
    LengthDistributionKind,
    TopicMix,
    WarmupPlan,
    generate_requests,
    make_prompt,
    TokenUnit,
)

SECRET = "s3cret"
NOW = 1_700_000_000.0


def _plan(**kw: object) -> WarmupPlan:
    base = dict(model="tiny", count=50, topics=TopicMix.of({"code": 0.5, "chat": 0.5}), seed=7)
    base.update(kw)
    return WarmupPlan(**base)  # type: ignore[arg-type]


def test_same_seed_same_requests_different_seed_different() -> None:
    a = generate_requests(_plan(), secret=SECRET, now=NOW)
    b = generate_requests(_plan(), secret=SECRET, now=NOW)
    c = generate_requests(_plan(seed=8), secret=SECRET, now=NOW)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_defaults_from_settings(clean_env: pytest.MonkeyPatch) -> None:
    s = WarmupSettings()
    plan = WarmupPlan.from_settings("tiny", s)
    assert plan.count == s.requests == 8
    assert plan.max_tokens == 1
    assert plan.lengths == LengthDistribution(LengthDistributionKind.GAUSSIAN, 23.0, 5.0)
    assert plan.topics.probabilities() == pytest.approx({"code": 0.4, "chat": 0.3, "summarize": 0.2, "translate": 0.1})
    reqs = generate_requests(plan, secret=SECRET, now=NOW)
    assert len(reqs) == 8
    for r in reqs:
        body = json.loads(r.body)
        assert body == {"model": "tiny", "prompt": r.prompt, "max_tokens": 1, "stream": False}
        assert len(r.prompt.split()) == r.prompt_tokens


def test_every_request_is_marked_and_signed_over_its_body() -> None:
    reqs = generate_requests(_plan(count=5), secret=SECRET, now=NOW)
    for r in reqs:
        h = r.header_dict()
        assert h[HEADER] == "1"
        assert is_valid_warmup(SECRET, h, "POST", COMPLETIONS_PATH, r.body, NOW + 1)
        assert not is_valid_warmup("other", h, "POST", COMPLETIONS_PATH, r.body, NOW + 1)
        assert not is_valid_warmup(SECRET, h, "POST", COMPLETIONS_PATH, r.body + b" ", NOW + 1)
    later = reqs[0].resigned(SECRET, NOW + 1000)
    assert later.body == reqs[0].body
    assert not is_valid_warmup(SECRET, reqs[0].header_dict(), "POST", COMPLETIONS_PATH, reqs[0].body, NOW + 1000)
    assert is_valid_warmup(SECRET, later.header_dict(), "POST", COMPLETIONS_PATH, later.body, NOW + 1000)


def test_empty_secret_is_refused() -> None:
    with pytest.raises(InvalidPayload, match="secret"):
        generate_requests(_plan(), secret="", now=NOW)


def test_gaussian_lengths_mean_sd_and_clipping() -> None:
    dist = LengthDistribution()
    rng = random.Random(1)
    xs = [dist.sample(rng) for _ in range(20_000)]
    assert statistics.fmean(xs) == pytest.approx(23.0, abs=0.2)
    assert statistics.pstdev(xs) == pytest.approx(5.0, abs=0.2)
    assert min(xs) >= 1
    wide = LengthDistribution(mean=3.0, sd=10.0, max_tokens=15)
    ys = [wide.sample(rng) for _ in range(5_000)]
    assert min(ys) == 1 and max(ys) == 15
    assert sum(1 for y in ys if y == 1) > 1000  # the clipped mass piles up at 1, nothing goes below


@pytest.mark.parametrize("kind", [LengthDistributionKind.UNIFORM, LengthDistributionKind.LOGNORMAL])
def test_other_distributions_keep_mean_and_sd(kind: LengthDistributionKind) -> None:
    dist = LengthDistribution(kind=kind, mean=40.0, sd=8.0)
    rng = random.Random(3)
    xs = [dist.sample(rng) for _ in range(20_000)]
    assert statistics.fmean(xs) == pytest.approx(40.0, abs=0.4)
    assert statistics.pstdev(xs) == pytest.approx(8.0, abs=0.4)


def test_fixed_distribution_and_bad_parameters() -> None:
    assert {LengthDistribution(kind="fixed", mean=12.4).sample(random.Random(0)) for _ in range(5)} == {12}  # type: ignore[arg-type]
    with pytest.raises(InvalidPayload, match="distribution must be one of"):
        LengthDistribution(kind="zipf")  # type: ignore[arg-type]
    with pytest.raises(InvalidPayload, match="mean"):
        LengthDistribution(mean=0)
    with pytest.raises(InvalidPayload, match="sd"):
        LengthDistribution(sd=-1)
    with pytest.raises(InvalidPayload, match="max_tokens"):
        LengthDistribution(min_tokens=5, max_tokens=2)


def test_topic_weights_are_respected() -> None:
    plan = _plan(count=4000, topics=TopicMix.of({"code": 0.4, "chat": 0.3, "summarize": 0.2, "translate": 0.1}))
    reqs = generate_requests(plan, secret=SECRET, now=NOW)
    counts = {t: sum(1 for r in reqs if r.topic == t) / len(reqs) for t in ("code", "chat", "summarize", "translate")}
    assert counts == pytest.approx({"code": 0.4, "chat": 0.3, "summarize": 0.2, "translate": 0.1}, abs=0.03)
    zero = generate_requests(_plan(count=300, topics=TopicMix.of({"code": 1.0, "chat": 0.0})), secret=SECRET, now=NOW)
    assert {r.topic for r in zero} == {"code"}


def test_topic_mix_rejects_bad_weights() -> None:
    with pytest.raises(InvalidPayload, match="at least one"):
        TopicMix.of({})
    with pytest.raises(InvalidPayload, match="all be zero"):
        TopicMix.of({"a": 0.0})
    with pytest.raises(InvalidPayload, match="'a' has weight -1"):
        TopicMix.of({"a": -1.0})


def test_prompt_length_with_a_custom_tokenizer() -> None:
    chars = len  # a byte-level tokenizer: one token per character
    rng = random.Random(0)
    for n in (1, 5, 23, 60):
        p = make_prompt("code", n, rng, count_tokens=chars)
        assert 1 <= len(p) and (len(p) <= n or len(p.split()) == 1)
    p = make_prompt("unknown-topic", 10, rng)
    assert len(p.split()) == 10 and p.startswith("unknown-topic:")


def test_byte_token_unit_counts_utf8_bytes(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PREWARM_WARMUP_PROMPT_TOKEN_UNIT", "byte")
    plan = WarmupPlan.from_settings("tiny", WarmupSettings(), count=400)
    assert plan.token_unit is TokenUnit.BYTE
    reqs = generate_requests(plan, secret=SECRET, now=NOW)
    sizes = [len(r.prompt.encode()) for r in reqs]
    # words are whole, so a prompt may stop a few bytes short of its target, never past it (beyond one word)
    assert all(n <= r.prompt_tokens or len(r.prompt.split()) == 1 for n, r in zip(sizes, reqs))
    assert statistics.fmean(sizes) == pytest.approx(23.0, abs=4.0)
    with pytest.raises(InvalidPayload, match="token unit"):
        WarmupPlan(model="m", token_unit="char")  # type: ignore[arg-type]
