"""Multi-model traces: every model's requests per step, from three public shapes of file.

A fleet backtest needs, for each model, how many requests arrived in each step of time.
The published fleet traces come in three shapes, each read here by column *name* (the
column order differs between published copies):

- per-client rate windows, ``client,window_start_s,rate_req_per_s[,cv]`` (ServeGen): each
  client is a model (or fine-tune); only windows with traffic are listed;
- Azure Functions 2019 invocation counts: one row per function with ``HashOwner``,
  ``HashApp``, ``HashFunction``, ``Trigger`` and one column per minute of the day (``1`` …
  ``1440`` or ``minute_1`` …); one file per day, given in order. A model is an app (the
  unit of memory in "Serverless in the Wild") or, on request, a function;
- a request log with a time column and a model column whose names the user gives
  (Alibaba's GenAI trace: ``gmt_create`` and ``checkpoint_model_version_id``).

All become a `FleetTrace`: a dense ``counts[step, model]`` matrix. Reading files is the
only I/O here; nothing imports Redis, Celery or HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from forecasting.data.traces import HistoryError, RateTrace

_MODEL_COLUMNS = ("client", "model", "model_id", "app", "function")
_MINUTE = re.compile(r"^(?:minute_?)?(\d+)$", re.IGNORECASE)


@dataclass(frozen=True, eq=False)
class FleetTrace:
    """Requests per step per model: ``counts[t, i]`` requests of ``names[i]`` in step ``t``.

    Step ``t`` covers ``[t * step_s, (t + 1) * step_s)`` seconds from the trace start;
    ``start_epoch`` is the epoch second of offset 0 (0 for offset-only traces).
    """

    names: tuple[str, ...]
    counts: np.ndarray
    step_s: float
    source: str
    kind: str
    start_epoch: float = 0.0

    @property
    def n_models(self) -> int:
        return len(self.names)

    @property
    def n_steps(self) -> int:
        return int(self.counts.shape[0])

    @property
    def duration_s(self) -> float:
        return self.n_steps * self.step_s

    @property
    def total_requests(self) -> float:
        return float(self.counts.sum())

    def head(self, n_models: int) -> "FleetTrace":
        """The ``n_models`` models with the most requests (a smaller fleet of the same trace)."""
        order = np.argsort(-self.counts.sum(axis=0), kind="stable")[:n_models]
        order = np.sort(order)
        return FleetTrace(tuple(self.names[i] for i in order), self.counts[:, order], self.step_s,
                          self.source, self.kind, self.start_epoch)

    def client(self, name: str, limit_s: float | None = None) -> RateTrace:
        """One model's rate per step (zeros where it had no request), as a single-model rate trace: the
        first `limit_s` seconds (None: all). An unknown name is an error that names it."""
        if name not in self.names:
            raise HistoryError(f"no model {name!r} in {self.source} (it has {self.n_models})")
        k = self.names.index(name)
        n = self.n_steps if limit_s is None else min(self.n_steps, int(np.ceil(limit_s / self.step_s)))
        return RateTrace(window_start_s=np.arange(n) * self.step_s, rate=self.counts[:n, k] / self.step_s,
                         window_s=self.step_s, source=f"{self.source}:{name}", start_epoch=self.start_epoch)


def _columns(frame: pd.DataFrame) -> dict[str, str]:
    return {str(c).strip().lower(): str(c) for c in frame.columns}


def _need(cols: dict[str, str], name: str, path: Path) -> str:
    key = name.strip().lower()
    if key not in cols:
        raise HistoryError(f"{path}: no column {name!r} (columns: {', '.join(cols.values())})")
    return cols[key]


def _dense(model_codes: np.ndarray, steps: np.ndarray, values: np.ndarray, n_models: int, n_steps: int) -> np.ndarray:
    counts = np.zeros((n_steps, n_models), dtype=np.float64)
    np.add.at(counts, (steps, model_codes), values)
    return counts


def read_client_rates(path: str | Path) -> FleetTrace:
    """Per-client rate windows (ServeGen's ``client,window_start_s,rate_req_per_s``)."""
    p = Path(path)
    frame = _read_csv(p)
    cols = _columns(frame)
    model_col = next((cols[c] for c in _MODEL_COLUMNS if c in cols), None)
    if model_col is None:
        raise HistoryError(f"{p}: no client/model column")
    start = pd.to_numeric(frame[_need(cols, "window_start_s", p)], errors="coerce").to_numpy(np.float64)
    rate = pd.to_numeric(frame[_need(cols, "rate_req_per_s", p)], errors="coerce").to_numpy(np.float64)
    ok = np.isfinite(start) & np.isfinite(rate) & (rate >= 0) & (start >= 0)
    if not ok.any():
        raise HistoryError(f"{p}: no usable rows")
    start, rate, names_col = start[ok], rate[ok], frame[model_col].astype(str).to_numpy()[ok]
    starts = np.unique(start)
    window = float(np.min(np.diff(starts))) if starts.size > 1 else 600.0
    codes, names = pd.factorize(names_col, sort=True)
    steps = np.rint(start / window).astype(np.int64)
    counts = _dense(codes, steps, rate * window, len(names), int(steps.max()) + 1)
    return FleetTrace(tuple(str(n) for n in names), counts, window, str(p), "client_rates")


def read_azure_functions(paths: Sequence[str | Path], *, unit: str = "app") -> FleetTrace:
    """Azure Functions 2019 invocation counts, one file per day in order; minute columns read by name.

    ``unit="app"`` sums an app's functions into one model (the memory unit of the paper);
    ``"function"`` keeps each function a model.
    """
    if unit not in ("app", "function"):
        raise ValueError(f"unit must be 'app' or 'function', not {unit!r}")
    if not paths:
        raise HistoryError("no Azure Functions files given")
    days: list[pd.DataFrame] = []
    for day, path in enumerate(paths):
        p = Path(path)
        frame = _read_csv(p)
        cols = _columns(frame)
        owner, app = _need(cols, "HashOwner", p), _need(cols, "HashApp", p)
        func = _need(cols, "HashFunction", p)
        minutes: dict[int, str] = {}
        for key, orig in cols.items():
            m = _MINUTE.match(key)
            if m:
                minutes[int(m.group(1))] = orig
        if not minutes:
            raise HistoryError(f"{p}: no minute columns (1..1440 or minute_1..)")
        order = sorted(minutes)
        if order[0] != 1 or order[-1] != len(order):
            raise HistoryError(f"{p}: minute columns are not 1..N (got {order[0]}..{order[-1]}, {len(order)} of them)")
        key = frame[owner].astype(str) + "/" + frame[app].astype(str)
        if unit == "function":
            key = key + "/" + frame[func].astype(str)
        values = frame[[minutes[m] for m in order]].apply(pd.to_numeric, errors="coerce").fillna(0.0).clip(lower=0.0)
        values.index = key.to_numpy()
        grouped = values.groupby(level=0).sum()
        grouped.columns = [day * len(order) + m - 1 for m in order]
        days.append(grouped)
    full = pd.concat(days, axis=1).fillna(0.0)
    full = full.reindex(columns=sorted(full.columns), fill_value=0.0).sort_index()
    counts = full.to_numpy(np.float64).T.copy()
    return FleetTrace(tuple(str(n) for n in full.index), counts, 60.0, ",".join(str(p) for p in paths), "azure_functions")


def read_request_log(path: str | Path, *, time_column: str, model_column: str, step_s: float = 60.0) -> FleetTrace:
    """One row per request: ``time_column`` (epoch seconds/ms or a datetime) and ``model_column``."""
    if step_s <= 0:
        raise ValueError("step_s must be positive")
    p = Path(path)
    frame = _read_csv(p)
    cols = _columns(frame)
    tcol, mcol = _need(cols, time_column, p), _need(cols, model_column, p)
    raw = frame[tcol]
    secs = pd.to_numeric(raw, errors="coerce").to_numpy(np.float64)
    if np.isfinite(secs).mean() < 0.5:
        parsed = pd.to_datetime(raw, errors="coerce", utc=True)
        secs = np.where(parsed.isna(), np.nan, parsed.astype("int64") / 1e9)
    elif np.nanmedian(secs) > 1e11:  # epoch milliseconds
        secs = secs / 1e3
    models = frame[mcol].astype(str).to_numpy()
    ok = np.isfinite(secs) & (frame[mcol].notna().to_numpy())
    if not ok.any():
        raise HistoryError(f"{p}: no usable rows in {time_column!r}/{model_column!r}")
    secs, models = secs[ok], models[ok]
    t0 = float(np.floor(secs.min() / step_s) * step_s)
    steps = ((secs - t0) // step_s).astype(np.int64)
    codes, names = pd.factorize(models, sort=True)
    counts = _dense(codes, steps, np.ones(steps.size), len(names), int(steps.max()) + 1)
    return FleetTrace(tuple(str(n) for n in names), counts, float(step_s), str(p), "request_log", start_epoch=t0)


def _read_csv(p: Path) -> pd.DataFrame:
    if not p.exists():
        raise HistoryError(f"{p}: no such file")
    try:
        frame = pd.read_csv(p, low_memory=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{p}: cannot read as CSV: {exc}") from exc
    if frame.empty:
        raise HistoryError(f"{p}: no rows")
    return frame


def is_fleet_trace(path: str | Path) -> bool:
    """Whether ``path``'s header is a fleet format (per-client rates or Azure Functions counts)."""
    try:
        with Path(path).open(encoding="utf-8", errors="replace") as fh:
            header = {h.strip().lower() for h in fh.readline().split(",")}
    except OSError:
        return False
    return {"hashapp", "hashfunction"} <= header or ("rate_req_per_s" in header and bool(header & set(_MODEL_COLUMNS)))


def load_fleet(paths: Sequence[str | Path], *, time_column: str | None = None, model_column: str | None = None,
               step_s: float = 60.0, unit: str = "app") -> FleetTrace:
    """Read a fleet trace, telling the shape from the header (or from the columns the user names)."""
    if not paths:
        raise HistoryError("no trace file given")
    if time_column or model_column:
        if not (time_column and model_column):
            raise ValueError("a request log needs both --time-column and --model-column")
        return read_request_log(paths[0], time_column=time_column, model_column=model_column, step_s=step_s)
    p = Path(paths[0])
    if not p.exists():
        raise HistoryError(f"{p}: no such file")
    with p.open(encoding="utf-8", errors="replace") as fh:
        header = {h.strip().lower() for h in fh.readline().split(",")}
    if {"hashapp", "hashfunction"} <= header:
        return read_azure_functions(paths, unit=unit)
    if "rate_req_per_s" in header and header & set(_MODEL_COLUMNS):
        return read_client_rates(p)
    raise HistoryError(f"{p}: not a fleet trace (per-client rates or Azure Functions); "
                       "for a request log name its --time-column and --model-column")
