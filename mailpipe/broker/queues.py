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
    """The queues that carry email jobs, of either stage and lane: what the sweeper reads to
    tell a waiting job from a lost one."""
    return [stage_queue(stage, settings, lane) for stage in Stage for lane in Lane]


def queue_of(task: TaskName, settings: Settings, lane: Lane = Lane.LIVE) -> str:
    stage = Stage.MODEL if task is TaskName.CLASSIFY_EMAIL else Stage.CPU
    return stage_queue(stage, settings, lane)


def stage_queue(stage: Stage, settings: Settings, lane: Lane = Lane.LIVE) -> str:
    queue = model_queue(settings) if stage is Stage.MODEL else email_queue(settings)
    return queue if lane is Lane.LIVE else f"{queue}.{lane}"


def stage_of(queue: str) -> Stage:
    """The stage whose jobs `queue` (a lane of a stage's queue, `stage_queue`) carries."""
    return Stage.MODEL if queue.removesuffix(f".{Lane.BULK}").endswith(".model") else Stage.CPU


def lane_of(queue: str) -> Lane:
    """The lane whose jobs `queue` carries: the control queue is live (never behind bulk)."""
    return Lane.BULK if queue.endswith(f".{Lane.BULK}") else Lane.LIVE
