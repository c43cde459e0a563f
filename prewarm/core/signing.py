"""HMAC signatures for warmup traffic.

Warmup requests carry `X-Warmup: 1`, `X-Warmup-Timestamp`, `X-Warmup-Nonce` and
`X-Warmup-Signature`, an HMAC-SHA256 over the timestamp, the nonce, the method, the path
and the body with the shared secret. A request whose signature does not verify gains
nothing: it is treated as user traffic. A verifier remembers the nonces it accepted for
the skew window, so a captured warmup request replayed within it is user traffic too: a
runtime in its own memory (`NonceCache`, it is one process), the gateways in Redis, shared
by every gateway pod (`prewarm.gateway.nonces`), since a replay may reach any of them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Mapping

HEADER = "X-Warmup"
HEADER_TS = "X-Warmup-Timestamp"
HEADER_SIG = "X-Warmup-Signature"
HEADER_NONCE = "X-Warmup-Nonce"
MAX_SKEW_S = 300.0


def sign(secret: str, method: str, path: str, body: bytes, timestamp: float, nonce: str = "") -> str:
    msg = b"\n".join([f"{timestamp:.3f}".encode(), nonce.encode(), method.upper().encode(), path.encode(), body])
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def warmup_headers(secret: str, method: str, path: str, body: bytes, now: float,
                   nonce: str | None = None) -> dict[str, str]:
    """Headers that mark a request as signed warmup traffic. `nonce`: unique per request (a random
    one when not given; pure callers pass one derived from their seed and `now`)."""
    nonce = nonce or secrets.token_hex(12)
    return {
        HEADER: "1",
        HEADER_TS: f"{now:.3f}",
        HEADER_NONCE: nonce,
        HEADER_SIG: sign(secret, method, path, body, float(f"{now:.3f}"), nonce),
    }


class NonceCache:
    """Nonces of accepted warmup requests, for the skew window: a second use is a replay."""

    def __init__(self, window_s: float = 2 * MAX_SKEW_S, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}  # nonce -> until; insertion order is expiry order

    def first_use(self, nonce: str, now: float) -> bool:
        while self._seen:
            oldest = next(iter(self._seen))
            if self._seen[oldest] > now and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + self.window_s
        return True


def verified_warmup(
    secret: str | None, headers: Mapping[str, str], method: str, path: str, body: bytes, now: float,
) -> tuple[str, float] | None:
    """(nonce, timestamp) of a request marked as warmup whose signature and timestamp verify, else None.
    Whether the nonce was used before is the caller's question (`NonceCache` in one process, or the
    gateways' shared record in Redis, `prewarm.gateway.nonces`)."""
    if not secret or headers.get(HEADER) != "1":
        return None
    try:
        ts = float(headers.get(HEADER_TS, ""))
    except ValueError:
        return None
    if not abs(now - ts) <= MAX_SKEW_S:  # NaN fails too
        return None
    nonce = headers.get(HEADER_NONCE, "")
    if not 8 <= len(nonce) <= 64:
        return None
    expected = sign(secret, method, path, body, ts, nonce)
    if not hmac.compare_digest(expected, headers.get(HEADER_SIG, "")):
        return None
    return nonce, ts


def is_valid_warmup(
    secret: str | None, headers: Mapping[str, str], method: str, path: str, body: bytes, now: float,
    nonces: NonceCache | None = None,
) -> bool:
    """True only for a request marked as warmup whose signature and timestamp verify and, with
    `nonces`, whose nonce was not used before (a replay)."""
    verified = verified_warmup(secret, headers, method, path, body, now)
    if verified is None:
        return False
    return nonces is None or nonces.first_use(verified[0], now)
