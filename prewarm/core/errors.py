"""Error types that say whether to retry.

A `PermanentError` is never retried (bad input, bad weights, a refused transition); a
`TemporaryError` carries the delay after which a retry makes sense. Client-library errors
are wrapped with ``raise ... from`` so the cause stays visible.

Each error type also names its own low-cardinality `reason` (the `reason` label of
`model_loading_failures_total`), so classifying a failure is reading a class attribute,
never matching an exception's text.
"""

from __future__ import annotations

from typing import ClassVar


class PrewarmError(Exception):
    """Base of every error prewarm raises on purpose."""

    reason: ClassVar[str] = "internal"


class PermanentError(PrewarmError):
    """Retrying cannot help: the input or the state is wrong."""

    reason: ClassVar[str] = "permanent"


class TemporaryError(PrewarmError):
    """Retrying after `retry_after` seconds may succeed."""

    reason: ClassVar[str] = "temporary"

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

    reason: ClassVar[str] = "invalid_payload"


class WeightsError(PermanentError):
    """A model's weights, config or manifest are wrong (read locally, or reported by its runtime)."""

    reason: ClassVar[str] = "bad_weights"


def failure_reason(exc: BaseException) -> str:
    """The reason code of any failure: the error type's own, `timeout` for a timeout, else `internal`."""
    if isinstance(exc, PrewarmError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "internal"
