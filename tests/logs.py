"""A logging handler that keeps every ERROR record, for tests asserting that nothing was logged as an error."""

from __future__ import annotations

import logging


class ErrorRecords(logging.Handler):
    """Collects the records at ERROR and above that reach it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
