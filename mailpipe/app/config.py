"""Celery configuration for every mailpipe process: lowercase Celery keys, values from the one
settings object (`mailpipe.settings`), each with the reason it is set. `celeryconfig.py` at the
top of the repository re-exports it. Figures behind the choices: docs/benchmarks.md and
docs/decisions/; why each window has its value: docs/settings.md.

Only Celery's keys are public names here: Celery reads every public name of this module as a
setting (`celery report` lists them), so helpers are imported under private names.
"""

import ssl as _ssl
from urllib.parse import urlsplit as _urlsplit

from kombu import Queue as _Queue

from mailpipe.broker.queues import TaskName as _TaskName
from mailpipe.broker.queues import consumed_queues as _consumed_queues
from mailpipe.broker.queues import control_queue as _control_queue
from mailpipe.broker.queues import email_queue as _email_queue
from mailpipe.broker.queues import model_queue as _model_queue
from mailpipe.settings import get_settings as _get_settings

_settings = _get_settings()

broker_url = _settings.broker_url
# A rediss:// broker's certificate is verified, as the app's own Redis clients (redis-py's
# from_url) verify it; kombu alone would not check it. An ssl_cert_reqs in the URL's query still
# wins.
broker_use_ssl = (
    {"ssl_cert_reqs": _ssl.CERT_REQUIRED} if _urlsplit(broker_url).scheme == "rediss" else None
)
# Workers, beat, Flower and the CLI share this one value. It exceeds the hard time limit plus the
# longest retry backoff (checked at start-up), so Redis never redelivers a job that is still
# running or waiting out its countdown. It is the last line of defence: a dead worker's messages
# come back through the worker heartbeat long before (mailpipe.coordination.heartbeat).
# kombu scans for expired unacked messages every interval x throttle seconds (100 s by default).
# MAILPIPE_REDIS_PREFIX goes before every kombu key, so environments can share one Redis.
broker_transport_options = {
    "visibility_timeout": _settings.visibility_timeout,
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
    "global_keyprefix": _settings.redis_prefix,
    # The order a worker BRPOPs its queues in: live first, bulk MAILPIPE_BULK_SHARE of the jobs
    # while live has work and all of them while it has none (docs/lanes.md). kombu's own
    # strategies are round robin (bulk gets half while both lanes have work) or strict priority
    # (bulk starves behind a steady live stream).
    "queue_order_strategy": "mailpipe.broker.lanes:LiveFirst",
    # No job is sent with a priority, so every message is in its queue's own list: a worker's
    # BRPOP names that list alone, not kombu's default four per queue (each lane queue has its
    # shards, so a worker would name 140 lists on every BRPOP). The previous release publishes
    # to the same lists; readers of the broker still read every priority's list
    # (docs/decisions/priority-steps.md).
    "priority_steps": [0],
}
# A restarted Redis or a deploy that starts workers before Redis must not crash them.
broker_connection_retry_on_startup = True

# JSON only: a pickle payload would let whoever can write to Redis run code in the workers.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
event_serializer = "json"
# Outcomes live in the database; a result backend would be a second, unread copy.
task_ignore_result = True

# Ack after the job, not before: a worker that dies mid-job leaves the message to be redelivered.
task_acks_late = True
# ...and a child killed mid-job (OOM, segfault) requeues its message instead of dropping it.
task_reject_on_worker_lost = True
# How long the pool waits for a dead child's result before it requeues the job (Celery: 10 s).
# A job is idempotent and leased, so a short wait costs nothing when the result was in flight
# and saves seconds on every crash.
worker_lost_wait = 2.0
# Two messages reserved per child: when a child finishes, the next job is already in the main
# process and goes to it at once, instead of after a BRPOP round trip. A reserved job waits for a
# child of its worker (the first that frees up) even if another worker is idle, at most as long
# as the shorter running job. For jobs of minutes, set MAILPIPE_WORKER_PREFETCH_MULTIPLIER=1.
# Reserved jobs are also what a live job can wait behind when a backfill is running: the queue
# order picks the lane of each job taken from Redis, not of those the worker already holds
# (concurrency x this). The model role, 32 threads waiting on the model, sets 1: its BRPOP round
# trip is nothing beside a model call, and it would otherwise hold 32 bulk calls ahead of a live one.
worker_prefetch_multiplier = _settings.worker_prefetch_multiplier

# The soft limit raises inside the job so it can record the error; the hard limit kills the child.
task_soft_time_limit = _settings.task_soft_time_limit
task_time_limit = _settings.task_time_limit
# Recycling children bounds what a leak in a parser library can grow to; a child past the memory
# cap is replaced after its current job. billiard compares the child's *peak* RSS (getrusage)
# with the cap, so a single job's transient peak recycles the child too.
worker_max_tasks_per_child = _settings.worker_max_tasks_per_child
worker_max_memory_per_child = _settings.worker_max_memory_per_child_kb
# Jobs at a time per worker process (ECS task); fleet capacity is tasks x this.
worker_concurrency = _settings.worker_concurrency
# On SIGTERM (with REMAP_SIGTERM=SIGQUIT) running jobs get this long to finish before they are
# requeued; 90 s leaves 30 s of ECS's 120 s stopTimeout for the requeue and exit.
worker_soft_shutdown_timeout = _settings.soft_shutdown_timeout

# Task events feed Flower's live view of workers and failed jobs. On from the start rather than
# left for Flower to turn on (it does every 5 s): with Flower running they cost the same, and a
# worker's first jobs would be missing (docs/decisions/task-events.md).
worker_send_task_events = True
task_send_sent_event = True
# STARTED state makes running jobs visible in Flower, not just queued and finished ones.
task_track_started = True

# The task shells, and the signal handlers of worker and beat processes: only the processes that
# run Celery's loops import them, never a process that merely publishes (upstream code, the CLI).
include = ["mailpipe.app.tasks"]
imports = ["mailpipe.app.signals"]

task_default_queue = _email_queue(_settings)
# A worker started without -Q consumes every list (local use, the demo); deployed, the worker role
# takes the email queues of both lanes and the control queue, and the model role the model
# queues of both lanes (Procfile, deploy/ecs). Housekeeping never waits behind the email backlog,
# and the CPU stage never waits on the model. A job's lane picks its queue when it is sent
# (mailpipe.enqueue.send_job); the routes below name the live one. Each lane queue comes with its
# mailboxes' shard queues, which a worker consumes with every lane queue it is given
# (mailpipe.app.signals).
task_queues = (
    *(_Queue(name) for name in _consumed_queues(_settings)),
    _Queue(_control_queue(_settings)),
)
task_routes = {
    _TaskName.SWEEP.value: {"queue": _control_queue(_settings)},
    _TaskName.CLASSIFY_EMAIL.value: {"queue": _model_queue(_settings)},
}

# The sweeper turns the database back into work; beat fires it. Only the beat holding the Redis
# lock fires, so a second beat process is a standby, not a second schedule. The same beat reports
# the fleet's metrics itself, not through a task (mailpipe.app.scheduler).
beat_scheduler = "mailpipe.app.scheduler:LockedScheduler"
beat_schedule = {
    "sweep": {"task": _TaskName.SWEEP.value, "schedule": _settings.sweep_interval},
}
