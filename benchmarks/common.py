"""Shared pieces of the benchmark scripts: argument handling, percentiles, the report.

Every script prints a readable table and, with `--json`, one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    return p


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, an observed value (numpy's inverted CDF); nan when empty."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q, method="inverted_cdf"))


def report(title: str, rows: list[tuple[str, Any, str]], result: dict[str, Any], as_json: bool) -> None:
    """Print `rows` (key, value, note) as a table, then the JSON object when asked."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("note")
    for key, value, note in rows:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, shown, note)
    Console(file=sys.stdout, width=120).print(table)
    if as_json:
        print(json.dumps(result), flush=True)


def prewarm_process(args: list[str], env: dict[str, str], log: Path | None = None,
                    cpus: str | None = None) -> subprocess.Popen[bytes]:
    """Start `prewarm ARGS` from this checkout's environment.

    With `log`, stdout and stderr go to that file: a process that logs a lot under load
    (a warning per failed request) must not block on a pipe nobody reads. With `cpus` (a
    CPU list, `taskset -c`), it and its children run on those CPUs only.
    """
    cmd = pinned([str(Path(sys.executable).with_name("prewarm")), *args], cpus)
    if log is None:
        return subprocess.Popen(
            cmd, env={**os.environ, **env}, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, env={**os.environ, **env}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """`cmd` run on the CPU list `cpus` only (`taskset -c`, util-linux); unchanged when None."""
    return cmd if cpus is None else ["taskset", "-c", cpus, *cmd]


def cpu_list(text: str) -> set[int]:
    """The CPUs of a list such as `0`, `0,2` or `0-3`; a clear error for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0, 0,2 or 0-3)")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return cpus


def wait_http(url: str, timeout: float = 30.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s")
