"""What the benchmarks measure with: a process's CPU time and nearest-rank percentiles (shared by ``bench``
and the page-load bench it runs)."""

from __future__ import annotations

import math
import os


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with 32 samples p95 is a real observation)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
