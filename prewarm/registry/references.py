"""What an external engine's validation is compared with: reference probes and speed baselines.

A revision's reference is built from the probes of its first `engine.reference_replicas`
validated replicas (the samples, one hash field per replica, so a redelivered validation
does not count twice); once there are enough, the robust reference is computed by the
pure `prewarm.policy.reference.build_reference` and stored once (SET NX: two agents that
finish together store one, and both read the same back). Speed baselines (time to first
token, decode seconds per token) live in the revision's baseline hash beside the built-in
warm latency, per node class: each is the median of the first `engine.reference_replicas`
validated replicas' figures (the same Lua script as the warm latency's, so one slow or one
fast first replica does not set it alone, and concurrent validations record one). Everything expires after
`keys.BASELINE_TTL_S`, when hardware and engine versions have moved under it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Mapping, Sequence

from prewarm.core import keys
from prewarm.policy.engine_checks import SpeedBaseline
from prewarm.policy.reference import Probe, probes_from_json, probes_to_json
from prewarm.registry.lua import BASELINE_SAMPLE
from prewarm.registry.replicas import _wrap_redis_errors, figures, record_figure

if TYPE_CHECKING:
    import redis

_SPEED_FIELDS = ("ttft_s", "decode_s_per_token")


class ReferenceStore:
    def __init__(self, client: "redis.Redis[str]") -> None:
        self.client = client
        self._baseline_sample = client.register_script(BASELINE_SAMPLE)

    @_wrap_redis_errors
    def reference(self, model: str, revision: str) -> tuple[Probe, ...] | None:
        raw = self.client.get(keys.reference(model, revision))
        return None if raw is None else probes_from_json(json.loads(raw))

    @_wrap_redis_errors
    def add_sample(self, model: str, revision: str, rid: str, probes: Sequence[Probe]) -> dict[str, tuple[Probe, ...]]:
        """Record one validated replica's probes; returns every sample so far (replica id -> probes)."""
        key = keys.reference_samples(model, revision)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, rid, json.dumps(probes_to_json(probes)))
        pipe.expire(key, keys.BASELINE_TTL_S)
        pipe.hgetall(key)
        raw: Mapping[str, str] = pipe.execute()[-1]
        return {r: probes_from_json(json.loads(v)) for r, v in sorted(raw.items())}

    @_wrap_redis_errors
    def set_reference_if_absent(self, model: str, revision: str, probes: Sequence[Probe]) -> tuple[Probe, ...]:
        """Store the reference unless one exists; returns the stored one."""
        key = keys.reference(model, revision)
        self.client.set(key, json.dumps(probes_to_json(probes)), nx=True, ex=keys.BASELINE_TTL_S)
        stored = self.reference(model, revision)
        return stored if stored is not None else tuple(probes)

    @_wrap_redis_errors
    def speed_baseline(self, model: str, node_class: str, revision: str) -> SpeedBaseline:
        vals = self.client.hmget(keys.baseline(model, node_class, revision), list(_SPEED_FIELDS))
        ttft, decode = (None if v is None or float(v) <= 0 else float(v) for v in vals)
        return SpeedBaseline(ttft, decode)

    @_wrap_redis_errors
    def record_speed_sample(self, model: str, node_class: str, revision: str, figures: Mapping[str, float], *,
                            samples: int) -> SpeedBaseline:
        """One validated replica's speed figures towards the baseline: each figure's baseline is the median of
        the first `samples` recorded (`BASELINE_SAMPLE`). Returns the baseline as it stands (None fields:
        not yet made)."""
        if samples < 1:
            raise ValueError(f"speed baseline samples must be at least 1, got {samples}")
        for name, value in figures.items():
            if name not in _SPEED_FIELDS:
                raise ValueError(f"unknown speed figure {name!r}; known: {_SPEED_FIELDS}")
            self._baseline_sample(keys=[f"{keys.baseline_samples(model, node_class, revision)}:{name}",
                                        keys.baseline(model, node_class, revision)],
                                  args=[repr(float(value)), samples, keys.BASELINE_TTL_S, name])
        return self.speed_baseline(model, node_class, revision)


class EnginePhases:
    """How long an external engine's replicas spend starting their server and being warmed and validated.

    The yardstick of warmup and validation for an engine prewarm does not control: their cost
    as a share of the engine's own start time, per model and node class."""

    SERVER_START = "server_start"
    WARM_VALIDATE = "warm_validate"

    def __init__(self, client: "redis.Redis[str]") -> None:
        self.client = client

    @_wrap_redis_errors
    def record(self, model: str, phase: str, node_class: str, seconds: float) -> None:
        record_figure(self.client, keys.engine_phase_times(model, phase, node_class), seconds)

    @_wrap_redis_errors
    def times(self, model: str, phase: str, node_class: str) -> list[float]:
        return figures(self.client, keys.engine_phase_times(model, phase, node_class))
