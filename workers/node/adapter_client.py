"""What every engine's client in the agent passes straight to its adapter: the bring-up steps.

`RuntimeClient` (the built-in runtime) and `VllmClient` (vLLM) add what each engine reports
besides; the steps the pipeline drives (load, warm up, validate, mark ready) are the adapter's.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

from prewarm.adapters.runtimes import LoadStatus, RuntimeAdapter, ValidationInputs
from prewarm.policy.validation import ValidationReport
from prewarm.policy.warmup import WarmupRequest

A = TypeVar("A", bound=RuntimeAdapter)


class AdapterClient(Generic[A]):
    """The bring-up steps every engine's client passes straight to its adapter."""

    adapter: A

    def load(self) -> LoadStatus:
        return self.adapter.load()

    def load_status(self) -> LoadStatus:
        return self.adapter.load_status()

    def warmup(self, requests: Sequence[WarmupRequest]) -> list[float]:
        return self.adapter.warmup(requests)

    def validation_inputs(self) -> ValidationInputs:
        return self.adapter.validation_inputs()

    def mark_ready(self, report: ValidationReport) -> bool:
        return self.adapter.mark_ready(report)

    def ready(self) -> bool:
        return self.adapter.ready()
