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

import csv
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterator

GRID_S = 60


def _window(starts: set[int]) -> int:
    ordered = sorted(starts)
    gaps = [b - a for a, b in zip(ordered, ordered[1:]) if b > a]
    if not gaps:
        raise ValueError("a per-client file needs at least two distinct window starts to read its window from")
    return min(gaps)


def offgrid_clients(rates: dict[str, dict[int, float]], seed: int) -> Iterator[tuple[str, int, float]]:
    """(client, start s, rate) per 60 s for ``rates[client][window start s]``, every client's window
    boundaries moved by its own draws of ``seed`` (uniform +-40% of a window, rounded to 60 s)."""
    window = _window({s for per in rates.values() for s in per})
    n = max(s for per in rates.values() for s in per) // window + 1
    for k, client in enumerate(sorted(rates)):
        rng = random.Random(seed * 100_003 + k)  # the client's own stream (k: its place in name order)
        bounds = [0] + [int(round((i * window + window * rng.uniform(-0.4, 0.4)) / GRID_S)) * GRID_S
                        for i in range(1, n)] + [n * window]
        for i in range(n):
            rate = rates[client].get(i * window, 0.0)
            for s in range(bounds[i], bounds[i + 1], GRID_S):
                if rate > 0:
                    yield client, s, rate


def read_rates(path: Path) -> dict[str, dict[int, float]]:
    rates: dict[str, dict[int, float]] = defaultdict(dict)
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                rates[row["client"]][int(float(row["window_start_s"]))] = float(row["rate_req_per_s"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: a row without client, window_start_s and rate_req_per_s: {row}") from e
    return rates


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    seed = int(argv[2]) if len(argv) == 3 else 1
    rows = 0
    with dst.open("w", newline="") as fh:
        fh.write("client,window_start_s,rate_req_per_s\n")
        for client, start, rate in offgrid_clients(read_rates(src), seed):
            fh.write(f"{client},{start},{rate:.6f}\n")
            rows += 1
    print(f"{dst}: {rows} rows per {GRID_S} s, every client's window boundaries moved off the grid (seed {seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
