"""A fleet: many models sharing one GPU pool, each kept at the right tier of warmth.

The single-model planner (`forecasting.planner`) answers "how many replicas of this model";
this package answers the fleet's question: which of many models stay warm, on which node,
and how warm (ready on GPU, asleep in host memory, in the page cache, on disk only), under
one GPU-memory budget shared by all of them.

Modules:
- `traces`: multi-model trace readers (per-client rates, Azure Functions counts, request
  logs with user-named columns) into one `FleetTrace` (requests per model per step);
- `catalog`: what the fleet knows of each model (footprint, priority, time to ready per tier);
- `estimate`: per-model arrival outlook from its own idle-time distribution and time of day,
  pooled across series so the long tail is cheap;
- `planner`: the pure fleet planner (value per GPU-memory-second, budget, placement, tiers);
- `policies`, `simulate`, `report`: the multi-model backtest and its baselines.

Everything here is pure (no Redis, Celery, HTTP); `now` and history are passed in.
"""
