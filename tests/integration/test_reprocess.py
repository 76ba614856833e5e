"""A reprocess on real workers, PostgreSQL and the Bedrock stand-in: the same request sent again
while the first is under way takes no email twice, and the first's progress adds up to what it
took. One email of the first is held in its steps (tests/support/faults.py), so that the first
is still under way, most of its emails done again, when the second is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mailpipe.cli.ingest import store_emails
from tests.support.bedrock_server import TimedBedrockServer, keyword_labels, unlimited_bedrock_env
from tests.support.emails import raw_email
from tests.support.fleet import Fleet
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAILS = 120
OTHER = raw_email("lunch", sender="carol@corp.example", message_id="l1@corp", body="Noon?")


def invoices(n: int) -> list[bytes]:
    return [
        raw_email(
            f"Invoice {i}",
            sender=f"billing{i}@acme.example",
            message_id=f"again-{i}@acme.example",
            body=f"Invoice {i}: amount due {i} EUR",
        )
        for i in range(n)
    ]


def progress(f: Fleet) -> list[dict[str, object]]:
    return list(json.loads(f.cli("status", "--json"))["reprocesses"])


def test_the_same_reprocess_sent_again_takes_each_email_once(res, fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = TimedBedrockServer(default=keyword_labels)
    server.start()
    try:
        f = fleet(**unlimited_bedrock_env(server, tmp_path))
        queue = f.env.get("MAILPIPE_QUEUE", res.settings.queue)
        f.worker("cpu", "-Q", f"{queue},{queue}.bulk,{queue}.control")
        f.worker("model", "-P", "threads", "-c", "8", "-Q", f"{queue}.model,{queue}.model.bulk")
        ids = store_emails(res, invoices(EMAILS))
        [other] = store_emails(res, [OTHER])  # what the filter leaves out
        f.enqueue([*ids, other])
        assert set(wait_until_closed(res, [*ids, other]).values()) == {"succeeded"}
        calls_before = len(server.arrivals())
        assert calls_before == EMAILS + 1

        held = ids[-1]
        f.set_fault(held, "held", times=1)
        request = ("reprocess", "--label", "invoice", "--from", "parse", "--yes")
        first = f.cli(*request)
        assert first.splitlines()[-1].endswith(f"reopened {EMAILS}, enqueued {EMAILS}")
        wait_for(
            lambda: progress(f)[0]["done"] >= EMAILS // 2,
            60,
            "half of the first reprocess's emails done again",
            every=0.5,
        )
        again = f.cli(*request)
        f.release(held)
        assert (
            again.strip() == "0 succeeded emails match, from parse, in the bulk lane: 0 model calls"
        )
        wait_for(lambda: progress(f)[0]["left"] == 0, 90, "the first reprocess to end", every=0.5)
    finally:
        server.stop()
    assert len(server.arrivals()) - calls_before == EMAILS  # one model call per email
    [reprocessed] = progress(f)
    assert {
        k: reprocessed[k] for k in ("emails", "taken", "done", "failed", "left", "retaken")
    } == {
        "emails": EMAILS,
        "taken": EMAILS,
        "done": EMAILS,
        "failed": 0,
        "left": 0,
        "retaken": 0,
    }
