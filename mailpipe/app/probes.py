"""The probe of a stage an outage paused: the check of the dependency that paused it.

Never an email's call: the email that faulted last may be the one object the store refuses, and
would keep the stage paused for ever. The check (mailpipe.pipeline.health) makes the stage's own
kinds of call, writes included, on things the fleet owns, so a denied write keeps the pause as a
denied read does. A check that passes ends the pause it was run for, and no other: an operator's
pause, or one set anew while the check ran, stays. This module never imports Celery.
"""

from __future__ import annotations

import enum
import logging

from mailpipe.broker.queues import Stage
from mailpipe.coordination import pauses
from mailpipe.errors import Dependency
from mailpipe.pipeline import health
from mailpipe.resources import Resources

log = logging.getLogger(__name__)

# The dependencies a stage's jobs call, checked when a pause names none.
STAGE_DEPENDENCIES = {
    Stage.CPU: (Dependency.BLOBS, Dependency.DATABASE),
    Stage.MODEL: (Dependency.MODEL, Dependency.DATABASE),
}


class ProbeResult(enum.StrEnum):
    PASSED = "passed"  # the check passed: the pause is ended
    REFUSED = "refused"  # the check failed: the pause stays
    INCONCLUSIVE = "inconclusive"  # not paused by an outage, or the pause changed meanwhile


def probe(res: Resources, stage: Stage) -> ProbeResult:
    """Run the check behind the stage's automatic pause; end that pause if the check passes."""
    pause = pauses.paused(res.redis).get(stage)
    if pause is None or pause.by != pauses.AUTO:
        return ProbeResult.INCONCLUSIVE
    named = pause.dependency
    dependencies = (Dependency(named),) if named else STAGE_DEPENDENCIES[stage]
    for dependency in dependencies:
        verdict = health.check(res, dependency)
        if not verdict.passed:
            log.warning("%s stage still paused: the %s check failed", stage, dependency)
            return ProbeResult.REFUSED
    if not pauses.end_if(res.redis, stage, pause.token, remember=res.settings.pause_window):
        return ProbeResult.INCONCLUSIVE
    log.warning("%s stage resumed: the %s check passed", stage, ", ".join(dependencies))
    return ProbeResult.PASSED
