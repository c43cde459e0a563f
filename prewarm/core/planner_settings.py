"""The planner's settings group (`PREWARM_PLANNER_*`): what it plans, how far ahead, and each judgement
constant with its reason. Part of the one settings root (`prewarm.core.settings`), in its own module by size."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from prewarm.core import keys
from prewarm.core.domain import check_name
from prewarm.core.errors import InvalidPayload
from prewarm.core.settings_base import _Group


class PlannerSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="PREWARM_PLANNER_", extra="forbid")
    group: ClassVar[str] = "planner"

    interval_s: float = Field(5.0, gt=0)  # beat period of forecast_and_plan (the simulator's planner cadence too)
    bucket_s: int = Field(60, gt=0)  # coarse buckets (a multiple of 10 or 60 s): the seasonal profile's history
    fine_bucket_s: int = Field(10, gt=0)  # fine buckets (a multiple of the 10 s counters): what the nowcast reads
    headroom: float = Field(0.0, ge=0)  # on top of the forecast the calibrated margin sizes
    lead_margin_s: float = Field(10.0, ge=0)
    default_cold_start_s: float = Field(8.7, gt=0)
    stabilization_s: float = Field(300.0, ge=0)  # the reactive fallback's window (forecast-quality gate closed)
    scale_down_tolerance: float = Field(0.1, ge=0, lt=1)  # the reactive fallback keeps a fall of at most this share
    release_band: float = Field(0.25, ge=0, lt=1)  # a predictive fall leaves this share of a replica spare (deadband)
    queue_beta: float = Field(1.5, ge=0)  # square-root staffing margin: slots for a mean load a are a + beta sqrt(a)
    error_threshold: float = Field(0.1, gt=0)  # recent typical relative error above which scale-downs turn reactive
    warm_pool_size: int | None = Field(None, ge=0)  # fixed warm pool; None: warm_pool_percent of the need
    warm_pool_percent: float = Field(0.0, ge=0, le=100)  # 0: the calibrated margin is the spare capacity
    budget_share: float = Field(0.12, ge=0, le=1)
    # --- the cold-start budget (forecasting/calibration.py; reasons in docs/operating.md) ---
    cold_start_budget: float = Field(0.001, gt=0, le=1)  # share of requests that may wait for a load or a wake
    margin_initial: float = Field(6.0, ge=0)  # the margin's start, on the safe side until misses are measured
    budget_gain: float = Field(0.2, gt=0)  # margin (beta) moved per calibration window's budget overspent
    budget_calibration_s: float = Field(3600.0, gt=0)  # the window the overspend is measured against
    budget_horizon_s: float = Field(86400.0, gt=0)  # the span the budget's share is meant over (its normaliser)
    margin_max: float = Field(40.0, gt=0)  # the calibrated margin's ceiling (no integrator wind-up)
    # how the margin meets the budget: "integrator" moves it by the overspend; "quantile" reads it from the margins
    # past buckets needed, the overspend moving the quantile's level (docs/operating.md, "the quantile rule")
    margin_rule: Literal["integrator", "quantile"] = "integrator"
    shortfall_horizon_s: float = Field(7 * 86400.0, gt=0)  # the quantile rule remembers needed margins this long
    season_s: float = Field(86400.0, gt=0)  # the period the traffic repeats over: declared (a day unless told)
    profile_bin_s: float = Field(1800.0, gt=0)  # resolution of the learned seasonal shape; at most season_s
    # --- a fall the profile or the recent level contradicts is held (forecasting/interruption.py; docs/operating.md) ---
    interruption_share: float = Field(0.1, ge=0, lt=1)  # below this share of the expected requests (0: never held)
    interruption_min_requests: float = Field(20.0, gt=0)  # judged over recent buckets expecting at least this many
    interruption_hold_s: float = Field(3600.0, ge=0)  # held at most this long from the start of the fall
    pause_memory: int = Field(64, ge=0)  # the last pauses a silent fall's span is learned from (0: off)

    @model_validator(mode="before")
    @classmethod
    def _no_quantile_knob(cls, data: Any) -> Any:
        """The planning quantile was the operator's knob until the cold-start budget replaced it (issue 17: it
        barely moved the waits): a deployment still setting it is told what to set instead, not ignored."""
        if os.environ.get("PREWARM_PLANNER_QUANTILE") is not None or (isinstance(data, dict) and "quantile" in data):
            raise ValueError("PREWARM_PLANNER_QUANTILE is no longer a setting: the planner steers to "
                             "PREWARM_PLANNER_COLD_START_BUDGET (the share of requests that may wait for a load "
                             "or a wake; docs/operating.md, 'The cold-start budget')")
        return data

    @model_validator(mode="after")
    def _bin_within_season(self) -> "PlannerSettings":
        if self.profile_bin_s > self.season_s:
            raise ValueError(f"PREWARM_PLANNER_PROFILE_BIN_S ({self.profile_bin_s:g}) must be at most "
                             f"PREWARM_PLANNER_SEASON_S ({self.season_s:g}): a profile bin within one season")
        return self
    dry_run: bool = False
    # model@revision to plan for; empty: every model seen. JSON (["a@r1","b@r2"]) or comma-separated (a@r1,b@r2)
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    batch_jobs: list[dict[str, Any]] = Field(default_factory=list)  # {cron, model, replicas, duration_s}

    @field_validator("fine_bucket_s")
    @classmethod
    def _fine_bucket_is_counted(cls, v: int) -> int:
        """The gateway counts peaks in flight and busy time at one resolution: a fine bucket sums whole ones."""
        if v % keys.FINE_RESOLUTION_S:
            raise ValueError(f"must be a whole multiple of the gateway's {keys.FINE_RESOLUTION_S} s in-flight "
                             f"counters, got {v}")
        return v

    @field_validator("bucket_s")
    @classmethod
    def _bucket_is_counted(cls, v: int) -> int:
        """Coarse buckets are summed from a resolution the gateway records."""
        if not any(v % r == 0 for r in keys.REQUEST_RESOLUTIONS_S):
            raise ValueError(f"must be a whole multiple of a request-counter resolution the gateway records "
                             f"({sorted(keys.REQUEST_RESOLUTIONS_S)} s), got {v}")
        return v

    @field_validator("models", mode="before")
    @classmethod
    def _models_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            text = v.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not a JSON list: {exc}") from None
            return [m.strip() for m in text.split(",") if m.strip()]
        return v

    @field_validator("models")
    @classmethod
    def _models_named(cls, v: list[str]) -> list[str]:
        """Each entry is model@revision with valid names: 'not json' is not a model, and a name a
        gateway would serve becomes part of Redis keys and metric labels."""
        for entry in v:
            name, sep, rev = entry.partition("@")
            if not sep:
                raise ValueError(f"each entry must be model@revision (a JSON list or comma-separated), got {entry!r}")
            try:
                check_name(name, "model")
                check_name(rev, "revision")
            except InvalidPayload as exc:
                raise ValueError(f"{entry!r}: {exc}") from None
        return v
    capacity_rps: float = Field(4.0, gt=0)  # sustained requests/s one replica serves within the SLA
    history_s: int = Field(3 * 86400, gt=0)  # how much of the gateway's counters a forecast is fitted on
    min_serving: int = Field(1, ge=0)  # serving replicas never planned below this; 0 lets a model scale to zero
    # A replica a scale-down releases but the learned daily profile needs again within this many seconds is
    # parked asleep (level-1 sleep: GPU freed, back in its wake time) instead of retired (a full cold start
    # later); beyond it the host memory is better spent elsewhere. 0: never parked (every release retires).
    park_horizon_s: float = Field(0.0, ge=0)
    # --- the fleet (many models on one GPU pool, workers/planning/fleet.py) ---
    fleet_budget_gb: float = Field(0.0, ge=0)  # > 0: one fleet round plans every model within this much GPU memory
    model_memory_gb: dict[str, float] = Field(default_factory=dict)  # GPU footprint of one replica, per model
    model_priority: dict[str, float] = Field(default_factory=dict)  # weight of a model's requests (default 1)
    # a model busier than this (requests/s over fleet_dense_window_s, or since its first request) has its replica
    # count sized by the count planner in the fleet round (reasons in docs/operating.md); at most fleet_max_dense
    fleet_dense_rps: float = Field(1.0, ge=0)
    fleet_max_dense: int = Field(32, ge=0)
    fleet_dense_window_s: float = Field(3600.0, gt=0)
    # the other models: a burst over one replica's capacity gets the replicas an HPA would give it (reasons in operating.md)
    fleet_burst_target: float = Field(0.7, gt=0, le=1)
    fleet_burst_hold_s: float = Field(300.0, ge=0)
    # e-folds the fleet round's memory price moves per calibration window's cold-start budget overspent, or per calm
    # window (the price is steered by `cold_start_budget` on the waits of the models planned by their outlook;
    # reasons in docs/fleet.md)
    fleet_price_gain: float = Field(1.0, gt=0)
