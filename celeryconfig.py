"""Celery configuration for every mailpipe process: lowercase Celery keys, values from the one
settings object (`mailpipe.settings`), each with the reason it is set."""

from kombu import Queue

from mailpipe.queues import TaskName, control_queue, email_queue
from mailpipe.settings import get_settings

_settings = get_settings()

broker_url = _settings.broker_url
# Workers, beat, Flower and the CLI share this one value. It exceeds the hard time limit plus the
# longest retry backoff (checked at start-up), so Redis never redelivers a job that is still
# running or waiting out its retry countdown.
# kombu scans for expired unacked messages every interval x throttle seconds (100 s by
# default); a scan every 10 s brings a dead worker's jobs back within visibility_timeout + 10 s.
# MAILPIPE_REDIS_PREFIX goes before every kombu key, so environments can share one Redis.
broker_transport_options = {
    "visibility_timeout": _settings.visibility_timeout,
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
    "global_keyprefix": _settings.redis_prefix,
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
# How long the pool waits for a dead child's result before it requeues the job (default 10 s).
# A job is idempotent and leased, so a short wait costs nothing when the result was in flight
# and saves 8 s on every crash.
worker_lost_wait = 2.0
# Two messages reserved per child: when a child finishes, the next job is already in the main
# process and goes to it at once, instead of after a BRPOP round trip (measured: the gap between
# two jobs of a child 3.3 -> 2.6 ms, throughput +4 to 5 % paired at -c 2, docs/benchmarks.md). A
# reserved job waits for a child of its worker (fair scheduling: the first that frees up) even if
# another worker is idle, at most as long as the shorter running job, and a SIGKILLed worker's
# reserved jobs wait out the visibility timeout with its running ones. For jobs of minutes, set
# MAILPIPE_WORKER_PREFETCH_MULTIPLIER=1.
worker_prefetch_multiplier = _settings.worker_prefetch_multiplier

# The soft limit raises inside the job so it can record the error; the hard limit kills the child.
task_soft_time_limit = _settings.task_soft_time_limit
task_time_limit = _settings.task_time_limit
# Recycling children bounds what a leak in a parser library can grow to (measured: under 1 MB per
# 1,000 jobs, docs/benchmarks.md); a child past the memory cap is replaced after its current job.
# billiard compares the child's *peak* RSS (getrusage) with the cap, so a single job's transient
# peak recycles the child too; a recycle cost 0.2 to 3 s of that child's time under load.
worker_max_tasks_per_child = _settings.worker_max_tasks_per_child
worker_max_memory_per_child = _settings.worker_max_memory_per_child_kb
# Jobs at a time per worker process (ECS task); fleet capacity is tasks x this.
worker_concurrency = _settings.worker_concurrency
# On SIGTERM (with REMAP_SIGTERM=SIGQUIT) running jobs get this long to finish before they are
# requeued; 90 s leaves 30 s of ECS's 120 s stopTimeout for the requeue and exit.
worker_soft_shutdown_timeout = _settings.soft_shutdown_timeout

# Task events feed Flower's live view of workers and failed jobs.
worker_send_task_events = True
task_send_sent_event = True
# STARTED state makes running jobs visible in Flower, not just queued and finished ones.
task_track_started = True
# Celery's consumer, except that the main process publishes task events in batches every 0.2 s
# instead of nearly one round trip per event (mailpipe.consumer).
worker_consumer = "mailpipe.consumer:Consumer"

task_default_queue = email_queue(_settings)
# Workers consume both lists by default; housekeeping never waits behind the email backlog.
task_queues = (Queue(email_queue(_settings)), Queue(control_queue(_settings)))
task_routes = {TaskName.SWEEP.value: {"queue": control_queue(_settings)}}

# The sweeper turns the database back into work; beat fires it. Only the beat holding the Redis
# lock fires, so a second beat process is a standby, not a second schedule (mailpipe.beat).
beat_scheduler = "mailpipe.beat:LockedScheduler"
beat_schedule = {
    "sweep": {"task": TaskName.SWEEP.value, "schedule": _settings.sweep_interval},
}
