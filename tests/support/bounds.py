"""A bound on the work a piece of code may do: its CPU time and its peak of allocated memory.

CPU time (`time.process_time`), not wall-clock time: it counts this process's own work, so a busy
machine does not move it. The bounds are far above what the bounded code needs (milliseconds, a
few MiB) and far below what the unbounded code took (seconds to minutes, hundreds of MiB).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def bounded(cpu_seconds: float = 2.0, mib: float = 50.0) -> Iterator[None]:
    tracemalloc.start()
    started = time.process_time()
    try:
        yield
    finally:
        used = time.process_time() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert used < cpu_seconds, f"used {used:.2f} s of CPU"
    assert peak < mib * 2**20, f"peak {peak / 2**20:.1f} MiB"
