"""A per-client rate file with every client's rate changes moved off the window grid.

`../shared/tools/offgrid.py` does this for one rate series (ServeGen's `window_start_s,rate_req_per_s`):
each boundary between two windows moves by a uniform offset within +-40% of a window, rounded to
60 s; same rates, same order, same daily shape. This applies the same rule to every client of a
per-client file (`client,window_start_s,rate_req_per_s[,cv]`, only windows with traffic listed),
each client's offsets drawn from its own stream of the seed, so the clients' steps do not move
together. The result is written per 60 s, rows with traffic only; the fleet backtest reads it as
it reads the original. Traces stay where they are: write the variant outside the repository.

Usage: python benchmarks/offgrid_clients.py IN.csv OUT.csv [SEED]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from forecasting.fleet.traces import FleetTrace, read_client_rates

GRID_S = 60


def offgrid_clients(trace: FleetTrace, seed: int) -> Iterator[tuple[str, int, float]]:
    """(client, start s, rate) per 60 s for a per-client rate trace (`read_client_rates`), every client's window
    boundaries moved by its own draws of ``seed`` (uniform +-40% of a window, rounded to 60 s)."""
    window, n = int(trace.step_s), trace.n_steps
    for k, client in enumerate(trace.names):  # in name order
        rng = random.Random(seed * 100_003 + k)  # the client's own stream
        bounds = [0] + [int(round((i * window + window * rng.uniform(-0.4, 0.4)) / GRID_S)) * GRID_S
                        for i in range(1, n)] + [n * window]
        for i in np.flatnonzero(trace.counts[:, k] > 0):
            rate = float(trace.counts[i, k]) / window
            for s in range(bounds[i], bounds[i + 1], GRID_S):
                yield client, s, rate


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    seed = int(argv[2]) if len(argv) == 3 else 1
    rows = 0
    with dst.open("w", newline="") as fh:
        fh.write("client,window_start_s,rate_req_per_s\n")
        for client, start, rate in offgrid_clients(read_client_rates(src), seed):
            fh.write(f"{client},{start},{rate:.6f}\n")
            rows += 1
    print(f"{dst}: {rows} rows per {GRID_S} s, every client's window boundaries moved off the grid (seed {seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
