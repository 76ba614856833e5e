"""Queue and task names, used alike by code, the Procfile and the deploy files."""

from __future__ import annotations

import enum

from mailpipe.settings import Settings


class Stage(enum.StrEnum):
    """The two stages of an email's job, each a task on a queue of its own."""

    CPU = "cpu"  # parse, origin, documents (and a local classifier's labels)
    MODEL = "model"  # the model call, the classification and the labels


class Lane(enum.StrEnum):
    """Each stage has a queue per lane. Workers take live jobs first; bulk (backfills, mass
    retries) gets a share of their capacity while live has work, and all of it when live has
    none (docs/lanes.md)."""

    LIVE = "live"  # fresh mail: the stage's own queue
    BULK = "bulk"  # the stage's queue with `.bulk` after it


class TaskName(enum.StrEnum):
    PROCESS_EMAIL = "mailpipe.process_email"  # the CPU stage: parse, origin, documents
    CLASSIFY_EMAIL = "mailpipe.classify_email"  # the model stage: the model call and labels
    SWEEP = "mailpipe.sweep"


def email_queue(settings: Settings) -> str:
    """One job per email; its depth and age are the fleet's backlog (MAILPIPE_QUEUE)."""
    return settings.queue


def control_queue(settings: Settings) -> str:
    """Sweeps and other housekeeping, on their own list so they never wait behind a backlog."""
    return f"{settings.queue}.control"


def model_queue(settings: Settings) -> str:
    """The classification stage: waits on the model, consumed by the model role (threads)."""
    return f"{settings.queue}.model"


def job_queues(settings: Settings) -> list[str]:
    """The lane queues of email jobs, of either stage and lane, each the name of its family (its
    own queue and its shards, `family`): what the sweeper reads to tell a waiting job from a lost
    one."""
    return [stage_queue(stage, settings, lane) for stage in Stage for lane in Lane]


# A shard queue is its lane queue's name, this separator and its number (mailpipe.broker.mailboxes).
SHARD_SEP = ":"


def shard_queue(queue: str, index: int) -> str:
    return f"{queue}{SHARD_SEP}{index:02d}"


def family(queue: str, settings: Settings) -> list[str]:
    """A lane queue and its shard queues: every queue a job of that stage and lane can wait in."""
    return [queue, *(shard_queue(queue, i) for i in range(settings.mailbox_queues))]


def family_of(queue: str) -> str:
    """The lane queue a queue belongs to: itself, or the lane queue of a shard."""
    head, sep, tail = queue.rpartition(SHARD_SEP)
    return head if sep and tail.isdigit() else queue


def consumed_queues(settings: Settings) -> list[str]:
    """Every queue of email jobs, shards included, as Celery declares them."""
    return [name for queue in job_queues(settings) for name in family(queue, settings)]


def queue_of(task: TaskName, settings: Settings, lane: Lane = Lane.LIVE) -> str:
    stage = Stage.MODEL if task is TaskName.CLASSIFY_EMAIL else Stage.CPU
    return stage_queue(stage, settings, lane)


def stage_queue(stage: Stage, settings: Settings, lane: Lane = Lane.LIVE) -> str:
    queue = model_queue(settings) if stage is Stage.MODEL else email_queue(settings)
    return queue if lane is Lane.LIVE else f"{queue}.{lane}"


def stage_of(queue: str) -> Stage:
    """The stage whose jobs `queue` (a lane of a stage's queue, `stage_queue`, or one of its
    shards) carries."""
    lane_queue = family_of(queue).removesuffix(f".{Lane.BULK}")
    return Stage.MODEL if lane_queue.endswith(".model") else Stage.CPU


def lane_of(queue: str) -> Lane:
    """The lane whose jobs `queue` carries: the control queue is live (never behind bulk)."""
    return Lane.BULK if family_of(queue).endswith(f".{Lane.BULK}") else Lane.LIVE
