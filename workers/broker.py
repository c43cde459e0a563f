"""The Celery broker transport for a Redis Sentinel group: kombu's own, with one fix.

kombu 5.7's `sentinel://` transport loses its way after a failover. When the worker's
connection to the old primary breaks, Celery collects the connection (kombu sets the
transport's `client` to None), then closes its channels; closing a channel restores its
unacked messages, and a reject of a message in flight does the same, through a connection
pool the channel builds anew from `transport.client`. That reads `None.hostname`, and the
AttributeError is an "Unrecoverable error" that shuts the node agent down (seen in
tests/test_sentinel_failover.py). Here the transport keeps the last connection it was
given, so that late restore finds the Sentinels, asks them for the promoted primary and puts
the messages back; nothing else changes. A single Redis (`redis://`) uses kombu's transport
as it is.
"""

from __future__ import annotations

from typing import Any

from kombu.transport.redis import SentinelTransport as _KombuSentinelTransport

#: What `broker_transport` names for a Sentinel group (workers.app).
TRANSPORT = "workers.broker:SentinelTransport"


class SentinelTransport(_KombuSentinelTransport):
    """kombu's Sentinel transport, keeping its `client` (the kombu Connection) once set."""

    _kept_client: Any = None

    @property
    def client(self) -> Any:
        return self._kept_client

    @client.setter
    def client(self, value: Any) -> None:
        if value is not None:  # kombu's Connection._do_close_transport sets None; late restores still need it
            self._kept_client = value
