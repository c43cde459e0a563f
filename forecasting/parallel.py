"""Independent replays side by side: a backtest's policies and knob sweeps, one process per CPU.

Every replay of a backtest reads the same inputs (a workload, a fleet trace and its fleet) and
draws from its own seeded generators, so a replay gives the same figures in any process and
in any order. `run_all` sends the shared inputs once to each process (not once per replay)
and returns the results in the order of the items; with one job it runs them in this process.
Processes are spawned, not forked: a backtest may be started from a process with threads
(a test run, a worker), and a fork copies their locks.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_SHARED: Any = None  # a worker process's copy of the shared inputs (`_init`)


def cpus() -> int:
    """The CPUs this process may run on (the default of `--jobs`)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def check_jobs(jobs: int) -> int:
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    return jobs


def _init(shared: Any) -> None:
    global _SHARED
    _SHARED = shared


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_SHARED, item)


def run_all(fn: Callable[[Any, T], R], shared: Any, items: Sequence[T], jobs: int = 1,
            done: Callable[[T], None] | None = None) -> list[R]:
    """``fn(shared, item)`` for each item, the results in the order of ``items``, in up to ``jobs`` processes;
    ``done(item)`` as each finishes. ``fn`` is a module-level function (the processes import it by name). The
    first replay that fails raises here once the ones running have ended; the ones not yet started are cancelled."""
    check_jobs(jobs)
    if jobs == 1 or len(items) <= 1:
        out = []
        for item in items:
            out.append(fn(shared, item))
            if done is not None:
                done(item)
        return out
    with ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init, initargs=(shared,)) as pool:
        futures: dict[Future[R], int] = {pool.submit(_call, fn, item): k for k, item in enumerate(items)}
        results: dict[int, R] = {}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    results[futures[f]] = f.result()
                    if done is not None:
                        done(items[futures[f]])
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    return [results[k] for k in range(len(items))]
