"""The self-validation role of the model host: validation inputs for an agent, its verdict,
and the in-process checks for a host without one (`serve-model --self-validate`).

Readiness means "loaded and validated": the agent (which owns the latency baseline) reads
`POST /validate/inputs`, runs the pure checks of `prewarm.policy.validation` and posts its
verdict to `POST /ready`; a stand-alone host runs the same three checks itself after each
load, and again after a wake from level-2 sleep.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from prewarm.policy.validation import (
    LogitStats,
    ValidationReport,
    check_numeric,
    check_performance,
    check_structural,
    tensor_specs,
)
from prewarm.runtime import api
from prewarm.runtime import probe
from prewarm.runtime.hostcore import HostCore, _json

log = logging.getLogger("prewarm.runtime")


class ValidationHandlers(HostCore):
    async def _probe_body(self, request: web.Request) -> str:
        raw = await request.read()
        if not raw:
            return probe.PROBE_PROMPT
        data = api.parse_json_object(raw)
        prompt = data.get("prompt", probe.PROBE_PROMPT)
        if not isinstance(prompt, str) or not prompt:
            raise api.bad_request("'prompt' must be a non-empty string", "prompt")
        return api.encodable(prompt, "prompt")

    async def validation_inputs(self, request: web.Request) -> web.Response:
        prompt = await self._probe_body(request)
        self._require_loaded()
        return _json(await self._run(probe.validation_inputs, self.engine, self.model_name, prompt))

    async def validate(self, request: web.Request) -> web.Response:
        """Run all three checks in-process; body: {"baseline_s": float|null, "requests": n, "mark_ready": bool}."""
        raw = await request.read()
        data = api.parse_json_object(raw) if raw else {}
        baseline = data.get("baseline_s")
        if baseline is not None and (not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or baseline <= 0):
            raise api.bad_request(f"'baseline_s' must be a positive number or null, got {baseline!r}", "baseline_s")
        n = data.get("requests", 5)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 100:
            raise api.bad_request(f"'requests' must be an integer in 1..100, got {n!r}", "requests")
        mark = data.get("mark_ready", True)
        self._require_loaded()
        return _json(await self.run_validation(float(baseline) if baseline is not None else None, n,
                                                           mark=bool(mark)))

    async def run_validation(self, baseline_s: float | None, requests: int, *, mark: bool) -> dict[str, Any]:
        """The three checks in-process (structural, numeric, performance against `baseline_s`);
        with `mark`, their verdict becomes this host's readiness. Returns the report."""
        inputs = await self._run(probe.validation_inputs, self.engine, self.model_name, probe.PROBE_PROMPT)
        ids = list(self.engine.encode(probe.PROBE_PROMPT))
        latencies = [await self._run(probe.timed_completion, self.engine, ids, 1) for _ in range(requests)]
        report = ValidationReport((
            check_structural(tensor_specs(inputs["manifest"]), tensor_specs(inputs["tensors"])),
            check_numeric(LogitStats.from_dict(inputs["logits"]), mean_bound=self.mean_bound),
            check_performance(latencies, baseline_s, factor=self.latency_factor),
        ))
        for c in report.checks:
            self.metrics.validation_results.labels(self.model_name, c.name.value, c.outcome.value).inc()
        body = report.to_dict()
        if mark:
            self.state.validated = report.passed
            self.state.report = body
        return body

    def validate_itself(self) -> None:
        """From now on, validate after each load without an agent: wait for the current load,
        run the three checks in-process and make their verdict this host's readiness (needs
        a running event loop)."""
        self.self_validate = True
        if self._self_check is None or self._self_check.done():
            self._self_check = asyncio.get_running_loop().create_task(self._validate_when_loaded())

    async def _validate_when_loaded(self, requests: int = 5) -> dict[str, Any] | None:
        """None when the load failed: the host then stays unready, and `/load` says why."""
        try:
            await asyncio.to_thread(self.engine.wait_loaded)
        except Exception as exc:  # noqa: BLE001 - the load's own error, already reported by /load and /health
            log.error("not validating %s: its load failed: %s", self.model_name, exc)
            return None
        try:
            report = await self.run_validation(None, requests, mark=True)
        except Exception as exc:  # noqa: BLE001 - e.g. put to sleep meanwhile: unready until the next load
            log.error("validation of %s could not run: %s", self.model_name, exc)
            return None
        if report["passed"]:
            log.info("%s validated itself: ready", self.model_name)
        else:
            log.error("%s failed its own validation (%s): it stays unready", self.model_name, report["reason"])
        return report

    async def mark_ready(self, request: web.Request) -> web.Response:
        """The agent's verdict: {"passed": bool, "report": {...}}; passed=false withdraws readiness."""
        data = api.parse_json_object(await request.read())
        passed = data.get("passed")
        if not isinstance(passed, bool):
            raise api.bad_request(f"'passed' must be a boolean, got {passed!r}", "passed")
        report = data.get("report")
        if report is not None and not isinstance(report, dict):
            raise api.bad_request("'report' must be an object", "report")
        if passed:
            self._require_loaded()
        self.state.validated = passed
        self.state.report = report
        ok, reason = self.ready()
        return _json({"ready": ok, "reason": reason})
