"""Error types that say whether to retry.

A `PermanentError` is never retried (bad input, bad weights, a refused transition); a
`TemporaryError` carries the delay after which a retry makes sense. Client-library errors
are wrapped with ``raise ... from`` so the cause stays visible.
"""

from __future__ import annotations


class PrewarmError(Exception):
    """Base of every error prewarm raises on purpose."""


class PermanentError(PrewarmError):
    """Retrying cannot help: the input or the state is wrong."""


class TemporaryError(PrewarmError):
    """Retrying after `retry_after` seconds may succeed."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SettingsError(PermanentError):
    """A setting is missing or invalid; the message names it."""


class IllegalTransition(PermanentError):
    """A replica state change that the state machine does not allow."""


class ReplicaNotFound(PermanentError):
    """The registry holds no replica with that id."""


class RegistryUnavailable(TemporaryError):
    """Redis cannot be reached; the caller should back off and retry."""


class InvalidPayload(PermanentError):
    """A task payload or request body is malformed; the message names the field."""
