"""Who a client is, seen through declared proxies: pure (addresses in, an address out).

Issue 20: behind an ingress every client shares the ingress's address, so a per-address
limit shuts every client out at once, and believing `X-Forwarded-For` from anyone lets any
client pick its own address. The header is believed only from a declared proxy
(`gateway.trusted_proxies`, CIDRs), and read right to left: the first address that is not a
trusted proxy is the client (the ones to its left were written by the client itself).
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Iterable, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def is_trusted(address: str, trusted: Sequence[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def client_address(peer: str, forwarded_for: str | None, trusted: Sequence[Network]) -> str:
    """The client's address: the peer's, unless the peer is a trusted proxy that says whom it forwards."""
    if not forwarded_for or not is_trusted(peer, trusted):
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        if not is_trusted(hop, trusted):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:  # garbage a client wrote: the last trustworthy hop is all we know
                return peer
    return peer


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if authorization and authorization[:7].lower() == "bearer " and authorization[7:].strip():
        return authorization[7:].strip()
    return None


def client_key(authorization: str | None, address: str) -> str:
    """The fairness key of a request: its API key (hashed: keys never reach logs or labels), else its address."""
    token = bearer(authorization)
    if token is not None:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return "addr:" + address
