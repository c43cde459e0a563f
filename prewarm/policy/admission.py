"""Admission by expected wait, shared fairly between clients: pure (no I/O, the state passed in).

Issue 20: the gateway bounded the queue by a count (128 requests per replica) while the
built-in runtime generates one request at a time, so one client's 200 requests of 500
tokens made another client's 4-token request wait a minute, and the 429 said "retry in
1 s" while the queue needed 60 s. A count says nothing about how long the queue takes to
drain; the tokens asked for do. So:

- a request costs the tokens it asks for (`max_tokens` x `n`, OpenAI's default 16 when absent);
- the queue of a model is the cost of its requests in flight, per client; it drains at the
  model's measured rate (tokens per busy second, measured by the gateway);
- a request is admitted while the whole queue, itself included, drains within `max_wait_s`;
- past that, a client still under its fair share (`max_wait_s` split evenly between the
  clients with work queued, itself counted) is admitted anyway, so a newcomer is never shut
  out by one greedy client; a client at or over its share is refused;
- a refusal's Retry-After is the time until enough of the queue drains for the request to
  fit: the real drain time, not a constant.

Who a client is (an API key, else the client address seen through trusted proxies) is the
caller's: see `prewarm.policy.clients`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

#: OpenAI's default `max_tokens` for /v1/completions (the built-in runtime's too).
DEFAULT_MAX_TOKENS = 16


class Admission(str, Enum):
    ADMIT = "admit"  # the queue drains within the bound
    FAIR_SHARE = "fair_share"  # over the bound, but the client is under its fair share
    OVER_SHARE = "over_share"  # over the bound and the client holds its share or more: 429


@dataclass(frozen=True)
class AdmissionDecision:
    outcome: Admission
    expected_wait_s: float  # how long the queue ahead of this request takes to drain
    retry_after_s: int  # whole seconds until the request would fit (0 when admitted)
    reason: str

    @property
    def admitted(self) -> bool:
        return self.outcome is not Admission.OVER_SHARE


def request_cost(payload: Mapping[str, Any]) -> float:
    """Tokens a request asks for: `max_tokens` (or `max_completion_tokens`) times `n`, at least 1.
    A value that is not a positive number counts as the default (the replica answers 400 for it)."""
    tokens: Any = payload.get("max_tokens", payload.get("max_completion_tokens"))
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens < 1:
        tokens = DEFAULT_MAX_TOKENS
    n: Any = payload.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        n = 1
    return float(tokens) * n


def admit(cost: float, client: str, queued: Mapping[str, float], *, rate: float, max_wait_s: float) -> AdmissionDecision:
    """Whether a request of `cost` tokens from `client` joins a model's queue.

    `queued`: tokens in flight per client for the model; `rate`: tokens the model drains per second.
    """
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"drain rate must be a positive number of tokens/s, got {rate!r}")
    total = sum(queued.values())
    ahead_s = total / rate
    if (total + cost) / rate <= max_wait_s or total == 0:  # an empty queue takes any one request
        return AdmissionDecision(Admission.ADMIT, ahead_s, 0, f"queue drains in {(total + cost) / rate:.1f}s")
    mine = queued.get(client, 0.0)
    clients = len({c for c, v in queued.items() if v > 0} | {client})
    share = max_wait_s * rate / clients  # tokens each active client may have queued
    if mine + cost <= share or mine == 0:  # a client with nothing queued always gets one request in
        return AdmissionDecision(Admission.FAIR_SHARE, ahead_s, 0,
                                 f"queue is over {max_wait_s:.0f}s but {client!r} is under its share of {clients}")
    # Refused: wait until the client's own excess over its share has drained (the queue drains in order,
    # so at the model's rate), or until the whole queue fits the bound, whichever comes first.
    excess_own = mine + cost - share
    excess_total = total + cost - max_wait_s * rate
    wait = min(excess_own, excess_total) / rate
    return AdmissionDecision(Admission.OVER_SHARE, ahead_s, max(1, math.ceil(wait)),
                             f"{client!r} has {mine:.0f} tokens queued, over its fair share of {share:.0f} "
                             f"({clients} clients, {max_wait_s:.0f}s at {rate:.1f} tokens/s)")
