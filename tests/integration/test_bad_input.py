"""Bad input fails its own job with a clear error; the worker and other emails go on."""

from __future__ import annotations

import pytest

from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.enqueue import enqueue_email, enqueue_emails
from mailpipe.pipeline import job
from mailpipe.storage import flags
from mailpipe.storage.models import PipelineRun
from tests.support.emails import nested_multipart, raw_email
from tests.support.waits import run_statuses, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

GOOD = raw_email("Invoice 7", message_id="good@x", body="Amount due: 5 EUR")
# An address header the default policy cannot read; the job must read it raw and go on.
RAISING_HEADER = (
    b'From: =?utf-8?b?////?= <@@@>, "unclosed\r\nTo: <<>>\r\nSubject: odd\r\n\r\nbody\r\n'
)


def test_bad_emails_fail_alone_with_their_reason(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    inputs = {
        "empty": b"",
        "garbage": b"\x00\x01\x02 not an email at all \xff\xfe",
        "deep": nested_multipart(1000),
        "raising_header": RAISING_HEADER,
        "good": GOOD,
    }
    ids = dict(zip(inputs, store_emails(res, list(inputs.values())), strict=True))
    enqueue_emails(list(ids.values()), res)
    statuses = wait_until_closed(res, list(ids.values()))
    with res.db.session() as session:
        errors = {
            name: session.get_one(PipelineRun, _run_id(session, email_id)).error
            for name, email_id in ids.items()
        }
    assert statuses[ids["empty"]] == "failed" and "empty" in errors["empty"]
    assert statuses[ids["garbage"]] == "failed" and "not an email" in errors["garbage"]
    assert statuses[ids["deep"]] == "failed" and "nested deeper than 25 levels" in errors["deep"]
    assert statuses[ids["raising_header"]] == "succeeded"
    assert statuses[ids["good"]] == "succeeded"
    # Permanent errors are not retried: one attempt each.
    with res.db.session() as session:
        attempts = {
            name: session.get_one(PipelineRun, _run_id(session, email_id)).attempts
            for name, email_id in ids.items()
        }
    assert attempts["garbage"] == 1 and attempts["deep"] == 1


def test_unknown_email_id_fails_cleanly_and_the_worker_goes_on(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    outcome = job.process_email(res, 987654)
    assert (outcome.kind.value, outcome.error) == ("failed", "no email_message row with id 987654")
    assert enqueue_email(987654)
    [good] = store_emails(res, [GOOD])
    enqueue_email(good)
    wait_until_closed(res, [good])
    # The unknown id's job ran and ended: its dedup marker is gone, no run was invented.
    wait_for(lambda: not res.redis.exists(redis_keys.job_marker(987654)), 30, "marker cleared")
    assert run_statuses(res, [987654]) == {}


def _run_id(session, email_id: int) -> int:  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    return session.scalar(select(PipelineRun.id).where(PipelineRun.email_id == email_id))
