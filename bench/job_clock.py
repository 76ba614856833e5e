"""What a process spends inside `mailpipe.pipeline.job.process_email`: CPU, wall time, page
faults and context switches, summed over its jobs. bench/throughput.py's `--job-clock` loads it
in the limit's processes and in the worker's children, to tell the CPU a child spends around a
job (Celery's share) from the CPU the job itself costs there.

    install()        wrap `job.process_email` in this process (the Celery task calls it through
                     the module, so the wrapper sees every job)
    write(folder)    this process's sums, as `<folder>/<pid>.json`
    collect(folder)  every process's sums, per job, and the files removed

Loaded into a worker with `-I bench.job_clock`: it installs itself, starts each child's sums at
zero and writes them when the child exits, into the folder named by `FOLDER_ENV`.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from mailpipe.pipeline import job

FOLDER_ENV = "MAILPIPE_BENCH_JOB_CLOCK_DIR"
_FIELDS = ("jobs", "cpu_s", "wall_s", "minor_faults", "voluntary_switches", "forced_switches")

_sums = dict.fromkeys(_FIELDS, 0.0)


def install() -> None:
    if getattr(job.process_email, "__wrapped__", None) is not None:
        return
    clocked = job.process_email

    @functools.wraps(clocked)
    def process_email(*args: Any, **kwargs: Any) -> Any:
        before = resource.getrusage(resource.RUSAGE_SELF)
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return clocked(*args, **kwargs)
        finally:
            after = resource.getrusage(resource.RUSAGE_SELF)
            _sums["jobs"] += 1
            _sums["cpu_s"] += time.process_time() - cpu
            _sums["wall_s"] += time.perf_counter() - wall
            _sums["minor_faults"] += after.ru_minflt - before.ru_minflt
            _sums["voluntary_switches"] += after.ru_nvcsw - before.ru_nvcsw
            _sums["forced_switches"] += after.ru_nivcsw - before.ru_nivcsw

    job.process_email = process_email


def reset() -> None:
    _sums.update(dict.fromkeys(_FIELDS, 0.0))


def write(folder: Path) -> None:
    if _sums["jobs"]:
        (folder / f"{os.getpid()}.json").write_text(json.dumps(_sums))


def collect(folder: Path) -> dict[str, float] | None:
    """Per job, over every process that wrote its sums: CPU and wall ms, faults, switches."""
    totals = dict.fromkeys(_FIELDS, 0.0)
    for path in folder.glob("*.json"):
        for name, value in json.loads(path.read_text()).items():
            totals[name] += value
        path.unlink()
    jobs = totals.pop("jobs")
    if not jobs:
        return None
    per_job = {name: value / jobs for name, value in totals.items()}
    per_job["cpu_ms"] = per_job.pop("cpu_s") * 1000
    per_job["wall_ms"] = per_job.pop("wall_s") * 1000
    return per_job


def _load_into_worker() -> None:
    from celery.signals import worker_process_init, worker_process_shutdown

    folder = Path(os.environ[FOLDER_ENV])
    install()
    worker_process_init.connect(lambda **_: reset(), weak=False)
    worker_process_shutdown.connect(lambda **_: write(folder), weak=False)


if FOLDER_ENV in os.environ:
    _load_into_worker()
