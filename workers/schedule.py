"""The beat schedule: which cluster-wide task runs how often (every entry runs on the planner queue)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prewarm.core.settings import Settings
from workers import names

DEMAND_SCAN_S = 10.0
FRAGMENTATION_SWEEP_S = 300.0
EVENT_DISPATCH_S = 2.0


def schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The beat schedule: every entry runs on the planner queue."""
    return {
        "reap-expired-replicas": {"task": names.REAP,
                                  "schedule": timedelta(seconds=settings.registry.reaper_interval_s)},
        "scan-unmet-demand": {"task": names.SCAN_DEMAND, "schedule": timedelta(seconds=DEMAND_SCAN_S)},
        "sweep-fragmentation": {"task": names.SWEEP_FRAGMENTATION,
                                "schedule": timedelta(seconds=FRAGMENTATION_SWEEP_S)},
        "dispatch-due-scale-events": {"task": names.DISPATCH_EVENTS,
                                      "schedule": timedelta(seconds=EVENT_DISPATCH_S)},
        "forecast-and-plan": {"task": names.FORECAST, "schedule": timedelta(seconds=settings.planner.interval_s)},
        "sweep-task-outbox": {"task": names.SWEEP_OUTBOX,
                              "schedule": timedelta(seconds=settings.agent.outbox_sweep_interval_s)},
    }
