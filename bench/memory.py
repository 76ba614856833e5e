"""Memory of a worker's children over 10,000 jobs, without recycling.

    .venv/bin/python -m bench.memory [--jobs 10000] [--concurrency 2] [--workload small|mixed]
                                     [--json FILE] [--plot docs/img/throughput-memory.png]

One `celery -A mailpipe worker -P prefork -c 2` with MAILPIPE_WORKER_MAX_TASKS_PER_CHILD=100000
(so no child is recycled during the run; checked: the children's pids must not change) processes
`--jobs` emails on a fresh PostgreSQL database, local blobs and the local Redis
under a key prefix of this run, model calls on with the `rules` classifier.

Every second: each child's RSS and USS (psutil), the main process's RSS, the runs closed so far
(one query) and each child's jobs done so far (its "succeeded" lines in the worker log; pool
children are numbered in the order they were forked, which is their pid order). Reported: RSS and
USS of each child when the worker had done 1k, 5k and 10k jobs, and the slope of each child's RSS
against its own job count (least squares, after its first 500 jobs, which load the libraries'
lazily imported parts and fill the caches).

Workloads: `small` (the default; bench.workload.small_email: a short plain-text email, one in
three with a small text or CSV attachment), or `mixed`, bench/throughput.py's
(bench.workload.mixed_workload: the shared corpus, generated emails with its PDF and DOCX files,
~10 % copies), to see whether the document libraries grow a child faster. With `mixed`,
`worker_max_memory_per_child` may still replace a child whose peak RSS crossed it: the report
says so ("recycled during the run").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench import harness
from tests.support.services import delete_prefix

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_mem_{RUN}")
PREFIX = f"benchmem{RUN}:"
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-memory-"))
ENV = harness.base_env(
    database_url=DATABASE.url,
    prefix=PREFIX,
    blob_url=f"file://{WORK / 'blobs'}",
    MAILPIPE_WORKER_MAX_TASKS_PER_CHILD="100000",
)
os.environ.update(ENV)

WARM_UP_JOBS = 500
_DONE_LINE = re.compile(
    rb"ForkPoolWorker-(\d+)\] Task mailpipe\.process_email\[[^\]]+\] succeeded in ([0-9.e-]+)s"
)


class LogCounter:
    """Jobs done per pool child index, read incrementally from the worker's log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.counts: dict[int, int] = {}
        self.first_durations: dict[int, list[float]] = {}

    def update(self) -> dict[int, int]:
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for found in _DONE_LINE.finditer(data[:end]):
            index = int(found.group(1))
            self.counts[index] = self.counts.get(index, 0) + 1
            durations = self.first_durations.setdefault(index, [])
            if len(durations) < 2000:
                durations.append(float(found.group(2)))
        return dict(self.counts)


def sample_loop(  # type: ignore[no-untyped-def]
    worker, db, log: LogCounter, stop: threading.Event, samples: list[dict]
) -> None:
    import psutil

    main = psutil.Process(worker.pid)
    started = time.monotonic()
    while not stop.is_set():
        children = sorted(worker.child_pids())
        row: dict[str, object] = {
            "t": time.monotonic() - started,
            "pids": children,
            "main_rss": main.memory_info().rss,
        }
        for pid in children:
            try:
                info = psutil.Process(pid).memory_full_info()
                row[f"rss:{pid}"] = info.rss
                row[f"uss:{pid}"] = info.uss
            except psutil.NoSuchProcess:
                pass
        (row["closed"],) = db.execute(
            "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
        ).fetchone()
        row["per_child"] = log.update()
        samples.append(row)
        stop.wait(1.0)


def slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--workload", choices=("small", "mixed"), default="small")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    import psycopg

    from bench.workload import mixed_workload, small_email
    from mailpipe.cli.demo import fleet
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.resources import get_resources
    from mailpipe.storage import flags
    from mailpipe.storage.migrate import upgrade

    print(f"machine: {harness.machine()}")
    url = DATABASE.create().url
    upgrade(url)
    res = get_resources()
    rng = random.Random(args.seed)
    if args.workload == "mixed":
        emails, kinds = mixed_workload(args.jobs, seed=args.seed)
        print(f"workload: {len(emails)} emails {kinds}, {sum(map(len, emails)) / 1e6:.1f} MB raw")
    else:
        emails = [
            small_email(rng, n, attachment=rng.random() < 1 / 3, tag=f"mem{args.seed}")
            for n in range(args.jobs)
        ]
    samples: list[dict] = []
    worker = fleet.worker(
        dict(os.environ), WORK / "logs", concurrency=args.concurrency, name=f"mem{RUN}"
    )
    db = psycopg.connect(url, autocommit=True)
    stop = threading.Event()
    try:
        with res.db.transaction() as session:
            flags.set_model_calls(session, False)  # no start-up sweep (see bench/throughput.py)
        worker.start()
        worker.wait_ready(timeout=120)
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        ids: list[int] = []
        for start in range(0, len(emails), 500):
            ids += store_emails(res, emails[start : start + 500])
        log = LogCounter(worker.log_path)
        sampler = threading.Thread(
            target=sample_loop, args=(worker, db, log, stop, samples), daemon=True
        )
        sampler.start()
        time.sleep(2.0)  # a couple of idle samples first
        started = time.monotonic()
        enqueue_emails(ids, res)
        while True:
            (closed,) = db.execute(
                "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
            ).fetchone()
            if closed >= len(ids):
                break
            if not worker.alive():
                raise RuntimeError(worker.log_tail())
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        time.sleep(2.0)
        stop.set()
        sampler.join(5)
        outcomes = dict(
            db.execute("SELECT status::text, count(*) FROM pipeline_run GROUP BY 1").fetchall()
        )
    finally:
        stop.set()
        worker.stop()
        db.close()
        res.close()
        DATABASE.drop()
        delete_prefix(harness.REDIS_URL, PREFIX)
        # The blobs are big; the worker logs stay for a look after a failure.
        shutil.rmtree(WORK / "blobs", ignore_errors=True)
        print(f"worker logs: {WORK / 'logs'}")

    pid_sets = {tuple(s["pids"]) for s in samples if s["pids"]}
    recycled = len(pid_sets) > 1
    pids = (
        sorted(pid_sets.pop()) if not recycled else sorted({p for s in samples for p in s["pids"]})
    )
    index_of = {pid: i + 1 for i, pid in enumerate(pids)}  # ForkPoolWorker-N in fork (pid) order
    print(
        f"{args.jobs} jobs in {elapsed:.1f} s ({args.jobs / elapsed:.1f}/s), outcomes {outcomes}, "
        f"children {pids}, recycled during the run: {recycled}"
    )

    def at(total: int) -> dict | None:
        return next((s for s in samples if s["closed"] >= total), None)

    marks = [m for m in (1000, 5000, 10000) if m <= args.jobs]
    report: dict[str, object] = {
        "jobs": args.jobs,
        "workload": args.workload,
        "seconds": elapsed,
        "recycled": recycled,
        "outcomes": outcomes,
        "children": {},
    }
    print(
        "\n| child | jobs done by it at 1k/5k/10k | RSS MB at 1k / 5k / 10k "
        "| USS MB at 1k / 5k / 10k "
        "| RSS slope KB per 1,000 of its jobs | first-job s / median job s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for pid in pids:
        index = index_of[pid]
        rows = [at(m) for m in marks]
        done = [r["per_child"].get(index, 0) if r else None for r in rows]
        rss = [r.get(f"rss:{pid}", 0) / 2**20 if r else None for r in rows]
        uss = [r.get(f"uss:{pid}", 0) / 2**20 if r else None for r in rows]
        points = [
            (s["per_child"].get(index, 0), s[f"rss:{pid}"] / 1024)
            for s in samples
            if f"rss:{pid}" in s and s["per_child"].get(index, 0) >= WARM_UP_JOBS
        ]
        kb_per_1000 = slope(points) * 1000
        durations = log.first_durations.get(index, [])
        first = durations[0] if durations else float("nan")
        typical = sorted(durations)[len(durations) // 2] if durations else float("nan")
        report["children"][pid] = {
            "index": index,
            "done": done,
            "rss_mb": rss,
            "uss_mb": uss,
            "rss_slope_kb_per_1000_jobs": kb_per_1000,
            "first_job_s": first,
            "median_job_s": typical,
        }
        print(
            f"| ForkPoolWorker-{index} (pid {pid}) | {' / '.join(str(d) for d in done)} | "
            f"{_megabytes(rss)} | "
            f"{_megabytes(uss)} | {kb_per_1000:.0f} | {first:.3f} / {typical:.4f} |"
        )
    main_rss = [s["main_rss"] / 2**20 for s in samples]
    print(f"\nmain process RSS: {main_rss[0]:.1f} MB at start, {main_rss[-1]:.1f} MB at the end")
    report["main_rss_mb"] = {"start": main_rss[0], "end": main_rss[-1]}
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": harness.machine(), **report, "samples": samples}, indent=1, default=str
            )
        )
    if args.plot:
        plot(samples, pids, index_of, args.plot, args.workload)
        print(f"plot: {args.plot}")
    return 0


def _megabytes(values: list[float | None]) -> str:
    return " / ".join(f"{x:.1f}" if x is not None else "-" for x in values)


def plot(
    samples: list[dict], pids: list[int], index_of: dict[int, int], path: Path, workload: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for pid in pids:
        index = index_of[pid]
        xs = [s["per_child"].get(index, 0) for s in samples if f"rss:{pid}" in s]
        ax.plot(
            xs,
            [s[f"rss:{pid}"] / 2**20 for s in samples if f"rss:{pid}" in s],
            label=f"ForkPoolWorker-{index} RSS",
        )
        ax.plot(
            xs,
            [s[f"uss:{pid}"] / 2**20 for s in samples if f"uss:{pid}" in s],
            "--",
            label=f"ForkPoolWorker-{index} USS",
        )
    ax.set_xlabel("jobs done by the child")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"Worker children's memory, -c 2 ({workload} workload)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
