"""Warmup nonces shared by every gateway, in Redis: a captured warmup request is warmup once.

The chart runs several gateway pods behind one Service. With each gateway remembering the
nonces it accepted in its own memory, a captured signed warmup request could be replayed as
(uncounted) warmup once per pod. Here the first gateway to accept a nonce records it with
`SET NX` under `keys.warmup_nonce`, kept until the request's timestamp leaves the skew window
(after that the signature check refuses it anyway), so any later use, on any gateway, is
plain user traffic: counted, and routed like any user request.

When Redis cannot answer, the check fails closed: the request is treated as user traffic
(counted as demand, which costs at most a little over-provisioning), never as warmup.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

import redis
import redis.asyncio as aioredis

from prewarm.core import keys, signing

log = logging.getLogger(__name__)


class SharedNonces:
    """The gateways' warmup check: signature (pure, `prewarm.core.signing`) and first use (Redis)."""

    def __init__(self, client: "aioredis.Redis[str]", secret: str | None) -> None:
        self.client = client
        self.secret = secret

    async def first_use(self, nonce: str, timestamp: float, now: float) -> bool:
        """Whether no gateway accepted `nonce` before; records it when so."""
        ttl = max(1, math.ceil(timestamp + signing.MAX_SKEW_S - now) + 1)
        try:
            return bool(await self.client.set(keys.warmup_nonce(nonce), "1", nx=True, ex=ttl))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("warmup nonce not checked (registry unavailable), treated as user traffic: %s", exc)
            return False

    async def is_valid_warmup(self, headers: Mapping[str, str], method: str, path: str, body: bytes,
                              now: float) -> bool:
        verified = signing.verified_warmup(self.secret, headers, method, path, body, now)
        return verified is not None and await self.first_use(verified[0], verified[1], now)
