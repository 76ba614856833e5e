"""Candidate fixes, tried in benchmark processes only (never committed to mailpipe).

`apply(names, celery_conf)` monkeypatches this process (and the processes it forks later); names:

- `noevents`: no Celery task events (worker_send_task_events, task_send_sent_event and
  task_track_started off): what a fleet without Flower's live view would run;
- `prefetchN`: worker_prefetch_multiplier = N. With 2 the worker holds the next message ready
  when a child frees up instead of fetching it then; that is the default since the fourth round,
  and `prefetch1` (one message per child) is the before of it;
- `nopreping`: engines without pool_pre_ping (no `SELECT 1` round trip at every checkout);
- `flagcache`: the model-calls switch read at most once every 5 s per process instead of once per
  job;
- `mainnice`: the worker's main process at a higher CPU priority than its pool children (nice -5
  for the main process, children set back to 0 in worker_process_init), so its short bursts
  (taking a result, acking, fetching and handing over the next message, publishing events) do not
  wait behind the busy children for a time slice. Without privileges the same relative priority
  is `os.nice(5)` in the children, which is what mailpipe could ship;
- `stockconsumer`: Celery's own worker consumer, which publishes task events at the next turn
  of the event loop (nearly one PUBLISH per event), instead of mailpipe's batches
  (`mailpipe.consumer`): the before of that fix;
- `stockredis`: kombu's own Redis transport, which builds a redis-py client per command, instead of
  the one mailpipe registers (`mailpipe.broker`): the before of that fix, side by side;
- `steptime`: measurement only, no fix: the CPU time spent inside
  `mailpipe.pipeline.job.process_email` (the step the limit runs), summed per process into
  $MAILPIPE_BENCH_STEPTIME_DIR/<pid> ("calls cpu_seconds rss_mb max_rss_mb"), to tell the
  pipeline's own cost in a worker child from the task machinery around it;
- `policyheaders`: every header read through the default policy's parser, however long, as
  before `mailpipe.pipeline.parse.LONG_HEADER_CHARS`: the before of that fix (a corpus email's
  200 KB Subject peaked at 350 MB there, past `worker_max_memory_per_child`, so the child that
  read it was recycled);
- `publishduring`: not applied in any process: bench/throughput.py publishes this variant's jobs
  while its worker takes them, the clock starting at the first publish (its method before the
  paused consumer), so that both methods are measured side by side in one run;
- `deferack`: every ack sent one more turn of the worker's event loop later. Celery already
  defers an ack to the next turn (`Consumer.call_soon_ack`); at that turn the ack frees a
  prefetch slot, the consumer fetches again, and the loop handles that delivery (its BRPOP
  reply and its bookkeeping transaction) before it writes the next job into the idle child's
  pipe. One more turn lets the write go first;
- `wakerenewer`: the lease renewal thread woken at every lease taken, as before it looked on a
  timer of its own (`mailpipe.leases._Renewer`): the before of that fix;

`fewertx` (the blob key read in the claim transaction; documents, classification, labels and the
run's close in one transaction with a local classifier) was tried here first and is now how
`mailpipe.pipeline.job` works.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

FLAG_TTL_S = 5.0


def apply(names: str, celery_conf: dict[str, Any] | None = None) -> list[str]:
    applied = []
    for name in filter(None, (n.strip() for n in names.replace("+", ",").split(","))):
        if name == "noevents":
            if celery_conf is not None:
                celery_conf.update(
                    worker_send_task_events=False,
                    task_send_sent_event=False,
                    task_track_started=False,
                )
        elif name.startswith("prefetch"):
            if celery_conf is not None:
                celery_conf["worker_prefetch_multiplier"] = int(name.removeprefix("prefetch"))
        elif name == "stockconsumer":
            if celery_conf is not None:
                celery_conf["worker_consumer"] = "celery.worker.consumer:Consumer"
        elif name == "stockredis":
            from kombu.transport import TRANSPORT_ALIASES

            TRANSPORT_ALIASES.update(
                redis="kombu.transport.redis:Transport", rediss="kombu.transport.redis:Transport"
            )
        elif name == "publishduring":
            pass
        elif name == "policyheaders":
            from mailpipe.pipeline import parse

            parse.LONG_HEADER_CHARS = 1 << 62
        elif name in PATCHES:
            PATCHES[name]()
        else:
            raise ValueError(f"unknown experiment {name!r}")
        applied.append(name)
    return applied


def _main_nice() -> None:
    import os

    from celery.signals import worker_process_init

    os.nice(-5)

    @worker_process_init.connect(weak=False)
    def _children_back_to_normal(**_: object) -> None:
        os.nice(5)


def _defer_ack() -> None:
    from celery.worker.request import Request
    from kombu.asynchronous import get_event_loop

    acknowledge = Request.acknowledge

    def deferred(self: Request) -> None:
        hub = get_event_loop()
        if self.acknowledged or hub is None:
            acknowledge(self)
            return
        self.acknowledged = True
        # _on_ack is a promise: the hub would call it without these arguments.
        hub.call_soon(functools.partial(self._on_ack, logger, self._connection_errors))

    logger = logging.getLogger(__name__)
    Request.acknowledge = deferred  # type: ignore[method-assign]


def _wake_renewer() -> None:
    from mailpipe import leases

    original = leases._Renewer.hold

    def hold(self, lease):  # type: ignore[no-untyped-def]
        original(self, lease)
        with self._changed:
            self._changed.notify()

    leases._Renewer.hold = hold  # type: ignore[method-assign]


def _step_time() -> None:
    import os

    from mailpipe.pipeline import job

    original = job.process_email
    folder = os.environ.get("MAILPIPE_BENCH_STEPTIME_DIR", "/tmp")
    totals = {"pid": 0, "calls": 0, "cpu": 0.0, "rss_max": 0.0}
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20

    def process_email(res, email_id):  # type: ignore[no-untyped-def]
        if totals["pid"] != os.getpid():  # a forked child starts its own count
            totals.update(pid=os.getpid(), calls=0, cpu=0.0, rss_max=0.0)
        started = time.process_time()
        try:
            return original(res, email_id)
        finally:
            totals["calls"] += 1
            totals["cpu"] += time.process_time() - started
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * page_mb
            totals["rss_max"] = max(totals["rss_max"], rss)
            with open(os.path.join(folder, str(os.getpid())), "w") as out:
                out.write(
                    f"{totals['calls']} {totals['cpu']:.6f} {rss:.0f} {totals['rss_max']:.0f}\n"
                )

    job.process_email = process_email  # type: ignore[assignment]


def _no_pre_ping() -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from mailpipe import db

    original = db.make_engine

    def make_engine(url: str):  # type: ignore[no-untyped-def]
        url = db.normalise_url(url)
        if make_url(url).get_backend_name() == "sqlite":
            return original(url)
        return create_engine(url, pool_pre_ping=False, pool_size=2, max_overflow=2)

    db.make_engine = make_engine  # type: ignore[assignment]


def _flag_cache() -> None:
    from mailpipe import flags

    original = flags.model_calls_enabled
    cache: dict[str, tuple[float, bool]] = {}

    def model_calls_enabled(session):  # type: ignore[no-untyped-def]
        now = time.monotonic()
        hit = cache.get("v")
        if hit is None or now - hit[0] > FLAG_TTL_S:
            hit = (now, original(session))
            cache["v"] = hit
        return hit[1]

    flags.model_calls_enabled = model_calls_enabled  # type: ignore[assignment]


# The experiments that patch this process and need nothing from the caller.
PATCHES = {
    "mainnice": _main_nice,
    "nopreping": _no_pre_ping,
    "flagcache": _flag_cache,
    "wakerenewer": _wake_renewer,
    "deferack": _defer_ack,
    "steptime": _step_time,
}
