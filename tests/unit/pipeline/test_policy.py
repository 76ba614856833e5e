"""The policy that judges an ended attempt, every branch, with no service running."""

from __future__ import annotations

import pytest

from mailpipe.pipeline import policy
from mailpipe.pipeline.policy import Failure, Limits, Verdict
from mailpipe.storage.models import AttemptOutcome, ErrorClass

LIMITS = Limits(max_attempts=4, max_shutdown_cutoffs=3)


def test_limits_are_the_settings():
    from mailpipe.settings import Settings

    settings = Settings(max_retries=5, max_shutdown_cutoffs=7)
    assert Limits.of(settings) == Limits(6, 7)


def test_a_lost_attempt_counts_and_the_run_goes_on_while_attempts_remain():
    verdict = policy.unfinished(2, 0, LIMITS, cut_off=None, shutdown=False)
    assert verdict == Verdict(
        AttemptOutcome.LOST,
        ErrorClass.LOST,
        "attempt 2 ended without a result: its worker process died or was killed, or stopped "
        "renewing its lease",
        attempts=2,
        cutoffs=0,
    )


def test_the_last_lost_attempt_fails_the_run_as_lost():
    verdict = policy.unfinished(4, 0, LIMITS, cut_off=None, shutdown=False)
    assert (verdict.outcome, verdict.attempts) == (AttemptOutcome.FAILED, 4)
    assert verdict.failure == Failure(ErrorClass.LOST, f"gave up after 4 attempts: {verdict.error}")


@pytest.mark.parametrize(("attempts", "fails"), [(3, False), (4, True)])
def test_the_hard_time_limit_counts_the_attempt(attempts: int, fails: bool):
    verdict = policy.unfinished(attempts, 1, LIMITS, cut_off=25.0, shutdown=True)
    # A cut-off by the time limit is no shutdown's, whatever the shutdown mark says.
    assert (verdict.attempts, verdict.cutoffs, verdict.error_class) == (
        attempts,
        1,
        ErrorClass.HARD_TIME_LIMIT,
    )
    assert verdict.error == f"attempt {attempts} was cut off by the hard time limit (25 s)"
    assert (verdict.failure is not None) is fails
    assert verdict.outcome is (AttemptOutcome.FAILED if fails else AttemptOutcome.CUT_OFF)


def test_a_shutdown_gives_the_attempt_back_and_counts_a_cutoff():
    verdict = policy.unfinished(4, 1, LIMITS, cut_off=None, shutdown=True)
    assert (verdict.outcome, verdict.attempts, verdict.cutoffs) == (AttemptOutcome.CUT_OFF, 3, 2)
    assert verdict.error_class == ErrorClass.SHUTDOWN_CUTOFFS
    assert verdict.error.startswith("cut off by shutdown (2 of at most 3)")
    assert verdict.failure is None


def test_the_last_shutdown_window_fails_the_run():
    verdict = policy.unfinished(1, 2, LIMITS, cut_off=None, shutdown=True)
    assert (verdict.outcome, verdict.attempts, verdict.cutoffs) == (AttemptOutcome.FAILED, 0, 3)
    assert verdict.failure is not None
    assert verdict.failure.error_class == ErrorClass.SHUTDOWN_CUTOFFS
    assert verdict.failure.error.startswith("cut off by shutdown 3 times")


def test_a_shutdown_at_the_attempt_bound_fails_on_attempts_only_past_it():
    # Given back, the attempt no longer counts: four attempts with one given back leave one.
    assert policy.unfinished(4, 0, LIMITS, cut_off=None, shutdown=True).failure is None
    assert policy.unfinished(5, 0, LIMITS, cut_off=None, shutdown=True).failure is not None


@pytest.mark.parametrize(("attempts", "fails"), [(1, False), (3, False), (4, True), (5, True)])
def test_a_failed_attempt_is_retried_while_attempts_remain(attempts: int, fails: bool):
    verdict = policy.failed_attempt(attempts, 0, LIMITS, "TransientError", "it broke")
    assert (verdict.error_class, verdict.error, verdict.attempts) == (
        "TransientError",
        "it broke",
        attempts,
    )
    if fails:
        assert verdict.outcome is AttemptOutcome.FAILED
        assert verdict.failure == Failure(
            "TransientError", f"gave up after {attempts} attempts: it broke"
        )
    else:
        assert (verdict.outcome, verdict.failure) == (AttemptOutcome.RETRYING, None)


def test_a_limit_lowered_since_the_last_attempt_fails_the_run_at_its_claim():
    assert policy.past_lowered_limit(3, LIMITS, "TransientError", "it broke") is None
    assert policy.past_lowered_limit(4, LIMITS, "TransientError", "it broke") == Failure(
        "TransientError", "gave up after 4 attempts: it broke"
    )
    assert policy.past_lowered_limit(4, LIMITS, None, None) == Failure(
        ErrorClass.ATTEMPTS_USED_UP, "gave up after 4 attempts: no error recorded"
    )
