"""HMAC signatures for warmup traffic.

Warmup requests carry `X-Warmup: 1`, `X-Warmup-Timestamp` and `X-Warmup-Signature`, an
HMAC-SHA256 over the timestamp, the method, the path and the body with the shared secret.
A request whose signature does not verify gains nothing: it is treated as user traffic.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping

HEADER = "X-Warmup"
HEADER_TS = "X-Warmup-Timestamp"
HEADER_SIG = "X-Warmup-Signature"
MAX_SKEW_S = 300.0


def sign(secret: str, method: str, path: str, body: bytes, timestamp: float) -> str:
    msg = b"\n".join([f"{timestamp:.3f}".encode(), method.upper().encode(), path.encode(), body])
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def warmup_headers(secret: str, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """Headers that mark a request as signed warmup traffic."""
    return {
        HEADER: "1",
        HEADER_TS: f"{now:.3f}",
        HEADER_SIG: sign(secret, method, path, body, float(f"{now:.3f}")),
    }


def is_valid_warmup(
    secret: str | None, headers: Mapping[str, str], method: str, path: str, body: bytes, now: float
) -> bool:
    """True only for a request marked as warmup whose signature and timestamp verify."""
    if not secret or headers.get(HEADER) != "1":
        return False
    try:
        ts = float(headers.get(HEADER_TS, ""))
    except ValueError:
        return False
    if abs(now - ts) > MAX_SKEW_S:
        return False
    expected = sign(secret, method, path, body, ts)
    return hmac.compare_digest(expected, headers.get(HEADER_SIG, ""))
