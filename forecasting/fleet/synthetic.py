"""A synthetic fleet in the Azure Functions 2019 format, for fixtures and the second backtest.

The published Azure Functions trace is not shipped with the project, so tests and the
README's second fleet backtest use days generated in its exact format (one row per
function, ``HashOwner,HashApp,HashFunction,Trigger,1..1440``) with the mix of behaviours
the paper reports ("Serverless in the Wild", ATC'20): timer functions firing on a fixed
period (minutes to a day), HTTP functions with Poisson arrivals over eight orders of
magnitude of rate and a daily cycle, bursty on/off sessions, and rare functions invoked a
few times a day. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

MINUTES = 1440


def _h(rng: np.random.Generator) -> str:
    return hashlib.sha1(rng.bytes(8)).hexdigest()[:16]


def azure_function_days(n_apps: int = 120, days: int = 4, seed: int = 0) -> list[pd.DataFrame]:
    """``days`` frames in the Azure Functions format; each app has one to three functions."""
    rng = np.random.default_rng(seed)
    total = days * MINUTES
    t = np.arange(total)
    rows: list[tuple[str, str, str, str, np.ndarray]] = []
    for _ in range(n_apps):
        owner, app = _h(rng), _h(rng)
        kind = rng.choice(["timer", "http", "burst", "rare"], p=[0.2, 0.45, 0.2, 0.15])
        for _f in range(int(rng.integers(1, 4))):
            if kind == "timer":
                period = int(rng.choice([1, 5, 10, 15, 30, 60, 120, 240, 720, 1440]))
                phase = int(rng.integers(0, period))
                x = ((t - phase) % period == 0).astype(np.float64)
                x *= rng.random(total) > 0.02  # an occasional missed tick
                trig = "timer"
            elif kind == "http":
                per_min = 10 ** rng.uniform(-3.3, 1.5)
                amp = rng.uniform(0.0, 0.9)
                shape = 1.0 + amp * np.sin(2 * np.pi * (t / MINUTES - rng.random()))
                x = rng.poisson(per_min * shape).astype(np.float64)
                trig = "http"
            elif kind == "burst":
                x = np.zeros(total)
                starts_per_day = 10 ** rng.uniform(0.0, 1.6)
                n = rng.poisson(starts_per_day * days)
                rate = 10 ** rng.uniform(-0.5, 1.5)
                for s in rng.integers(0, total, size=n):
                    ln = int(np.clip(rng.lognormal(np.log(15), 0.8), 1, 240))
                    x[s:s + ln] += rng.poisson(rate, size=min(ln, total - s))
                trig = "queue"
            else:
                x = np.zeros(total)
                x[rng.integers(0, total, size=rng.poisson(3 * days))] = 1.0
                trig = "event"
            rows.append((owner, app, _h(rng), trig, x))
    out = []
    for d in range(days):
        data = {"HashOwner": [r[0] for r in rows], "HashApp": [r[1] for r in rows],
                "HashFunction": [r[2] for r in rows], "Trigger": [r[3] for r in rows]}
        block = np.stack([r[4][d * MINUTES:(d + 1) * MINUTES] for r in rows]).astype(np.int64)
        frame = pd.DataFrame(data)
        minutes = pd.DataFrame(block, columns=[str(m) for m in range(1, MINUTES + 1)])
        out.append(pd.concat([frame, minutes], axis=1))
    return out
