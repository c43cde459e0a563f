"""Whether a model has an asleep tier on a node: what its engine reports, carried to the planner.

The asleep tier (engine level-1 sleep: weights to host memory, GPU freed) exists only where the
engine can sleep: prewarm's own runtime always can; vLLM only where its platform supports sleep
mode (CUDA; on CPU it refuses `--enable-sleep-mode`), which the agent asks vLLM once at start.
Planned anyway, a sleep is refused by the agent (`no_sleep_mode`) and the replica stays on GPU
while the planner counts its memory as freed, and a parked scale-down never releases anything.

Each agent publishes, in its node view (`keys.node_info`, field `sleep_mode`), per model whose
engine has answered whether it can sleep there: ``{"*": <the default engine's answer>,
"<model>": <its engine's answer>}`` for the models `engine.models` names. A model the report does
not cover (an engine not asked yet, an older agent) is unreported: the tier is absent only where
an engine said so, never assumed.

Pure: no I/O; the agent and the planner call these with what they read.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

#: The node view's field, and the report's key for every model its default engine serves.
FIELD = "sleep_mode"
DEFAULT = "*"


def sleep_report(default_engine: str, models: Mapping[str, str], answers: Mapping[str, bool | None]) -> dict[str, bool]:
    """The node's report: the default engine's answer under ``*``, each model `models` maps to an engine
    under its name, leaving out those whose engine has not answered (`answers[engine]` None or missing)."""
    out: dict[str, bool] = {}
    if answers.get(default_engine) is not None:
        out[DEFAULT] = bool(answers[default_engine])
    for model, engine in models.items():
        if answers.get(engine) is not None:
            out[model] = bool(answers[engine])
    return out


def parse_report(raw: str | None) -> dict[str, bool]:
    """A node view's `sleep_mode` field; an absent or malformed one reports nothing."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, bool)}


def can_sleep(report: Mapping[str, bool], model: str) -> bool | None:
    """What a node's report says of ``model`` (a name or model@revision): True, False, or None (unreported)."""
    name = model.split("@", 1)[0]
    got = report.get(name, report.get(DEFAULT))
    return None if got is None else bool(got)


def tier_absent(reports: Iterable[Mapping[str, bool]], model: str) -> bool:
    """The asleep tier of ``model`` is absent on these nodes: at least one reports on it and every
    report on it says it cannot sleep (a node that can, or a node that says nothing, keeps it)."""
    said = [can_sleep(r, model) for r in reports]
    return bool(said) and all(s is False for s in said)


__all__ = ["DEFAULT", "FIELD", "can_sleep", "parse_report", "sleep_report", "tier_absent"]
