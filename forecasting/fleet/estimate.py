"""Each model's arrival outlook for the next step, learned online from its own history.

For a sparse model the useful forecast is not a rate but "will a request come in the next
step, given it has been idle for tau steps?": the hazard of its idle-time distribution, the
quantity behind the hybrid-histogram keep-alive of "Serverless in the Wild" (Shahrad et
al., ATC'20). Here it is estimated for every model at once (arrays over models, one update
per step, so 1,000 models cost microseconds):

- an idle-gap histogram per model (a bin per step up to 10, then geometric bins to weeks),
  shrunk toward the histogram pooled over all models (one shared model for
  the sparse series: a model seen twice borrows the fleet's shape);
- for a model that is active now, the chance its run continues (active -> active);
- a time-of-day profile (share of days on which each slot of the day was active) that
  catches timers and daily jobs whose gaps are too long for the histogram's bins;
- the number of requests that arrive at the start of a burst (what a cold start hits).

The outlook is ``max(hazard, time-of-day)`` per model: either signal alone is enough to
keep a model warm; the planner weighs it by the requests a cold start would hit, the
model's priority and its GPU footprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

def gap_edges(exact: int = 10, growth: float = 1.2, top: int = 40_000) -> np.ndarray:
    """Idle-gap bin edges (steps): one per step up to ``exact``, then growing by ``growth`` up to ``top``.

    Exact bins keep a timer's period; geometric ones smooth the sparse counts of long gaps.
    """
    start = max(1, exact)
    k = int(np.ceil(np.log(top / start) / np.log(growth))) + 1
    edges = np.concatenate([np.arange(1, start + 1), np.round(start * growth ** np.arange(1, k + 1))])
    edges = np.unique(edges.astype(np.int64))
    return edges[edges <= top]


#: Pseudo-gaps of the heavy-tailed prior every model's idle-time survival carries.
TAIL_WEIGHT = 0.1
#: Look-ahead horizons (steps) over which keeping a model warm is valued.
LOOKAHEAD = np.unique(np.round(1.5 ** np.arange(0, 22)).astype(np.int64)).astype(np.float64)


@dataclass
class Outlook:
    """Per model: chance of a request in the next step, and requests a cold start would hit."""

    p_next: np.ndarray
    rate: np.ndarray
    burst_requests: np.ndarray
    idle_steps: np.ndarray
    active_now: np.ndarray


class ArrivalEstimator:
    """Online per-model arrival statistics over a fleet (arrays over models, updated per step).

    ``slot_s`` is the time-of-day resolution; ``prior_weight`` the pseudo-count of the pooled
    fleet histogram mixed into each model's own.
    """

    def __init__(self, n_models: int, step_s: float, *, slot_s: float, day_s: float,
                 prior_weight: float = 2.0, exact_bins: int = 10, bin_growth: float = 1.2) -> None:
        self.n = n_models
        self.step_s = float(step_s)
        self.prior_weight = float(prior_weight)
        self.edges = gap_edges(exact_bins, bin_growth)
        self.width = np.diff(np.append(self.edges, self.edges[-1] * 2)).astype(np.float64)
        nb = self.edges.size
        self.tail = np.zeros((n_models, nb), dtype=np.float64)  # gaps of length >= edge[b]
        self.hist = np.zeros((n_models, nb), dtype=np.float64)
        self.idle = np.full(n_models, -1, dtype=np.int64)  # -1: never active yet
        self.active_steps = np.zeros(n_models)
        self.continued = np.zeros(n_models)
        self.burst_ewma = np.zeros(n_models)
        self.bursts = np.zeros(n_models)
        self.slot_steps = max(1, int(round(max(slot_s, step_s) / step_s)))
        self.n_slots = max(1, int(round(day_s / (self.slot_steps * step_s))))
        self.slot_active = np.zeros((n_models, self.n_slots))
        self.slot_seen = np.zeros(self.n_slots)
        self._slot_hit = np.zeros(n_models, dtype=bool)
        self.steps_seen = 0
        self._rows = np.arange(n_models)

    # --- learning ---------------------------------------------------------------------------
    def observe(self, counts: np.ndarray) -> None:
        """Fold in one step of requests per model (the step just finished)."""
        active = counts > 0
        was_active = self.idle == 0
        ended = active & (self.idle > 0)
        if ended.any():
            gaps = self.idle[ended]
            b = np.searchsorted(self.edges, gaps, side="right") - 1
            rows = self._rows[ended]
            self.hist[rows, b] += 1.0
            self.tail[rows] += (np.arange(self.edges.size)[None, :] <= b[:, None])
        self.continued += active & was_active
        self.active_steps += was_active
        starts = active & ~was_active
        if starts.any():
            alpha = np.maximum(0.1, 1.0 / (self.bursts[starts] + 1.0))
            self.burst_ewma[starts] += alpha * (counts[starts] - self.burst_ewma[starts])
            self.bursts[starts] += 1
        self.idle = np.where(active, 0, np.where(self.idle >= 0, self.idle + 1, -1))
        slot = (self.steps_seen // self.slot_steps) % self.n_slots
        self._slot_hit |= active
        if (self.steps_seen + 1) % self.slot_steps == 0:
            self.slot_active[:, slot] += self._slot_hit
            self.slot_seen[slot] += 1
            self._slot_hit[:] = False
        self.steps_seen += 1

    # --- forecasting ------------------------------------------------------------------------
    def _survival(self, x: np.ndarray) -> np.ndarray:
        """Gap counts >= x (own, plus the pooled fleet shape as ``prior_weight`` gaps), per model; x: [m, k]."""
        nb = self.edges.size
        xs = np.maximum(x, 1)
        b = np.clip(np.searchsorted(self.edges, xs, side="right") - 1, 0, nb - 1)
        frac = np.clip((self.edges[b] + self.width[b] - xs) / self.width[b], 0.0, 1.0)
        nxt = np.minimum(b + 1, nb - 1)
        rows = self._rows[:, None]
        own = np.where(b + 1 < nb, self.tail[rows, nxt], 0.0) + self.hist[rows, b] * frac
        total = self._pool_hist.sum()
        if total > 0:
            ph = self._pool_hist / total
            pt = self._pool_tail / total
            pool = np.where(b + 1 < nb, pt[nxt], 0.0) + ph[b] * frac
        else:
            pool = np.zeros_like(own)
        # a heavy tail (Pareto, S ~ 1/x) as a tenth of a gap: past every gap seen, a model's
        # chance of a request fades as 1/idle instead of the conditional becoming 0/0
        return own + self.prior_weight * pool + TAIL_WEIGHT / np.maximum(x, 1.0)

    def outlook(self) -> Outlook:
        """Per model: arrivals expected per warm step (best look-ahead), and requests a cold start hits.

        For an idle model the look-ahead ``H`` that maximises P(request within H) / E[warm steps
        until the request or H] is taken: it keeps a model warm across a dip of its hazard when
        a likely arrival follows (a gap of ten minutes is bridged from its first idle minute).
        """
        active_now = self.idle == 0
        a = self.prior_weight
        self._pool_hist = self.hist.sum(axis=0)
        self._pool_tail = self.tail.sum(axis=0)
        pool_cont = (self.continued.sum() + 1.0) / (self.active_steps.sum() + 2.0)
        p_run = (self.continued + a * pool_cont) / (self.active_steps + a)
        tau = np.maximum(self.idle, 1).astype(np.float64)
        grid = tau[:, None] + LOOKAHEAD[None, :]
        s = self._survival(np.concatenate([tau[:, None], grid], axis=1))
        s0 = np.maximum(s[:, :1], 1e-12)
        cond = np.clip(s / s0, 0.0, 1.0)  # P(G >= tau + h | G >= tau), h = 0, LOOKAHEAD...
        p_h = 1.0 - cond[:, 1:]
        steps = np.concatenate([[0.0], LOOKAHEAD])
        warm = np.cumsum(0.5 * (cond[:, 1:] + cond[:, :-1]) * np.diff(steps)[None, :], axis=1)
        rate_gap = np.max(p_h / (warm + 1.0), axis=1)
        p_next = np.where(active_now, p_run, p_h[:, 0])
        rate = np.where(active_now, np.maximum(p_run, rate_gap), rate_gap)
        never = self.idle < 0
        slot = (self.steps_seen // self.slot_steps) % self.n_slots
        if self.slot_seen[slot] >= 2:
            base = self.slot_active.sum(axis=1) / max(1.0, self.slot_seen.sum())
            best = np.zeros(self.n)
            for j in range(3):  # this slot and the next two: warm from now until then
                sl = (slot + j) % self.n_slots
                q = (self.slot_active[:, sl] + base) / (self.slot_seen[sl] + 1.0)
                best = np.maximum(best, q / ((j + 1) * self.slot_steps))
            rate = np.maximum(rate, best)
            p_next = np.maximum(p_next, best)
        rate = np.where(never, 0.0, rate)
        p_next = np.where(never, 0.0, p_next)
        burst = np.where(self.bursts > 0, self.burst_ewma, 1.0)
        return Outlook(p_next=p_next, rate=rate, burst_requests=burst, idle_steps=self.idle.copy(),
                       active_now=active_now)
