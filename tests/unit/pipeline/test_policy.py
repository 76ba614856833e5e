"""The policy that judges what a delivery comes to, every branch, with no service running."""

from __future__ import annotations

import pytest

from mailpipe.errors import Dependency, PermanentError, Throttled, TransientError
from mailpipe.pipeline import policy
from mailpipe.pipeline.policy import Ending, Failure, Fault, Kind, Limits, Verdict
from mailpipe.storage.models import AttemptOutcome, ErrorClass

LIMITS = Limits(max_attempts=4, max_shutdown_cutoffs=3)


def test_limits_are_the_settings():
    from mailpipe.settings import Settings

    settings = Settings(max_retries=5, max_shutdown_cutoffs=7, max_deferral=99, defer_max=9)
    limits = Limits.of(settings)
    assert (limits.max_attempts, limits.max_shutdown_cutoffs) == (6, 7)
    assert (limits.max_deferral, limits.defer_max) == (99, 9)


def test_a_lost_attempt_counts_and_the_run_goes_on_while_attempts_remain():
    verdict = policy.unfinished(2, 0, LIMITS, cut_off=None, shutdown=False)
    assert verdict == Ending(
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


BACKOFF = Limits(4, 3, retry_backoff_base=10, retry_backoff_max=60)


@pytest.mark.parametrize(
    ("attempt", "jitter", "delay"),
    [(1, 0.0, 5.0), (1, 1.0, 10.0), (2, 0.5, 15.0), (3, 0.0, 20.0), (9, 1.0, 60.0), (9, 0.0, 30.0)],
)
def test_the_backoff_doubles_with_equal_jitter_up_to_the_maximum(attempt, jitter, delay):
    assert policy.retry_delay(BACKOFF, attempt, jitter) == delay


def test_a_service_s_retry_after_takes_precedence_over_the_backoff_but_not_its_maximum():
    assert policy.retry_delay(BACKOFF, 1, 0.5, retry_after=3.5) == 3.5
    # ...but never past the longest backoff, which keeps every countdown inside the visibility
    # timeout.
    assert policy.retry_delay(BACKOFF, 1, 0.5, retry_after=10_000) == 60


def test_a_retry_is_sent_after_its_backoff_with_its_error():
    verdict = policy.retry(BACKOFF, 2, "S3 unavailable", error_class="TransientError", jitter=0)
    assert verdict == Verdict(Kind.RETRY, 10.0, "S3 unavailable", error_class="TransientError")
    assert verdict.follows_up


DEFERRALS = Limits(4, 3, retry_backoff_max=60, defer_base=5, defer_max=40, max_deferral=100)


def test_a_deferral_grows_with_the_time_waited_up_to_its_maximum():
    assert [policy.deferral_delay(DEFERRALS, w) for w in (0, 10, 35, 1000)] == [5, 15, 40, 40]


def test_a_deferral_goes_out_within_its_bounds_and_keeps_its_first_time():
    short = policy.deferred(DEFERRALS, Verdict(Kind.DEFER, 0.0, "held", 1000.0), now=1010.0)
    assert short == Verdict(Kind.DEFER, 0.5, "held", 1000.0)
    first = policy.deferred(DEFERRALS, Verdict(Kind.DEFER, 900.0, "held"), now=1010.0)
    assert first == Verdict(Kind.DEFER, 60.0, "held", 1010.0)


def test_a_job_deferred_past_the_bound_fails_unless_it_waits_out_an_outage():
    late = Verdict(Kind.DEFER, 10.0, "rate limited", 1000.0)
    failed = policy.deferred(DEFERRALS, late, now=1091.0)
    assert (failed.kind, failed.error_class) == (Kind.FAILED, ErrorClass.DEFERRED_TOO_LONG)
    assert failed.error == (
        "deferred for 91 s in all, past MAILPIPE_MAX_DEFERRAL (100 s): rate limited"
    )
    # Just inside the bound, it waits once more.
    assert policy.deferred(DEFERRALS, late, now=1090.0).kind is Kind.DEFER
    outage = Verdict(Kind.DEFER, 10.0, "S3 down", 0.0, outage=Dependency.BLOBS)
    assert policy.deferred(DEFERRALS, outage, now=1e9).kind is Kind.DEFER


@pytest.mark.parametrize(
    ("exc", "outage", "fault"),
    [
        (Throttled("slow down"), Dependency.MODEL, Fault.THROTTLED),
        (TransientError("S3 down"), Dependency.BLOBS, Fault.OUTAGE),
        (PermanentError("not an email"), Dependency.BLOBS, Fault.OUTAGE),
        (PermanentError("not an email"), None, Fault.REJECTED),
        (TransientError("S3 hiccup"), None, Fault.ATTEMPT),
        (ValueError("a bug"), None, Fault.ATTEMPT),
    ],
)
def test_whose_fault_an_error_is(exc, outage, fault):
    assert policy.fault_of(exc, outage) is fault


def test_what_a_failed_attempt_records():
    from celery.exceptions import SoftTimeLimitExceeded

    assert policy.attempt_error(SoftTimeLimitExceeded(), 240) == (
        "soft time limit (240 s) exceeded",
        False,
    )
    error, unforeseen = policy.attempt_error(TransientError("S3 hiccup"), 240)
    assert (error, unforeseen) == ("TransientError: S3 hiccup", False)
    error, unforeseen = policy.attempt_error(ValueError("a bug"), 240)
    assert (error, unforeseen) == ("unexpected ValueError", True)


def test_a_wait_for_a_mailbox_slot_is_bounded_per_deferral_and_never_fails_the_run():
    # A slot an hour away, past MAILPIPE_MAX_DEFERRAL: waited for in deferrals of at most
    # MAILPIPE_RETRY_BACKOFF_MAX each, and the job's clock of deferrals is not started.
    far = Verdict(Kind.DEFER, 3600.0, "at its ceiling", mailbox_slot=4610.0, for_slot=True)
    first = policy.deferred(DEFERRALS, far, now=1010.0)
    assert first == Verdict(
        Kind.DEFER, 60.0, "at its ceiling", None, mailbox_slot=4610.0, for_slot=True
    )
    # Nor does one that has waited for other reasons before fail for the slot's wait.
    waited = Verdict(Kind.DEFER, 0.1, "at its ceiling", 0.0, mailbox_slot=1e9, for_slot=True)
    assert policy.deferred(DEFERRALS, waited, now=1e9 - 0.1) == Verdict(
        Kind.DEFER, 0.5, "at its ceiling", 0.0, mailbox_slot=1e9, for_slot=True
    )


def test_a_fleet_wait_of_a_job_holding_a_mailbox_slot_keeps_the_slot_and_its_bound():
    fleet = Verdict(Kind.DEFER, 10.0, "at the fleet limit", 1000.0, mailbox_slot=995.0)
    assert policy.deferred(DEFERRALS, fleet, now=1010.0) == Verdict(
        Kind.DEFER, 10.0, "at the fleet limit", 1000.0, mailbox_slot=995.0
    )
    assert policy.deferred(DEFERRALS, fleet, now=1091.0).kind is Kind.FAILED
